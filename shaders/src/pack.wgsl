// Packs a strided batch of R x C matrices into a tiled, zero-padded layout (the operand format of
// the subgroup matmul). Tiles are T0 x T1 (T1 a power of two, at least 4, given as its log); tile
// (t0, t1) covers rows t0 * T0 .. + T0 and columns t1 * T1 .. + T1; inside a tile, elements are
// row-major. With `col_outer` the tiles are ordered column-tile first (t1, t0), else row-tile
// first (t0, t1). Source elements outside R x C read as 0.
//
// The grid walks the padded source: x is a run of four columns (one vec4 of the destination),
// one workgroup row (y, from `y_base`) one (matrix, row) pair. Lanes only shift and mask: integer
// division has no vector instruction on a CPU, so llvmpipe divides lane by lane, and the
// divisions left (of the workgroup's y) are the same for every lane.
//
// Source element (b, r, c) is at off + b * bs + r * rs + c * cs; `read_src` reads it from f32
// values or from packed halves (the SRC placeholder, see `kernel.rs`), so half operands are
// widened here, on the way into the f32 tiles, at no extra pass.

struct PackParams {
    rows: u32, cols: u32, t0: u32, lg_t1: u32, n_t0: u32, n_t1: u32, col_outer: u32,
    off: u32, bs: u32, rs: u32, cs: u32, y_base: u32,
}

@group(0) @binding(0) var<storage, read> params: PackParams;

{{SRC}}
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let T0 = params.t0;
    let lg1 = params.lg_t1;
    let nT0 = params.n_t0;
    let nT1 = params.n_t1;
    let c = gid.x * 4u;
    if (c >= nT1 << lg1) { return; }
    let padded_rows = nT0 * T0;
    let y = params.y_base + wid.y;
    let b = y / padded_rows;
    let r = y - b * padded_rows;
    let t0 = r / T0;
    let t1 = c >> lg1;
    let tile = select(t0 * nT1 + t1, t1 * nT0 + t0, params.col_outer != 0u);
    let e0 = r - t0 * T0;
    let e1 = c & ((1u << lg1) - 1u);
    let e = (((b * nT0 * nT1 + tile) * T0 + e0) << lg1) + e1;
    var v = vec4<f32>(0.0);
    if (r < params.rows) {
        let base = params.off + b * params.bs + r * params.rs + c * params.cs;
        let cs = params.cs;
        let cols = params.cols;
        if (c < cols) { v.x = read_src(base); }
        if (c + 1u < cols) { v.y = read_src(base + cs); }
        if (c + 2u < cols) { v.z = read_src(base + 2u * cs); }
        if (c + 3u < cols) { v.w = read_src(base + 3u * cs); }
    }
    dst[e >> 2u] = v;
}
