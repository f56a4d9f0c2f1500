// Convolution lowering (im2col, col2im) and 2-D pooling over NCHW tensors, one invocation per
// output element. The adjoints (col2im, pool backward) gather over the windows that cover each
// input pixel instead of scattering, so they need no atomics and sum in a fixed order.
//
// Bindings: 1 = in0, 2 = in1 (read); 3 = out0, 4 = out1 (read-write); each entry point uses
// the ones it names.
// Pooling passes dilation 1 and one group.

struct SpatialParams {
    n: u32, c: u32, h: u32, w: u32,
    // kernel, stride, padding, dilation
    kh: u32, kw: u32, sh: u32, sw: u32, ph: u32, pw: u32, dh: u32, dw: u32,
    groups: u32, h_out: u32, w_out: u32,
}

@group(0) @binding(0) var<storage, read> params: SpatialParams;

@group(0) @binding(1) var<storage, read> in0: array<f32>;
@group(0) @binding(2) var<storage, read> in1: array<f32>;
@group(0) @binding(3) var<storage, read_write> out0: array<f32>;
@group(0) @binding(4) var<storage, read_write> out1: array<f32>;

const WG: u32 = {{WG}}u;

struct Geo {
    n: u32,
    c: u32,
    h: i32,
    w: i32,
    kh: i32,
    kw: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    dh: i32,
    dw: i32,
    groups: u32,
    h_out: i32,
    w_out: i32,
}

fn geo() -> Geo {
    return Geo(
        params.n, params.c, i32(params.h), i32(params.w), i32(params.kh), i32(params.kw),
        i32(params.sh), i32(params.sw), i32(params.ph), i32(params.pw), i32(params.dh),
        i32(params.dw), params.groups, i32(params.h_out), i32(params.w_out),
    );
}

// Smallest o >= 0 with o * s - p + (k - 1) * d >= y, i.e. the first window reaching y, for
// dilation 1: ceil((y + p - k + 1) / s) clamped at 0.
fn first_window(y: i32, p: i32, k: i32, s: i32) -> i32 {
    let t = y + p - k + 1;
    if (t <= 0) {
        return 0;
    }
    return (t + s - 1) / s;
}

// cols [n, groups, (c / groups) * kh * kw, h_out * w_out] from x [n, c, h, w]
@compute @workgroup_size(WG)
fn im2col(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    let cg = g.c / g.groups;
    let cr = cg * u32(g.kh * g.kw);
    let cc = u32(g.h_out * g.w_out);
    if (e >= g.n * g.groups * cr * cc) { return; }
    let col = e % cc;
    let r = (e / cc) % cr;
    let grp = (e / (cc * cr)) % g.groups;
    let b = e / (cc * cr * g.groups);
    let kx = i32(r % u32(g.kw));
    let ky = i32((r / u32(g.kw)) % u32(g.kh));
    let ch = grp * cg + r / u32(g.kh * g.kw);
    let oy = i32(col) / g.w_out;
    let ox = i32(col) % g.w_out;
    let iy = oy * g.sh - g.ph + ky * g.dh;
    let ix = ox * g.sw - g.pw + kx * g.dw;
    var v = 0.0;
    if (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) {
        v = in0[((b * g.c + ch) * u32(g.h) + u32(iy)) * u32(g.w) + u32(ix)];
    }
    out0[e] = v;
}

// x [n, c, h, w] = sum of the columns that read each pixel
@compute @workgroup_size(WG)
fn col2im(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    let hw = u32(g.h * g.w);
    if (e >= g.n * g.c * hw) { return; }
    let x = i32(e % u32(g.w));
    let y = i32((e / u32(g.w)) % u32(g.h));
    let ch = (e / hw) % g.c;
    let b = e / (hw * g.c);
    let cg = g.c / g.groups;
    let grp = ch / cg;
    let cl = ch % cg;
    let cr = cg * u32(g.kh * g.kw);
    let cc = u32(g.h_out * g.w_out);
    let base = (b * g.groups + grp) * cr;
    var acc = 0.0;
    for (var ky = 0; ky < g.kh; ky = ky + 1) {
        let ty = y + g.ph - ky * g.dh;
        if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.h_out) {
            continue;
        }
        let oy = ty / g.sh;
        for (var kx = 0; kx < g.kw; kx = kx + 1) {
            let tx = x + g.pw - kx * g.dw;
            if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.w_out) {
                continue;
            }
            let ox = tx / g.sw;
            let r = (cl * u32(g.kh) + u32(ky)) * u32(g.kw) + u32(kx);
            acc = acc + in0[(base + r) * cc + u32(oy * g.w_out + ox)];
        }
    }
    out0[e] = acc;
}

// Where output element `e` of a pool sits: its window's column and row, and the start of its
// (n, c) input plane.
struct OutWindow {
    ox: i32,
    oy: i32,
    plane: u32,
}

fn out_window(e: u32, g: Geo) -> OutWindow {
    let ohw = u32(g.h_out * g.w_out);
    return OutWindow(
        i32(e % u32(g.w_out)),
        i32((e / u32(g.w_out)) % u32(g.h_out)),
        (e / ohw) * u32(g.h * g.w),
    );
}

// The output windows covering input pixel `e` of a pool (for the adjoints): its flat position
// in its plane, the start of its (n, c) output plane, and the window rows/columns to visit.
struct Covering {
    pos: i32,
    oplane: u32,
    oy_first: i32,
    oy_end: i32,
    ox_first: i32,
    ox_end: i32,
}

fn covering_windows(e: u32, g: Geo) -> Covering {
    let hw = u32(g.h * g.w);
    let pos = i32(e % hw);
    let x = pos % g.w;
    let y = pos / g.w;
    return Covering(
        pos,
        (e / hw) * u32(g.h_out * g.w_out),
        first_window(y, g.ph, g.kh, g.sh),
        min((y + g.ph) / g.sh, g.h_out - 1),
        first_window(x, g.pw, g.kw, g.sw),
        min((x + g.pw) / g.sw, g.w_out - 1),
    );
}

// y, argmax [n, c, h_out, w_out] from x [n, c, h, w]; padding never wins; ties keep the first.
@compute @workgroup_size(WG)
fn max_pool2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    if (e >= g.n * g.c * u32(g.h_out * g.w_out)) { return; }
    let o = out_window(e, g);
    let ox = o.ox;
    let oy = o.oy;
    let plane = o.plane;
    var best = neg_inf();
    var arg = -1;
    for (var ky = 0; ky < g.kh; ky = ky + 1) {
        let iy = oy * g.sh - g.ph + ky;
        if (iy < 0 || iy >= g.h) {
            continue;
        }
        for (var kx = 0; kx < g.kw; kx = kx + 1) {
            let ix = ox * g.sw - g.pw + kx;
            if (ix < 0 || ix >= g.w) {
                continue;
            }
            let v = in0[plane + u32(iy * g.w + ix)];
            if (arg < 0 || v > best) {
                best = v;
                arg = iy * g.w + ix;
            }
        }
    }
    out0[e] = best;
    out1[e] = f32(max(arg, 0));
}

// dx [n, c, h, w] from dy, argmax [n, c, h_out, w_out]
@compute @workgroup_size(WG)
fn max_pool2d_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    if (e >= g.n * g.c * u32(g.h * g.w)) { return; }
    let c = covering_windows(e, g);
    let pos = c.pos;
    let oplane = c.oplane;
    var acc = 0.0;
    for (var oy = c.oy_first; oy <= c.oy_end; oy = oy + 1) {
        for (var ox = c.ox_first; ox <= c.ox_end; ox = ox + 1) {
            let o = oplane + u32(oy * g.w_out + ox);
            if (i32(in1[o]) == pos) {
                acc = acc + in0[o];
            }
        }
    }
    out0[e] = acc;
}

// y [n, c, h_out, w_out] = window sum / (kh * kw) (padding counts as zeros)
@compute @workgroup_size(WG)
fn avg_pool2d(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    if (e >= g.n * g.c * u32(g.h_out * g.w_out)) { return; }
    let o = out_window(e, g);
    let ox = o.ox;
    let oy = o.oy;
    let plane = o.plane;
    var acc = 0.0;
    for (var ky = 0; ky < g.kh; ky = ky + 1) {
        let iy = oy * g.sh - g.ph + ky;
        if (iy < 0 || iy >= g.h) {
            continue;
        }
        for (var kx = 0; kx < g.kw; kx = kx + 1) {
            let ix = ox * g.sw - g.pw + kx;
            if (ix < 0 || ix >= g.w) {
                continue;
            }
            acc = acc + in0[plane + u32(iy * g.w + ix)];
        }
    }
    out0[e] = acc / f32(g.kh * g.kw);
}

// dx [n, c, h, w] = sum over the windows covering each pixel of dy / (kh * kw)
@compute @workgroup_size(WG)
fn avg_pool2d_backward(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let g = geo();
    if (e >= g.n * g.c * u32(g.h * g.w)) { return; }
    let c = covering_windows(e, g);
    let oplane = c.oplane;
    let inv = 1.0 / f32(g.kh * g.kw);
    var acc = 0.0;
    for (var oy = c.oy_first; oy <= c.oy_end; oy = oy + 1) {
        for (var ox = c.ox_first; ox <= c.ox_end; ox = ox + 1) {
            acc = acc + in0[oplane + u32(oy * g.w_out + ox)] * inv;
        }
    }
    out0[e] = acc;
}
