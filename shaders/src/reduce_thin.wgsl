// Row reduction of short rows: one invocation per row of a contiguous [rows, cols] matrix, its
// columns folded in order, with no workgroup memory and no barrier. reduce.wgsl gives each row a
// workgroup and a tree of barriers: with a few columns most of its invocations idle, and on
// lavapipe every barrier is a switch per invocation ([65536, 8] over its last axis: 13.5 ms).
//
// Placeholders as reduce.wgsl: <WG> workgroup size; <IDENTITY> the neutral value; <COMBINE> the
// body of `combine(a, b) -> Acc`; <RESULT> the value of the reduction from `best`.

struct ReduceParams {
    rows: u32, cols: u32, x_offset: u32, segments: u32, seg_len: u32,
}

@group(0) @binding(0) var<storage, read> params: ReduceParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

struct Acc {
    v: f32,
    i: u32,
}

fn result(best: Acc) -> f32 {
    return {{RESULT}};
}

fn combine(a: Acc, b: Acc) -> Acc {
    {{COMBINE}}
}

const SLAB: u32 = 16u;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let row = linear_index(gid, nwg, {{WG}}u);
    if (row >= params.rows) { return; }
    let base = params.x_offset + row * params.cols;
    // Folded in slabs of SLAB columns, each into a fresh pair then into the total: a sum's
    // rounding error grows with cols / SLAB + SLAB additions instead of cols (a batch-norm
    // gradient summed over 256 positions was 10x PyTorch's error in one serial fold). The order
    // of the columns is kept, so a first extreme stays the first.
    var acc = Acc({{IDENTITY}}, 0xffffffffu);
    for (var j0 = 0u; j0 < params.cols; j0 = j0 + SLAB) {
        var slab = Acc({{IDENTITY}}, 0xffffffffu);
        for (var j = j0; j < min(j0 + SLAB, params.cols); j = j + 1u) {
            slab = combine(slab, Acc(x[base + j], j));
        }
        acc = combine(acc, slab);
    }
    out[row] = result(acc);
}
