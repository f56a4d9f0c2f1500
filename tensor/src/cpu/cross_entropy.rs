//! Softmax + cross-entropy over the rows of contiguous `[rows, cols]` logits: the loss of each row
//! and its backward, each one pass per row where log_softmax, gather, scatter and the log-softmax
//! backward made several over the whole matrix.

use rayon::prelude::*;

use super::math::exp;
use super::par::rows_per_chunk;
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
    let run = |r0: usize, l: &mut [f32], m: &mut [f32], s: &mut [f32]| {
        let mut scratch = vec![0f32; cols];
        for i in 0..l.len() {
            let r = r0 + i;
            let row = &x[r * cols..(r + 1) * cols];
            (l[i], m[i], s[i]) = row_loss(row, targets[r] as usize, &mut scratch);
        }
    };
    match rows_per_chunk(rows, cols) {
        None => run(0, loss, max_out, logsum),
        Some(rpc) => loss
            .par_chunks_mut(rpc)
            .zip(max_out.par_chunks_mut(rpc))
            .zip(logsum.par_chunks_mut(rpc))
            .enumerate()
            .for_each(|(c, ((l, m), s))| run(c * rpc, l, m, s)),
    }
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
