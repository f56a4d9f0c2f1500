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

/// The tensors of a reference safetensors file (f64 or f32) as f32 values with their shapes,
/// by name.
pub type Reference = std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>;

pub fn read_reference(path: &std::path::Path) -> Reference {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = match view.dtype() {
                safetensors::Dtype::F64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                safetensors::Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                d => panic!("{name}: dtype {d:?}"),
            };
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// The folder or file `name` under `tests/fixtures`.
pub fn fixture_path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Largest |got - want| over the largest |want|: a norm-wise relative error.
pub fn norm_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f32::max);
    diff / want
        .iter()
        .map(|w| w.abs())
        .fold(f32::MIN_POSITIVE, f32::max)
}

/// [`norm_err`] at most `tol`; the error is printed (`--nocapture` shows every figure).
#[track_caller]
pub fn assert_near(got: &[f32], want: &[f32], tol: f32, what: &str) {
    let e = norm_err(got, want);
    eprintln!("{what}: {e:.2e}");
    assert!(e <= tol, "{what}: error {e:.2e} past {tol:.0e}");
}

/// A Python that imports `modules` (`WGPIPE_PYTHON`, else `python3`), or `None` after saying
/// on stderr that the test is skipped and why.
pub fn python_with(modules: &str) -> Option<String> {
    let python = std::env::var("WGPIPE_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output();
    if probe.is_ok_and(|o| o.status.success()) {
        Some(python)
    } else {
        eprintln!("SKIPPED: {python} cannot import {modules} (set WGPIPE_PYTHON)");
        None
    }
}

/// The numbers a Python `script` prints as one JSON list, failing with its stderr if it fails.
pub fn python_floats(python: &str, script: &str) -> Vec<f32> {
    let run = std::process::Command::new(python)
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    String::from_utf8_lossy(&run.stdout)
        .trim()
        .trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(|v| v.trim().parse().unwrap())
        .collect()
}
