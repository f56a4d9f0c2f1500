// Column sums of a contiguous [rows, width] matrix over chunks of its rows (a bias gradient):
// out[c * width + j] = x[off + i * width + j] summed over i in [c * chunk, min((c + 1) * chunk,
// rows)), in order (in slabs: see below). One invocation per (chunk, column): neighbouring
// invocations read neighbouring columns, and there is no barrier. The row kernels' one-workgroup-per-row tree
// (reduce.wgsl, after a transposing copy) cost 10-30x more here: on lavapipe every barrier is a
// switch per invocation. Several chunks give a partial sum each; the host sums the partials with
// this kernel again until one chunk is left.

struct SumLeadingParams {
    rows: u32, width: u32, chunk: u32, chunks: u32, x_offset: u32,
}

@group(0) @binding(0) var<storage, read> params: SumLeadingParams;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

const SLAB: u32 = 16u;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, {{WG}}u);
    let width = params.width;
    if (e >= width * params.chunks) { return; }
    let j = e % width;
    let begin = (e / width) * params.chunk;
    let end = min(begin + params.chunk, params.rows);
    // In slabs of SLAB rows, each summed fresh then added: the rounding error grows with
    // chunk / SLAB + SLAB additions instead of chunk.
    var acc = 0.0;
    for (var i0 = begin; i0 < end; i0 = i0 + SLAB) {
        var slab = 0.0;
        for (var i = i0; i < min(i0 + SLAB, end); i = i + 1u) {
            slab = slab + x[params.x_offset + i * width + j];
        }
        acc = acc + slab;
    }
    out[e] = acc;
}
