// The backward of a (scaled) softmax over each row of contiguous [rows, cols] matrices, one
// workgroup per row: dx = scale * y * (g - sum(g * y)), where y is the softmax's output and g
// its gradient. Masked entries (y = 0) get 0, so the causal softmax needs no mask here.
//
// Placeholders: <WG> workgroup size (a power of two). The output is contiguous from 0. Needs
// row_tree.wgsl (or row_subgroup.wgsl).

struct SoftmaxBackwardParams {
    rows: u32, cols: u32, scale: f32, y_offset: u32, g_offset: u32,
}

@group(0) @binding(0) var<storage, read> params: SoftmaxBackwardParams;

@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let cols = params.cols;
    if (row >= params.rows) { return; }
    let base = row * cols;
    let yb = params.y_offset + base;
    let gb = params.g_offset + base;

    var dot = 0.0;
    for (var j = lid; j < cols; j = j + {{WG}}u) {
        dot = dot + g[gb + j] * y[yb + j];
    }
    let total = tree_sum(lid, dot);

    for (var j = lid; j < cols; j = j + {{WG}}u) {
        let yv = y[yb + j];
        out[base + j] = yv * (g[gb + j] - total) * params.scale;
    }
}
