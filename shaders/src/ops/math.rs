//! Branch-free scalar math that LLVM vectorises (std's `expf` is a libm call per element): the
//! f32 `exp` (Cephes-style, within 2 ulp of the true value) and sigmoid, and the two GELUs
//! (exact, and the tanh approximation) with their derivatives, computed in f64 and rounded once
//! (see below why), near zero through polynomials.
//!
//! Polynomials and reductions are written with `mul_add`: Rust never contracts `a * b + c`, and a
//! fused multiply-add halves their instructions and the latency of their chains. Every CPU loop
//! that calls these is built for AVX2 + FMA and AVX-512 (`cpu::simd`); in the baseline build, or
//! on a target without FMA, `mul_add` is a libm call: the same correctly rounded result, only
//! slower.

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

// The GELUs. Every value is computed in f64 and rounded once to f32: its error is then f32's
// rounding alone, within about half an ulp and leaning neither way. An f32 approximation's own
// error (a polynomial fit, `1 - s` cancelling in a sigmoid's derivative) has a sign that holds
// over whole ranges of x; summed over the thousands of positions of a weight's or a norm's
// gradient it does not average out: an f32 tanh-form GELU whose values were each within 1.2e-6
// raised a 6-block model's layer-norm gradient error 10x past PyTorch's own f32 error (issue 62;
// `tests/tests/accuracy.rs` holds whole models against float64 now). The f64 polynomials are
// fitted by `scripts/fit_gelu.py` to ~1e-11 relative; LLVM vectorises the f64 loops like the
// f32 ones, at half the lanes.

/// `sqrt(2 / pi)`, the GELU tanh-form constant.
const GELU_C: f64 = 0.797_884_560_802_865_4;
const GELU_A: f64 = 0.044_715;

/// Where the two GELUs and their derivatives are polynomials ([`gelu_near`], [`gelu_grad_near`],
/// [`gelu_tanh_near`], [`gelu_tanh_grad_near`]): `|x| <= 2`, 95% of a standard normal's values,
/// and nearly all of a freshly initialised layer's (~0.6 of one's spread). Loops that find a
/// whole run of values inside it skip the far forms' `exp` and division (`UnaryOpT::NEAR`).
pub const GELU_NEAR: f32 = 2.0;

/// `e^x` in f64 for the GELUs: `2^n e^r`, `n = round(x / ln 2)`, `|r| <= ln 2 / 2`, `e^r` by its
/// Taylor polynomial of degree 11 (error below 1e-15 relative). `x` is clamped to
/// `[-708, 709]`: past them the GELUs' f32 values no longer change.
#[inline(always)]
fn exp64(x: f64) -> f64 {
    /// `1.5 * 2^52`: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let xc = x.clamp(-708.0, 709.0); // NaN stays NaN
    let t = xc.mul_add(std::f64::consts::LOG2_E, MAGIC);
    let n = t - MAGIC;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, xc));
    let er = horner64(
        r,
        [
            1.0,
            1.0,
            1.0 / 2.0,
            1.0 / 6.0,
            1.0 / 24.0,
            1.0 / 120.0,
            1.0 / 720.0,
            1.0 / 5_040.0,
            1.0 / 40_320.0,
            1.0 / 362_880.0,
            1.0 / 3_628_800.0,
            1.0 / 39_916_800.0,
        ],
    );
    // n is in -1022..=1023: 2^n is a normal f64.
    let n_i = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i64;
    er * f64::from_bits(((n_i + 1023) as u64) << 52)
}

/// `c[0] + v (c[1] + v (c[2] + ..))`, one multiply-add a term (Horner's rule).
#[inline(always)]
fn horner64<const N: usize>(v: f64, c: [f64; N]) -> f64 {
    c[..N - 1]
        .iter()
        .rev()
        .fold(c[N - 1], |sum, &ci| v.mul_add(sum, ci))
}

/// `w = x^2 / 2 - 1`: the near polynomials' variable, `[-1, 1]` for `|x| <= GELU_NEAR` (in it
/// their terms stay small and the sums well conditioned).
#[inline(always)]
fn near_w(x: f64) -> f64 {
    (x * x).mul_add(2.0 / (GELU_NEAR as f64 * GELU_NEAR as f64), -1.0)
}

/// Tanh-form GELU (PyTorch's `gelu(approximate='tanh')`), `0.5 x (1 + tanh(u))` with
/// `u = c (x + a x^3)`: [`gelu_tanh_near`] where `|x| <= GELU_NEAR`, else `x * sigmoid(2u)`.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        gelu_tanh_near(x)
    } else {
        let x = x as f64;
        (x / (1.0 + tanh_exp(x))) as f32
    }
}

/// `e^{-2u}`, `u = c (x + a x^3)`: `sigmoid(2u) = 1 / (1 + e^{-2u})`.
#[inline(always)]
fn tanh_exp(x: f64) -> f64 {
    exp64(-2.0 * GELU_C * (GELU_A * x * x).mul_add(x, x))
}

/// d/dx of [`gelu_tanh`]: `s + 2 x s (1 - s) u'` with `s = sigmoid(2u)`, `u' = c (1 + 3 a x^2)`,
/// and `s (1 - s) = e s^2` from `e = e^{-2u}` (no `1 - s` to cancel where `s` is near 1);
/// [`gelu_tanh_grad_near`] where `|x| <= GELU_NEAR`.
#[inline(always)]
pub fn gelu_tanh_grad(x: f32) -> f32 {
    if x.abs() <= GELU_NEAR {
        return gelu_tanh_grad_near(x);
    }
    let x = x as f64;
    let e = tanh_exp(x);
    let s = 1.0 / (1.0 + e);
    let du = GELU_C * (3.0 * GELU_A * x).mul_add(x, 1.0);
    ((2.0 * x * du * e * s).mul_add(s, s)) as f32
}

/// [`gelu_tanh`] on `|x| <= GELU_NEAR`: `x (0.5 + x S(x^2))`, `S` of degree 11 in
/// `w = x^2 / 2 - 1`.
#[inline(always)]
pub fn gelu_tanh_near(x: f32) -> f32 {
    let x = x as f64;
    let s = horner64(
        near_w(x),
        [
            0.297_823_934_046_387_2,
            -0.075_442_638_690_600_53,
            0.020_067_952_449_988_567,
            -0.004_556_306_494_622_165,
            0.000_885_245_332_924_064_7,
            -0.000_146_453_129_261_426_24,
            1.909_947_953_725_319_6e-5,
            -1.218_451_891_763_053_2e-6,
            -3.177_013_835_934_011_4e-7,
            1.740_951_148_283_110_5e-7,
            -6.164_422_017_540_165e-8,
            1.423_100_277_145_434e-8,
        ],
    );
    (x * x.mul_add(s, 0.5)) as f32
}

/// [`gelu_tanh_grad`] on `|x| <= GELU_NEAR`: `0.5 + x G(x^2)`, `G` of degree 12 in
/// `w = x^2 / 2 - 1`.
#[inline(always)]
pub fn gelu_tanh_grad_near(x: f32) -> f32 {
    let x = x as f64;
    let g = horner64(
        near_w(x),
        [
            0.444_762_590_705_343_5,
            -0.221_498_744_604_021_14,
            0.093_069_876_458_498_26,
            -0.029_368_497_473_590_76,
            0.007_387_910_248_820_394,
            -0.001_528_192_339_853_113_1,
            0.000_250_399_021_569_865_7,
            -2.470_895_705_799_283_8e-5,
            -2.737_479_148_672_145e-6,
            2.392_396_349_059_155_5e-6,
            -8.825_016_185_052_055e-7,
            2.847_289_715_449_088e-7,
            -6.189_419_859_017_484e-8,
        ],
    );
    x.mul_add(g, 0.5) as f32
}

/// d/dx of [`gelu_tanh_grad`] (the double backward only; f32): with `q = s (1 - s)`,
/// `u' = c (1 + 3 a x^2)`: `q (4 u' + 4 x u'^2 (1 - 2 s) + 12 c a x^2)`.
#[inline(always)]
pub fn gelu_tanh_grad2(x: f32) -> f32 {
    let (c, a) = (GELU_C as f32, GELU_A as f32);
    let s = sigmoid(2.0 * c * (x + a * x * x * x));
    let q = s * (1.0 - s);
    let u1 = c * (1.0 + 3.0 * a * x * x);
    q * (4.0 * u1 + 4.0 * x * u1 * u1 * (1.0 - 2.0 * s) + 12.0 * c * a * x * x)
}

/// `1 / sqrt(2 pi)`.
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// The standard normal CDF `Phi(x)` for `|x| > GELU_NEAR`, from its tail `erfc(z) / 2`,
/// `z = |x| / sqrt 2`, which does not cancel: Numerical Recipes' form refitted in f64,
/// `erfc(z) = t e^{-z^2 + Q(t)}`, `t = 1 / (1 + z / 2)`, `Q` of degree 12 (absolute error 1.2e-12
/// for `sqrt 2 <= z <= 27`; `z` is clamped to 27, where `erfc` is below f64's normal range).
#[inline(always)]
fn normal_cdf_far(x: f64) -> f64 {
    const T_LO: f64 = 0.068_965_517_241_379_31;
    const T_HI: f64 = 0.585_786_437_626_905;
    let z = (x.abs() * std::f64::consts::FRAC_1_SQRT_2).min(27.0);
    let t = 1.0 / z.mul_add(0.5, 1.0);
    let q = horner64(
        (t - T_LO) * (2.0 / (T_HI - T_LO)) - 1.0,
        [
            -0.896_629_122_419_053_7,
            0.323_198_050_539_581_4,
            0.022_922_335_252_979_927,
            -0.003_481_589_623_148_909,
            -0.001_365_510_154_928_189_3,
            2.990_769_749_362_555_7e-5,
            9.127_508_086_527_559e-5,
            4.548_169_639_678_426e-6,
            -7.040_065_030_553_138e-6,
            -6.103_610_913_635_775e-7,
            5.974_265_479_491_203e-7,
            4.462_240_646_894_134_6e-8,
            -4.254_856_859_334_276e-8,
        ],
    );
    let half_tail = 0.5 * t * exp64((-z).mul_add(z, q));
    if x < 0.0 {
        half_tail
    } else {
        1.0 - half_tail
    }
}

/// Exact GELU, `x Phi(x)` (PyTorch's `gelu`, `approximate='none'`): [`gelu_near`] where
/// `|x| <= GELU_NEAR`, else through the normal tail.
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

/// [`gelu`] past `GELU_NEAR` (or anywhere: the tests compare the two forms inside the bound).
#[inline(always)]
fn gelu_far(x: f32) -> f32 {
    let x = x as f64;
    (x * normal_cdf_far(x)) as f32
}

/// [`gelu_grad`] past `GELU_NEAR`.
#[inline(always)]
fn gelu_grad_far(x: f32) -> f32 {
    let x = x as f64;
    // x^2 / 2 is exact in f64 for an f32 x.
    let pdf = FRAC_1_SQRT_2PI * exp64(-0.5 * x * x);
    x.mul_add(pdf, normal_cdf_far(x)) as f32
}

/// [`gelu`] on `|x| <= GELU_NEAR`: `x Phi(x)` with `Phi(x) = 0.5 + x S(x^2)`, `S` of degree 10
/// in `w = x^2 / 2 - 1`.
#[inline(always)]
pub fn gelu_near(x: f32) -> f32 {
    let x = x as f64;
    let s = horner64(
        near_w(x),
        [
            0.297_939_722_603_048_4,
            -0.075_588_529_716_454_52,
            0.020_000_731_490_851_922,
            -0.004_437_054_275_773_028,
            0.000_824_867_052_704_114_1,
            -0.000_130_869_448_429_927_07,
            1.804_492_840_069_911_8e-5,
            -2.195_761_926_822_512e-6,
            2.390_133_529_084_501e-7,
            -2.398_499_498_029_916_3e-8,
            2.125_261_244_609_18e-9,
        ],
    );
    (x * x.mul_add(s, 0.5)) as f32
}

/// [`gelu_grad`] on `|x| <= GELU_NEAR`: `Phi(x) + x phi(x) = 0.5 + x G(x^2)`, `G` of degree 11
/// in `w = x^2 / 2 - 1`.
#[inline(always)]
pub fn gelu_grad_near(x: f32) -> f32 {
    let x = x as f64;
    let g = horner64(
        near_w(x),
        [
            0.444_702_385_776_618_14,
            -0.222_351_192_889_109_23,
            0.093_382_063_089_577_57,
            -0.028_897_498_160_511_896,
            0.006_939_977_883_302_949,
            -0.001_353_891_510_236_744,
            0.000_221_882_525_410_747_23,
            -3.131_565_827_837_04e-5,
            3.877_888_701_024_713e-6,
            -4.280_639_178_231_318e-7,
            4.350_718_475_367_019e-8,
            -3.849_737_502_745_337e-9,
        ],
    );
    x.mul_add(g, 0.5) as f32
}

/// d/dx of [`gelu_grad`] (the double backward only): `phi(x) (2 - x^2)`.
#[inline(always)]
pub fn gelu_grad2(x: f32) -> f32 {
    let x = x as f64;
    (FRAC_1_SQRT_2PI * exp64(-0.5 * x * x) * (2.0 - x * x)) as f32
}

#[cfg(test)]
mod tests;
