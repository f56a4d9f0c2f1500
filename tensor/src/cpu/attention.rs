//! Causal attention, forward and backward, one head at a time: each head's scores, probabilities
//! and their gradients are made and used while they sit in L1 / L2, where the composed op
//! (batched `q @ k.t()`, a causal softmax pass, batched `p @ v`; four products and a softmax
//! backward pass after it) wrote each `[t, t]` matrix of the batch out to memory and read it back,
//! and computed the masked half of every product. Here every product stops at the diagonal: query
//! `i` sees keys `0..=i`, so row blocks of the scores end there, `p @ v` sums `j <= i` only and
//! `p.t() @ g` sums `i >= j` only.
//!
//! All six products run one register block ([`block`]: [`ROWS`] rows, 16-lane columns; AVX-512
//! intrinsics up to four registers of columns at a time, else plain Rust compiled for AVX2 + FMA
//! or the baseline); each value sums its terms in index order with one multiply-add per term,
//! whatever the SIMD level, the threads or the head's place in the batch. The softmax and its
//! backward are [`super::reduce`]'s row functions, so a row of `p` is the composed op's row for the
//! same scores.
//!
//! Measured on a 2-core Zen 4, forward + backward, 2 threads (`tests::bench`, three runs): the
//! main job's 128 heads of 64 x 16 in 0.82-0.89 ms against 1.11-1.18 for the composed op, a
//! decoder block's 32 heads of 128 x 64 in 1.47-1.71 ms against 2.41-3.08. In whole steps the
//! attention went from 22% of the main job's step to 18%, from 11% of the block's to 7% (perf).
//! Left: the forward softmax, ~15-19% of the kernel, and the transposes of `k` and `v`, ~5-7%.
//!
//! The output and the gradients go where the caller's layout puts them ([`HeadsMut`]): heads
//! split out of `[b, t, h, dh]` rows get them back in such rows, so the layer merges its heads
//! with a view, where it made four strided copies a block (64-byte runs). The main job's steps
//! went from 34.5-36.0 to 38.6-40.0 a second with it (`bench_train --workloads lm`, three
//! alternations on a Zen 4): more than the copies' ~3% of the step's perf samples, which is
//! not explained.

use rayon::prelude::*;

use crate::backend::{HeadDims, MatLayout};

use super::reduce::{causal_softmax_row, softmax_backward_row};
use super::simd::multiversion;

/// Rows of a register block (with AVX-512 up to 24 accumulators, six rows by four registers;
/// the portable build's six rows by 16 lanes are twelve 8-lane registers with AVX2). Twelve
/// rows ran the main job's heads ~15% slower: the blocks reach further past the diagonal.
const ROWS: usize = 6;
/// Columns of a register block, and the unit the packed operands are padded to.
const LANES: usize = 16;

/// One operand of a batch of `[t, dh]` matrices whose rows are contiguous: element `(b, i, c)` at
/// `data[layout.matrix_offset(b) + i * layout.row_stride + c]` (`layout.col_stride == 1`).
#[derive(Clone, Copy)]
pub(crate) struct Heads<'a> {
    pub data: &'a [f32],
    pub layout: MatLayout,
}

impl<'a> Heads<'a> {
    /// Matrix `b` (its offset found once: with two batch strides it takes a division).
    fn matrix(&self, b: usize) -> Rows<'a> {
        Rows {
            data: &self.data[self.layout.matrix_offset(b)..],
            ld: self.layout.row_stride,
        }
    }
}

/// Whether the backend runs attention through this module (else the front-end composes its
/// products and row kernels): yes, unless `WGPIPE_CPU_ATTENTION=composed` asks for the composed
/// op, to compare the two in one binary (`bench_train`).
pub(crate) fn chosen() -> bool {
    static ASKED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let asked = ASKED.get_or_init(|| std::env::var("WGPIPE_CPU_ATTENTION").ok());
    asked.as_deref() != Some("composed")
}

/// `t` rounded up to whole [`LANES`]: the row length of packed `[.., t]` operands.
fn padded_t(d: HeadDims) -> usize {
    d.t.next_multiple_of(LANES)
}

/// `dh` rounded up to whole [`LANES`]: the row length of packed `[t, ..]` operands.
fn padded_dh(d: HeadDims) -> usize {
    d.dh.next_multiple_of(LANES)
}

/// `y = p @ v` with `p = causal_softmax(scale * q @ k.t())`, into `y` (a batch of `[t, dh]`,
/// see [`HeadsMut`]) and contiguous `p` (`[batch, t, t]`, zeros above the diagonal).
pub(crate) fn forward(y: HeadsMut, p: &mut [f32], [q, k, v]: [Heads; 3], d: HeadDims, scale: f32) {
    let (t, dh, tp) = (d.t, d.dh, padded_t(d));
    assert_eq!(y.d, d, "attention output");
    let one = |scratch: &mut Scratch, b: usize, [p]: [&mut [f32]; 1]| {
        // SAFETY: `for_heads` runs head `b` once.
        let y = unsafe { y.matrix(b) };
        let Scratch {
            kt, block, v: vbuf, ..
        } = scratch;
        pack_transposed(kt, k.matrix(b), d);
        let v = lane_rows(v.matrix(b), d, vbuf);
        let q = q.matrix(b);
        for r0 in (0..t).step_by(ROWS) {
            let rows = ROWS.min(t - r0);
            let keys = r0 + rows;
            let qrows: [&[f32]; ROWS] = std::array::from_fn(|r| q.row(r0 + r.min(rows - 1), dh));
            scores(
                block,
                tp,
                &qrows,
                rows,
                kt,
                dh,
                keys.next_multiple_of(LANES),
            );
            for r in 0..rows {
                let i = r0 + r;
                causal_softmax_row(&mut p[i * t..(i + 1) * t], &block[r * tp..], scale, i + 1);
            }
            let prows: [&[f32]; ROWS] = std::array::from_fn(|r| &p[(r0 + r.min(rows - 1)) * t..]);
            lower_product(y.rows_from(r0), &prows, rows, keys, v, dh);
        }
    };
    for_heads(d, false, [(p, t * t)], one);
}

/// The gradients of `q`, `k` and `v` (a batch of `[t, dh]` each, see [`HeadsMut`]) of
/// [`forward`], given its `p` and the gradient `g` of `y`.
pub(crate) fn backward(
    [gq, gk, gv]: [HeadsMut; 3],
    [q, k, v]: [Heads; 3],
    p: &[f32],
    g: Heads,
    d: HeadDims,
    scale: f32,
) {
    let (t, dh, tp) = (d.t, d.dh, padded_t(d));
    for out in [&gq, &gk, &gv] {
        assert_eq!(out.d, d, "attention gradient");
    }
    let one = |scratch: &mut Scratch, b: usize, []: [&mut [f32]; 0]| {
        // SAFETY: `for_heads` runs head `b` once.
        let [gq, gk, gv] = [&gq, &gk, &gv].map(|out| unsafe { out.matrix(b) });
        let Scratch {
            kt: vt,
            block: gp,
            ds,
            v: gbuf,
            q: qbuf,
            k: kbuf,
        } = scratch;
        let p = &p[b * t * t..(b + 1) * t * t];
        pack_transposed(vt, v.matrix(b), d);
        let g = g.matrix(b);
        let g_rows = lane_rows(g, d, gbuf);
        // gv = p.t() @ g: row j sums i >= j.
        upper_transposed_product(gv, p, t, t, g_rows, dh);
        // ds = softmax_backward(p, g @ v.t()), a row block at a time, up to the diagonal.
        for r0 in (0..t).step_by(ROWS) {
            let rows = ROWS.min(t - r0);
            let keys = r0 + rows;
            let grows: [&[f32]; ROWS] = std::array::from_fn(|r| g.row(r0 + r.min(rows - 1), dh));
            scores(gp, tp, &grows, rows, vt, dh, keys.next_multiple_of(LANES));
            for r in 0..rows {
                let i = r0 + r;
                let (valid, rest) = ds[i * tp..(i + 1) * tp].split_at_mut(i + 1);
                softmax_backward_row(
                    valid,
                    &p[i * t..=i * t + i],
                    &gp[r * tp..=r * tp + i],
                    scale,
                );
                rest.fill(0.0);
            }
        }
        // gq = ds @ k: row i sums j <= i.
        let k_rows = lane_rows(k.matrix(b), d, kbuf);
        for r0 in (0..t).step_by(ROWS) {
            let rows = ROWS.min(t - r0);
            let srows: [&[f32]; ROWS] = std::array::from_fn(|r| &ds[(r0 + r.min(rows - 1)) * tp..]);
            lower_product(gq.rows_from(r0), &srows, rows, r0 + rows, k_rows, dh);
        }
        // gk = ds.t() @ q: row j sums i >= j.
        let q_rows = lane_rows(q.matrix(b), d, qbuf);
        upper_transposed_product(gk, ds, tp, t, q_rows, dh);
    };
    for_heads(d, true, [], one);
}

/// One head's packed operands and score rows, reused from head to head by one thread.
struct Scratch {
    /// `[dh, tp]`: `k.t()` or `v.t()`, zeros after column `t`.
    kt: Vec<f32>,
    /// `[ROWS, tp]`: a row block of scores (forward) or of their gradient before the softmax
    /// backward (backward).
    block: Vec<f32>,
    /// `[t, tp]`: the head's gradient of the scores, zeros above the diagonal (backward).
    ds: Vec<f32>,
    /// `[t, dp]` each where `dh` is not whole lanes (else empty: rows are read in place): `v`
    /// (forward) or `g` (backward), `q`, `k` (backward) padded with zeros (see [`lane_rows`]).
    v: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
}

impl Scratch {
    fn new(d: HeadDims, backward: bool) -> Scratch {
        let (tp, dp) = (padded_t(d), padded_dh(d));
        let rows = if d.dh.is_multiple_of(LANES) {
            0
        } else {
            d.t * dp
        };
        let only_backward = |n| vec![0.0; if backward { n } else { 0 }];
        Scratch {
            kt: vec![0.0; d.dh * tp],
            block: vec![0.0; ROWS * tp],
            ds: only_backward(d.t * tp),
            v: vec![0.0; rows],
            q: only_backward(rows),
            k: only_backward(rows),
        }
    }
}

/// Rows `x` as rows whose first [`padded_dh`] values may be read whole lanes at a time: in
/// place where `dh` is whole lanes, else copied into `buf` and padded with zeros.
fn lane_rows<'a>(x: Rows<'a>, d: HeadDims, buf: &'a mut [f32]) -> Rows<'a> {
    if d.dh.is_multiple_of(LANES) {
        return x;
    }
    let dp = padded_dh(d);
    for i in 0..d.t {
        buf[i * dp..i * dp + d.dh].copy_from_slice(x.row(i, d.dh));
    }
    Rows { data: buf, ld: dp }
}

/// Rows `ld` apart: row `i` starts at `data[i * ld]`.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    ld: usize,
}

impl<'a> Rows<'a> {
    /// The first `n` values of row `i`.
    fn row(&self, i: usize, n: usize) -> &'a [f32] {
        &self.data[i * self.ld..i * self.ld + n]
    }
}

/// An output batch of `[t, dh]` matrices with contiguous rows that the heads' threads write
/// at once: matrix `b` at `data[layout.matrix_offset(b)..]`, its rows `layout.row_stride`
/// apart. Heads may interleave (the `[batch, t, heads, dh]` layout of a tensor whose `[batch,
/// heads, t, dh]` view the caller wants back), so each thread writes through a pointer; [`new`]
/// checks that the matrices lie in `data` and share no value.
///
/// [`new`]: HeadsMut::new
pub(crate) struct HeadsMut<'a> {
    ptr: *mut f32,
    layout: MatLayout,
    d: HeadDims,
    _data: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: threads write disjoint matrices (checked in `new`), each head from one thread.
unsafe impl Sync for HeadsMut<'_> {}

impl<'a> HeadsMut<'a> {
    /// The batch `d` of matrices of `layout` in `data`. Panics unless they lie in `data`, one
    /// value each: what [`HeadsMut::matrix`]'s writes rely on.
    pub(crate) fn new(data: &'a mut [f32], layout: MatLayout, d: HeadDims) -> HeadsMut<'a> {
        let l = layout;
        // The matrices' axes as (length, stride): the batch's one or two, the rows.
        let (outer, inner) = match l.groups {
            Some(g) => {
                let outer = d.batch.div_ceil(g.len.max(1));
                ((outer, g.stride), (g.len.min(d.batch), l.batch_stride))
            }
            None => ((1, 0), (d.batch, l.batch_stride)),
        };
        let mut axes: Vec<(usize, usize)> = [outer, inner, (d.t, l.row_stride)]
            .into_iter()
            .filter(|&(len, _)| len > 1)
            .collect();
        axes.sort_by_key(|&(_, stride)| stride);
        // Each axis must step past everything the shorter strides reach (then no two values
        // of the batch share an address), and the last value must lie in the buffer.
        let mut extent = d.dh;
        let disjoint = axes.iter().all(|&(len, stride)| {
            let clear = stride >= extent;
            extent += stride * (len - 1);
            clear
        });
        assert!(
            l.col_stride == 1 && disjoint && l.offset + extent <= data.len(),
            "attention output {l:?} of {d:?} must hold disjoint matrices with contiguous rows \
             in its {} values",
            data.len()
        );
        HeadsMut {
            ptr: data.as_mut_ptr(),
            layout,
            d,
            _data: std::marker::PhantomData,
        }
    }

    /// Matrix `b`.
    ///
    /// # Safety
    /// No other thread holds matrix `b` (`b < batch`, asserted).
    unsafe fn matrix(&self, b: usize) -> RowsMut {
        assert!(b < self.d.batch);
        RowsMut {
            ptr: self.ptr.add(self.layout.matrix_offset(b)),
            ld: self.layout.row_stride,
            rows: self.d.t,
            cols: self.d.dh,
        }
    }
}

/// One output matrix of a [`HeadsMut`]: `rows` rows of `cols` values, `ld` apart from `ptr`.
#[derive(Clone, Copy)]
struct RowsMut {
    ptr: *mut f32,
    ld: usize,
    rows: usize,
    cols: usize,
}

impl RowsMut {
    /// The rows from row `r` on.
    fn rows_from(self, r: usize) -> RowsMut {
        assert!(r <= self.rows);
        RowsMut {
            ptr: self.ptr.wrapping_add(r * self.ld),
            rows: self.rows - r,
            ..self
        }
    }
}

/// Runs `f(scratch, b, outs of head b)` once for every head `b`, over the threads when there
/// are several heads and threads; `outs` are `(buffer, values per head)`.
fn for_heads<const N: usize>(
    d: HeadDims,
    backward: bool,
    outs: [(&mut [f32], usize); N],
    f: impl Fn(&mut Scratch, usize, [&mut [f32]; N]) + Sync + Send,
) {
    let mut heads: Vec<[&mut [f32]; N]> = Vec::with_capacity(d.batch);
    let mut iters: Vec<_> = outs.into_iter().map(|(o, n)| o.chunks_mut(n)).collect();
    for _ in 0..d.batch {
        heads.push(std::array::from_fn(|i| {
            iters[i].next().expect("one part per head")
        }));
    }
    if super::par::kernel_threads() > 1 && d.batch > 1 {
        heads
            .into_par_iter()
            .enumerate()
            .for_each_init(|| Scratch::new(d, backward), |s, (b, outs)| f(s, b, outs));
    } else {
        let mut s = Scratch::new(d, backward);
        for (b, outs) in heads.into_iter().enumerate() {
            f(&mut s, b, outs);
        }
    }
}

/// `out[c * tp + j] = x[j][c]`: a `[t, dh]` matrix transposed into `[dh, tp]`.
fn pack_transposed(out: &mut [f32], x: Rows, d: HeadDims) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: AVX2 was just detected.
        return unsafe { pack_transposed_8x8(out, x, d) };
    }
    pack_transposed_tiles(out, x, d);
}

/// [`pack_transposed`] through 8 x 8 register transposes where whole ones fit, the rest value by
/// value. (In the main job's steps the tile copy below took ~2% of the step, ~13% of the
/// attention; in `tests::bench`'s profile, one thread, two runs each, this takes 4.7-7.0% of the
/// kernel's time against the tile copy's 7.7-8.4%, most of it the first reads of the rows.)
///
/// # Safety
/// AVX2 must be present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_transposed_8x8(out: &mut [f32], x: Rows, d: HeadDims) {
    use std::arch::x86_64::*;
    let (tp, dh) = (padded_t(d), d.dh);
    let (whole_t, whole_dh) = (d.t / 8 * 8, dh / 8 * 8);
    for j0 in (0..whole_t).step_by(8) {
        for c0 in (0..whole_dh).step_by(8) {
            // A loop, not `array::from_fn`: its closure would not be built with AVX2.
            let mut rows = [_mm256_setzero_ps(); 8];
            for (jj, row) in rows.iter_mut().enumerate() {
                *row = _mm256_loadu_ps(x.row(j0 + jj, dh)[c0..c0 + 8].as_ptr());
            }
            for (cc, column) in super::simd::transpose_8x8(rows).into_iter().enumerate() {
                _mm256_storeu_ps(out[(c0 + cc) * tp + j0..][..8].as_mut_ptr(), column);
            }
        }
    }
    for j in 0..d.t {
        let row = x.row(j, dh);
        let first = if j < whole_t { whole_dh } else { 0 };
        for (c, &value) in row.iter().enumerate().skip(first) {
            out[c * tp + j] = value;
        }
    }
}

multiversion! {
/// [`pack_transposed`] a 16 x 16 tile at a time, read row by row and written column by column.
fn pack_transposed_tiles(out: &mut [f32], x: Rows, d: HeadDims) {
    let tp = padded_t(d);
    for j0 in (0..d.t).step_by(LANES) {
        let n = LANES.min(d.t - j0);
        for c0 in (0..d.dh).step_by(LANES) {
            let width = LANES.min(d.dh - c0);
            let mut tile = [[0f32; LANES]; LANES];
            for (jj, tile_row) in tile.iter_mut().enumerate().take(n) {
                let row = &x.row(j0 + jj, d.dh)[c0..];
                if width == LANES {
                    tile_row.copy_from_slice(&row[..LANES]);
                } else {
                    tile_row[..width].copy_from_slice(&row[..width]);
                }
            }
            for cc in 0..width {
                let column: [f32; LANES] = std::array::from_fn(|jj| tile[jj][cc]);
                out[(c0 + cc) * tp + j0..][..LANES].copy_from_slice(&column);
            }
        }
    }
}
}

/// `s[r * tp + j] = sum_c x[r][c] * yt[c * tp + j]` for rows `r < rows` and columns `j < cols`
/// (a multiple of [`LANES`]): a row block of scores `x @ y.t()` from `y` packed transposed.
fn scores(
    s: &mut [f32],
    tp: usize,
    x: &[&[f32]; ROWS],
    rows: usize,
    yt: &[f32],
    dh: usize,
    cols: usize,
) {
    assert!(cols <= tp && yt.len() >= dh * tp && x.iter().all(|r| r.len() >= dh));
    assert!((1..=ROWS).contains(&rows) && s.len() >= (rows - 1) * tp + cols);
    // SAFETY: step `c < dh` reads `yt[c * tp..][..cols]` (`cols <= tp`) and `x[r][c]`; the
    // block writes `s[r * tp..][..cols]` for `r < rows` (asserted).
    unsafe {
        block(
            Strides {
                steps: dh,
                x: yt.as_ptr(),
                x_step: tp,
                a: x.map(|r| r.as_ptr()),
                a_step: 1,
            },
            s.as_mut_ptr(),
            tp,
            rows,
            cols,
        );
    }
}

/// `out[r][c] = sum_{j < keys} m[r][j] * x[j][c]` for rows `r < rows`, `c < dh`: a row block
/// of `m @ x`, each row of `m` read up to `keys`.
fn lower_product(out: RowsMut, m: &[&[f32]; ROWS], rows: usize, keys: usize, x: Rows, dh: usize) {
    let dp = dh.next_multiple_of(LANES);
    assert!(keys > 0 && x.data.len() >= (keys - 1) * x.ld + dp);
    assert!(m.iter().all(|r| r.len() >= keys));
    assert!((1..=ROWS).contains(&rows) && rows <= out.rows && dh <= out.cols);
    // SAFETY: step `j < keys` reads `x.data[j * x.ld..][..dp]` and `m[r][j]`; the block
    // writes `out`'s rows `r < rows`, `dh` values each (asserted).
    unsafe {
        block(
            Strides {
                steps: keys,
                x: x.data.as_ptr(),
                x_step: x.ld,
                a: m.map(|r| r.as_ptr()),
                a_step: 1,
            },
            out.ptr,
            out.ld,
            rows,
            dh,
        );
    }
}

/// `out[j][c] = sum_{i >= j, i < t} m[i * lm + j] * x[i][c]` for every `j < t`, `c < dh`:
/// `m.t() @ x` for `m` zero above its diagonal.
fn upper_transposed_product(out: RowsMut, m: &[f32], lm: usize, t: usize, x: Rows, dh: usize) {
    let dp = dh.next_multiple_of(LANES);
    assert!(t > 0 && t <= lm && m.len() >= (t - 1) * lm + t);
    assert!(x.data.len() >= (t - 1) * x.ld + dp && t <= out.rows && dh <= out.cols);
    for j0 in (0..t).step_by(ROWS) {
        let rows = ROWS.min(t - j0);
        // Column `j0 + r` of `m` from row `j0`; a last block short of ROWS reads its last
        // column again for the rows it leaves out (their sums are not stored).
        let a: [*const f32; ROWS] =
            std::array::from_fn(|r| m[j0 * lm + j0 + r.min(rows - 1)..].as_ptr());
        let out = out.rows_from(j0);
        // SAFETY: step `s < t - j0` reads `x.data[(j0 + s) * x.ld..][..dp]` and `m[(j0 + s) *
        // lm + j0 + r]`; the block writes `out`'s rows `j0 + r`, `dh` values each (asserted).
        unsafe {
            block(
                Strides {
                    steps: t - j0,
                    x: x.data[j0 * x.ld..].as_ptr(),
                    x_step: x.ld,
                    a,
                    a_step: lm,
                },
                out.ptr,
                out.ld,
                rows,
                dh,
            );
        }
    }
}

/// The operands of one [`block`]: `steps` steps, step `s` reading the [`LANES`] values at `x + s
/// * x_step` and the value at `a[r] + s * a_step` for each row `r`.
#[derive(Clone, Copy)]
struct Strides {
    steps: usize,
    x: *const f32,
    x_step: usize,
    a: [*const f32; ROWS],
    a_step: usize,
}

/// The register blocks all three products run: `out[r * ldo + l] = sum_s a_r(s) * x_l(s)` for
/// rows `r < rows` and columns `l < columns`, [`LANES`] columns at a time, each sum one
/// multiply-add per step in step order (the same bits at every SIMD level).
///
/// # Safety
/// Every value [`Strides`] names must be readable for the columns rounded up to whole
/// [`LANES`], `out[r * ldo..][..columns]` writable for `r < rows`, `rows <= ROWS`.
#[inline]
unsafe fn block(st: Strides, out: *mut f32, ldo: usize, rows: usize, columns: usize) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx512() {
        return block_avx512(st, out, ldo, rows, columns);
    }
    for c0 in (0..columns).step_by(LANES) {
        let st = Strides {
            x: st.x.wrapping_add(c0),
            ..st
        };
        block_portable(st, out.add(c0), ldo, rows, LANES.min(columns - c0));
    }
}

/// [`block`] in 16-lane registers, up to four registers of columns at a time (24 accumulators;
/// each step four loads of `x` and 24 multiply-adds with six broadcast values of `a`, so a
/// short run of steps, such as the 16 of a main-job head's scores, still pays for its setup).
///
/// # Safety
/// As [`block`]; AVX-512F must be present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_avx512(st: Strides, out: *mut f32, ldo: usize, rows: usize, columns: usize) {
    let mut c0 = 0;
    while c0 < columns {
        let left = columns - c0;
        let width = left.min(4 * LANES);
        match width.div_ceil(LANES) {
            4 => block_avx512_wide::<4>(st, out, ldo, rows, c0, width),
            3 => block_avx512_wide::<3>(st, out, ldo, rows, c0, width),
            2 => block_avx512_wide::<2>(st, out, ldo, rows, c0, width),
            _ => block_avx512_wide::<1>(st, out, ldo, rows, c0, width),
        }
        c0 += width;
    }
}

/// Columns `c0..c0 + width` of [`block_avx512`] in `N` registers (`width <= N * LANES`; the
/// last register's lanes past `width` are not stored).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn block_avx512_wide<const N: usize>(
    st: Strides,
    out: *mut f32,
    ldo: usize,
    rows: usize,
    c0: usize,
    width: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); N]; ROWS];
    let (mut x, mut at) = (st.x.add(c0), 0);
    for _ in 0..st.steps {
        let xv: [__m512; N] = std::array::from_fn(|n| _mm512_loadu_ps(x.add(n * LANES)));
        for (r, sums) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(*st.a[r].add(at));
            for (sum, &xn) in sums.iter_mut().zip(&xv) {
                *sum = _mm512_fmadd_ps(a, xn, *sum);
            }
        }
        x = x.add(st.x_step);
        at += st.a_step;
    }
    for (r, sums) in acc.iter().enumerate().take(rows) {
        for (n, sum) in sums.iter().enumerate() {
            let lanes = LANES.min(width - n * LANES);
            let mask: __mmask16 = if lanes == LANES { !0 } else { (1 << lanes) - 1 };
            _mm512_mask_storeu_ps(out.add(r * ldo + c0 + n * LANES), mask, *sum);
        }
    }
}

multiversion! {
/// [`block`] in plain Rust, vectorised by the compiler (AVX2 + FMA, or the baseline).
fn block_portable(st: Strides, out: *mut f32, ldo: usize, rows: usize, width: usize) {
    let mut acc = [[0f32; LANES]; ROWS];
    let (mut x, mut at) = (st.x, 0);
    for _ in 0..st.steps {
        // SAFETY: the caller of `block` vouches for every value `st` names.
        let xv: [f32; LANES] = unsafe { x.cast::<[f32; LANES]>().read_unaligned() };
        for (sums, a) in acc.iter_mut().zip(st.a) {
            let a = unsafe { *a.add(at) };
            for (sum, x) in sums.iter_mut().zip(xv) {
                *sum = a.mul_add(x, *sum);
            }
        }
        x = x.wrapping_add(st.x_step);
        at += st.a_step;
    }
    for (r, sums) in acc.iter().enumerate().take(rows) {
        // SAFETY: as above, `out[r * ldo..][..width]` is writable.
        unsafe { std::ptr::copy_nonoverlapping(sums.as_ptr(), out.add(r * ldo), width) };
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) (the crate's generator).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        crate::rng::uniform_vec(seed, 0, n, -1.0, 1.0)
    }

    /// Contiguous `[batch, t, dh]`.
    fn contiguous(d: HeadDims) -> MatLayout {
        MatLayout::new(0, d.t * d.dh, d.dh, 1)
    }

    /// `[batch / heads, t, heads, dh]` rows seen as `[batch / heads, heads, t, dh]` heads (as
    /// attention layers split them out): two batch strides.
    fn split_heads(d: HeadDims, heads: usize) -> MatLayout {
        MatLayout {
            offset: 0,
            batch_stride: d.dh,
            row_stride: heads * d.dh,
            col_stride: 1,
            groups: Some(crate::backend::MatGroups {
                len: heads,
                stride: d.t * heads * d.dh,
            }),
        }
    }

    /// The f64 reference: scores, causal softmax, products, and their gradients written out
    /// from the definitions.
    fn reference([q, k, v]: [Heads; 3], g: Heads, d: HeadDims, scale: f32) -> [Vec<f64>; 5] {
        let HeadDims { batch, t, dh } = d;
        let at = |x: Heads, b: usize, i: usize, c: usize| x.matrix(b).row(i, dh)[c] as f64;
        let (mut y, mut p) = (vec![0.0; batch * t * dh], vec![0.0; batch * t * t]);
        let (mut gq, mut gk, mut gv) = (y.clone(), y.clone(), y.clone());
        let s = scale as f64;
        for b in 0..batch {
            let pb = &mut p[b * t * t..(b + 1) * t * t];
            for i in 0..t {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        s * (0..dh)
                            .map(|c| at(q, b, i, c) * at(k, b, j, c))
                            .sum::<f64>()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                for j in 0..=i {
                    pb[i * t + j] = (sc[j] - m).exp() / z;
                }
            }
            for i in 0..t {
                for c in 0..dh {
                    y[(b * t + i) * dh + c] = (0..t).map(|j| pb[i * t + j] * at(v, b, j, c)).sum();
                }
            }
            // dp = g v^T; ds = s * p * (dp - rowsum(dp * p))
            let mut ds = vec![0.0; t * t];
            for i in 0..t {
                let dp: Vec<f64> = (0..t)
                    .map(|j| (0..dh).map(|c| at(g, b, i, c) * at(v, b, j, c)).sum())
                    .collect();
                let dot: f64 = (0..t).map(|j| dp[j] * pb[i * t + j]).sum();
                for j in 0..t {
                    ds[i * t + j] = s * pb[i * t + j] * (dp[j] - dot);
                }
            }
            for i in 0..t {
                for c in 0..dh {
                    let o = (b * t + i) * dh + c;
                    gv[o] = (0..t).map(|r| pb[r * t + i] * at(g, b, r, c)).sum();
                    gq[o] = (0..t).map(|j| ds[i * t + j] * at(k, b, j, c)).sum();
                    gk[o] = (0..t).map(|r| ds[r * t + i] * at(q, b, r, c)).sum();
                }
            }
        }
        [y, p, gq, gk, gv]
    }

    /// The forward and backward with the outputs written at `out` (every value, checked: the
    /// buffers start as NaN), returned as contiguous `[batch, t, dh]` (`p`: `[batch, t, t]`).
    fn run(q: Heads, k: Heads, v: Heads, g: Heads, out: MatLayout, d: HeadDims) -> [Vec<f32>; 5] {
        let scale = 1.0 / (d.dh as f32).sqrt();
        let n = d.batch * d.t * d.dh;
        let (mut y, mut p) = (vec![f32::NAN; n], vec![f32::NAN; d.batch * d.t * d.t]);
        forward(HeadsMut::new(&mut y, out, d), &mut p, [q, k, v], d, scale);
        let mut grads = [(); 3].map(|_| vec![f32::NAN; n]);
        let [gq, gk, gv] = &mut grads;
        let outs = [gq, gk, gv].map(|x| HeadsMut::new(x, out, d));
        backward(outs, [q, k, v], &p, g, d, scale);
        let [gq, gk, gv] = grads;
        let rows = |x: &[f32]| -> Vec<f32> {
            let h = Heads {
                data: x,
                layout: out,
            };
            (0..d.batch)
                .flat_map(|b| {
                    (0..d.t)
                        .flat_map(move |i| h.matrix(b).row(i, d.dh))
                        .copied()
                })
                .collect()
        };
        [rows(&y), p, rows(&gq), rows(&gk), rows(&gv)]
    }

    fn assert_close(name: &str, got: &[f32], want: &[f64], d: HeadDims) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (&a, &b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a as f64 - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                "{name} {d:?}: element {i} is {a}, the f64 reference {b}"
            );
        }
    }

    #[test]
    fn matches_the_f64_reference() {
        // t and dh not multiples of the blocks, and ones that are.
        let cases = [
            (3, 13, 5),
            (2, 7, 16),
            (2, 33, 20),
            (1, 1, 3),
            (4, 64, 16),
            (6, 9, 32),
        ];
        for ((batch, t, dh), split) in cases.into_iter().zip([false, true].into_iter().cycle()) {
            let d = HeadDims { batch, t, dh };
            let n = batch * t * dh;
            let (q, k, v, g) = (values(n, 1), values(n, 2), values(n, 3), values(n, 4));
            // Every other case as heads split out of rows (two heads a row, batch even).
            let split = split && batch % 2 == 0;
            let l = if split {
                split_heads(d, 2)
            } else {
                contiguous(d)
            };
            let h = |x| Heads { data: x, layout: l };
            let scale = 1.0 / (dh as f32).sqrt();
            let ops = [h(&q[..]), h(&k[..]), h(&v[..]), h(&g[..])];
            let want = reference([ops[0], ops[1], ops[2]], ops[3], d, scale);
            // Outputs contiguous, and in the operands' layout (heads interleaved in a row).
            for out in [contiguous(d), l] {
                let got = run(ops[0], ops[1], ops[2], ops[3], out, d);
                for (name, (got, want)) in ["y", "p", "gq", "gk", "gv"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    assert_close(name, got, want, d);
                }
            }
        }
    }

    #[test]
    fn outputs_that_overlap_or_overrun_their_buffer_are_refused() {
        let d = HeadDims {
            batch: 4,
            t: 8,
            dh: 16,
        };
        let fits = |l: MatLayout, len: usize| {
            let mut buf = vec![0.0; len];
            std::panic::catch_unwind(move || {
                HeadsMut::new(&mut buf, l, d);
            })
            .is_ok()
        };
        let n = 4 * 8 * 16;
        assert!(fits(contiguous(d), n));
        assert!(fits(split_heads(d, 2), n));
        assert!(fits(split_heads(d, 4), n));
        // One value short, rows overlapping, heads overlapping, strided columns.
        assert!(!fits(contiguous(d), n - 1));
        assert!(!fits(MatLayout::new(0, 8 * 16, 15, 1), n));
        assert!(!fits(MatLayout::new(0, 7 * 16, 16, 1), n));
        assert!(!fits(MatLayout::new(0, 8 * 16, 16, 2), 2 * n));
        // Two heads a row, the second pair of heads starting half-way through the first's rows.
        let groups_overlap = MatLayout {
            groups: Some(crate::backend::MatGroups {
                len: 2,
                stride: 4 * 32,
            }),
            ..split_heads(d, 2)
        };
        assert!(!fits(groups_overlap, 2 * n));
    }

    /// The composed op's CPU kernels (batched products, causal softmax, softmax backward) on
    /// contiguous heads, into `o` (`[s, p, gp, gs]` of `[batch, t, t]`, then `[y, gv, gq, gk]`):
    /// what [`forward`] and [`backward`] replace.
    fn composed(
        [q, k, v, g]: [&[f32]; 4],
        rows: MatLayout,
        o: &mut [Vec<f32>; 8],
        d: HeadDims,
        scale: f32,
    ) {
        use crate::backend::MatDims;
        use crate::cpu::{matmul::matmul, reduce};
        let HeadDims { batch, t, dh } = d;
        let cols = MatLayout {
            row_stride: 1,
            col_stride: rows.row_stride,
            ..rows
        };
        let square = MatLayout::new(0, t * t, t, 1);
        let square_t = MatLayout::new(0, t * t, 1, t);
        let dims = |m, k, n| MatDims { batch, m, k, n };
        let [s, p, gp, gs, y, gv, gq, gk] = o;
        matmul(s, q, rows, k, cols, dims(t, dh, t));
        reduce::causal_softmax_rows(p, s, t, scale);
        matmul(y, p, square, v, rows, dims(t, t, dh));
        matmul(gv, p, square_t, g, rows, dims(t, t, dh));
        matmul(gp, g, rows, v, cols, dims(t, dh, t));
        reduce::softmax_backward_rows(gs, p, gp, t, scale);
        matmul(gq, gs, square, k, rows, dims(t, t, dh));
        matmul(gk, q, cols, gs, square, dims(dh, t, t));
    }

    /// Forward and backward of the main job's heads (128 of 64 x 16) and a decoder block's (32
    /// of 128 x 64), here against the composed op, alternating (run: `cargo test -p
    /// wgpipe-tensor --release --lib attention::tests::bench -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn bench_against_the_composed_op() {
        // (name, heads, t, dh, heads split out of [batch / heads, t, heads, dh] rows)
        let cases = [
            ("main job", 128, 64, 16, false),
            ("main job, heads out of rows", 128, 64, 16, true),
            ("block", 32, 128, 64, false),
        ];
        for (name, batch, t, dh, split) in cases {
            let d = HeadDims { batch, t, dh };
            let n = batch * t * dh;
            let (q, k, v, g) = (values(n, 1), values(n, 2), values(n, 3), values(n, 4));
            let l = if split {
                split_heads(d, 4)
            } else {
                contiguous(d)
            };
            let h = |x| Heads { data: x, layout: l };
            let scale = 1.0 / (dh as f32).sqrt();
            let (mut fused, mut composed_us) = (Vec::new(), Vec::new());
            let sizes = [t * t, t * t, t * dh, t * dh, t * dh];
            let mut fused_out = sizes.map(|m| vec![0.0; batch * m]);
            let mut composed_out: [Vec<f32>; 8] =
                std::array::from_fn(|i| vec![0.0; batch * if i < 4 { t * t } else { t * dh }]);
            for _ in 0..7 {
                let reps = 50;
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    let [y, p, gq, gk, gv] = &mut fused_out;
                    let y = HeadsMut::new(y, l, d);
                    forward(y, p, [h(&q[..]), h(&k[..]), h(&v[..])], d, scale);
                    let ops = [h(&q[..]), h(&k[..]), h(&v[..])];
                    let outs = [gq, gk, gv].map(|x| HeadsMut::new(x, l, d));
                    backward(outs, ops, p, h(&g[..]), d, scale);
                }
                fused.push(t0.elapsed().as_secs_f64() * 1e6 / reps as f64);
                if std::env::var("BENCH_FUSED_ONLY").is_ok() {
                    continue;
                }
                let t0 = std::time::Instant::now();
                for _ in 0..reps {
                    composed([&q, &k, &v, &g], l, &mut composed_out, d, scale);
                }
                composed_us.push(t0.elapsed().as_secs_f64() * 1e6 / reps as f64);
            }
            fused.sort_by(f64::total_cmp);
            composed_us.sort_by(f64::total_cmp);
            composed_us.resize(7, f64::NAN);
            eprintln!(
                "{name} ({batch} heads of {t} x {dh}): forward + backward {:.0} us fused, {:.0} \
                 composed (medians of 7)",
                fused[3], composed_us[3]
            );
        }
    }
}
