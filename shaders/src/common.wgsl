// Prepended to every kernel.
//
// Binding 0 of every kernel is its parameter block: u32 words (f32 values stored as their bits),
// one block per dispatch, carved out of one buffer per submission.
@group(0) @binding(0) var<storage, read> params: array<u32>;

fn param_f32(i: u32) -> f32 {
    return bitcast<f32>(params[i]);
}

// Linear invocation index on a 2-D grid of 1-D workgroups of `wg` invocations: the host splits
// dispatches wider than 65535 workgroups into rows of `num_workgroups.x` workgroups.
fn linear_index(gid: vec3<u32>, nwg: vec3<u32>, wg: u32) -> u32 {
    return gid.y * nwg.x * wg + gid.x;
}

// Linear workgroup index on the same 2-D grid (kernels with one workgroup per row or tile).
fn linear_group(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.y * nwg.x + wid.x;
}

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}
