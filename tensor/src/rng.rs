//! Counter-based random numbers (Philox 4x32-10), identical on every backend.
//!
//! Element `i` of a stream keyed by `(seed, offset)` is a pure function of `(seed, offset, i)`,
//! so re-running a forward pass (re-materialization) replays the same dropout mask bit for bit,
//! and the WGSL kernel (`shaders/src/philox.wgsl`) produces the same bits as this code.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox 4x32 with 10 rounds on counter `c` and key `k`.
pub fn philox4x32(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for _ in 0..10 {
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The `i`-th 32-bit random word of the stream `(seed, offset)`.
pub fn random_u32(seed: u64, offset: u64, i: u64) -> u32 {
    let block = i / 4;
    let c = [
        block as u32,
        (block >> 32) as u32,
        offset as u32,
        (offset >> 32) as u32,
    ];
    philox4x32(c, [seed as u32, (seed >> 32) as u32])[(i % 4) as usize]
}

/// Maps a random word to a float in [0, 1) using its top 24 bits (exact in f32 on every backend).
pub fn u32_to_unit(u: u32) -> f32 {
    (u >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// `n` uniform floats in [lo, hi) from the stream `(seed, offset)`.
pub fn uniform_vec(seed: u64, offset: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * u32_to_unit(random_u32(seed, offset, i)))
        .collect()
}

/// `n` normal floats (Box-Muller on pairs of words) from the stream `(seed, offset)`.
pub fn normal_vec(seed: u64, offset: u64, n: usize, mean: f32, std: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            // 1 - u keeps the log argument in (0, 1].
            let u1 = 1.0 - u32_to_unit(random_u32(seed, offset, 2 * i)) as f64;
            let u2 = u32_to_unit(random_u32(seed, offset, 2 * i + 1)) as f64;
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            mean + std * z as f32
        })
        .collect()
}

/// Dropout keep/scale value of element `i`: 0 with probability `p`, else 1/(1-p).
pub fn dropout_value(seed: u64, offset: u64, i: u64, p: f32) -> f32 {
    if u32_to_unit(random_u32(seed, offset, i)) < p {
        0.0
    } else {
        1.0 / (1.0 - p)
    }
}

/// splitmix64's increment (the golden ratio in 64 bits).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's output function: a bijective, well-mixing 64-bit hash.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One splitmix64 step as a hash: `mix64(z + GOLDEN_GAMMA)` (seed derivation).
#[inline]
pub fn splitmix64(z: u64) -> u64 {
    mix64(z.wrapping_add(GOLDEN_GAMMA))
}

/// SplitMix64: a tiny, fast, seedable sequential generator for host-side randomness (data
/// generation, shuffling, sampling, seed derivation); not cryptographic. Tensor randomness uses
/// the counter-based Philox streams above instead.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    pub state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// A generator seeded from several values (e.g. seed, step, row), so that different
    /// tuples give independent-looking streams.
    pub fn from_parts(parts: &[u64]) -> Self {
        let mut h = 0x243F_6A88_85A3_08D3u64;
        for &p in parts {
            h = mix64(h ^ mix64(p.wrapping_add(GOLDEN_GAMMA)));
        }
        SplitMix64::new(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `0..n` (`n > 0`), via 128-bit multiply (negligible bias).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1]
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Known-answer vectors of the Random123 reference (kat_vectors, philox4x32_10).
        assert_eq!(
            philox4x32([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
    }

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a = uniform_vec(7, 0, 1000, 0.0, 1.0);
        assert_eq!(a, uniform_vec(7, 0, 1000, 0.0, 1.0));
        assert_ne!(a, uniform_vec(7, 1, 1000, 0.0, 1.0));
        assert_ne!(a, uniform_vec(8, 0, 1000, 0.0, 1.0));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
        let z = normal_vec(1, 0, 20000, 0.0, 1.0);
        let m = z.iter().sum::<f32>() / z.len() as f32;
        let v = z.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / z.len() as f32;
        assert!(m.abs() < 0.03 && (v - 1.0).abs() < 0.05, "mean {m} var {v}");
    }

    #[test]
    fn dropout_keeps_about_one_minus_p() {
        let kept = (0..10000)
            .filter(|&i| dropout_value(3, 9, i, 0.25) > 0.0)
            .count();
        assert!((kept as f32 / 10000.0 - 0.75).abs() < 0.02);
        assert_eq!(dropout_value(3, 9, 0, 0.0), 1.0);
    }
}
