//! Dropout masks from the counter-based Philox stream, equal bit for bit to
//! [`crate::rng::dropout_value`]. Philox rounds form a long dependency chain, so blocks are
//! computed [`LANES`] at a time in structure-of-arrays form: independent chains the CPU overlaps
//! (and LLVM vectorises).

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
    let value = |u: u32| if u32_to_unit(u) < p { 0.0 } else { keep };
    // Rows of 4 * LANES elements keep every chunk aligned to a group of Philox blocks.
    const ROW: usize = 4 * LANES;
    let n = out.len();
    let (body, tail) = out.split_at_mut(n - n % ROW);
    for_rows(body, ROW, |r0, chunk| {
        super::simd::wide(|| {
            for (k, o) in chunk.chunks_exact_mut(ROW).enumerate() {
                let w = philox_lanes(((r0 + k) * LANES) as u64, offset, key);
                for l in 0..LANES {
                    for word in 0..4 {
                        o[4 * l + word] = value(w[word][l]);
                    }
                }
            }
        })
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
            *o = value(u);
        }
    }
}
