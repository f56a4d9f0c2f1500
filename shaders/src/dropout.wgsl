// Dropout multipliers: element i is 0 with probability p, else `scale` (= 1 / (1 - p), computed
// on the host in f32 like the CPU backend), from word i of the Philox stream (seed, offset):
// block i / 4 is the counter (block, 0, offset_lo, offset_hi), key (seed_lo, seed_hi).
// One invocation per block of four elements. Needs philox.wgsl.
//

struct DropoutParams {
    numel: u32, seed_lo: u32, seed_hi: u32, offset_lo: u32, offset_hi: u32,
    p: f32, scale: f32,
}

@group(0) @binding(0) var<storage, read> params: DropoutParams;

@group(0) @binding(1) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let block = linear_index(gid, nwg, {{WG}}u);
    let n = params.numel;
    let i0 = block * 4u;
    if (i0 >= n) { return; }
    let r = philox4x32(
        vec4<u32>(block, 0u, params.offset_lo, params.offset_hi),
        vec2<u32>(params.seed_lo, params.seed_hi),
    );
    let p = params.p;
    let scale = params.scale;
    for (var j = 0u; j < 4u; j = j + 1u) {
        if (i0 + j < n) {
            out[i0 + j] = select(scale, 0.0, u32_to_unit(r[j]) < p);
        }
    }
}
