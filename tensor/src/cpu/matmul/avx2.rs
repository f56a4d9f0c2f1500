//! The AVX2 + FMA micro-kernel of [`super::blocked`]: a 6 x 16 tile of `C` kept in twelve
//! 8-lane registers through the whole `kc` loop (BLIS's shape for Haswell and Zen: twelve
//! accumulators, two registers of `B`, one broadcast of `A`, 15 of the 16 registers), and the
//! packing loops that transpose in registers. x86-64 only (the module is).

use std::arch::x86_64::*;

use crate::cpu::simd::transpose_8x8;

/// Rows of the tile.
pub(crate) const MR: usize = 6;
/// Columns of the tile (two 8-lane registers).
pub(crate) const NR: usize = 16;

/// `C[0..6][0..16] (+)= A_panel · B_panel` over `kc` steps.
///
/// `a` is a packed panel of `A`: `kc` groups of [`MR`] values (column `p` of six rows); `b` a
/// packed panel of `B`: `kc` groups of [`NR`] values (row `p` of sixteen columns), 32-byte
/// aligned. Row `i` of the tile is at `c + i * ldc`. With `accumulate` false the tile is
/// overwritten, else added to.
///
/// # Safety
/// AVX2 and FMA must be present; `a` must hold `kc * MR` values, `b` `kc * NR` from a 32-byte
/// boundary, and `c` six rows of sixteen writable values `ldc` apart.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn kernel_6x16(
    kc: usize,
    a: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // The tile's rows are far apart (a row of C each) and were last touched a whole block of
    // `A` ago: fetched now, they arrive while the loop runs instead of stalling the stores.
    for i in 0..MR {
        _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + NR - 1) as *const i8);
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        // The panel of A streams from L2: asked for eight steps ahead.
        _mm_prefetch::<_MM_HINT_T0>(a.add(8 * MR) as *const i8);
        let b0 = _mm256_load_ps(b);
        let b1 = _mm256_load_ps(b.add(8));
        for (i, row) in acc.iter_mut().enumerate() {
            let ai = _mm256_broadcast_ss(&*a.add(i));
            row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
            row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
        }
        a = a.add(MR);
        b = b.add(NR);
    }
    for (i, row) in acc.iter().enumerate() {
        let ci = c.add(i * ldc);
        let (mut lo, mut hi) = (row[0], row[1]);
        if accumulate {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(ci));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(ci.add(8)));
        }
        _mm256_storeu_ps(ci, lo);
        _mm256_storeu_ps(ci.add(8), hi);
    }
}

/// Packs one panel of `A` from rows whose values are contiguous (`a` at row 0, column 0 of the
/// block, rows `lda` apart): `dst[p * MR + r] = a[r * lda + p]` for `p < kc`, `r < rows`
/// (at most [`MR`]), zero for the rows past `rows`. Eight columns at a time through an 8 x 8
/// transpose, each column's eight lanes stored where its six belong (the two extra are
/// overwritten by the next column's store, so `dst` needs two values of room past the panel).
///
/// # Safety
/// AVX2 must be present; `rows` rows of `kc` values must be readable; `dst` must hold
/// `kc * MR + 2` values.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pack_a_rows(dst: *mut f32, a: *const f32, lda: usize, rows: usize, kc: usize) {
    let zero = _mm256_setzero_ps();
    let full = kc / 8 * 8;
    for p0 in (0..full).step_by(8) {
        let mut r = [zero; 8];
        for (i, v) in r.iter_mut().enumerate().take(rows) {
            *v = _mm256_loadu_ps(a.add(i * lda + p0));
        }
        for (p, col) in transpose_8x8(r).iter().enumerate() {
            _mm256_storeu_ps(dst.add((p0 + p) * MR), *col);
        }
    }
    for p in full..kc {
        for i in 0..MR {
            *dst.add(p * MR + i) = if i < rows { *a.add(i * lda + p) } else { 0.0 };
        }
    }
}

/// Packs one panel of `B` from columns whose values are contiguous (`b` at row 0, column 0 of
/// the block, columns `ldb` apart; a transposed weight): `dst[p * NR + c] = b[c * ldb + p]` for
/// `p < kc`, `c < cols` (at most [`NR`]), zero for the columns past `cols`. Eight rows by eight
/// columns at a time through an 8 x 8 transpose.
///
/// # Safety
/// AVX2 must be present; `cols` columns of `kc` values must be readable; `dst` must hold
/// `kc * NR` values.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pack_b_columns(
    dst: *mut f32,
    b: *const f32,
    ldb: usize,
    cols: usize,
    kc: usize,
) {
    let zero = _mm256_setzero_ps();
    let full = kc / 8 * 8;
    for half in 0..2 {
        let c0 = half * 8;
        let here = cols.saturating_sub(c0).min(8);
        for p0 in (0..full).step_by(8) {
            let mut r = [zero; 8];
            for (c, v) in r.iter_mut().enumerate().take(here) {
                *v = _mm256_loadu_ps(b.add((c0 + c) * ldb + p0));
            }
            for (p, row) in transpose_8x8(r).iter().enumerate() {
                _mm256_storeu_ps(dst.add((p0 + p) * NR + c0), *row);
            }
        }
        for p in full..kc {
            for c in 0..8 {
                *dst.add(p * NR + c0 + c) = if c < here {
                    *b.add((c0 + c) * ldb + p)
                } else {
                    0.0
                };
            }
        }
    }
}

/// A mask of the first `n` lanes (at most 8) of an 8-lane register, for `maskload`, which
/// neither reads nor faults past them.
#[target_feature(enable = "avx2,fma")]
unsafe fn first_lanes(n: usize) -> __m256i {
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane)
}

/// Packs the panels of `A` for `rows` rows (`rows.div_ceil(MR)` panels, `kc * MR` values apart)
/// from columns whose values are contiguous (`a` at row 0, column 0 of the block, columns `lda`
/// apart; a transposed view such as `dy.t()`): `dst[ip * kc * MR + p * MR + r]` is
/// `a[p * lda + ip * MR + r]`, zero for the rows past `rows`. Column `p` of every panel before
/// column `p + 1` of any, so each column's values are read once, in one run: panel by panel,
/// each 64-byte line held parts of three panels and was read three times, from lines `lda`
/// apart that the prefetchers do not follow (4 KiB apart in a 1024-wide `dy`: a set of L1 that
/// holds eight). How many panels a call should take: [`super::blocked`]'s `A_PANELS_TOGETHER`.
/// One 8-lane load and store per panel and column, the two extra lanes stored over the next
/// column's values before they are written; the last column's six values are stored alone,
/// where the two extra would land on the next panel's first column.
///
/// # Safety
/// AVX2 must be present; `kc` columns of `rows` values must be readable; `dst` must hold
/// `rows.div_ceil(MR) * kc * MR` values.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pack_a_columns(
    dst: *mut f32,
    a: *const f32,
    lda: usize,
    rows: usize,
    kc: usize,
) {
    let panels = rows.div_ceil(MR);
    // Panels whose eight lanes lie inside the rows read unmasked; the rest (at most two: the
    // last, and the one before it where the last has one row) through a mask of the rows they
    // have, worked out once (the lanes past `rows` read as zero, never touched in memory).
    let unmasked = rows.saturating_sub(2) / MR;
    let masks = [0, 1].map(|i| first_lanes(rows.saturating_sub((unmasked + i) * MR)));
    let load = |col: *const f32, ip: usize| {
        if ip < unmasked {
            _mm256_loadu_ps(col.add(ip * MR))
        } else {
            _mm256_maskload_ps(col.add(ip * MR), masks[ip - unmasked])
        }
    };
    for p in 0..kc - 1 {
        let col = a.add(p * lda);
        for ip in 0..panels {
            _mm256_storeu_ps(dst.add(ip * kc * MR + p * MR), load(col, ip));
        }
    }
    let col = a.add((kc - 1) * lda);
    for ip in 0..panels {
        let v = load(col, ip);
        let d = dst.add(ip * kc * MR + (kc - 1) * MR);
        _mm_storeu_ps(d, _mm256_castps256_ps128(v));
        _mm_store_sd(
            d.add(4) as *mut f64,
            _mm_castps_pd(_mm256_extractf128_ps::<1>(v)),
        );
    }
}

/// Packs the panels of `B` for `cols` columns (`cols.div_ceil(NR)` panels, `kc * NR` values
/// apart) from rows whose values are contiguous (`b` at row 0, column 0 of the block, rows `ldb`
/// apart): `dst[jp * kc * NR + p * NR + c] = b[p * ldb + jp * NR + c]`, zero for the columns past
/// `cols`. Row `p` of every panel before row `p + 1` of any, so each row is read in one run:
/// panel by panel, each row gave 64 bytes and the next row's were `ldb` on, where the
/// prefetchers do not follow. How many panels a call should take: [`super::blocked`]'s
/// `B_PANELS_TOGETHER`. Two 8-lane loads and stores per row and panel, masked where the last
/// panel is narrower (a copy of sixteen values through `copy_from_slice` was a library call per
/// row).
///
/// # Safety
/// AVX2 must be present; `kc` rows of `cols` values must be readable; `dst` must hold
/// `cols.div_ceil(NR) * kc * NR` values from a 32-byte boundary.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pack_b_rows(dst: *mut f32, b: *const f32, ldb: usize, cols: usize, kc: usize) {
    let full = cols / NR;
    let rest = cols % NR;
    let (lo, hi) = (
        first_lanes(rest.min(8)),
        first_lanes(rest.saturating_sub(8)),
    );
    for p in 0..kc {
        let row = b.add(p * ldb);
        for jp in 0..full {
            let d = dst.add(jp * kc * NR + p * NR);
            _mm256_store_ps(d, _mm256_loadu_ps(row.add(jp * NR)));
            _mm256_store_ps(d.add(8), _mm256_loadu_ps(row.add(jp * NR + 8)));
        }
        if rest > 0 {
            let d = dst.add(full * kc * NR + p * NR);
            let part = row.add(full * NR);
            _mm256_store_ps(d, _mm256_maskload_ps(part, lo));
            // Past the row when `rest <= 8`: then the mask reads nothing.
            _mm256_store_ps(d.add(8), _mm256_maskload_ps(part.wrapping_add(8), hi));
        }
    }
}
