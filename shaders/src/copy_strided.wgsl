// Strided copy: element i (row-major over `shape`) goes from `src` at (in_offset, in_strides)
// to `dst` at (out_offset, out_strides). Concat writes each input into its slab this way.
//

struct CopyParams {
    numel: u32, rank: u32,
    // shape[rank], in_offset, in_strides[rank], out_offset, out_strides[rank].
    dims: array<u32>,
}

@group(0) @binding(0) var<storage, read> params: CopyParams;

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params.numel) { return; }
    let rank = params.rank;
    let in_base = rank;
    let out_base = in_base + 1u + rank;
    var si = params.dims[in_base];
    var di = params.dims[out_base];
    var rem = i;
    for (var d = rank; d > 0u; d = d - 1u) {
        let k = d - 1u;
        let size = params.dims[k];
        let c = rem % size;
        rem = rem / size;
        si = si + c * params.dims[in_base + 1u + k];
        di = di + c * params.dims[out_base + 1u + k];
    }
    dst[di] = src[si];
}
