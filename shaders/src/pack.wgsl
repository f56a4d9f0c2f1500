// Packs a strided batch of R x C matrices into a tiled, zero-padded layout (the operand format of
// the subgroup matmul). Tile (t0, t1) covers rows t0 * T0 .. + T0 and columns t1 * T1 .. + T1;
// inside a tile, elements are row-major. With `col_outer` the tiles are ordered column-tile
// first (t1, t0), else row-tile first (t0, t1). One invocation per destination element; source
// elements outside R x C read as 0.
//
// Params: [total, R, C, T0, T1, nT0, nT1, col_outer, off, bs, rs, cs].

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, {{WG}}u);
    if (e >= params[0]) {
        return;
    }
    let R = params[1];
    let C = params[2];
    let T0 = params[3];
    let T1 = params[4];
    let nT0 = params[5];
    let nT1 = params[6];
    let e1 = e % T1;
    let e0 = (e / T1) % T0;
    let rest = e / (T0 * T1);
    var t0 = 0u;
    var t1 = 0u;
    if (params[7] != 0u) {
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
        v = src[params[8] + b * params[9] + r * params[10] + c * params[11]];
    }
    dst[e] = v;
}
