// Prepended to every kernel.
//
// Binding 0 of every kernel is its parameter block `params`: a struct declared in the kernel's
// file, mirrored by the #[repr(C)] struct of the same name in `params.rs` (a test checks that
// the two layouts agree). The host carves one block per dispatch out of one buffer per
// submission.

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
