// matmul.wgsl: stages the slab of operand <X> into <SLAB> with vec4 loads along k (stride 1
// along k; the offset, <O_STRIDE> and K multiples of 4), spreading each vec4 over four k rows.
// Element (o, k) of the operand is at base + o * <O_STRIDE> + k.
fn load_{{X}}(lid: u32, k0: u32, o0: u32, base: u32) {
    let o_stride = {{O_STRIDE}};
    for (var l = lid; l < {{EXT}} * BK / 4u; l = l + NT) {
        let o = l / (BK / 4u);
        let kq = (l % (BK / 4u)) * 4u;
        let go = o0 + o;
        let gk = k0 + kq;
        var v = vec4<f32>(0.0);
        if (go < {{LIMIT}} && gk < params.k_end) { v = {{X}}[(base + go * o_stride + gk) / 4u]; }
        {{SLAB}}[kq * {{EXT}}4 + o / 4u][o % 4u] = v.x;
        {{SLAB}}[(kq + 1u) * {{EXT}}4 + o / 4u][o % 4u] = v.y;
        {{SLAB}}[(kq + 2u) * {{EXT}}4 + o / 4u][o % 4u] = v.z;
        {{SLAB}}[(kq + 3u) * {{EXT}}4 + o / 4u][o % 4u] = v.w;
    }
}
