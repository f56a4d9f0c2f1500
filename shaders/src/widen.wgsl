// out[i] = {{FORMAT}} element i of `src` (two per word, element 2w in the low half of word w),
// for i < numel; one invocation per word.

struct CastParams {
    numel: u32, offset: u32,
}

@group(0) @binding(0) var<storage, read> params: CastParams;

@group(0) @binding(1) var<storage, read> src: array<u32>;

@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let w = linear_index(gid, nwg, {{WG}}u);
    let i = 2u * w;
    if (i >= params.numel) { return; }
    let word = src[w];
    out[i] = {{FORMAT}}_to_f32(word & 0xFFFFu);
    if (i + 1u < params.numel) {
        out[i + 1u] = {{FORMAT}}_to_f32(word >> 16u);
    }
}
