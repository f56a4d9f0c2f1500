//! The AVX-512 micro-kernel of [`super::blocked`]: a 12 x 16 tile of `C` in twelve 16-lane
//! registers, fed by two of the packed 6-row panels of `A` that the AVX2 kernel reads (so both
//! kernels share one packing). Each step loads one register of `B` and broadcasts twelve values
//! of `A` into the multiply-adds: twelve FMAs for thirteen loads, where the AVX2 kernel issues
//! twelve 8-lane FMAs for eight loads, half the instructions per multiply. A second kernel
//! reads `A` unpacked, for products whose `B` is only a few panels wide. x86-64 only.

use std::arch::x86_64::*;

use super::avx2::{MR, NR};

/// `C[0..12][0..16] (+)= A_panels · B_panel` over `kc` steps: rows 0..6 from panel `a0`, rows
/// 6..12 from panel `a1`, each `kc` groups of [`MR`] values as [`super::avx2::kernel_6x16`]
/// reads them; `b` a packed panel of `B` (`kc` groups of [`NR`] values), 64-byte aligned. Row
/// `i` of the tile is at `c + i * ldc`. Each element sums its products in the order the AVX2
/// kernel does, one FMA per step, so the two give the same bits.
///
/// # Safety
/// AVX-512F must be present; `a0` and `a1` must hold `kc * MR` values each, `b` `kc * NR` from
/// a 64-byte boundary, and `c` twelve rows of sixteen writable values `ldc` apart.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn kernel_12x16(
    kc: usize,
    a0: *const f32,
    a1: *const f32,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    const ROWS: usize = 2 * MR;
    prefetch_tile(c, ldc);
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let (mut a0, mut a1, mut b) = (a0, a1, b);
    for _ in 0..kc {
        // Both panels of A stream from L2: asked for eight steps ahead.
        _mm_prefetch::<_MM_HINT_T0>(a0.add(8 * MR) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(a1.add(8 * MR) as *const i8);
        let bv = _mm512_load_ps(b);
        for i in 0..MR {
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(*a0.add(i)), bv, acc[i]);
            acc[MR + i] = _mm512_fmadd_ps(_mm512_set1_ps(*a1.add(i)), bv, acc[MR + i]);
        }
        a0 = a0.add(MR);
        a1 = a1.add(MR);
        b = b.add(NR);
    }
    store_tile(&acc, c, ldc, accumulate);
}

/// [`kernel_12x16`] reading `A` where it lies instead of from packed panels: element `(i, p)`
/// of the tile's rows at `rows[i] + p * cs`. For products whose `B` is a few panels wide, where
/// packing `A` for them cost about as much as a sixth of the multiplies. The same multiply-adds
/// in the same order, so the same bits.
///
/// # Safety
/// AVX-512F must be present; elements `(i, p)` of `A` for `i < 12`, `p < kc` must be readable;
/// `b` and `c` as for [`kernel_12x16`].
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn kernel_12x16_direct(
    kc: usize,
    rows: &[*const f32; 2 * MR],
    cs: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    const ROWS: usize = 2 * MR;
    prefetch_tile(c, ldc);
    let mut acc = [_mm512_setzero_ps(); ROWS];
    let mut b = b;
    for p in 0..kc {
        let at = p * cs;
        let bv = _mm512_load_ps(b);
        for (row, sum) in rows.iter().zip(acc.iter_mut()) {
            *sum = _mm512_fmadd_ps(_mm512_set1_ps(*row.add(at)), bv, *sum);
        }
        b = b.add(NR);
    }
    store_tile(&acc, c, ldc, accumulate);
}

/// Asks for the tile's rows of `C` (as the AVX2 kernel does: they arrive while the loop runs).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn prefetch_tile(c: *mut f32, ldc: usize) {
    for i in 0..2 * MR {
        _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(c.add(i * ldc + NR - 1) as *const i8);
    }
}

/// Writes the accumulators over the tile at `c`, or adds them to it.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn store_tile(acc: &[__m512; 2 * MR], c: *mut f32, ldc: usize, accumulate: bool) {
    for (i, row) in acc.iter().enumerate() {
        let ci = c.add(i * ldc);
        let mut v = *row;
        if accumulate {
            v = _mm512_add_ps(v, _mm512_loadu_ps(ci));
        }
        _mm512_storeu_ps(ci, v);
    }
}
