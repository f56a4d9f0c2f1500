// Row reduction template: one workgroup per row (or per segment of a row) of a contiguous
// [rows, cols] matrix. Each invocation folds the columns lid, lid + WG, ... of its range into an
// (value, index) pair, then the workgroup combines the pairs with a tree reduction in workgroup
// memory.
//
// Three modes share the template: `direct` reduces whole rows of x into out; `partial` reduces
// segments of SEG columns into (value, index) partials; `final` reduces the partials of each
// row. Long rows take partial + final, which keeps every invocation's loop short (lavapipe
// stops an invocation after 65535 loop iterations) and spreads a long row over many workgroups.
//
// Placeholders: <WG> workgroup size (a power of two); <IDENTITY> the neutral value;
// <COMBINE> the body of `combine(a, b) -> Acc`; <RESULT> the value of the reduction from
// `best`; <MODE> the mode's file (reduce_direct.wgsl, reduce_partial.wgsl,
// reduce_final.wgsl): its buffers, `load` (the pair of column j) and `store`.

// The workgroup g handles row g / segments, columns [(g % segments) * seg_len,
// min(that + seg_len, cols)).
struct ReduceParams {
    rows: u32, cols: u32, x_offset: u32, segments: u32, seg_len: u32,
}

@group(0) @binding(0) var<storage, read> params: ReduceParams;

struct Acc {
    v: f32,
    i: u32,
}

fn result(best: Acc) -> f32 {
    return {{RESULT}};
}

{{MODE}}

var<workgroup> sv: array<f32, {{WG}}>;
var<workgroup> si: array<u32, {{WG}}>;

fn combine(a: Acc, b: Acc) -> Acc {
    {{COMBINE}}
}

@compute @workgroup_size({{WG}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = linear_group(wid, nwg);
    let rows = params.rows;
    let cols = params.cols;
    let segments = params.segments;
    let seg_len = params.seg_len;
    if (g >= rows * segments) { return; }
    let row = g / segments;
    let begin = (g % segments) * seg_len;
    let end = min(begin + seg_len, cols);
    let base = params.x_offset + row * cols;
    var acc = Acc({{IDENTITY}}, 0xffffffffu);
    for (var j = begin + lid; j < end; j = j + {{WG}}u) {
        acc = combine(acc, load(base, j));
    }
    sv[lid] = acc.v;
    si[lid] = acc.i;
    workgroupBarrier();
    for (var s = {{WG}}u / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let r = combine(Acc(sv[lid], si[lid]), Acc(sv[lid + s], si[lid + s]));
            sv[lid] = r.v;
            si[lid] = r.i;
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        store(g, Acc(sv[0], si[0]));
    }
}
