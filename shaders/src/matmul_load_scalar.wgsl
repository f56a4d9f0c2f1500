// matmul.wgsl: stages the slab of operand <X> (BK deep, <EXT> wide along its non-k axis o)
// into workgroup memory <SLAB>, one scalar load per step; <O> / <KK> decode the step l into
// (o, kk) so that consecutive invocations walk k or o, whichever is contiguous in memory.
// Element (o, k) of the operand is at base + o * <O_STRIDE> + k * <K_STRIDE>; outside
// <LIMIT> x K it reads as 0. `read_<X>` reads one element (an f32, or an unpacked half).
fn load_{{X}}(lid: u32, k0: u32, o0: u32, base: u32) {
    let o_stride = {{O_STRIDE}};
    let k_stride = {{K_STRIDE}};
    for (var l = lid; l < {{EXT}} * BK; l = l + NT) {
        let o = {{O}};
        let kk = {{KK}};
        let go = o0 + o;
        let gk = k0 + kk;
        var v = 0.0;
        if (go < {{LIMIT}} && gk < params.k_end) { v = read_{{X}}(base + go * o_stride + gk * k_stride); }
        {{SLAB}}[kk * {{EXT}}4 + o / 4u][o % 4u] = v;
    }
}
