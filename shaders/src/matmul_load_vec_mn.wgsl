// matmul.wgsl: stages the slab of operand <X> into <SLAB> with vec4 loads along its non-k axis
// o (stride 1 along o; the offset, <K_STRIDE> and the extent multiples of 4).
// Element (o, k) of the operand is at base + o + k * <K_STRIDE>.
fn load_{{X}}(lid: u32, k0: u32, o0: u32, base: u32) {
    let k_stride = {{K_STRIDE}};
    for (var l = lid; l < {{EXT}} * BK / 4u; l = l + NT) {
        let oq = l % {{EXT}}4;
        let kk = l / {{EXT}}4;
        let go = o0 + oq * 4u;
        let gk = k0 + kk;
        var v = vec4<f32>(0.0);
        if (go < {{LIMIT}} && gk < params.k_end) { v = {{X}}[(base + go + gk * k_stride) / 4u]; }
        {{SLAB}}[kk * {{EXT}}4 + oq] = v;
    }
}
