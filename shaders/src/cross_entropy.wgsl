// Softmax + cross-entropy of each row of contiguous [rows, cols] logits, one workgroup per row:
// a tree max, a tree sum of exp(x - max), then loss = -((x[t] - max) - log(sum)), with max and
// logsum = log(sum) kept for the backward (cross_entropy_backward.wgsl).
//
// Placeholders: <WG> workgroup size (a power of two). The outputs are contiguous from 0. Needs
// row_tree.wgsl (or row_subgroup.wgsl).

struct CrossEntropyParams {
    rows: u32, cols: u32, x_offset: u32, t_offset: u32,
}

@group(0) @binding(0) var<storage, read> params: CrossEntropyParams;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<f32>;
@group(0) @binding(3) var<storage, read_write> loss: array<f32>;
@group(0) @binding(4) var<storage, read_write> max_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> logsum_out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let cols = params.cols;
    if (row >= params.rows) { return; }
    let xb = params.x_offset + row * cols;

    var m = neg_inf();
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        m = max(m, x[xb + j]);
    }
    let mx = tree_max(lid, m);

    var sum = 0.0;
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        sum = sum + exp(x[xb + j] - mx);
    }
    let ls = log(tree_sum(lid, sum));

    if (lid == 0u) {
        let t = u32(targets[params.t_offset + row]);
        loss[row] = -((x[xb + t] - mx) - ls);
        max_out[row] = mx;
        logsum_out[row] = ls;
    }
}
