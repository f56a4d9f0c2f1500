//! Shared test helpers: tensors from values, closeness, and this suite's settings of the
//! central-difference gradient check (`wgpipe_autograd::gradcheck`).
#![allow(dead_code)]

use wgpipe_autograd::gradcheck::{uniform_weights, unit_weights, GradCheck, Weights};
use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_models::{Conv2d, TransformerLm};
use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{Device, Result, Tensor};

pub fn cpu() -> Device {
    Device::cpu()
}

pub fn t(data: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(data, shape, &cpu()).unwrap()
}

pub fn rand(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_uniform(shape, -1.0, 1.0, seed, &cpu()).unwrap()
}

pub fn vals(x: &Tensor) -> Vec<f32> {
    x.to_vec().unwrap()
}

#[track_caller]
pub fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "lengths differ: {got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w} (tol {tol})\n got  {got:?}\n want {want:?}"
        );
    }
}

/// The models suite's checks: at most `sample` elements of each tensor, tolerance 2e-2 (absolute
/// and relative), step `eps`.
fn checker(eps: f32, sample: usize, weights: Weights) -> GradCheck {
    GradCheck {
        eps,
        rtol: 2e-2,
        atol: 2e-2,
        sample: Some(sample),
        weights,
    }
}

/// Checks the gradients of `module` (its parameters and, if `wrt_input`, its input) against
/// central differences of `sum(module(x) * r)`, on up to 24 elements of each tensor.
#[track_caller]
pub fn grad_check_module(module: &dyn Module, x: &Tensor, ctx: &ForwardCtx, wrt_input: bool) {
    grad_check_module_eps(module, x, ctx, wrt_input, 1e-2);
}

/// As [`grad_check_module`] with step `eps` (smaller for networks with ReLU kinks).
#[track_caller]
pub fn grad_check_module_eps(
    module: &dyn Module,
    x: &Tensor,
    ctx: &ForwardCtx,
    wrt_input: bool,
    eps: f32,
) {
    checker(eps, 24, uniform_weights).check_module(module, x, ctx, wrt_input);
}

/// Checks the gradient of a scalar function of one input against central differences, on up
/// to 32 elements.
#[track_caller]
pub fn grad_check_fn(f: impl Fn(&Var) -> Result<Var>, x: &Tensor) {
    checker(1e-2, 32, unit_weights).check("loss", std::slice::from_ref(x), |v| f(&v[0]));
}

/// A two-block LM small enough for debug-build tests: vocab 11, d 16, 2 heads, sequences of 8,
/// dropout 0.1, tied embeddings.
pub fn tiny_lm() -> TransformerLm {
    TransformerLm {
        vocab: 11,
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 8,
        dropout: 0.1,
        tie_embeddings: true,
    }
}

/// A `4 -> 6` convolution with every option: kernel `kernel`, stride (2, 1), padding 1, two
/// groups, a bias.
pub fn grouped_strided_conv(kernel: (usize, usize), seed: u64) -> Conv2d {
    let p = Conv2dParams {
        stride: (2, 1),
        padding: (1, 1),
        dilation: (1, 1),
        groups: 2,
    };
    Conv2d::with_params(4, 6, kernel, p, true, seed, &cpu()).unwrap()
}
