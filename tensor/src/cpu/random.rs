//! Dropout masks from the counter-based Philox stream, equal bit for bit to
//! [`crate::rng::dropout_value`]. Philox rounds form a long dependency chain, so blocks are
//! computed [`LANES`] at a time in structure-of-arrays form: independent chains the CPU overlaps,
//! and with AVX2 eight blocks go through each round as 256-bit vectors.

use crate::rng::{philox4x32, u32_to_unit};

use super::par::for_rows;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;
const LANES: usize = 8;

/// Philox 4x32-10 of the counters `(first + l, offset)` for `l` in `0..LANES`, as in
/// [`crate::rng::random_u32`]: returns the four words of each block, word-major.
#[inline(always)]
fn philox_lanes(first: u64, offset: u64, key: [u32; 2]) -> [[u32; LANES]; 4] {
    let mut c0: [u32; LANES] = std::array::from_fn(|l| (first + l as u64) as u32);
    let mut c1: [u32; LANES] = std::array::from_fn(|l| ((first + l as u64) >> 32) as u32);
    let mut c2 = [offset as u32; LANES];
    let mut c3 = [(offset >> 32) as u32; LANES];
    let mut k = key;
    for _ in 0..10 {
        for l in 0..LANES {
            let p0 = M0 as u64 * c0[l] as u64;
            let p1 = M1 as u64 * c2[l] as u64;
            let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
            let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
            c0[l] = hi1 ^ c1[l] ^ k[0];
            c1[l] = lo1;
            c2[l] = hi0 ^ c3[l] ^ k[1];
            c3[l] = lo0;
        }
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    [c0, c1, c2, c3]
}

/// `out[i] = dropout_value(seed, offset, i, p)` for every `i`.
pub(crate) fn dropout_mask(out: &mut [f32], p: f32, seed: u64, offset: u64) {
    let keep = 1.0 / (1.0 - p);
    let key = [seed as u32, (seed >> 32) as u32];
    // Rows of 4 * LANES elements keep every chunk aligned to a group of Philox blocks.
    const ROW: usize = 4 * LANES;
    let n = out.len();
    let (body, tail) = out.split_at_mut(n - n % ROW);
    for_rows(body, ROW, |r0, chunk| {
        fill_blocks(chunk, (r0 * LANES) as u64, offset, key, p, keep)
    });
    let first_block = (n - tail.len()) / 4;
    for (b, o) in tail.chunks_mut(4).enumerate() {
        let c = (first_block + b) as u64;
        let w = philox4x32(
            [
                c as u32,
                (c >> 32) as u32,
                offset as u32,
                (offset >> 32) as u32,
            ],
            key,
        );
        for (o, &u) in o.iter_mut().zip(&w) {
            *o = if u32_to_unit(u) < p { 0.0 } else { keep };
        }
    }
}

/// Fills `out` (a multiple of `4 * LANES` long) from the Philox blocks starting at `first`.
pub(super) fn fill_blocks(
    out: &mut [f32],
    first: u64,
    offset: u64,
    key: [u32; 2],
    p: f32,
    keep: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { avx2::fill_blocks(out, first, offset, key, p, keep) };
    }
    fill_blocks_portable(out, first, offset, key, p, keep)
}

/// [`fill_blocks`] without vector intrinsics.
pub(super) fn fill_blocks_portable(
    out: &mut [f32],
    first: u64,
    offset: u64,
    key: [u32; 2],
    p: f32,
    keep: f32,
) {
    for (k, o) in out.chunks_exact_mut(4 * LANES).enumerate() {
        let w = philox_lanes(first + (k * LANES) as u64, offset, key);
        for l in 0..LANES {
            for word in 0..4 {
                o[4 * l + word] = if u32_to_unit(w[word][l]) < p {
                    0.0
                } else {
                    keep
                };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{LANES, M0, M1, W0, W1};

    /// `(hi, lo)` 32-bit halves of the 64-bit products `a[l] * m` for all 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mulhilo(a: __m256i, m: __m256i) -> (__m256i, __m256i) {
        let even = _mm256_mul_epu32(a, m); // lanes 0, 2, 4, 6 as 64-bit products
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), m); // lanes 1, 3, 5, 7
        let hi = _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(even), odd);
        let lo = _mm256_mullo_epi32(a, m);
        (hi, lo)
    }

    /// Eight Philox blocks per step, then the dropout values, interleaved back to element order.
    #[target_feature(enable = "avx2")]
    pub(super) fn fill_blocks(
        out: &mut [f32],
        first: u64,
        offset: u64,
        key: [u32; 2],
        p: f32,
        keep: f32,
    ) {
        let (m0, m1) = (_mm256_set1_epi32(M0 as i32), _mm256_set1_epi32(M1 as i32));
        let scale = _mm256_set1_ps(1.0 / 16_777_216.0);
        let (pv, keepv) = (_mm256_set1_ps(p), _mm256_set1_ps(keep));
        for (k, o) in out.chunks_exact_mut(4 * LANES).enumerate() {
            let b = first + (k * LANES) as u64;
            // Counter words of blocks b + l (the high word can differ between lanes).
            let ctr: [u64; LANES] = std::array::from_fn(|l| b + l as u64);
            let word = |f: fn(u64) -> u32| {
                _mm256_setr_epi32(
                    f(ctr[0]) as i32,
                    f(ctr[1]) as i32,
                    f(ctr[2]) as i32,
                    f(ctr[3]) as i32,
                    f(ctr[4]) as i32,
                    f(ctr[5]) as i32,
                    f(ctr[6]) as i32,
                    f(ctr[7]) as i32,
                )
            };
            let mut c0 = word(|c| c as u32);
            let mut c1 = word(|c| (c >> 32) as u32);
            let mut c2 = _mm256_set1_epi32(offset as u32 as i32);
            let mut c3 = _mm256_set1_epi32((offset >> 32) as u32 as i32);
            let mut k0 = key[0];
            let mut k1 = key[1];
            for _ in 0..10 {
                let (hi0, lo0) = mulhilo(c0, m0);
                let (hi1, lo1) = mulhilo(c2, m1);
                c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(k0 as i32));
                c1 = lo1;
                c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(k1 as i32));
                c3 = lo0;
                k0 = k0.wrapping_add(W0);
                k1 = k1.wrapping_add(W1);
            }
            // Word w of lane l is element 4 l + w: value = (u >> 8) * 2^-24 < p ? 0 : keep.
            let mut vals = [[0f32; LANES]; 4];
            for (word, c) in [c0, c1, c2, c3].into_iter().enumerate() {
                let u = _mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(c));
                let drop = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_mul_ps(u, scale), pv);
                let v = _mm256_andnot_ps(drop, keepv);
                // SAFETY: `vals[word]` is 8 f32 values; unaligned store.
                unsafe { _mm256_storeu_ps(vals[word].as_mut_ptr(), v) };
            }
            for l in 0..LANES {
                for (word, row) in vals.iter().enumerate() {
                    o[4 * l + word] = row[l];
                }
            }
        }
    }
}
