//! Batched matmul: on CPUs with AVX2 and FMA but no AVX-512 through this crate's own blocked
//! product (`blocked`); with AVX-512 through it where a big product has a transposed operand,
//! and through the `gemm` crate for the rest; elsewhere through the `gemm` crate (NEON kernels
//! picked at run time). `WGPIPE_CPU_MATMUL` picks either everywhere (see `blocked::chosen`).
//! Operands are read in place through their strides, so transposed and batch-broadcast operands
//! cost no copy, but for the column-major right operand of a big product in `gemm` (see
//! `matmul_by_panels`).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod blocked;
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) use blocked::chosen as blocked_chosen;
mod skinny;
pub(crate) mod timing;

use gemm::Parallelism;
use rayon::prelude::*;

use crate::backend::{MatDims, MatLayout};
use crate::layout::{Dims, Layout};

/// Products with at least this many multiply-adds are spread over the threads (by `blocked` or
/// by gemm's own rayon parallelism).
const GEMM_PAR_MACS: usize = 96 * 96 * 96;
/// Single products with at least this many multiply-adds get a column-major right operand copied
/// to row-major first (see `matmul`).
const B_COPY_MACS: usize = 128 * 256 * 256;
/// Values of such an operand copied at a time (512 KiB, see [`matmul_by_panels`]).
const PANEL_VALUES: usize = 1 << 17;
/// The fewest columns a panel has (narrower products run gemm below its best rate).
const MIN_PANEL_COLUMNS: usize = 64;

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
    check_bounds(a, la, batch, m, k);
    check_bounds(b, lb, batch, k, n);
    let started = timing::on().then(std::time::Instant::now);
    let kernel = products(out, a, la, b, lb, d);
    if let Some(t0) = started {
        timing::record(d, la, lb, kernel, t0.elapsed());
    }
}

/// The product of [`matmul`] (operands checked, `m * n * k > 0`); returns the kernel that ran
/// it (see [`timing::MatmulTime::kernel`]).
fn products(
    out: &mut [f32],
    a: &[f32],
    la: MatLayout,
    b: &[f32],
    lb: MatLayout,
    d: MatDims,
) -> &'static str {
    let MatDims { batch, m, k, n } = d;
    let (mn, macs) = (m * n, m * n * k);
    if skinny::takes(la, lb, d) {
        skinny::product(out, a, la, b, lb, d);
        return "skinny";
    }
    #[cfg(target_arch = "x86_64")]
    let own = blocked::chosen(blocked_on_avx512(la, lb, d));
    #[cfg(not(target_arch = "x86_64"))]
    let own = false;
    // gemm packs a column-major right operand (e.g. the `w.t()` of a Linear layer) element by
    // element: measured on AVX-512 with 256 x 1024 x 1024, about 117 GFLOP/s against 218 with a
    // row-major one. Big single products copy it to row-major first, a panel at a time (`blocked`
    // packs such an operand through register transposes and needs no copy).
    if !own
        && batch == 1
        && macs >= B_COPY_MACS
        && lb.row_stride == 1
        && lb.col_stride >= k
        && k > 1
        && n > 1
    {
        matmul_by_panels(out, a, la, b, lb, d);
        return "gemm crate, B copied";
    }
    let one = |bi: usize, o: &mut [f32], threads: usize| {
        let pa = &a[la.matrix_offset(bi)..];
        let pb = &b[lb.matrix_offset(bi)..];
        #[cfg(target_arch = "x86_64")]
        if own {
            let operand = |p: &[f32], l: MatLayout| blocked::Strided {
                ptr: p.as_ptr(),
                rs: l.row_stride,
                cs: l.col_stride,
            };
            // SAFETY: `available` was checked; `check_bounds` showed both operands lie inside
            // their slices; `o` is this product's own `m * n` values, row stride `n`.
            unsafe {
                blocked::gemm(
                    m,
                    n,
                    k,
                    operand(pa, la),
                    operand(pb, lb),
                    blocked::Out {
                        ptr: o.as_mut_ptr(),
                        ldc: n,
                    },
                    threads,
                );
            }
            return;
        }
        let par = if threads > 1 {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
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
        // Big products: one after another, each spread over every core. (Tried and dropped:
        // cutting deep products with few outputs along `k` into parts of 512, run side by
        // side and added in order, for the main job's 64 x 2048 x 64 and 64 x 2048 x 256
        // weight gradients. Timed in place in whole steps on a 2-core Zen 4, 2026-12-04, two
        // runs each way, cut against uncut: 100-105 us against 93-99, 498-521 against 478-536.
        // The `gemm` crate already shares such products out, no worse than the parts did.)
        for (bi, o) in out.chunks_mut(mn).enumerate() {
            one(bi, o, threads);
        }
    } else if threads > 1 && batch > 1 && batch * macs >= 32 * 1024 {
        // Many small products: one per task (one thread runs them in the loop below). (Tried
        // and dropped on AVX-512: a kernel of its own for these, 16-row tiles straight through
        // `k`, `A` read in place, the same bits as the blocked product. On one thread with an
        // output in L1 it ran the main job's 128 heads 5-31% faster than the `gemm` crate; in
        // place in whole steps on a 2-core Zen 4, 2026-12-04, those heads' products took 0-13%
        // less time (four runs: 0 to 0.8 ms of a step of 26-30 ms), a decoder block's 128-wide
        // heads from 13% less to 16% more (four runs), and no step got measurably faster. Inside a
        // step `q @ k.t()` of the main job's heads runs at 75-87 GFLOP/s on two threads (the
        // crate's; `bench_train --matmul-times`), writing 2 MiB of scores: fusing it with the
        // softmax is what is left to try.)
        out.par_chunks_mut(mn)
            .enumerate()
            .for_each(|(bi, o)| one(bi, o, 1));
    } else {
        for (bi, o) in out.chunks_mut(mn).enumerate() {
            one(bi, o, 1);
        }
    }
    if own {
        "blocked"
    } else {
        "gemm crate"
    }
}

/// Whether this batch's products run the blocked product on AVX-512 CPUs too (see
/// `blocked::chosen`): those at least [`blocked::BIG_SIDE`] rows and columns wide with a
/// transposed operand (`A` whose `k` axis is not its contiguous one, `dy.t()`, or `B` whose `k`
/// axis is, `w.t()` or an attention's `k.t()`), and a single `x @ w.t()` (a Linear layer's
/// forward) at least [`LINEAR_MIN_SIDE`] rows and columns wide however narrow or short. The
/// `gemm` crate packs such a `B` element by element, or after a transposing copy of all of it
/// (`matmul_by_panels`), which products with few rows or columns do not amortise. One thread
/// each way on this Zen 4 (GFLOP/s, blocked against the crate): the main job's micro-batches
/// (64 rows, d 64) 96 / 87 for Q/K/V, 97 / 88 for the FFN's first layer, 100 / 64 for its
/// second (64 x 256 x 64), 69 / 59 for the head; 16 and 64 rows of a 1024 x 1024 layer 68 / 33
/// and 94 / 67; the plain LM's narrow layers (2048 rows), the same within 2%.
fn blocked_on_avx512(la: MatLayout, lb: MatLayout, d: MatDims) -> bool {
    let MatDims { batch, m, k, n } = d;
    let a_transposed = la.col_stride != 1;
    let b_transposed = lb.row_stride == 1 && lb.col_stride != 1;
    let big = m.min(n) >= blocked::BIG_SIDE && (a_transposed || b_transposed);
    let linear = batch == 1 && b_transposed && m.min(n) >= LINEAR_MIN_SIDE;
    k > 1 && (big || linear)
}

/// The fewest rows and columns of a single `x @ w.t()` that [`blocked_on_avx512`] takes
/// whatever its size: a tile's width (a matrix-vector product stays in the crate).
const LINEAR_MIN_SIDE: usize = 16;

/// One product (`d.batch == 1`) whose right operand is column-major: a panel of its columns at
/// a time is copied to row-major and multiplied into those columns of `out`.
///
/// A panel of at most [`PANEL_VALUES`] is still in L2 when gemm reads it. Copying the whole
/// operand first (as this did before) wrote it out past L2 and read it back. Where each thread
/// can have panels of at least [`MIN_PANEL_COLUMNS`], the threads share the panels out, each
/// copying and multiplying its own on one thread: the panel never leaves that core's L2, and
/// there is no fork and join per panel. On 2 threads of this machine's AVX-512 Xeon (4
/// alternating runs of each; `gemm` runs row-major operands of these shapes at ~287 GFLOP/s):
///
/// | m x k x n | whole copy | panels, each over all threads | panels shared out |
/// |---|---|---|---|
/// | 256 x 1024 x 1024 (an MLP layer's `x @ w.t()`) | ~207 | ~240 | ~270 |
/// | 1024 x 256 x 768 (a decoder block's Q/K/V) | ~285 | ~298 | ~314 |
/// | 1024 x 1024 x 256 (its second FFN layer) | ~282 | ~297 | ~295-311 |
fn matmul_by_panels(
    out: &mut [f32],
    a: &[f32],
    la: MatLayout,
    b: &[f32],
    lb: MatLayout,
    d: MatDims,
) {
    let MatDims { m, k, n, .. } = d;
    let threads = super::par::kernel_threads();
    let widest = (PANEL_VALUES / k).max(MIN_PANEL_COLUMNS);
    let out_ptr = SharedOut(out.as_mut_ptr());
    // Copies columns j0..j0 + w of `b` into a row-major panel and multiplies it into the same
    // columns of `out`.
    let panel_product = |j0: usize, w: usize, panel: &mut [f32], par: Parallelism| {
        let columns = Layout {
            shape: Dims::from_slice(&[k, w]),
            strides: Dims::from_slice(&[1, lb.col_stride]),
            offset: lb.offset + j0 * lb.col_stride,
        };
        super::elementwise::copy(panel, b, &columns);
        // SAFETY: `matmul` checked that `a` covers m x k through `la`; the panel is k x w
        // row-major; the destination is columns j0..j0 + w of the m x n row-major output,
        // which no other panel writes.
        unsafe {
            gemm::gemm(
                m,
                w,
                k,
                out_ptr.at(j0),
                1,
                n as isize,
                false,
                a[la.offset..].as_ptr(),
                la.col_stride as isize,
                la.row_stride as isize,
                panel.as_ptr(),
                1,
                w as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    };
    if threads > 1 && n / threads >= MIN_PANEL_COLUMNS {
        // As many panels as fit the size, rounded up to a multiple of the threads, so that
        // the threads get equal shares.
        let panels = n.div_ceil(widest).next_multiple_of(threads);
        let width = n.div_ceil(panels).next_multiple_of(16);
        let starts: Vec<usize> = (0..n).step_by(width).collect();
        starts.par_iter().for_each(|&j0| {
            let w = width.min(n - j0);
            // From the host pool: the copy writes every value, and each step asks again.
            let mut panel = crate::host_pool::take_for_overwrite(k * w);
            panel_product(j0, w, &mut panel, Parallelism::None);
            crate::host_pool::give(panel);
        });
    } else {
        let width = (widest / 16 * 16).min(n);
        let mut panel = crate::host_pool::take_for_overwrite(k * width);
        let par = if threads > 1 {
            Parallelism::Rayon(0)
        } else {
            Parallelism::None
        };
        for j0 in (0..n).step_by(width) {
            let w = width.min(n - j0);
            panel_product(j0, w, &mut panel[..k * w], par);
        }
        crate::host_pool::give(panel);
    }
}

/// The output of [`matmul_by_panels`], shared by the threads that write its panels.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each thread writes only its own panels' columns (see `matmul_by_panels`).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `j` values in.
    ///
    /// # Safety
    /// `j` must be inside the output.
    unsafe fn at(self, j: usize) -> *mut f32 {
        self.0.add(j)
    }
}

/// Panics unless the last element of every batch of an operand is inside `data`.
fn check_bounds(data: &[f32], l: MatLayout, batch: usize, rows: usize, cols: usize) {
    // The farthest matrix starts at most this far (exactly there when the batch is whole
    // groups, as the front-end makes it): the last group, at the last place in a group.
    let farthest = match l.groups {
        Some(g) => {
            l.offset + (batch - 1) / g.len * g.stride + (g.len.min(batch) - 1) * l.batch_stride
        }
        None => l.matrix_offset(batch - 1),
    };
    let last = farthest + (rows - 1) * l.row_stride + (cols - 1) * l.col_stride;
    assert!(
        last < data.len(),
        "matmul operand {l:?} ({batch} x {rows} x {cols}) reaches past its storage of {} values",
        data.len()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which products run blocked on AVX-512: an MLP layer's `x @ w.t()` and `dy.t() @ x` and a
    /// decoder block's `q @ k.t()` over 128 positions do, its `dy @ w` does not; of the narrow
    /// ones (the main job's 64-wide heads and layers) only a single `x @ w.t()` does.
    #[test]
    fn blocked_products_are_the_wide_ones_with_a_transposed_operand_and_linear_layers() {
        let dims = |batch, m, k, n| MatDims { batch, m, k, n };
        // Row-major and column-major `rows x cols` operands.
        let rm = |rows: usize, cols: usize| MatLayout::new(0, rows * cols, cols, 1);
        let cm = |rows: usize, cols: usize| MatLayout::new(0, rows * cols, 1, rows);
        let (m, k, n) = (256, 1024, 512);
        let cases = [
            ("x @ w.t()", rm(m, k), cm(k, n), dims(1, m, k, n), true),
            ("dy.t() @ x", cm(m, k), rm(k, n), dims(1, m, k, n), true),
            ("dy @ w", rm(m, k), rm(k, n), dims(1, m, k, n), false),
            (
                "q @ k.t(), 8 heads",
                rm(m, k),
                cm(k, n),
                dims(8, m, k, n),
                true,
            ),
            (
                "q @ k.t(), 64 wide",
                rm(64, 16),
                cm(16, 64),
                dims(8, 64, 16, 64),
                false,
            ),
            (
                "narrow x @ w.t()",
                rm(m, k),
                cm(k, 64),
                dims(1, m, k, 64),
                true,
            ),
            (
                "a micro-batch's x @ w.t()",
                rm(64, 64),
                cm(64, 28),
                dims(1, 64, 64, 28),
                true,
            ),
            (
                "one row's x @ w.t()",
                rm(1, k),
                cm(k, n),
                dims(1, 1, k, n),
                false,
            ),
            (
                "short dy.t() @ x",
                cm(64, k),
                rm(k, n),
                dims(1, 64, k, n),
                false,
            ),
        ];
        for (name, la, lb, d, want) in cases {
            assert_eq!(blocked_on_avx512(la, lb, d), want, "{name}");
        }
    }
}
