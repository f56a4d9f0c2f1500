//! Initialisation as in PyTorch's defaults, from counter-based random streams.
//!
//! Every constructor takes a `seed`; a layer with several tensors derives one seed per tensor
//! with [`sub_seed`], and a model derives one per element. `Tensor::rand_uniform` and
//! `Tensor::rand_normal` are counter-based and backend-independent, so the same seed gives the
//! same weights on the CPU and on every wgpu device.

use wgpipe_tensor::rng::splitmix64;
use wgpipe_tensor::{Device, Result, Tensor};

/// The seed of child number `k` of something seeded with `seed` (distinct, well mixed).
pub fn sub_seed(seed: u64, k: u64) -> u64 {
    splitmix64(splitmix64(seed) ^ splitmix64(k.wrapping_add(0x5851_F42D_4C95_7F2D)))
}

/// Hands out one fresh seed per call, derived from a base seed.
#[derive(Debug, Clone)]
pub struct Init {
    seed: u64,
    next: u64,
}

impl Init {
    pub fn new(seed: u64) -> Self {
        Init { seed, next: 0 }
    }
    /// The next seed of the stream.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let s = sub_seed(self.seed, self.next);
        self.next += 1;
        s
    }
}

/// The bound of PyTorch's default Linear/Conv init, `kaiming_uniform_(a = sqrt(5))`:
/// gain `sqrt(2 / (1 + a^2)) = sqrt(1/3)`, bound `gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in)`.
/// The bias uses the same bound.
pub fn kaiming_uniform_bound(fan_in: usize) -> f32 {
    1.0 / (fan_in.max(1) as f32).sqrt()
}

/// `U(-bound, bound)`.
pub fn uniform(shape: &[usize], bound: f32, seed: u64, dev: &Device) -> Result<Tensor> {
    Tensor::rand_uniform(shape, -bound, bound, seed, dev)
}

/// PyTorch's default weight (and bias) init for a layer with `fan_in` inputs per output.
pub fn kaiming_uniform(shape: &[usize], fan_in: usize, seed: u64, dev: &Device) -> Result<Tensor> {
    uniform(shape, kaiming_uniform_bound(fan_in), seed, dev)
}

/// `N(mean, std)` (nn.Embedding's default is `N(0, 1)`).
pub fn normal(shape: &[usize], mean: f32, std: f32, seed: u64, dev: &Device) -> Result<Tensor> {
    Tensor::rand_normal(shape, mean, std, seed, dev)
}
