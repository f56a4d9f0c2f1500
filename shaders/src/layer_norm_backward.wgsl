// The gradient of layer norm's input over each row of contiguous [rows, cols] matrices, one
// workgroup per row: dx = carry + rstd * ((gxhat - mean(gxhat)) - xhat * mean(gxhat * xhat)),
// gxhat = g * gamma, xhat = (x - mean) * rstd; `carry` (the gradient x already has from its
// other consumers) is added only when `has_carry` is set (the host binds g in its place
// otherwise).
//
// Placeholders: <WG> workgroup size (a power of two). The output is contiguous from 0. Needs
// row_tree.wgsl (or row_subgroup.wgsl).

struct LayerNormBackwardParams {
    rows: u32, cols: u32, x_offset: u32, mean_offset: u32, rstd_offset: u32,
    gamma_offset: u32, g_offset: u32, carry_offset: u32, has_carry: u32,
}

@group(0) @binding(0) var<storage, read> params: LayerNormBackwardParams;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> mean_in: array<f32>;
@group(0) @binding(3) var<storage, read> rstd_in: array<f32>;
@group(0) @binding(4) var<storage, read> gamma: array<f32>;
@group(0) @binding(5) var<storage, read> g: array<f32>;
@group(0) @binding(6) var<storage, read> carry: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let cols = params.cols;
    if (row >= params.rows) { return; }
    let base = row * cols;
    let xb = params.x_offset + base;
    let gb = params.g_offset + base;
    let go = params.gamma_offset;
    let mean = mean_in[params.mean_offset + row];
    let rstd = rstd_in[params.rstd_offset + row];
    let inv_n = 1.0 / f32(cols);

    var s1 = 0.0;
    var s2 = 0.0;
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        let gx = g[gb + j] * gamma[go + j];
        s1 = s1 + gx;
        s2 = s2 + gx * ((x[xb + j] - mean) * rstd);
    }
    let m1 = tree_sum(lid, s1) * inv_n;
    let m2 = tree_sum(lid, s2) * inv_n;

    for (var j = lid; j < cols; j = j + {{WG}}u) {
        let gx = g[gb + j] * gamma[go + j];
        let xh = (x[xb + j] - mean) * rstd;
        var d = ((gx - m1) - xh * m2) * rstd;
        if (params.has_carry != 0u) {
            d = carry[params.carry_offset + base + j] + d;
        }
        out[base + j] = d;
    }
}
