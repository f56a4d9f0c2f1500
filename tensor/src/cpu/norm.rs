//! Layer normalisation over the rows of a contiguous `[rows, cols]` matrix.

use super::par::for_row_chunks;
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

/// The length of the rows of `y_len` values over `mean.len()` rows, or `None` when there is
/// nothing to normalise: no rows, or empty rows (whose statistics are then those of a zero
/// variance).
fn row_len(y_len: usize, mean: &mut [f32], rstd: &mut [f32], eps: f32) -> Option<usize> {
    let rows = mean.len();
    if rows == 0 {
        return None;
    }
    let cols = y_len / rows;
    if cols == 0 {
        mean.fill(0.0);
        rstd.fill(1.0 / eps.sqrt());
        return None;
    }
    Some(cols)
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
    let Some(cols) = row_len(y.len(), mean, rstd, eps) else {
        return;
    };
    for_row_chunks(
        [y, mean, rstd],
        [cols, 1, 1],
        rows,
        cols,
        |r0, [y, mean, rstd]| {
            for (i, yr) in y.chunks_mut(cols).enumerate() {
                let at = (r0 + i) * cols;
                (mean[i], rstd[i]) = layer_norm_row(yr, &x[at..at + cols], gamma, beta, eps);
            }
        },
    );
}

/// [`layer_norm_rows`] of `x + r`, the sum written to `s` first (the normalisation then reads
/// it back, so `y` is bit for bit the layer norm of the materialised sum).
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_layer_norm_rows(
    s: &mut [f32],
    y: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    r: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
) {
    let rows = mean.len();
    let Some(cols) = row_len(y.len(), mean, rstd, eps) else {
        return;
    };
    for_row_chunks(
        [s, y, mean, rstd],
        [cols, cols, 1, 1],
        rows,
        cols,
        |r0, [s, y, mean, rstd]| {
            for (i, (sr, yr)) in s.chunks_mut(cols).zip(y.chunks_mut(cols)).enumerate() {
                let at = (r0 + i) * cols;
                add_row(sr, &x[at..at + cols], &r[at..at + cols]);
                (mean[i], rstd[i]) = layer_norm_row(yr, sr, gamma, beta, eps);
            }
        },
    );
}

multiversion! {
fn add_row(s: &mut [f32], x: &[f32], r: &[f32]) {
    for ((o, &a), &b) in s.iter_mut().zip(x).zip(r) {
        *o = a + b;
    }
}
}

multiversion! {
/// One row of the layer norm's input gradient (see [`layer_norm_backward_rows`]); `xhat` and
/// `prod` are scratch rows. Each mean is `sum * (1 / n) + 0`, as `Tensor::mean` computes it.
#[allow(clippy::too_many_arguments)]
fn layer_norm_backward_row(
    out: &mut [f32],
    x: &[f32],
    mean: f32,
    rstd: f32,
    gamma: &[f32],
    g: &[f32],
    carry: Option<&[f32]>,
    xhat: &mut [f32],
    prod: &mut [f32],
) {
    let inv_n = 1.0 / x.len() as f32;
    for (((o, &gv), &gm), (xh, &v)) in out.iter_mut().zip(g).zip(gamma).zip(xhat.iter_mut().zip(x)) {
        *o = gv * gm;
        *xh = (v - mean) * rstd;
    }
    let m1 = sum(out) * inv_n + 0.0;
    for ((p, &o), &xh) in prod.iter_mut().zip(out.iter()).zip(xhat.iter()) {
        *p = o * xh;
    }
    let m2 = sum(prod) * inv_n + 0.0;
    for (o, &xh) in out.iter_mut().zip(xhat.iter()) {
        *o = ((*o - m1) - xh * m2) * rstd;
    }
    if let Some(c) = carry {
        // The tape's `carry + dx` (IEEE addition commutes exactly).
        for (o, &cv) in out.iter_mut().zip(c) {
            *o += cv;
        }
    }
}
}

/// The gradient of layer norm's input `x [rows, cols]` given the output gradient `g`, the saved
/// `mean`, `rstd` (`[rows]`) and `gamma` (`[cols]`), plus `carry` when given: the arithmetic, op
/// for op, of the composed backward and the tape's gradient sum.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward_rows(
    out: &mut [f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    g: &[f32],
    carry: Option<&[f32]>,
) {
    let rows = mean.len();
    if rows == 0 {
        return;
    }
    let cols = out.len() / rows;
    super::par::for_rows(out, cols, |r0, o| {
        let (mut xhat, mut prod) = (vec![0f32; cols], vec![0f32; cols]);
        for (i, o) in o.chunks_mut(cols).enumerate() {
            let r = r0 + i;
            let at = r * cols;
            layer_norm_backward_row(
                o,
                &x[at..at + cols],
                mean[r],
                rstd[r],
                gamma,
                &g[at..at + cols],
                carry.map(|c| &c[at..at + cols]),
                &mut xhat,
                &mut prod,
            );
        }
    });
}
