// matmul.wgsl, matmul_subgroup.wgsl: writes (or, with `accumulate`, adds) the columns
// col .. col + 3 of row `row` of c that are inside c, one scalar at a time.
fn store4(c_base: u32, row: u32, col: u32, v: vec4<f32>) {
    let N = params.n;
    if (row >= params.m) { return; }
    for (var e = 0u; e < 4u; e = e + 1u) {
        if (col + e < N) {
            let ci = c_base + row * N + col + e;
            if (params.accumulate != 0u) { c[ci] = c[ci] + v[e]; } else { c[ci] = v[e]; }
        }
    }
}
