//! Branch-free scalar math that LLVM vectorises (std's `expf` is a libm call per element):
//! `exp` (Cephes-style, within 2 ulp of the true value), and sigmoid, `erfc` and the two GELUs
//! (exact, through `erfc` or near zero through two polynomials, and the tanh approximation)
//! built on it.
//!
//! Polynomials and reductions are written with `mul_add`: Rust never contracts `a * b + c`, and a
//! fused multiply-add halves their instructions and the latency of their chains (the exact GELU
//! 2.0 -> 1.5 ns per value forward on AVX2). Every CPU loop that calls these is built for
//! AVX2 + FMA and AVX-512 (`cpu::simd`); in the baseline build, or on a target without FMA,
//! `mul_add` is a libm call: the same correctly rounded result, only slower.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 * 2^23`: adding it rounds to an integer held in the low mantissa bits.
const MAGIC: f32 = 12_582_912.0;
/// Past these, `exp` is `inf` / 0 (below: would be subnormal; flushed to 0).
const HI: f32 = 88.722_83;
const LO: f32 = -87.336_55;

/// `e^x`: 2^n * e^r with n = round(x / ln 2), r in [-ln2/2, ln2/2], e^r by a degree-6
/// polynomial. Exact at the edges that matter: `exp(-inf) = 0`, `exp(inf) = inf`, NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(LO, HI); // NaN stays NaN
    let t = xc.mul_add(LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    // e^r - 1 - r = r^2 (0.5 + c3 r + ... + c7 r^5), the polynomial in Estrin's form (three
    // levels of products instead of a chain of five: vectorised loops are latency bound).
    let r2 = r * r;
    let p01 = r.mul_add(1.666_666_5e-1, 0.5);
    let p23 = r.mul_add(8.333_452e-3, 4.166_579_6e-2);
    let p45 = r.mul_add(1.987_569_1e-4, 1.398_2e-3);
    let p = p45.mul_add(r2 * r2, p23.mul_add(r2, p01));
    let er = p.mul_add(r2, r) + 1.0;
    // 2^n from the integer in t's mantissa, as 2^h * 2^(n - h) with h = n / 2, so that both
    // factors are normal floats for every n in -126..=128.
    let n_i = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
    let h = n_i >> 1;
    let s1 = f32::from_bits(((h + 127) as u32) << 23);
    let s2 = f32::from_bits(((n_i - h + 127) as u32) << 23);
    let scaled = er * s1 * s2;
    if x > HI {
        f32::INFINITY
    } else if x < LO {
        0.0
    } else {
        scaled
    }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `sqrt(2 / pi)`, the GELU tanh-form constant.
const GELU_C: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// Tanh-form GELU, `0.5 x (1 + tanh(u))` with `u = c (x + a x^3)`, computed as
/// `x * sigmoid(2u)` (the same value; accurate on both tails); [`gelu_tanh_near`] where
/// `|x| <= GELU_NEAR`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        gelu_tanh_near(x)
    } else {
        x * sigmoid(2.0 * GELU_C * (x + GELU_A * x * x * x))
    }
}

/// d/dx of [`gelu_tanh`]: `0.5 (1 + t) + 0.5 x (1 - t^2) u'`, with `0.5 (1 + t) = s = sigmoid(2u)`
/// and `1 - t^2 = 4 s (1 - s)`; [`gelu_tanh_grad_near`] where `|x| <= GELU_NEAR`.
#[inline(always)]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        return gelu_tanh_grad_near(x);
    }
    let s = sigmoid(2.0 * GELU_C * (x + GELU_A * x * x * x));
    s + 2.0 * x * s * (1.0 - s) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
}

/// [`gelu_tanh`] on `|x| <= GELU_NEAR`, as [`gelu_near`]: `x (0.5 + x S(x^2))`, `S` of degree 8
/// in `w = x^2 / 2 - 1` (relative error ~1e-7 in f32; fitted by `scripts/fit_gelu_near.py`).
#[inline(always)]
pub fn gelu_tanh_near(x: f32) -> f32 {
    let s = horner(
        near_w(x),
        [
            0.297_823_94,
            -7.544_265e-2,
            2.006_795_3e-2,
            -4.556_212e-3,
            8.852_306_6e-4,
            -1.467_912_1e-4,
            1.918_042e-5,
            -7.804_731e-7,
            -4.447_502_7e-7,
        ],
    );
    x * x.mul_add(s, 0.5)
}

/// [`gelu_tanh_grad`] on `|x| <= GELU_NEAR`, as [`gelu_grad_near`]: `0.5 + x G(x^2)`, `G` of
/// degree 9 in `w = x^2 / 2 - 1` (relative error ~1.4e-7 in f32; fitted by
/// `scripts/fit_gelu_near.py`).
#[inline(always)]
pub fn gelu_tanh_grad_near(x: f32) -> f32 {
    let g = horner(
        near_w(x),
        [
            0.444_762_6,
            -0.221_498_74,
            9.306_997e-2,
            -2.936_844_2e-2,
            7.387_154_3e-3,
            -1.528_281e-3,
            2.525_417e-4,
            -2.490_971_6e-5,
            -5.155_937_3e-6,
            2.914_203_6e-6,
        ],
    );
    x.mul_add(g, 0.5)
}

/// d/dx of [`gelu_tanh_grad`]: with `q = s (1 - s)`, `u' = c (1 + 3 a x^2)`:
/// `q (4 u' + 4 x u'^2 (1 - 2 s) + 12 c a x^2)`.
#[inline(always)]
pub fn gelu_tanh_grad2(x: f32) -> f32 {
    let s = sigmoid(2.0 * GELU_C * (x + GELU_A * x * x * x));
    let q = s * (1.0 - s);
    let u1 = GELU_C * (1.0 + 3.0 * GELU_A * x * x);
    q * (4.0 * u1 + 4.0 * x * u1 * u1 * (1.0 - 2.0 * s) + 12.0 * GELU_C * GELU_A * x * x)
}

/// `erfc(z)` for `z >= 0` with relative error below 1.2e-7 (Numerical Recipes' `erfcc`, a
/// Chebyshev fit of `erfc(z) e^{z^2}`): accurate on the tail, where `1 - erf` would cancel.
/// The WGSL `erfc_pos` in `elementwise.wgsl` is the same polynomial, evaluated by Horner (a GPU
/// hides the chain's latency behind other invocations).
#[inline(always)]
pub fn erfc_pos(z: f32) -> f32 {
    let t = 1.0 / z.mul_add(0.5, 1.0);
    // The degree-9 polynomial in Estrin's form: four levels of products instead of Horner's
    // chain of nine, so vectorised loops are not bound by the chain's latency.
    let t2 = t * t;
    let t4 = t2 * t2;
    let a0 = t.mul_add(1.000_023_7, -1.265_512_2);
    let a1 = t.mul_add(0.096_784_18, 0.374_091_96);
    let a2 = t.mul_add(0.278_868_07, -0.186_288_06);
    let a3 = t.mul_add(1.488_515_9, -1.135_204);
    let a4 = t.mul_add(0.170_872_77, -0.822_152_23);
    let p = a4.mul_add(t4 * t4, a3.mul_add(t2, a2).mul_add(t4, a1.mul_add(t2, a0)));
    t * exp((-z).mul_add(z, p))
}

/// `1 / sqrt(2)`.
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

/// The standard normal CDF `Phi(x) = erfc(-x / sqrt 2) / 2`, from the tail that does not
/// cancel on either side.
#[inline(always)]
pub fn normal_cdf(x: f32) -> f32 {
    let half = 0.5 * erfc_pos(x.abs() * FRAC_1_SQRT_2);
    if x < 0.0 {
        half
    } else {
        1.0 - half
    }
}

/// The standard normal density `phi(x)`.
#[inline(always)]
pub fn normal_pdf(x: f32) -> f32 {
    FRAC_1_SQRT_2PI * exp(-0.5 * x * x)
}

/// Exact GELU, `x Phi(x)` (PyTorch's `gelu`, `approximate='none'`): [`gelu_near`] where
/// `|x| <= GELU_NEAR`, else through [`normal_cdf`].
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        gelu_near(x)
    } else {
        gelu_far(x)
    }
}

/// d/dx of [`gelu`]: `Phi(x) + x phi(x)`; [`gelu_grad_near`] where `|x| <= GELU_NEAR`.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        gelu_grad_near(x)
    } else {
        gelu_grad_far(x)
    }
}

/// [`gelu`] for any `x`, through [`normal_cdf`] (what it runs past `GELU_NEAR`).
#[inline(always)]
fn gelu_far(x: f32) -> f32 {
    x * normal_cdf(x)
}

/// [`gelu_grad`] for any `x`, through [`normal_cdf`] and [`normal_pdf`].
#[inline(always)]
fn gelu_grad_far(x: f32) -> f32 {
    x.mul_add(normal_pdf(x), normal_cdf(x))
}

/// Where the two GELUs and their derivatives are polynomials ([`gelu_near`], [`gelu_grad_near`],
/// [`gelu_tanh_near`], [`gelu_tanh_grad_near`]): `|x| <= 2`, 95% of a standard normal's values,
/// and nearly all of a freshly initialised layer's (~0.6 of one's spread). Loops that find a
/// whole run of values inside it skip the far forms' `exp` and division (`UnaryOpT::NEAR`): on
/// AVX2 the exact GELU's far form is ~55 operations, the near one ~12. The bound is where the
/// lower tail's cancellation (`Phi` as `0.5 + x S`) stays within 3e-6 of `x Phi(x)` relatively;
/// past it, [`erfc_pos`] and the sigmoid have none.
pub const GELU_NEAR: f32 = 2.0;

/// `c[0] + w (c[1] + w (c[2] + ..))`, one multiply-add a term (Horner's rule).
#[inline(always)]
fn horner<const N: usize>(w: f32, c: [f32; N]) -> f32 {
    c[..N - 1]
        .iter()
        .rev()
        .fold(c[N - 1], |sum, &ci| w.mul_add(sum, ci))
}

/// `w = x^2 / 2 - 1`: the polynomials' variable, `[-1, 1]` for `|x| <= GELU_NEAR` (in it their
/// terms stay small and the sums well conditioned; in `x^2` the derivative's cancelled 13-fold).
#[inline(always)]
fn near_w(x: f32) -> f32 {
    (x * x).mul_add(2.0 / (GELU_NEAR * GELU_NEAR), -1.0)
}

/// [`gelu`] on `|x| <= GELU_NEAR`: `x Phi(x)` with `Phi(x) = 0.5 + x S(x^2)`, `S` of degree 7
/// in `w = x^2 / 2 - 1` (relative error ~1e-7 in f32; fitted by `scripts/fit_gelu_near.py`).
#[inline(always)]
pub fn gelu_near(x: f32) -> f32 {
    let s = horner(
        near_w(x),
        [
            0.297_939_72,
            -7.558_853e-2,
            2.000_079_1e-2,
            -4.437_038_7e-3,
            8.245_678_6e-4,
            -1.308_833_3e-4,
            1.852_587_6e-5,
            -2.218_527_7e-6,
        ],
    );
    x * x.mul_add(s, 0.5)
}

/// [`gelu_grad`] on `|x| <= GELU_NEAR`: `Phi(x) + x phi(x) = 0.5 + x G(x^2)`, `G` of degree 8 in
/// `w = x^2 / 2 - 1` (relative error ~1e-7 in f32; fitted by `scripts/fit_gelu_near.py`).
#[inline(always)]
pub fn gelu_grad_near(x: f32) -> f32 {
    let g = horner(
        near_w(x),
        [
            0.444_702_4,
            -0.222_351_18,
            9.338_208e-2,
            -2.889_768_8e-2,
            6.939_879e-3,
            -1.353_187_4e-3,
            2.220_030_9e-4,
            -3.227_393_6e-5,
            3.877_65e-6,
        ],
    );
    x.mul_add(g, 0.5)
}

/// d/dx of [`gelu_grad`]: `phi(x) (2 - x^2)`.
#[inline(always)]
pub fn gelu_grad2(x: f32) -> f32 {
    normal_pdf(x) * (2.0 - x * x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_and_exact_at_the_edges() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.5 {
            let want = (x as f64).exp() as f32;
            worst = worst.max(ulps(exp(x), want));
            x += 0.001_3;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!((exp(HI) / (HI as f64).exp() as f32 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn gelu_tanh_matches_the_tanh_form() {
        for i in -400..400 {
            let x = i as f32 * 0.025;
            let u = 0.797_884_560_802_865_4 * (x as f64 + 0.044715 * (x as f64).powi(3));
            let want = 0.5 * x as f64 * (1.0 + u.tanh());
            assert!(
                (gelu_tanh(x) as f64 - want).abs() < 1e-6 * (1.0 + want.abs()),
                "{x}"
            );
            let h = 1e-3;
            let num = (gelu_tanh(x + h) as f64 - gelu_tanh(x - h) as f64) / (2.0 * h as f64);
            assert!((gelu_tanh_grad(x) as f64 - num).abs() < 2e-3, "{x}");
            let sg = 1.0 / (1.0 + (-(x as f64)).exp());
            assert!((sigmoid(x) as f64 - sg).abs() < 1e-6, "{x}");
        }
    }

    /// `Phi(x)` in f64 by Simpson's rule over the density from -12 (the lower tail directly, the
    /// upper one by symmetry): a reference independent of any erf formula.
    fn phi_reference(x: f64) -> f64 {
        let lower = |x: f64| {
            let (a, n) = (-12.0, 4000);
            let h = (x - a) / n as f64;
            let f = |t: f64| (-0.5 * t * t).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let mut s = f(a) + f(x);
            for i in 1..n {
                s += f(a + i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
            }
            s * h / 3.0
        };
        if x <= 0.0 {
            lower(x)
        } else {
            1.0 - lower(-x)
        }
    }

    #[test]
    fn exact_gelu_and_its_derivatives_match_an_integrated_normal_cdf() {
        for i in -320..=320 {
            let x = i as f32 * 0.025;
            let xf = x as f64;
            let cdf = phi_reference(xf);
            let pdf = (-0.5 * xf * xf).exp() / (2.0 * std::f64::consts::PI).sqrt();
            // Relative on the lower tail too (where x Phi(x) is tiny): erfc_pos has no
            // cancellation there.
            let (want, got) = (xf * cdf, gelu(x) as f64);
            assert!(
                (got - want).abs() <= 4e-6 * want.abs().max(1e-3),
                "gelu({x}): {got} vs {want}"
            );
            let d = cdf + xf * pdf;
            assert!((gelu_grad(x) as f64 - d).abs() < 1e-6, "gelu_grad({x})");
            let d2 = pdf * (2.0 - xf * xf);
            assert!((gelu_grad2(x) as f64 - d2).abs() < 1e-6, "gelu_grad2({x})");
        }
        // PyTorch's values: gelu(-1) = -0.158655, gelu(2) = 1.954500 (2 is the near form's).
        assert!((gelu(-1.0) + 0.158_655_25).abs() < 1e-6);
        assert!((gelu(2.0) - 1.954_499_7).abs() < 1e-6);
        assert_eq!(gelu(0.0), 0.0);
    }

    /// Inside `GELU_NEAR` the polynomials stand for the far forms: checked on a fine grid (the
    /// references above are coarser) against the exact GELU's `erfc` forms (~1e-7 relative) and
    /// the tanh form in f64, and across the bound.
    #[test]
    fn the_near_forms_agree_with_the_far_ones_inside_their_bound() {
        type Forms = [fn(f32) -> f32; 4];
        let exact: Forms = [gelu, gelu_near, gelu_grad, gelu_grad_near];
        let tanh: Forms = [
            gelu_tanh,
            gelu_tanh_near,
            gelu_tanh_grad,
            gelu_tanh_grad_near,
        ];
        let exact_far = |x: f32| (gelu_far(x) as f64, gelu_grad_far(x) as f64);
        let tanh_f64 = |x: f32| {
            let (x, c, a) = (x as f64, (2.0 / std::f64::consts::PI).sqrt(), 0.044_715);
            let t = (c * (x + a * x * x * x)).tanh();
            let df = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x);
            (0.5 * x * (1.0 + t), df)
        };
        type Reference<'a> = &'a dyn Fn(f32) -> (f64, f64);
        for (name, [f, near, df, df_near], reference) in [
            ("exact", exact, &exact_far as Reference),
            ("tanh", tanh, &tanh_f64 as Reference),
        ] {
            let (mut worst, mut worst_grad) = (0.0f64, 0.0f64);
            for i in -20_000..=20_000 {
                let x = i as f32 * (GELU_NEAR / 20_000.0);
                assert_eq!(f(x).to_bits(), near(x).to_bits(), "{name} at {x}");
                assert_eq!(df(x).to_bits(), df_near(x).to_bits(), "{name}' at {x}");
                let (want, want_grad) = reference(x);
                let rel = (near(x) as f64 - want).abs() / want.abs().max(1e-30);
                worst = worst.max(if x == 0.0 { 0.0 } else { rel });
                worst_grad = worst_grad.max((df_near(x) as f64 - want_grad).abs());
            }
            // The lower tail's cancellation is largest at -2 (`Phi(-2)` = 0.023 from 0.5 - 0.477).
            assert!(worst < 3e-6, "{name}: worst relative error {worst:e}");
            assert!(worst_grad < 3e-7, "{name}': worst error {worst_grad:e}");
            // Across the bound the two forms meet: no step a gradient check would see.
            let (inside, outside) = (GELU_NEAR, GELU_NEAR.next_up());
            assert!(inside.abs() <= GELU_NEAR && outside.abs() > GELU_NEAR);
            for (x, y) in [(inside, outside), (-inside, -outside)] {
                assert!((f(x) - f(y)).abs() < 4e-7, "{name} at {x}");
                assert!((df(x) - df(y)).abs() < 4e-7, "{name}' at {x}");
            }
        }
    }
}
