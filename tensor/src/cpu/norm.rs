//! Layer normalisation over the rows of a contiguous `[rows, cols]` matrix.

use rayon::prelude::*;

use super::par::rows_per_chunk;
use super::reduce::sum;
use super::simd::multiversion;

multiversion! {
/// One row: two-pass mean and biased variance, then `y = (x - mean) * rstd * gamma + beta`.
fn layer_norm_row(y: &mut [f32], x: &[f32], gamma: &[f32], beta: &[f32], eps: f32) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = sum(x) / n;
    for (o, &v) in y.iter_mut().zip(x) {
        let d = v - mean;
        *o = d * d;
    }
    let var = sum(y) / n;
    let rstd = 1.0 / (var + eps).sqrt();
    for (((o, &v), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
        *o = (v - mean) * rstd * g + b;
    }
    (mean, rstd)
}
}

/// Fills `y [rows, cols]`, `mean [rows]`, `rstd [rows]` from contiguous `x`.
pub(crate) fn layer_norm_rows(
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) {
    let rows = mean.len();
    if rows == 0 {
        return;
    }
    let cols = y.len() / rows;
    if cols == 0 {
        mean.fill(0.0);
        rstd.fill(1.0 / eps.sqrt());
        return;
    }
    let run = |r0: usize, y: &mut [f32], mean: &mut [f32], rstd: &mut [f32]| {
        for (i, yr) in y.chunks_mut(cols).enumerate() {
            let r = r0 + i;
            let xr = &x[r * cols..(r + 1) * cols];
            let (m, s) = layer_norm_row(yr, xr, gamma, beta, eps);
            mean[i] = m;
            rstd[i] = s;
        }
    };
    match rows_per_chunk(rows, cols) {
        None => run(0, y, mean, rstd),
        Some(rpc) => y
            .par_chunks_mut(rpc * cols)
            .zip(mean.par_chunks_mut(rpc))
            .zip(rstd.par_chunks_mut(rpc))
            .enumerate()
            .for_each(|(c, ((y, m), s))| run(c * rpc, y, m, s)),
    }
}
