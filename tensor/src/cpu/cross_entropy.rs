//! Softmax + cross-entropy over the rows of contiguous `[rows, cols]` logits: the loss of each row
//! and its backward, each one pass per row where log_softmax, gather, scatter and the log-softmax
//! backward made several over the whole matrix.

use super::math::exp;
use super::par::for_row_chunks;
use super::reduce::{max, sum};
use super::simd::multiversion;

multiversion! {
/// `(loss, max, logsum)` of one row whose target is `t`; `scratch` holds the row's exponentials
/// so they are summed in the lanes [`super::reduce::softmax_rows`] sums them in.
fn row_loss(x: &[f32], t: usize, scratch: &mut [f32]) -> (f32, f32, f32) {
    let m = max(x);
    for (o, &v) in scratch.iter_mut().zip(x) {
        *o = exp(v - m);
    }
    let ls = sum(scratch).ln();
    (-((x[t] - m) - ls), m, ls)
}
}

/// Fills `loss`, `max`, `logsum` (`[rows]` each) from contiguous `x` and `targets`.
pub(crate) fn cross_entropy_rows(
    loss: &mut [f32],
    max_out: &mut [f32],
    logsum: &mut [f32],
    x: &[f32],
    targets: &[f32],
) {
    let rows = loss.len();
    if rows == 0 {
        return;
    }
    let cols = x.len() / rows;
    for_row_chunks(
        [loss, max_out, logsum],
        [1, 1, 1],
        rows,
        cols,
        |r0, [l, m, s]| {
            let mut scratch = vec![0f32; cols];
            for i in 0..l.len() {
                let r = r0 + i;
                let row = &x[r * cols..(r + 1) * cols];
                (l[i], m[i], s[i]) = row_loss(row, targets[r] as usize, &mut scratch);
            }
        },
    );
}

multiversion! {
/// `out = g * exp((x - m) - ls)`, minus `g` at `t`: the composed backward's arithmetic
/// (`G - exp(log_softmax) * sum(G)` with `G` the scattered gradient of the gathered log-prob).
fn row_grad(out: &mut [f32], x: &[f32], t: usize, m: f32, ls: f32, g: f32) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp((v - m) - ls) * g;
    }
    out[t] -= g;
}
}

/// `dx [rows, cols]` from contiguous `x`, `targets`, `max`, `logsum` and `g` (`[rows]` each).
pub(crate) fn cross_entropy_backward_rows(
    out: &mut [f32],
    x: &[f32],
    targets: &[f32],
    max_in: &[f32],
    logsum: &[f32],
    g: &[f32],
) {
    let rows = g.len();
    if rows == 0 {
        return;
    }
    let cols = out.len() / rows;
    super::par::for_rows(out, cols, |r0, o| {
        for (i, o) in o.chunks_mut(cols).enumerate() {
            let r = r0 + i;
            let row = &x[r * cols..(r + 1) * cols];
            row_grad(o, row, targets[r] as usize, max_in[r], logsum[r], g[r]);
        }
    });
}
