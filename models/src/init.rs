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

std::thread_local! {
    /// Set while [`without_random_init`] runs on this thread.
    static SKIPPED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `build` with every random draw of this module ([`uniform`], [`normal`] and what calls
/// them) giving zeros instead: for layers whose values are overwritten right after (by a
/// checkpoint's), as transformers' `no_init_weights`. Zeros cost no time, and on the host no
/// memory until written (the allocator hands out zeroed pages untouched), so loading a model
/// neither draws its random values nor holds them. Only this thread's builds are affected.
pub fn without_random_init<R>(build: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SKIPPED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SKIPPED.with(|s| s.replace(true)));
    build()
}

fn random_init_skipped() -> bool {
    SKIPPED.with(|s| s.get())
}

/// `U(-bound, bound)`.
pub fn uniform(shape: &[usize], bound: f32, seed: u64, dev: &Device) -> Result<Tensor> {
    if random_init_skipped() {
        return Tensor::zeros(shape, dev);
    }
    Tensor::rand_uniform(shape, -bound, bound, seed, dev)
}

/// PyTorch's default weight (and bias) init for a layer with `fan_in` inputs per output.
pub fn kaiming_uniform(shape: &[usize], fan_in: usize, seed: u64, dev: &Device) -> Result<Tensor> {
    uniform(shape, kaiming_uniform_bound(fan_in), seed, dev)
}

/// `N(mean, std)` (nn.Embedding's default is `N(0, 1)`).
pub fn normal(shape: &[usize], mean: f32, std: f32, seed: u64, dev: &Device) -> Result<Tensor> {
    if random_init_skipped() {
        return Tensor::zeros(shape, dev);
    }
    Tensor::rand_normal(shape, mean, std, seed, dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_zero(t: &Tensor) -> bool {
        t.to_vec().unwrap().iter().all(|&v| v == 0.0)
    }

    #[test]
    fn without_random_init_gives_zeros_on_its_thread_only_and_restores() {
        let dev = Device::cpu();
        let drawn = || normal(&[64], 0.0, 1.0, 7, &dev).unwrap();
        assert!(!all_zero(&drawn()));
        let (inside, nested, after_nested, other_thread) = without_random_init(|| {
            let inside = drawn();
            let nested = without_random_init(drawn);
            let after_nested = uniform(&[64], 1.0, 7, &dev).unwrap();
            let other_thread = std::thread::scope(|s| s.spawn(drawn).join().unwrap());
            (inside, nested, after_nested, other_thread)
        });
        assert!(all_zero(&inside) && all_zero(&nested) && all_zero(&after_nested));
        assert!(
            !all_zero(&other_thread),
            "another thread's init is not affected"
        );
        assert_eq!(
            drawn().to_vec().unwrap(),
            normal(&[64], 0.0, 1.0, 7, &dev).unwrap().to_vec().unwrap()
        );
        assert!(!all_zero(&drawn()), "random init is back after the scope");
        let panicked = std::panic::catch_unwind(|| without_random_init(|| panic!("build failed")));
        assert!(panicked.is_err());
        assert!(
            !all_zero(&drawn()),
            "a panicking build restores random init too"
        );
    }
}
