//! 2-D max and average pooling over NCHW planes, and their adjoints. Work is split by plane.

use rayon::prelude::*;

use crate::backend::Pool2dGeometry;

use super::par::{for_rows, rows_per_chunk};

/// In-bounds input range `[lo, hi)` of the window of output `o` along one axis.
#[inline]
fn window(o: usize, stride: usize, pad: usize, k: usize, size: usize) -> (usize, usize) {
    let start = o * stride;
    let lo = start.saturating_sub(pad).min(size);
    let hi = (start + k).saturating_sub(pad).min(size);
    (lo, hi.max(lo))
}

/// `y` and `argmax` (`n * c * h_out * w_out` each) from contiguous `x`. Padding counts as
/// `-inf`; ties keep the first position in row-major window order; NaN wins.
pub(crate) fn max_pool2d(y: &mut [f32], argmax: &mut [f32], x: &[f32], g: &Pool2dGeometry) {
    let hw = g.h * g.w;
    let ohw = g.h_out * g.w_out;
    if ohw == 0 {
        return;
    }
    let xw: Vec<(usize, usize)> = (0..g.w_out)
        .map(|ox| window(ox, g.stride.1, g.padding.1, g.kw, g.w))
        .collect();
    let run = |p0: usize, y: &mut [f32], am: &mut [f32]| {
        for (i, (yp, ap)) in y.chunks_mut(ohw).zip(am.chunks_mut(ohw)).enumerate() {
            let xp = &x[(p0 + i) * hw..(p0 + i + 1) * hw];
            for oy in 0..g.h_out {
                let (y0, y1) = window(oy, g.stride.0, g.padding.0, g.kh, g.h);
                let yo = &mut yp[oy * g.w_out..(oy + 1) * g.w_out];
                let ao = &mut ap[oy * g.w_out..(oy + 1) * g.w_out];
                for ((yo, ao), &(x0, x1)) in yo.iter_mut().zip(ao.iter_mut()).zip(&xw) {
                    // Branch-free scan (random data would mispredict every compare); an empty
                    // window gives -inf at index 0.
                    let mut best = f32::NEG_INFINITY;
                    let mut at = usize::MAX;
                    for iy in y0..y1 {
                        let row = &xp[iy * g.w..(iy + 1) * g.w];
                        for (ix, &v) in row[x0..x1].iter().enumerate() {
                            let first = at == usize::MAX;
                            let better = first | (v > best) | (v.is_nan() & !best.is_nan());
                            best = if better { v } else { best };
                            at = if better { iy * g.w + x0 + ix } else { at };
                        }
                    }
                    let at = if at == usize::MAX { 0 } else { at };
                    *yo = best;
                    *ao = at as f32;
                }
            }
        }
    };
    let planes = y.len() / ohw;
    match rows_per_chunk(planes, ohw * g.kh * g.kw) {
        None => run(0, y, argmax),
        Some(rpc) => y
            .par_chunks_mut(rpc * ohw)
            .zip(argmax.par_chunks_mut(rpc * ohw))
            .enumerate()
            .for_each(|(c, (y, a))| run(c * rpc, y, a)),
    }
}

/// `dx` (`n * c * h * w`, zero-initialised) gets each `dy` added at its plane's `argmax`.
pub(crate) fn max_pool2d_backward(dx: &mut [f32], dy: &[f32], argmax: &[f32], g: &Pool2dGeometry) {
    let hw = g.h * g.w;
    let ohw = g.h_out * g.w_out;
    for_rows(dx, hw, |p0, chunk| {
        for (i, xp) in chunk.chunks_mut(hw).enumerate() {
            let p = p0 + i;
            let (d, a) = (&dy[p * ohw..(p + 1) * ohw], &argmax[p * ohw..(p + 1) * ohw]);
            for (&d, &a) in d.iter().zip(a) {
                xp[a as usize] += d;
            }
        }
    });
}

/// `y` (`n * c * h_out * w_out`) from contiguous `x`: window sums over `kh * kw`.
pub(crate) fn avg_pool2d(y: &mut [f32], x: &[f32], g: &Pool2dGeometry) {
    let hw = g.h * g.w;
    let ohw = g.h_out * g.w_out;
    let inv = 1.0 / (g.kh * g.kw) as f32;
    for_rows(y, ohw, |p0, chunk| {
        for (i, yp) in chunk.chunks_mut(ohw).enumerate() {
            let xp = &x[(p0 + i) * hw..(p0 + i + 1) * hw];
            for oy in 0..g.h_out {
                let (y0, y1) = window(oy, g.stride.0, g.padding.0, g.kh, g.h);
                for ox in 0..g.w_out {
                    let (x0, x1) = window(ox, g.stride.1, g.padding.1, g.kw, g.w);
                    let mut s = 0.0;
                    for iy in y0..y1 {
                        s += xp[iy * g.w + x0..iy * g.w + x1].iter().sum::<f32>();
                    }
                    yp[oy * g.w_out + ox] = s * inv;
                }
            }
        }
    });
}

/// `dx` (`n * c * h * w`, zero-initialised) gets `dy / (kh * kw)` spread over each window.
pub(crate) fn avg_pool2d_backward(dx: &mut [f32], dy: &[f32], g: &Pool2dGeometry) {
    let hw = g.h * g.w;
    let ohw = g.h_out * g.w_out;
    let inv = 1.0 / (g.kh * g.kw) as f32;
    for_rows(dx, hw, |p0, chunk| {
        for (i, xp) in chunk.chunks_mut(hw).enumerate() {
            let p = p0 + i;
            let d = &dy[p * ohw..(p + 1) * ohw];
            for oy in 0..g.h_out {
                let (y0, y1) = window(oy, g.stride.0, g.padding.0, g.kh, g.h);
                for ox in 0..g.w_out {
                    let (x0, x1) = window(ox, g.stride.1, g.padding.1, g.kw, g.w);
                    let v = d[oy * g.w_out + ox] * inv;
                    for iy in y0..y1 {
                        for t in &mut xp[iy * g.w + x0..iy * g.w + x1] {
                            *t += v;
                        }
                    }
                }
            }
        }
    });
}
