// Layer norm over each row of a contiguous [rows, cols] matrix, one workgroup per row:
// y = (x - mean) * rstd * gamma + beta, rstd = 1 / sqrt(var + eps) with the biased variance
// (two passes: the mean, then the mean of squared deviations).
//
// Placeholders: <WG> workgroup size (a power of two); <INPUT> declares the other bindings and
// `input(base, j)` (the row's value j: x itself, or x + r for the fused residual add),
// `keep_input` (where the residual variant writes the sum) and `store_stats`.
// The outputs are contiguous from 0. Needs row_tree.wgsl (or row_subgroup.wgsl).

struct LayerNormParams {
    rows: u32, cols: u32, eps: f32, x_offset: u32, gamma_offset: u32,
    beta_offset: u32, r_offset: u32,
}

@group(0) @binding(0) var<storage, read> params: LayerNormParams;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> gamma: array<f32>;
@group(0) @binding(3) var<storage, read> beta: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

{{INPUT}}

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let rows = params.rows;
    let cols = params.cols;
    let eps = params.eps;
    if (row >= rows) { return; }
    let base = row * cols;
    let go = params.gamma_offset;
    let bo = params.beta_offset;
    let inv_n = 1.0 / f32(cols);

    var s = 0.0;
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        let v = input(base, j);
        keep_input(base + j, v);
        s = s + v;
    }
    let mean = tree_sum(lid, s) * inv_n;

    var q = 0.0;
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        let d = input(base, j) - mean;
        q = q + d * d;
    }
    let rstd = inverseSqrt(tree_sum(lid, q) * inv_n + eps);

    for (var j = lid; j < cols; j = j + {{WG}}u) {
        y[base + j] = (input(base, j) - mean) * rstd * gamma[go + j] + beta[bo + j];
    }
    if (lid == 0u) {
        store_stats(row, mean, rstd);
    }
}
