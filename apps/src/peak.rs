//! The CPU's f32 multiply-add ceiling, measured: the rate no f32 kernel on these cores can beat,
//! which the benchmarks quote their own rates against (PaLM's "model FLOPs utilisation" idea).
//!
//! Each thread runs independent chains of vector fused multiply-adds on registers only (no
//! memory traffic), in the widest build the CPU has (AVX-512, else AVX2 + FMA, else whatever the
//! compiler makes of a plain `mul_add` loop), all threads at once.

use std::time::{Duration, Instant};

/// The CPU's vendor, family and model as Linux names them (`AuthenticAMD family 25: AMD EPYC`),
/// so that a figure quoted against the peak says which CPU it came from; `None` where
/// /proc/cpuinfo is missing.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let field = |key: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    // The family beside the model: on AMD it tells Zen 4 (25) from Zen 5 (26), whose AVX-512
    // units differ in width, and every speed figure depends on which.
    let vendor = match (field("vendor_id"), field("cpu family")) {
        (Some(v), Some(f)) => Some(format!("{v} family {f}")),
        (v, _) => v,
    };
    match (vendor, field("model name")) {
        (Some(v), Some(m)) => Some(format!("{v}: {m}")),
        (v, m) => v.or(m),
    }
}

/// GFLOP/s (2 per multiply-add) of `threads` threads running FMA chains together: the best of a
/// few trials, each about `budget / 3` long.
pub fn cpu_fma_peak_gflops(threads: usize, budget: Duration) -> f64 {
    let threads = threads.max(1);
    // Iterations per call of the kernel: long enough that the call overhead vanishes.
    const ITERS: u64 = 200_000;
    let kernel = Kernel::best();
    let flops_per_call = ITERS as f64 * kernel.flops_per_iter();
    let trial = budget / 3;
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let calls: u64 = std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(move || {
                        let mut calls = 0u64;
                        while calls == 0 || start.elapsed() < trial {
                            std::hint::black_box(kernel.run(ITERS));
                            calls += 1;
                        }
                        calls
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap_or(0)).sum()
        });
        let secs = start.elapsed().as_secs_f64();
        best = best.max(calls as f64 * flops_per_call / secs / 1e9);
    }
    best
}

/// The widest FMA build this CPU runs.
#[derive(Clone, Copy)]
enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

/// Independent accumulators per thread: more than FMA latency x FMA ports on any current core,
/// so the chains never wait on each other.
const CHAINS: usize = 16;

/// The same for AVX2, whose 16 vector registers must also hold the two constants: 16 chains
/// would spill to memory, and the loads and stores cut the figure nearly in half (a 2-core Zen 3
/// measured 107 GFLOP/s so, below MKL's products at 150, and 194-198 with 12 chains). 12 still
/// exceed latency x ports (4 x 2 on Zen 3).
const CHAINS_AVX2: usize = 12;

impl Kernel {
    fn best() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Kernel::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    fn flops_per_iter(self) -> f64 {
        let (chains, lanes) = match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => (CHAINS, 16),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => (CHAINS_AVX2, 8),
            Kernel::Portable => (CHAINS, 1),
        };
        (chains * lanes * 2) as f64
    }

    fn run(self, iters: u64) -> f32 {
        match self {
            // SAFETY: `best` picked these only where the CPU reported the features.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { chains_avx512(iters) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { chains_avx2(iters) },
            Kernel::Portable => chains_portable(iters),
        }
    }
}

// Each chain is `acc = acc * a + b` with a just below 1: it settles near b / (1 - a) = 0.1, far
// from overflow and denormals, and the sum is returned so that nothing is optimised away.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chains_avx512(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    let mut acc = [_mm512_set1_ps(0.0); CHAINS];
    for _ in 0..iters {
        for r in acc.iter_mut() {
            *r = _mm512_fmadd_ps(*r, a, b);
        }
    }
    acc.iter().map(|&r| _mm512_reduce_add_ps(r)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chains_avx2(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    let mut acc = [_mm256_set1_ps(0.0); CHAINS_AVX2];
    for _ in 0..iters {
        for r in acc.iter_mut() {
            *r = _mm256_fmadd_ps(*r, a, b);
        }
    }
    let mut lanes = [0.0f32; 8];
    let mut sum = 0.0;
    for r in acc {
        _mm256_storeu_ps(lanes.as_mut_ptr(), r);
        sum += lanes.iter().sum::<f32>();
    }
    sum
}

/// Scalar chains, each counted as one lane: where the compiler does not vectorise them (or the
/// CPU has no FMA and `mul_add` is a library call), the figure underestimates the peak.
fn chains_portable(iters: u64) -> f32 {
    let mut acc = [0.0f32; CHAINS];
    for _ in 0..iters {
        for r in acc.iter_mut() {
            *r = r.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}
