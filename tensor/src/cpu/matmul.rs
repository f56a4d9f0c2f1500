//! Batched matmul through the `gemm` crate (AVX-512 / AVX2 / NEON kernels picked at run time).
//! Operands are read in place through their strides, so transposed and batch-broadcast operands
//! cost no copy.

use gemm::Parallelism;
use rayon::prelude::*;

use crate::backend::{MatDims, MatLayout};
use crate::layout::Layout;

/// Products with at least this many multiply-adds use gemm's own rayon parallelism.
const GEMM_PAR_MACS: usize = 96 * 96 * 96;
/// Single products with at least this many multiply-adds get a column-major right operand copied
/// to row-major first (see `matmul`).
const B_COPY_MACS: usize = 128 * 256 * 256;

/// `out[b] = a[b] @ b[b]` into contiguous `out` (`batch * m * n` elements).
pub(crate) fn matmul(
    out: &mut [f32],
    a: &[f32],
    la: MatLayout,
    b: &[f32],
    lb: MatLayout,
    d: MatDims,
) {
    let MatDims { batch, m, k, n } = d;
    let mn = m * n;
    if mn == 0 || batch == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let macs = m * n * k;
    check_bounds(a, la, batch, m, k);
    check_bounds(b, lb, batch, k, n);
    // gemm packs a column-major right operand (e.g. the `w.t()` of a Linear layer) element by
    // element: measured on AVX-512 with 256 x 1024 x 1024, about 117 GFLOP/s against 218 with a
    // row-major one. A transposing copy of that operand (k * n values, ~0.5 ms for 1M) costs
    // less than it saves on big single products. Scratch memory, like gemm's packing buffers.
    let b_rows;
    let (b, lb) = if batch == 1
        && macs >= B_COPY_MACS
        && lb.row_stride == 1
        && lb.col_stride >= k
        && k > 1
        && n > 1
    {
        let mut t = vec![0.0; k * n];
        let l = Layout {
            shape: vec![k, n],
            strides: vec![1, lb.col_stride],
            offset: lb.offset,
        };
        super::elementwise::copy(&mut t, b, &l);
        b_rows = t;
        let row_major = MatLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: n,
            col_stride: 1,
        };
        (&b_rows[..], row_major)
    } else {
        (b, lb)
    };
    let one = |bi: usize, o: &mut [f32], par: Parallelism| {
        let pa = &a[la.offset + bi * la.batch_stride..];
        let pb = &b[lb.offset + bi * lb.batch_stride..];
        // SAFETY: `check_bounds` showed every element (i, j) of both operands lies inside its
        // slice; `o` is exactly `m * n` elements, written row-major (row stride n, col stride 1);
        // `read_dst = false`, so its old contents are ignored.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                o.as_mut_ptr(),
                1,
                n as isize,
                false,
                pa.as_ptr(),
                la.col_stride as isize,
                la.row_stride as isize,
                pb.as_ptr(),
                lb.col_stride as isize,
                lb.row_stride as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    };
    let threads = super::par::kernel_threads();
    if macs >= GEMM_PAR_MACS && (batch < threads || macs >= 4 * GEMM_PAR_MACS) {
        // Big products: one after another, each spread over every core by gemm.
        let par = if threads > 1 {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        for (bi, o) in out.chunks_mut(mn).enumerate() {
            one(bi, o, par);
        }
    } else if threads > 1 && batch > 1 && batch * macs >= 32 * 1024 {
        // Many small products: one per task (one thread runs them in the loop below).
        out.par_chunks_mut(mn)
            .enumerate()
            .for_each(|(bi, o)| one(bi, o, Parallelism::None));
    } else {
        for (bi, o) in out.chunks_mut(mn).enumerate() {
            one(bi, o, Parallelism::None);
        }
    }
}

/// Panics unless the last element of every batch of an operand is inside `data`.
fn check_bounds(data: &[f32], l: MatLayout, batch: usize, rows: usize, cols: usize) {
    let last = l.offset
        + (batch - 1) * l.batch_stride
        + (rows - 1) * l.row_stride
        + (cols - 1) * l.col_stride;
    assert!(
        last < data.len(),
        "matmul operand {l:?} ({batch} x {rows} x {cols}) reaches past its storage of {} values",
        data.len()
    );
}
