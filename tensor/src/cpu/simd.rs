//! Hot loops compiled for the CPU's vector extensions. The crate is built for baseline x86-64
//! (SSE2, 4 lanes); the functions here also exist in an AVX2 + FMA build (8 lanes) and an
//! AVX-512 build (16 lanes), the best one picked at run time. The loop body must be inlined into
//! the `#[target_feature]` function to be compiled for it, so bodies are `#[inline(always)]`
//! functions called directly (a closure passed through would be compiled once, for the
//! baseline).
//!
//! AVX-512 pays for the transcendental loops (exp, the exact GELU and their gradients): on
//! this machine's Xeon, 1M values on one thread, GELU 1.44 -> 0.82-1.12 ns per value forward and
//! 2.3 -> 1.2-1.55 backward, exp 0.52 -> 0.36-0.45. Every variant runs the same operations on each
//! element (no reassociation), so all three give the same bits. The GELUs' loops run their
//! polynomials over runs of values near zero ([`by_runs`]): on a Zen 4, 1M values drawn from a
//! normal of spread 0.6 on one thread (`bias_act`), the exact GELU's AVX2 1.38 -> 0.42 ns per
//! value forward and 2.10 -> 0.51 backward, AVX-512 0.80 -> 0.35 and 1.15 -> 0.40. Those were
//! f32 polynomials; the GELUs are computed in f64 now (`wgpipe_shaders::ops::math`, issue 62:
//! the f32 forms' errors leaned one way), at about 1.5x their cost: on an Ice Lake Xeon, 64K
//! values of spread 0.5 (`bias_act`, best of 28 batches), the tanh form 0.32 -> 0.57 ns forward
//! and 0.38 -> 0.64 backward, the exact 0.33 -> 0.48 and 0.36 -> 0.67.

use std::sync::atomic::{AtomicU8, Ordering};

use wgpipe_shaders::ops::UnaryOpT;

/// The builds of the hot loops, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    Baseline = 0,
    Avx2 = 1,
    Avx512 = 2,
}

/// The widest build the dispatch may pick. Only tests lower it: on a machine with AVX-512 the
/// AVX2 and baseline builds would otherwise never run, and they must give the same bits.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
static MAX_LEVEL: AtomicU8 = AtomicU8::new(Level::Avx512 as u8);

/// Caps the build the dispatch picks (tests only; every build gives the same bits, so other
/// threads running kernels meanwhile see no difference but speed).
#[cfg(test)]
pub(crate) fn set_max_level(level: Level) {
    MAX_LEVEL.store(level as u8, Ordering::Relaxed);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
fn allowed(level: Level) -> bool {
    MAX_LEVEL.load(Ordering::Relaxed) >= level as u8
}

/// Whether the CPU has `level`'s features and this process may run them ([`process_allows`]),
/// whatever the tests cap the dispatch to: for choices that must not change while other tests
/// run (which product kernel takes a product).
#[inline(always)]
pub(crate) fn cpu_runs(level: Level) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = || {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        };
        process_allows(level)
            && match level {
                Level::Baseline => true,
                Level::Avx2 => avx2(),
                Level::Avx512 => std::arch::is_x86_feature_detected!("avx512f") && avx2(),
            }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        level == Level::Baseline
    }
}

/// Whether this process may run `level` at all: yes, unless `WGPIPE_CPU_SIMD` (`avx2` or
/// `baseline`) caps it, read once. It runs a CPU with AVX-512 the way a CPU without it runs
/// (its kernels, and the products' routing, see [`crate::cpu::matmul`]), so a Zen 4 can stand
/// in for a Zen 3 in benchmarks; unlike the tests' cap it is fixed for the whole run.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[inline(always)]
pub(crate) fn process_allows(level: Level) -> bool {
    static CAP: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    let cap = *CAP.get_or_init(|| match std::env::var("WGPIPE_CPU_SIMD").as_deref() {
        Ok("avx2") => Level::Avx2 as u8,
        Ok("baseline") => Level::Baseline as u8,
        Err(_) => Level::Avx512 as u8,
        Ok(other) => {
            eprintln!("WGPIPE_CPU_SIMD={other:?} ignored: `avx2` or `baseline` caps the kernels");
            Level::Avx512 as u8
        }
    });
    cap >= level as u8
}

/// True when the AVX2 + FMA variants may run (the check is cached by std).
#[inline(always)]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        allowed(Level::Avx2) && cpu_runs(Level::Avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when the AVX-512 variants may run (they also use AVX2 and FMA).
#[inline(always)]
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        allowed(Level::Avx512) && cpu_runs(Level::Avx512)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[c] = [rows[0][c], .., rows[7][c]]`: an 8 x 8 block transposed in registers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn transpose_8x8(
    r: [std::arch::x86_64::__m256; 8],
) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// `fn name<G: Bound, ..>(args) -> ret { body }`, built three times (baseline, AVX2 + FMA,
/// AVX-512) and dispatched at run time. Arguments must be plain identifiers with types; generic
/// parameters take one bound each.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident: $gb:path),+>)?
        ($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        #[inline]
        $vis fn $name $(<$($g: $gb),+>)? ($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn imp $(<$($g: $gb),+>)? ($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512 $(<$($g: $gb),+>)? ($($a: $t),*) $(-> $r)? {
                imp $(::<$($g),+>)? ($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2 $(<$($g: $gb),+>)? ($($a: $t),*) $(-> $r)? {
                imp $(::<$($g),+>)? ($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::cpu::simd::has_avx512() {
                // SAFETY: the features `avx512` is compiled with were just detected.
                return unsafe { avx512 $(::<$($g),+>)? ($($a),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::cpu::simd::has_avx2() {
                // SAFETY: the features `avx2` is compiled with were just detected.
                return unsafe { avx2 $(::<$($g),+>)? ($($a),*) };
            }
            imp $(::<$($g),+>)? ($($a),*)
        }
    };
}
pub(crate) use multiversion;

multiversion! {
/// `o[j] = f(j)`: the loops over strided views, whose `f` gathers its operands, compiled like
/// [`map`] (an op's `mul_add`s are FMA instructions here; outside AVX2 + FMA code they are libm
/// calls).
pub(crate) fn fill_with<F: Fn(usize) -> f32>(o: &mut [f32], f: &F) {
    for (j, o) in o.iter_mut().enumerate() {
        *o = f(j);
    }
}
}

multiversion! {
/// `o[i] = f(x[i])` over two slices of one length.
pub(crate) fn map<F: Fn(f32) -> f32>(o: &mut [f32], x: &[f32], f: &F) {
    for (o, &v) in o.iter_mut().zip(x) {
        *o = f(v);
    }
}
}

multiversion! {
/// `o[i] = f(a[i], b[i])` over three slices of one length.
pub(crate) fn zip<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], b: &[f32], f: &F) {
    for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}
}

multiversion! {
/// `o[i] = f(o[i], b[i])`: [`zip`] with its first operand and its output in one slice.
pub(crate) fn zip_assign<F: Fn(f32, f32) -> f32>(o: &mut [f32], b: &[f32], f: &F) {
    for (o, &y) in o.iter_mut().zip(b) {
        *o = f(*o, y);
    }
}
}

multiversion! {
/// `o[i] = f(a[i], y)`.
pub(crate) fn zip_scalar<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], y: f32, f: &F) {
    for (o, &x) in o.iter_mut().zip(a) {
        *o = f(x, y);
    }
}
}

multiversion! {
/// `o[i] = T(x[i])`, the op inlined into the loop (as [`unary_grad`]), its near form run where
/// it can be (see [`by_runs`]).
pub(crate) fn unary<T: UnaryOpT>(o: &mut [f32], x: &[f32], s: [f32; 2]) {
    by_runs::<T>(o, x, None, None, s)
}
}

multiversion! {
/// `o[i] = g[i] * T'(x[i])`: the backward of unary op `T` with its derivative inlined into the
/// loop. Through [`zip`] the derivative sits in a closure, which LLVM leaves out of line when it
/// is big (the exact GELU's: a quarter of a decoder-block step, one scalar call per element).
pub(crate) fn unary_grad<T: UnaryOpT>(o: &mut [f32], x: &[f32], g: &[f32], s: [f32; 2]) {
    by_runs::<T>(o, x, None, Some(g), s)
}
}

/// Values in a run that [`by_runs`] tests for an op's near form: two AVX2 registers, one
/// AVX-512 one. (Longer runs fall outside more often: with the values of a standard normal,
/// a run of 16 lies inside the GELUs' `|x| <= 2` 47% of the time, one of 64 5%.)
const RUN: usize = 16;

/// `o[i] = T(x[i] + b[i])`, or with `g`, `g[i] * T'(x[i] + b[i])` (no `b`: `x[i]` alone). For
/// an op with a near form ([`UnaryOpT::NEAR`]), run by run of [`RUN`] values: a run whose
/// inputs all lie inside its bound runs the near form, which gives the same bits there, so
/// the result does not depend on where runs start or on the build. Inlined into each loop
/// above, where the `Option`s are constants.
#[inline(always)]
pub(crate) fn by_runs<T: UnaryOpT>(
    o: &mut [f32],
    x: &[f32],
    b: Option<&[f32]>,
    g: Option<&[f32]>,
    s: [f32; 2],
) {
    if T::NEAR < 0.0 {
        return apply::<T, false>(o, x, b, g, s);
    }
    for (r, o) in o.chunks_mut(RUN).enumerate() {
        let run = r * RUN..r * RUN + o.len();
        let (x, b, g) = (
            &x[run.clone()],
            b.map(|b| &b[run.clone()]),
            g.map(|g| &g[run]),
        );
        // The op's inputs `x + b` are formed here for the test and again in `apply` (an add
        // a value), not kept in a buffer between the two.
        let inside = |all: bool, v: f32| all & (v.abs() <= T::NEAR);
        let near = match b {
            Some(b) => x.iter().zip(b).fold(true, |all, (x, b)| inside(all, x + b)),
            None => x.iter().fold(true, |all, &x| inside(all, x)),
        };
        if near {
            apply::<T, true>(o, x, b, g, s)
        } else {
            apply::<T, false>(o, x, b, g, s)
        }
    }
}

/// [`by_runs`]' loops, with the near forms or the full ones.
#[inline(always)]
fn apply<T: UnaryOpT, const NEAR: bool>(
    o: &mut [f32],
    x: &[f32],
    b: Option<&[f32]>,
    g: Option<&[f32]>,
    s: [f32; 2],
) {
    let f = |v: f32| if NEAR { T::f_near(v, s) } else { T::f(v, s) };
    let df = |v: f32| if NEAR { T::df_near(v, s) } else { T::df(v, s) };
    match (b, g) {
        (None, None) => o.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x)),
        (Some(b), None) => {
            for ((o, &x), &b) in o.iter_mut().zip(x).zip(b) {
                *o = f(x + b);
            }
        }
        (None, Some(g)) => {
            for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
                *o = g * df(x);
            }
        }
        (Some(b), Some(g)) => {
            for (((o, &x), &b), &g) in o.iter_mut().zip(x).zip(b).zip(g) {
                *o = g * df(x + b);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Set in the child process of the test below.
    const CHILD: &str = "WGPIPE_TEST_SIMD_CHILD";

    /// `WGPIPE_CPU_SIMD` caps the kernels for the whole process (read once, so checked in a
    /// child process of this test binary): `avx2` turns the AVX-512 builds off, and with them
    /// the products' AVX-512 routing, `baseline` the AVX2 ones too.
    #[test]
    fn the_environment_caps_the_kernels_for_the_whole_process() {
        let detected = |f| std::arch::is_x86_feature_detected!("avx2") && f;
        if let Ok(cap) = std::env::var(CHILD) {
            assert_eq!(
                std::env::var("WGPIPE_CPU_SIMD").as_deref(),
                Ok(cap.as_str())
            );
            assert!(!has_avx512() && !process_allows(Level::Avx512));
            let avx2 = detected(std::arch::is_x86_feature_detected!("fma"));
            assert_eq!(has_avx2(), cap == "avx2" && avx2, "{cap}");
            // Without AVX-512 the blocked product runs every product it can.
            let blocked = crate::cpu::matmul::blocked_chosen(false);
            assert_eq!(blocked, cap == "avx2" && avx2, "{cap}");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let name = "cpu::simd::tests::the_environment_caps_the_kernels_for_the_whole_process";
        for cap in ["avx2", "baseline"] {
            let out = std::process::Command::new(&exe)
                .args(["--exact", name, "--test-threads", "1"])
                .env("WGPIPE_CPU_SIMD", cap)
                .env(CHILD, cap)
                .env_remove("WGPIPE_CPU_MATMUL")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "WGPIPE_CPU_SIMD={cap}: {}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
