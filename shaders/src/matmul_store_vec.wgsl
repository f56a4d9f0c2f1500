// matmul.wgsl, matmul_subgroup.wgsl: writes (or, with `accumulate`, adds) the four columns
// col .. col + 3 of row `row` of c as one vec4 (n a multiple of 4).
fn store4(c_base: u32, row: u32, col: u32, v: vec4<f32>) {
    let N = params.n;
    if (row >= params.m || col >= N) { return; }
    let ci = (c_base + row * N + col) / 4u;
    if (params.accumulate != 0u) { c[ci] = c[ci] + v; } else { c[ci] = v; }
}
