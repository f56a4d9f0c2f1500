// The backward of cross_entropy.wgsl over each row, one workgroup per row:
// dx = g * exp((x - max) - logsum), minus g at the target (g is the gradient of the row's loss).
//
// Placeholders: <WG> workgroup size (a power of two). The output is contiguous from 0.

struct CrossEntropyBackwardParams {
    rows: u32, cols: u32, x_offset: u32, t_offset: u32, max_offset: u32,
    logsum_offset: u32, g_offset: u32,
}

@group(0) @binding(0) var<storage, read> params: CrossEntropyBackwardParams;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> targets: array<f32>;
@group(0) @binding(3) var<storage, read> max_in: array<f32>;
@group(0) @binding(4) var<storage, read> logsum_in: array<f32>;
@group(0) @binding(5) var<storage, read> g: array<f32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let cols = params.cols;
    if (row >= params.rows) { return; }
    let base = row * cols;
    let xb = params.x_offset + base;
    let t = u32(targets[params.t_offset + row]);
    let mx = max_in[params.max_offset + row];
    let ls = logsum_in[params.logsum_offset + row];
    let gv = g[params.g_offset + row];

    for (var j = lid; j < cols; j = j + {{WG}}u) {
        var d = exp((x[xb + j] - mx) - ls) * gv;
        if (j == t) {
            d = d - gv;
        }
        out[base + j] = d;
    }
}
