// Numerically stable (log-)softmax of each row of a contiguous [rows, cols] matrix, one
// workgroup per row: a tree max, a tree sum of exp(x - max), then the write. The row is
// `scale * x`; with `causal` set the rows are [rows / cols, cols, cols] attention scores and row r
// (query r % cols) sees columns 0..=r % cols only: the rest are masked (probability 0).
//
// Placeholders: <WG> workgroup size (a power of two); <LOG> true for log-softmax.
// The output is contiguous from 0. Needs row_tree.wgsl (or row_subgroup.wgsl).

struct SoftmaxParams {
    rows: u32, cols: u32, x_offset: u32, scale: f32, causal: u32,
}

@group(0) @binding(0) var<storage, read> params: SoftmaxParams;

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const LOG: bool = {{LOG}};

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = linear_group(wid, nwg);
    let rows = params.rows;
    let cols = params.cols;
    if (row >= rows) { return; }
    let base = row * cols;
    let xb = params.x_offset + base;
    let scale = params.scale;
    var valid = cols;
    if (params.causal != 0u) {
        valid = row % cols + 1u;
    }

    var m = neg_inf();
    for (var j = lid; j < valid; j = j + {{WG}}u) {
        m = max(m, x[xb + j] * scale);
    }
    let mx = tree_max(lid, m);

    var sum = 0.0;
    for (var j = lid; j < valid; j = j + {{WG}}u) {
        sum = sum + exp(x[xb + j] * scale - mx);
    }
    let total = tree_sum(lid, sum);

    if (LOG) {
        let lt = log(total);
        for (var j = lid; j < cols; j = j + {{WG}}u) {
            if (j < valid) {
                out[base + j] = x[xb + j] * scale - mx - lt;
            } else {
                out[base + j] = neg_inf();
            }
        }
    } else {
        let inv = 1.0 / total;
        for (var j = lid; j < cols; j = j + {{WG}}u) {
            if (j < valid) {
                out[base + j] = exp(x[xb + j] * scale - mx) * inv;
            } else {
                out[base + j] = 0.0;
            }
        }
    }
}
