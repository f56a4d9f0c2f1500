//! Row reductions and row softmax on contiguous `[rows, cols]` data. Rows are spread over threads;
//! a few very long rows are split inside the row instead.

use rayon::prelude::*;

use crate::backend::ReduceOp;

use super::par::{rows_per_chunk, PAR_THRESHOLD};
use super::simd::multiversion;

/// Sum with 8 independent f32 lanes (vectorises) per block of 4096, blocks added in f64: fast,
/// and far more accurate than one running f32 sum.
#[inline(always)]
pub(crate) fn sum(xs: &[f32]) -> f32 {
    let mut total = 0f64;
    for block in xs.chunks(SUM_BLOCK) {
        let (lanes, rest) = block.split_at(block.len() / 8 * 8);
        total += lane_sum(lanes, rest) as f64;
    }
    total as f32
}

/// One block of [`sum`]: `lanes` into eight lanes (a last chunk shorter than eight as if padded
/// with zeros, which add nothing: the causal softmax's sum of a row's visible values relies on
/// it), the lanes added pairwise, then `rest` one by one.
#[inline(always)]
fn lane_sum(lanes: &[f32], rest: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = lanes.chunks_exact(8);
    let last = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += c[k];
        }
    }
    for (k, &v) in last.iter().enumerate() {
        acc[k] += v;
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for &v in rest {
        s += v;
    }
    s
}

/// `out[j] = sum_i x[i * out.len() + j]`: the sums of the columns of contiguous
/// `[x.len() / out.len(), out.len()]` data (a bias gradient), row after row into f64 running sums
/// (vectorised across the columns; no transposing copy; at least as accurate as [`sum`]). Big
/// inputs are cut into bands of columns, one per task: each column is still summed row after
/// row, so the bits do not depend on the threads.
pub(crate) fn sum_columns(out: &mut [f32], x: &[f32]) {
    let width = out.len();
    if width == 0 {
        return;
    }
    let band = |first: usize, o: &mut [f32]| {
        let mut acc = vec![0f64; o.len()];
        for row in x.chunks_exact(width) {
            add_row_f64(&mut acc, &row[first..first + o.len()]);
        }
        for (o, a) in o.iter_mut().zip(acc) {
            *o = a as f32;
        }
    };
    // A pass over memory with one add per value: only big inputs repay the hand-off (measured,
    // 2 threads: [1024, 1024] 209 -> 132 us, but [1024, 256] 33 -> 43 us). Four bands per
    // thread (one each balanced worse: 183 us), each a whole number of 16-column pieces.
    let threads = super::par::kernel_threads();
    if threads <= 1 || x.len() < COLUMN_SUM_PAR_VALUES || width < 128 {
        return band(0, out);
    }
    let cols = (width / (4 * threads)).max(32).next_multiple_of(16);
    out.par_chunks_mut(cols)
        .enumerate()
        .for_each(|(c, o)| band(c * cols, o));
}

/// Inputs of at least this many values have their column sums split over the threads.
const COLUMN_SUM_PAR_VALUES: usize = 512 * 1024;

multiversion! {
fn add_row_f64(acc: &mut [f64], row: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(row) {
        *a += v as f64;
    }
}
}

/// `true` when `v` should replace the running maximum `best` (NaN wins and sticks, as PyTorch).
#[inline]
fn beats_max(v: f32, best: f32) -> bool {
    v > best || (v.is_nan() && !best.is_nan())
}

#[inline]
fn beats_min(v: f32, best: f32) -> bool {
    v < best || (v.is_nan() && !best.is_nan())
}

/// Maximum of a slice (`-inf` when empty); NaN propagates.
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    extreme(xs, f32::NEG_INFINITY, |a, b| a > b)
}

/// Minimum of a slice (`+inf` when empty); NaN propagates.
#[inline(always)]
pub(crate) fn min(xs: &[f32]) -> f32 {
    extreme(xs, f32::INFINITY, |a, b| a < b)
}

/// Eight-lane max/min (vectorises); a NaN anywhere gives NaN.
#[inline(always)]
fn extreme(xs: &[f32], init: f32, better: impl Fn(f32, f32) -> bool) -> f32 {
    let mut acc = [init; 8];
    let mut nan = [false; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] = if better(c[k], acc[k]) { c[k] } else { acc[k] };
            nan[k] |= c[k].is_nan();
        }
    }
    let mut m = init;
    for &v in acc.iter().chain(rest) {
        if better(v, m) {
            m = v;
        }
    }
    if nan.iter().any(|&b| b) || rest.iter().any(|v| v.is_nan()) {
        return f32::NAN;
    }
    m
}

/// `(index, value)` of the first extreme element (`(0, first)` for an empty slice: 0).
fn arg_extreme(xs: &[f32], beats: fn(f32, f32) -> bool) -> (usize, f32) {
    let mut bi = 0;
    let mut best = match xs.first() {
        Some(&v) => v,
        None => return (0, f32::NAN),
    };
    for (i, &v) in xs.iter().enumerate().skip(1) {
        if beats(v, best) {
            best = v;
            bi = i;
        }
    }
    (bi, best)
}

/// One row reduced.
fn reduce_one(op: ReduceOp, xs: &[f32]) -> f32 {
    match op {
        ReduceOp::Sum => sum(xs),
        ReduceOp::Max => max(xs),
        ReduceOp::Min => min(xs),
        ReduceOp::ArgMax => arg_extreme(xs, beats_max).0 as f32,
        ReduceOp::ArgMin => arg_extreme(xs, beats_min).0 as f32,
    }
}

/// A long row reduced in parallel pieces.
fn reduce_long(op: ReduceOp, xs: &[f32]) -> f32 {
    let piece = xs
        .len()
        .div_ceil(rayon::current_num_threads() * 4)
        .max(8192);
    match op {
        ReduceOp::Sum => {
            let parts: Vec<f32> = xs.par_chunks(piece).map(sum).collect();
            parts.iter().map(|&v| v as f64).sum::<f64>() as f32
        }
        ReduceOp::Max => max(&xs.par_chunks(piece).map(max).collect::<Vec<_>>()),
        ReduceOp::Min => min(&xs.par_chunks(piece).map(min).collect::<Vec<_>>()),
        ReduceOp::ArgMax | ReduceOp::ArgMin => {
            let beats = if op == ReduceOp::ArgMax {
                beats_max
            } else {
                beats_min
            };
            let parts: Vec<(usize, f32)> = xs
                .par_chunks(piece)
                .enumerate()
                .map(|(c, p)| {
                    let (i, v) = arg_extreme(p, beats);
                    (c * piece + i, v)
                })
                .collect();
            // Pieces are in order, so keeping the earlier one on ties keeps the first index.
            let mut best = parts[0];
            for &p in &parts[1..] {
                if beats(p.1, best.1) {
                    best = p;
                }
            }
            best.0 as f32
        }
    }
}

/// `out[r] = op(x[r, :])` for contiguous `x` of `out.len()` rows of `cols`.
pub(crate) fn reduce_rows(op: ReduceOp, out: &mut [f32], x: &[f32], cols: usize) {
    let rows = out.len();
    if cols == 0 {
        let v = match op {
            ReduceOp::Sum | ReduceOp::ArgMax | ReduceOp::ArgMin => 0.0,
            ReduceOp::Max => f32::NEG_INFINITY,
            ReduceOp::Min => f32::INFINITY,
        };
        out.fill(v);
        return;
    }
    let threads = rayon::current_num_threads();
    if rows < 2 * threads && cols >= PAR_THRESHOLD && threads > 1 {
        for (r, o) in out.iter_mut().enumerate() {
            *o = reduce_long(op, &x[r * cols..(r + 1) * cols]);
        }
        return;
    }
    let run = |r0: usize, o: &mut [f32]| {
        for (i, o) in o.iter_mut().enumerate() {
            let r = r0 + i;
            *o = reduce_one(op, &x[r * cols..(r + 1) * cols]);
        }
    };
    match rows_per_chunk(rows, cols) {
        None => run(0, out),
        Some(rpc) => out
            .par_chunks_mut(rpc)
            .enumerate()
            .for_each(|(c, o)| run(c * rpc, o)),
    }
}

multiversion! {
/// Numerically stable softmax (or log-softmax) of one row into `out`.
fn softmax_row(out: &mut [f32], x: &[f32], log: bool) {
    let m = max(x);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = super::math::exp(v - m);
    }
    let s = sum(out);
    if log {
        // (v - m) is exact near the maximum; adding m to ln(s) first would round it away.
        let ls = s.ln();
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - m) - ls;
        }
    } else {
        let inv = 1.0 / s;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}
}

/// Softmax of each row of contiguous `x` (`out.len() / cols` rows).
pub(crate) fn softmax_rows(out: &mut [f32], x: &[f32], cols: usize, log: bool) {
    super::par::for_rows(out, cols, |r0, o| {
        for (i, o) in o.chunks_mut(cols).enumerate() {
            let r = r0 + i;
            softmax_row(o, &x[r * cols..(r + 1) * cols], log);
        }
    });
}

multiversion! {
/// Softmax of `scale * x[..valid]` into `out[..valid]`, zeros after it: one row of causal
/// attention scores, the future masked out. The same arithmetic as the scaled, masked
/// (`-1e9`) and softmaxed row the unfused chain computed, so the two agree bit for bit.
///
/// The exponentials are summed in [`sum`]'s lanes and order over the whole row, but the zeros
/// after `valid` are not visited (they would add nothing), and the masked values are written
/// once, at the end (`0 * (1 / sum)`, NaN where the row is, as the unfused row's are): one pass
/// over them where the row made three. Summing each exponential as it is made (one pass fewer
/// over the valid ones) ran the attention kernel ~30% slower: that loop, eight lanes wide for
/// the sum's sake, was not vectorised as the plain exponential loop is.
pub(crate) fn causal_softmax_row(out: &mut [f32], x: &[f32], scale: f32, valid: usize) {
    let len = out.len();
    for (o, &v) in out[..valid].iter_mut().zip(x) {
        *o = v * scale;
    }
    let m = max(&out[..valid]);
    let total = if len > SUM_BLOCK {
        // Rows longer than one of `sum`'s blocks (never an attention's here): as written.
        for o in out[..valid].iter_mut() {
            *o = super::math::exp(*o - m);
        }
        out[valid..].fill(0.0);
        sum(out)
    } else {
        for o in out[..valid].iter_mut() {
            *o = super::math::exp(*o - m);
        }
        // The whole row's lanes and rest, cut at `valid`: zeros after it.
        let (lanes, rest) = out[..valid].split_at(valid.min(len / 8 * 8));
        lane_sum(lanes, rest)
    };
    let inv = 1.0 / total;
    for o in out[..valid].iter_mut() {
        *o *= inv;
    }
    out[valid..].fill(0.0 * inv);
}
}

/// The values [`sum`] adds in f32 before it adds the blocks in f64.
const SUM_BLOCK: usize = 4096;

/// [`causal_softmax_row`] of each row of contiguous `x`, seen as `[rows / cols, cols, cols]`
/// score matrices: row `r` is query `r % cols`, which may look at keys `0..=r % cols`.
pub(crate) fn causal_softmax_rows(out: &mut [f32], x: &[f32], cols: usize, scale: f32) {
    super::par::for_rows(out, cols, |r0, o| {
        for (i, o) in o.chunks_mut(cols).enumerate() {
            let r = r0 + i;
            causal_softmax_row(o, &x[r * cols..(r + 1) * cols], scale, r % cols + 1);
        }
    });
}

multiversion! {
/// `scale * y * (g - sum(g * y))`: the gradient of the scores of one softmaxed row `y` (the
/// gradient of `softmax(scale * x)` with respect to `x`), in two passes. The difference comes
/// before the product, as in PyTorch: where a row is peaked, `g` is close to the sum at its
/// largest `y`, and `g * y - y * sum` would round two products of about `g` each before
/// cancelling them.
pub(crate) fn softmax_backward_row(out: &mut [f32], y: &[f32], g: &[f32], scale: f32) {
    for ((o, &yv), &gv) in out.iter_mut().zip(y).zip(g) {
        *o = gv * yv;
    }
    let s = sum(out);
    for ((o, &yv), &gv) in out.iter_mut().zip(y).zip(g) {
        *o = yv * (gv - s) * scale;
    }
}
}

/// [`softmax_backward_row`] of each row of contiguous `y` and `g`.
pub(crate) fn softmax_backward_rows(
    out: &mut [f32],
    y: &[f32],
    g: &[f32],
    cols: usize,
    scale: f32,
) {
    super::par::for_rows(out, cols, |r0, o| {
        for (i, o) in o.chunks_mut(cols).enumerate() {
            let r = (r0 + i) * cols;
            softmax_backward_row(o, &y[r..r + cols], &g[r..r + cols], scale);
        }
    });
}
