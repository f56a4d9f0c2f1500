//! Indexing kernels on contiguous `[outer, dim, inner]` data with f32-held indices:
//! index_select / index_add (one index list for every outer slice) and gather / scatter_add
//! (an index per element). The adds run in index order inside each outer slice, so results do
//! not depend on the thread count.

use super::par::for_rows;

/// `out [outer, n, inner]`: `out[o, j, :] = x[o, idx[j], :]`.
pub(crate) fn index_select(out: &mut [f32], x: &[f32], idx: &[f32], dim: usize, inner: usize) {
    let n = idx.len();
    if inner == 0 || n == 0 {
        return;
    }
    for_rows(out, inner, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(inner).enumerate() {
            let r = r0 + i;
            let (o, j) = (r / n, r % n);
            let s = (o * dim + idx[j] as usize) * inner;
            row.copy_from_slice(&x[s..s + inner]);
        }
    });
}

/// `out [outer, dim, inner]` (zero-initialised): `out[o, idx[j], :] += src[o, j, :]`.
pub(crate) fn index_add(out: &mut [f32], src: &[f32], idx: &[f32], dim: usize, inner: usize) {
    let n = idx.len();
    let slab = dim * inner;
    if slab == 0 {
        return;
    }
    if out.len() == slab
        && inner >= 128
        && n * inner >= super::par::PAR_THRESHOLD
        && super::par::kernel_threads() > 1
    {
        // One outer slice (an embedding's gradient): split the columns instead (same sums, in
        // the same order, as the loop below; one thread runs that loop instead).
        index_add_by_columns(out, src, idx, inner);
        return;
    }
    for_rows(out, slab, |o0, chunk| {
        for (i, os) in chunk.chunks_mut(slab).enumerate() {
            let o = o0 + i;
            for (j, &t) in idx.iter().enumerate() {
                let d = t as usize * inner;
                let s = (o * n + j) * inner;
                for (a, &b) in os[d..d + inner].iter_mut().zip(&src[s..s + inner]) {
                    *a += b;
                }
            }
        }
    });
}

/// `index_add` for `outer == 1`, threads taking disjoint column ranges of every row.
fn index_add_by_columns(out: &mut [f32], src: &[f32], idx: &[f32], inner: usize) {
    use rayon::prelude::*;
    let threads = super::par::kernel_threads().max(1);
    let width = inner.div_ceil(threads).max(64);
    // View `out` as rows; hand each task a column band through disjoint row pieces.
    let mut bands: Vec<Vec<&mut [f32]>> = (0..inner.div_ceil(width)).map(|_| vec![]).collect();
    for row in out.chunks_mut(inner) {
        let mut rest = row;
        for band in bands.iter_mut() {
            let (piece, tail) = rest.split_at_mut(width.min(rest.len()));
            band.push(piece);
            rest = tail;
        }
    }
    bands.into_par_iter().enumerate().for_each(|(b, mut rows)| {
        let c0 = b * width;
        for (j, &t) in idx.iter().enumerate() {
            let dst = &mut rows[t as usize];
            let (s, len) = (j * inner + c0, dst.len());
            for (a, &v) in dst.iter_mut().zip(&src[s..s + len]) {
                *a += v;
            }
        }
    });
}

/// `out [outer, n, inner]`: `out[o, j, i] = x[o, idx[o, j, i], i]` (`idx` shaped like `out`).
pub(crate) fn gather(out: &mut [f32], x: &[f32], idx: &[f32], n: usize, dim: usize, inner: usize) {
    if inner == 0 || n == 0 {
        return;
    }
    for_rows(out, inner, |r0, chunk| {
        for (k, row) in chunk.chunks_mut(inner).enumerate() {
            let r = r0 + k; // o * n + j
            let base = (r / n) * dim * inner;
            let ids = &idx[r * inner..(r + 1) * inner];
            for (i, (o, &t)) in row.iter_mut().zip(ids).enumerate() {
                *o = x[base + t as usize * inner + i];
            }
        }
    });
}

/// `out [outer, dim, inner]` (zero-initialised): `out[o, idx[o, j, i], i] += src[o, j, i]`.
pub(crate) fn scatter_add(
    out: &mut [f32],
    src: &[f32],
    idx: &[f32],
    n: usize,
    dim: usize,
    inner: usize,
) {
    let slab = dim * inner;
    if slab == 0 {
        return;
    }
    for_rows(out, slab, |o0, chunk| {
        for (k, os) in chunk.chunks_mut(slab).enumerate() {
            let o = o0 + k;
            let s = &src[o * n * inner..(o + 1) * n * inner];
            let t = &idx[o * n * inner..(o + 1) * n * inner];
            for (sr, tr) in s.chunks(inner).zip(t.chunks(inner)) {
                for (i, (&v, &d)) in sr.iter().zip(tr).enumerate() {
                    os[d as usize * inner + i] += v;
                }
            }
        }
    });
}
