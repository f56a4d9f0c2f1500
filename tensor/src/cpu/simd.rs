//! Hot loops compiled for the CPU's vector extensions. The crate is built for baseline x86-64
//! (SSE2, 4 lanes); the functions here also exist in an AVX2 + FMA build (8 lanes), picked at run
//! time. The loop body must be inlined into the `#[target_feature]` function to be compiled for
//! it, so bodies are `#[inline(always)]` functions called directly (a closure passed through
//! would be compiled once, for the baseline).

use wgpipe_shaders::ops::UnaryOpT;

/// True when the AVX2 + FMA variants may run (the check is cached by std).
#[inline(always)]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `fn name(args) -> ret { body }`, built twice (baseline and AVX2 + FMA) and dispatched at run
/// time. Arguments must be plain identifiers with types.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[inline(always)]
            fn imp($($a: $t),*) $(-> $r)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($a: $t),*) $(-> $r)? {
                imp($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::cpu::simd::has_avx2() {
                // SAFETY: the features `avx2` is compiled with were just detected.
                return unsafe { avx2($($a),*) };
            }
            imp($($a),*)
        }
    };
}
pub(crate) use multiversion;

#[inline(always)]
fn map_imp<F: Fn(f32) -> f32>(o: &mut [f32], x: &[f32], f: &F) {
    for (o, &v) in o.iter_mut().zip(x) {
        *o = f(v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn map_avx2<F: Fn(f32) -> f32>(o: &mut [f32], x: &[f32], f: &F) {
    map_imp(o, x, f)
}

/// `o[i] = f(x[i])` over two slices of one length.
#[inline]
pub(crate) fn map<F: Fn(f32) -> f32>(o: &mut [f32], x: &[f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { map_avx2(o, x, f) };
    }
    map_imp(o, x, f)
}

#[inline(always)]
fn fill_with_imp<F: Fn(usize) -> f32>(o: &mut [f32], f: &F) {
    for (j, o) in o.iter_mut().enumerate() {
        *o = f(j);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_with_avx2<F: Fn(usize) -> f32>(o: &mut [f32], f: &F) {
    fill_with_imp(o, f)
}

/// `o[j] = f(j)`: the loops over strided views, whose `f` gathers its operands, compiled like
/// [`map`] (an op's `mul_add`s are FMA instructions here; outside AVX2 + FMA code they are libm
/// calls).
#[inline]
pub(crate) fn fill_with<F: Fn(usize) -> f32>(o: &mut [f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { fill_with_avx2(o, f) };
    }
    fill_with_imp(o, f)
}

#[inline(always)]
fn zip_imp<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], b: &[f32], f: &F) {
    for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
        *o = f(x, y);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn zip_avx2<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], b: &[f32], f: &F) {
    zip_imp(o, a, b, f)
}

/// `o[i] = f(a[i], b[i])` over three slices of one length.
#[inline]
pub(crate) fn zip<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], b: &[f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { zip_avx2(o, a, b, f) };
    }
    zip_imp(o, a, b, f)
}

#[inline(always)]
fn zip_assign_imp<F: Fn(f32, f32) -> f32>(o: &mut [f32], b: &[f32], f: &F) {
    for (o, &y) in o.iter_mut().zip(b) {
        *o = f(*o, y);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn zip_assign_avx2<F: Fn(f32, f32) -> f32>(o: &mut [f32], b: &[f32], f: &F) {
    zip_assign_imp(o, b, f)
}

/// `o[i] = f(o[i], b[i])`: [`zip`] with its first operand and its output in one slice.
#[inline]
pub(crate) fn zip_assign<F: Fn(f32, f32) -> f32>(o: &mut [f32], b: &[f32], f: &F) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { zip_assign_avx2(o, b, f) };
    }
    zip_assign_imp(o, b, f)
}

#[inline(always)]
fn zip_scalar_imp<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], y: f32, f: &F) {
    for (o, &x) in o.iter_mut().zip(a) {
        *o = f(x, y);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn zip_scalar_avx2<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], y: f32, f: &F) {
    zip_scalar_imp(o, a, y, f)
}

/// `o[i] = f(a[i], y)`.
#[inline]
pub(crate) fn zip_scalar<F: Fn(f32, f32) -> f32>(o: &mut [f32], a: &[f32], y: f32, f: &F) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { zip_scalar_avx2(o, a, y, f) };
    }
    zip_scalar_imp(o, a, y, f)
}

#[inline(always)]
fn unary_grad_imp<T: UnaryOpT>(o: &mut [f32], x: &[f32], g: &[f32], s: [f32; 2]) {
    for ((o, &v), &g) in o.iter_mut().zip(x).zip(g) {
        *o = g * T::df(v, s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn unary_grad_avx2<T: UnaryOpT>(o: &mut [f32], x: &[f32], g: &[f32], s: [f32; 2]) {
    unary_grad_imp::<T>(o, x, g, s)
}

/// `o[i] = g[i] * T'(x[i])`: the backward of unary op `T` with its derivative inlined into the
/// loop. Through [`zip`] the derivative sits in a closure, which LLVM leaves out of line when it
/// is big (the exact GELU's: a quarter of a decoder-block step, one scalar call per element).
#[inline]
pub(crate) fn unary_grad<T: UnaryOpT>(o: &mut [f32], x: &[f32], g: &[f32], s: [f32; 2]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { unary_grad_avx2::<T>(o, x, g, s) };
    }
    unary_grad_imp::<T>(o, x, g, s)
}

#[inline(always)]
fn bias_act_imp<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], s: [f32; 2]) {
    for ((o, &z), &b) in o.iter_mut().zip(z).zip(b) {
        *o = T::f(z + b, s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bias_act_avx2<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], s: [f32; 2]) {
    bias_act_imp::<T>(o, z, b, s)
}

/// `o[i] = T(z[i] + b[i])`, the op inlined into the loop (as [`unary_grad`]).
#[inline]
pub(crate) fn bias_act<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], s: [f32; 2]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { bias_act_avx2::<T>(o, z, b, s) };
    }
    bias_act_imp::<T>(o, z, b, s)
}

#[inline(always)]
fn bias_act_grad_imp<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], g: &[f32], s: [f32; 2]) {
    for (((o, &z), &b), &g) in o.iter_mut().zip(z).zip(b).zip(g) {
        *o = g * T::df(z + b, s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn bias_act_grad_avx2<T: UnaryOpT>(
    o: &mut [f32],
    z: &[f32],
    b: &[f32],
    g: &[f32],
    s: [f32; 2],
) {
    bias_act_grad_imp::<T>(o, z, b, g, s)
}

/// `o[i] = g[i] * T'(z[i] + b[i])`, the derivative inlined into the loop.
#[inline]
pub(crate) fn bias_act_grad<T: UnaryOpT>(
    o: &mut [f32],
    z: &[f32],
    b: &[f32],
    g: &[f32],
    s: [f32; 2],
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { bias_act_grad_avx2::<T>(o, z, b, g, s) };
    }
    bias_act_grad_imp::<T>(o, z, b, g, s)
}
