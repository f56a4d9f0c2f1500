// Packs a strided batch of R x C matrices into a tiled, zero-padded layout (the operand format of
// the subgroup matmul). Tile (t0, t1) covers rows t0 * T0 .. + T0 and columns t1 * T1 .. + T1;
// inside a tile, elements are row-major. With `col_outer` the tiles are ordered column-tile
// first (t1, t0), else row-tile first (t0, t1). One invocation per destination element; source
// elements outside R x C read as 0.
//
// Source element (b, r, c) is at off + b * bs + r * rs + c * cs; `read_src` reads it from f32
// values or from packed halves (the SRC placeholder, see `kernel.rs`), so half operands are
// widened here, on the way into the f32 tiles, at no extra pass.

struct PackParams {
    total: u32, rows: u32, cols: u32,
    t0: u32, t1: u32, n_t0: u32, n_t1: u32, col_outer: u32,
    off: u32, bs: u32, rs: u32, cs: u32,
}

@group(0) @binding(0) var<storage, read> params: PackParams;

{{SRC}}
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, {{WG}}u);
    if (e >= params.total) { return; }
    let R = params.rows;
    let C = params.cols;
    let T0 = params.t0;
    let T1 = params.t1;
    let nT0 = params.n_t0;
    let nT1 = params.n_t1;
    let e1 = e % T1;
    let e0 = (e / T1) % T0;
    let rest = e / (T0 * T1);
    var t0 = 0u;
    var t1 = 0u;
    if (params.col_outer != 0u) {
        t0 = rest % nT0;
        t1 = (rest / nT0) % nT1;
    } else {
        t1 = rest % nT1;
        t0 = (rest / nT1) % nT0;
    }
    let b = rest / (nT0 * nT1);
    let r = t0 * T0 + e0;
    let c = t1 * T1 + e1;
    var v = 0.0;
    if (r < R && c < C) {
        v = read_src(params.off + b * params.bs + r * params.rs + c * params.cs);
    }
    dst[e] = v;
}
