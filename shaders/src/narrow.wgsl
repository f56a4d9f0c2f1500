// Word w of `out` = elements 2w and 2w + 1 of src[offset..offset + numel] rounded to {{FORMAT}}
// (low half first; a missing last element is 0).

struct CastParams {
    numel: u32, offset: u32,
}

@group(0) @binding(0) var<storage, read> params: CastParams;

@group(0) @binding(1) var<storage, read> src: array<f32>;

@group(0) @binding(2) var<storage, read_write> out: array<u32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let w = linear_index(gid, nwg, {{WG}}u);
    let i = 2u * w;
    if (i >= params.numel) { return; }
    let lo = f32_to_{{FORMAT}}(src[params.offset + i]);
    var hi = 0u;
    if (i + 1u < params.numel) {
        hi = f32_to_{{FORMAT}}(src[params.offset + i + 1u]);
    }
    out[w] = lo | (hi << 16u);
}
