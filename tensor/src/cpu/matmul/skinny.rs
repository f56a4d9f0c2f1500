//! Products of a few rows against a column-major right operand: `x @ w.t()` of a Linear layer
//! when decoding (1 to 15 rows, a language model's head of 32000 x 512 among them). The general
//! paths copy `w.t()` to row-major first or pack it element by element, each costing more than
//! the product; here each output is a dot product of two contiguous runs (a row of `x`, a row of
//! `w`), each row of `w` read once for all rows of `x`, the columns split over the threads.
//! Measured on a Zen 4 (2 threads), a 45M-parameter Llama decoding 2 rows through 2 stages:
//! 30.8 -> 80.8 tokens/s per row (one micro-batch of the 2 rows).

use rayon::prelude::*;

use crate::backend::{MatDims, MatLayout};
use crate::cpu::simd::multiversion;

/// Rows below this go here (the blocked product's tile height; see `LINEAR_MIN_SIDE`).
pub(super) const MAX_ROWS: usize = 16;
/// Columns per task.
const COLUMNS_PER_TASK: usize = 256;

/// Whether [`product`] takes this product: one matrix, few rows, `A`'s rows and `B`'s columns
/// contiguous along `k`, enough columns to share out.
pub(super) fn takes(la: MatLayout, lb: MatLayout, d: MatDims) -> bool {
    d.batch == 1
        && d.m < MAX_ROWS
        && d.k >= 16
        && d.n >= 64
        && la.col_stride == 1
        && lb.row_stride == 1
        && la.row_stride >= d.k
        && lb.col_stride >= d.k
}

/// `out = a @ b` for a product [`takes`] accepts (operands checked by the caller).
pub(super) fn product(
    out: &mut [f32],
    a: &[f32],
    la: MatLayout,
    b: &[f32],
    lb: MatLayout,
    d: MatDims,
) {
    let MatDims { m, k, n, .. } = d;
    let (a, b) = (&a[la.matrix_offset(0)..], &b[lb.matrix_offset(0)..]);
    // Column-major per task ([j][i]), so that each task writes one contiguous run.
    let mut by_column = vec![0.0f32; n * m];
    by_column
        .par_chunks_mut(COLUMNS_PER_TASK * m)
        .enumerate()
        .for_each(|(task, cols)| {
            let j0 = task * COLUMNS_PER_TASK;
            for (dj, outs) in cols.chunks_mut(m).enumerate() {
                let col = &b[(j0 + dj) * lb.col_stride..][..k];
                for (i, o) in outs.iter_mut().enumerate() {
                    *o = dot(&a[i * la.row_stride..][..k], col);
                }
            }
        });
    for (j, outs) in by_column.chunks(m).enumerate() {
        for (i, &v) in outs.iter().enumerate() {
            out[i * n + j] = v;
        }
    }
}

multiversion! {
/// `sum(x[i] * y[i])` in 16 lanes, then the lanes in order, then the tail.
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (cx, cy) = (x.chunks_exact(16), y.chunks_exact(16));
    let (rx, ry) = (cx.remainder(), cy.remainder());
    for (u, v) in cx.zip(cy) {
        for l in 0..16 {
            acc[l] = u[l].mul_add(v[l], acc[l]);
        }
    }
    let mut s = 0.0f32;
    for a in acc {
        s += a;
    }
    for (u, v) in rx.iter().zip(ry) {
        s = u.mul_add(*v, s);
    }
    s
}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(offset: usize, row_stride: usize, col_stride: usize) -> MatLayout {
        MatLayout {
            offset,
            batch_stride: 0,
            row_stride,
            col_stride,
            groups: None,
        }
    }

    /// Against a float64 product of the same operands, read through their strides: rows 1..15,
    /// depths with and without a tail of the 16 lanes, padded rows and an offset.
    #[test]
    fn skinny_products_equal_a_float64_reference() {
        let value = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        for (m, k, n) in [
            (1, 16, 64),
            (2, 512, 1000),
            (3, 37, 300),
            (15, 100, 257),
            (7, 17, 64),
        ] {
            let (pad_a, pad_b, off) = (3, 5, 11);
            let la = layout(off, k + pad_a, 1);
            let lb = layout(off, 1, k + pad_b);
            let a: Vec<f32> = (0..off + m * (k + pad_a)).map(value).collect();
            let b: Vec<f32> = (0..off + n * (k + pad_b)).map(|i| value(i + 13)).collect();
            let d = MatDims { batch: 1, m, k, n };
            assert!(takes(la, lb, d));
            let mut out = vec![f32::NAN; m * n];
            product(&mut out, &a, la, &b, lb, d);
            for i in 0..m {
                for j in 0..n {
                    let (want, size): (f64, f64) = (0..k)
                        .map(|kk| {
                            let x = a[off + i * la.row_stride + kk] as f64;
                            let y = b[off + kk + j * lb.col_stride] as f64;
                            (x * y, (x * y).abs())
                        })
                        .fold((0.0, 0.0), |(s, t), (p, q)| (s + p, t + q));
                    let got = out[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * size.max(1.0),
                        "{m}x{k}x{n} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
        let d = MatDims {
            batch: 1,
            m: 16,
            k: 64,
            n: 64,
        };
        assert!(
            !takes(layout(0, 64, 1), layout(0, 1, 64), d),
            "16 rows: the blocked product's"
        );
        let d = MatDims {
            batch: 1,
            m: 2,
            k: 64,
            n: 64,
        };
        assert!(
            !takes(layout(0, 64, 1), layout(0, 64, 1), d),
            "a row-major B stays with gemm"
        );
    }

    /// GB/s of the weight read by decode-time products (`cargo test -p wgpipe-tensor --release
    /// --lib skinny::tests::bench -- --ignored --nocapture`): the bound is the memory's.
    #[test]
    #[ignore]
    fn bench_decode_products() {
        for (name, m, k, n) in [
            ("head 2x512x32000", 2, 512, 32000),
            ("head 1x512x32000", 1, 512, 32000),
            ("q 2x512x512", 2, 512, 512),
            ("kv 2x512x256", 2, 512, 256),
            ("gate 2x512x1408", 2, 512, 1408),
            ("down 2x1408x512", 2, 1408, 512),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
            let b: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.1).collect();
            let d = MatDims { batch: 1, m, k, n };
            let (la, lb) = (layout(0, k, 1), layout(0, 1, k));
            let mut out = vec![0.0; m * n];
            let reps = (200_000_000 / (n * k)).max(3);
            let mut times = Vec::new();
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    product(&mut out, &a, la, &b, lb, d);
                }
                times.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            times.sort_by(f64::total_cmp);
            let t = times[2];
            eprintln!(
                "{name}: {:.3} ms, {:.1} GB/s of weight",
                t * 1e3,
                (n * k * 4) as f64 / t / 1e9
            );
        }
    }
}
