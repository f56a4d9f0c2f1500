//! The GELUs and their derivatives in plain Rust, the references of the op tests: the tanh form
//! from its formula, the exact one from the Maclaurin series of erf in f64 (independent of the
//! library's `erfc` fit and of its polynomials near zero). The integration tests reach it through
//! `common`, the wgpu kernels' unit tests (`src/wgpu/tests.rs`) by its path.
#![allow(dead_code)]

pub fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub fn gelu_tanh_grad(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

/// `x Phi(x)` in f64 from the Maclaurin series of erf (|z| <= 5; beyond, erf is +-1 in f32):
/// a reference independent of the library's erfc fit.
pub fn gelu_exact_ref(x: f32) -> f32 {
    let z = x as f64 / std::f64::consts::SQRT_2;
    let erf = if z.abs() > 5.0 {
        z.signum()
    } else {
        let (mut term, mut sum) = (z, z);
        for n in 1..200 {
            term *= -z * z / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    };
    (x as f64 * 0.5 * (1.0 + erf)) as f32
}

/// d/dx of [`gelu_exact_ref`]: `Phi(x) + x phi(x)`.
pub fn gelu_exact_grad_ref(x: f32) -> f32 {
    let xf = x as f64;
    let phi = (-0.5 * xf * xf).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let cdf = if x == 0.0 {
        0.5
    } else {
        gelu_exact_ref(x) as f64 / xf
    };
    (cdf + xf * phi) as f32
}
