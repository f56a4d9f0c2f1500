// out[j] = {{FORMAT}} element offset + j of the packed source (see `read_src`), for j < numel;
// one invocation per two outputs.

struct CastParams {
    numel: u32, offset: u32,
}

@group(0) @binding(0) var<storage, read> params: CastParams;

{{SRC}}

@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let j = 2u * linear_index(gid, nwg, {{WG}}u);
    if (j >= params.numel) { return; }
    out[j] = read_src(params.offset + j);
    if (j + 1u < params.numel) {
        out[j + 1u] = read_src(params.offset + j + 1u);
    }
}
