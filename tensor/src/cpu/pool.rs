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
    // Valid output columns of each kernel column: ix = ox * sw + kx - pw inside 0..w.
    let cols: Vec<(usize, usize)> = (0..g.kw)
        .map(|kx| {
            let ok = |ox: usize| {
                (ox * g.stride.1 + kx)
                    .checked_sub(g.padding.1)
                    .is_some_and(|i| i < g.w)
            };
            let lo = (0..g.w_out).find(|&o| ok(o)).unwrap_or(g.w_out);
            let hi = (lo..g.w_out).rev().find(|&o| ok(o)).map_or(lo, |o| o + 1);
            (lo, hi)
        })
        .collect();
    let run = |p0: usize, y: &mut [f32], am: &mut [f32]| {
        // Taps outermost, output columns innermost: independent updates the CPU overlaps,
        // branch-free. Taps go in row-major window order, so ties keep the first position.
        let mut at = vec![usize::MAX; g.w_out];
        for (i, (yp, ap)) in y.chunks_mut(ohw).zip(am.chunks_mut(ohw)).enumerate() {
            let xp = &x[(p0 + i) * hw..(p0 + i + 1) * hw];
            for oy in 0..g.h_out {
                let (y0, y1) = window(oy, g.stride.0, g.padding.0, g.kh, g.h);
                let best = &mut yp[oy * g.w_out..(oy + 1) * g.w_out];
                best.fill(f32::NEG_INFINITY);
                at.fill(usize::MAX);
                for iy in y0..y1 {
                    let row = &xp[iy * g.w..(iy + 1) * g.w];
                    for (kx, &(lo, hi)) in cols.iter().enumerate() {
                        for ox in lo..hi {
                            let ix = ox * g.stride.1 + kx - g.padding.1;
                            let v = row[ix];
                            let (b, a) = (best[ox], at[ox]);
                            let better = (a == usize::MAX) | (v > b) | (v.is_nan() & !b.is_nan());
                            best[ox] = if better { v } else { b };
                            at[ox] = if better { iy * g.w + ix } else { a };
                        }
                    }
                }
                for (o, &a) in ap[oy * g.w_out..(oy + 1) * g.w_out].iter_mut().zip(&at) {
                    *o = if a == usize::MAX { 0.0 } else { a as f32 };
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
