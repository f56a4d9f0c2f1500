//! im2col and its adjoint col2im for 2-D convolution (NCHW).
//!
//! Per image, the column matrix is `[c_in * kh * kw, h_out * w_out]` (the groups are consecutive
//! blocks of its rows, so `[groups, col_rows, col_cols]` is the same memory): row
//! `(c * kh + ky) * kw + kx`, column `oy * w_out + ox` holds
//! `x[c, oy * sh + ky * dh - ph, ox * sw + kx * dw - pw]`, or 0 in the padding.

use crate::backend::Conv2dGeometry;

use super::par::for_rows;

/// Input coordinate of output position `o` for kernel tap `k`, if inside `0..size`.
#[inline]
fn src(o: usize, k: usize, stride: usize, dil: usize, pad: usize, size: usize) -> Option<usize> {
    let i = (o * stride + k * dil).checked_sub(pad)?;
    (i < size).then_some(i)
}

/// Range of output positions `o` in `0..n_out` whose input coordinate is in bounds.
fn valid_range(
    k: usize,
    stride: usize,
    dil: usize,
    pad: usize,
    size: usize,
    n_out: usize,
) -> (usize, usize) {
    let lo = (0..n_out)
        .find(|&o| src(o, k, stride, dil, pad, size).is_some())
        .unwrap_or(n_out);
    let hi = (lo..n_out)
        .rev()
        .find(|&o| src(o, k, stride, dil, pad, size).is_some())
        .map_or(lo, |o| o + 1);
    (lo, hi)
}

/// `cols` (`n * c_in * kh * kw * h_out * w_out`, zero-initialised or not) from contiguous `x`.
pub(crate) fn im2col(cols: &mut [f32], x: &[f32], g: &Conv2dGeometry) {
    let (sh, sw) = g.stride;
    let (ph, pw) = g.padding;
    let (dh, dw) = g.dilation;
    let ncol = g.col_cols();
    let taps = g.kh * g.kw;
    for_rows(cols, ncol, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(ncol).enumerate() {
            let r = r0 + i;
            let plane = r / taps; // n * c_in + c
            let (ky, kx) = ((r % taps) / g.kw, r % g.kw);
            let xp = &x[plane * g.h * g.w..(plane + 1) * g.h * g.w];
            let (lo, hi) = valid_range(kx, sw, dw, pw, g.w, g.w_out);
            for oy in 0..g.h_out {
                let o = &mut row[oy * g.w_out..(oy + 1) * g.w_out];
                let Some(iy) = src(oy, ky, sh, dh, ph, g.h) else {
                    o.fill(0.0);
                    continue;
                };
                let xr = &xp[iy * g.w..(iy + 1) * g.w];
                o[..lo].fill(0.0);
                o[hi..].fill(0.0);
                if hi > lo {
                    let ix0 = lo * sw + kx * dw - pw;
                    if sw == 1 {
                        o[lo..hi].copy_from_slice(&xr[ix0..ix0 + (hi - lo)]);
                    } else {
                        for (j, v) in o[lo..hi].iter_mut().enumerate() {
                            *v = xr[ix0 + j * sw];
                        }
                    }
                }
            }
        }
    });
}

/// Adjoint of [`im2col`]: `dx` (`n * c_in * h * w`, zero-initialised) gets every column entry
/// added back at its input position.
pub(crate) fn col2im(dx: &mut [f32], cols: &[f32], g: &Conv2dGeometry) {
    let (sh, sw) = g.stride;
    let (ph, pw) = g.padding;
    let (dh, dw) = g.dilation;
    let ncol = g.col_cols();
    let taps = g.kh * g.kw;
    let hw = g.h * g.w;
    for_rows(dx, hw, |p0, chunk| {
        for (i, xp) in chunk.chunks_mut(hw).enumerate() {
            let plane = p0 + i;
            for ky in 0..g.kh {
                for kx in 0..g.kw {
                    let r = plane * taps + ky * g.kw + kx;
                    let row = &cols[r * ncol..(r + 1) * ncol];
                    let (lo, hi) = valid_range(kx, sw, dw, pw, g.w, g.w_out);
                    if hi <= lo {
                        continue;
                    }
                    for oy in 0..g.h_out {
                        let Some(iy) = src(oy, ky, sh, dh, ph, g.h) else {
                            continue;
                        };
                        let xr = &mut xp[iy * g.w..(iy + 1) * g.w];
                        let cr = &row[oy * g.w_out..(oy + 1) * g.w_out];
                        let ix0 = lo * sw + kx * dw - pw;
                        for (j, &v) in cr[lo..hi].iter().enumerate() {
                            xr[ix0 + j * sw] += v;
                        }
                    }
                }
            }
        }
    });
}
