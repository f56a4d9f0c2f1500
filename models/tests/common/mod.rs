//! Shared test helpers: tensors from values, closeness, and a central-difference gradient check.
#![allow(dead_code)]

use wgpipe_autograd::{ForwardCtx, Module, Param, Tape, Var};
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

/// `sum(f(x) * r)` for a fixed random `r`: a scalar that depends on every output element.
fn project(y: &Var, seed: u64) -> Result<Var> {
    let r = Tensor::rand_uniform(y.shape(), -1.0, 1.0, seed, y.device())?;
    y.mul(&y.tape().constant(r))?.sum_all()
}

/// Up to `max` evenly spread element indices of a tensor with `n` elements.
fn sample(n: usize, max: usize) -> Vec<usize> {
    if n <= max {
        (0..n).collect()
    } else {
        (0..max)
            .map(|k| k * n / max + (k * 7) % (n / max).max(1))
            .collect()
    }
}

fn with_elem(x: &Tensor, i: usize, delta: f32) -> Tensor {
    let mut v = x.to_vec().unwrap();
    v[i] += delta;
    Tensor::from_vec(v, x.shape(), x.device()).unwrap()
}

fn check(what: &str, analytic: &[f32], idx: &[usize], numeric: &[f32], tol: f32) {
    for (k, &i) in idx.iter().enumerate() {
        let (a, n) = (analytic[i], numeric[k]);
        assert!(
            (a - n).abs() <= tol * (1.0 + n.abs().max(a.abs())),
            "{what}[{i}]: backward {a} vs central difference {n}"
        );
    }
}

/// Checks the gradients of `module` (its parameters and, if `wrt_input`, its input) against
/// central differences of `sum(module(x) * r)`, on up to 24 elements of each tensor.
pub fn grad_check_module(module: &dyn Module, x: &Tensor, ctx: &ForwardCtx, wrt_input: bool) {
    grad_check_module_eps(module, x, ctx, wrt_input, 1e-2);
}

/// As [`grad_check_module`] with step `eps` (smaller for networks with ReLU kinks).
pub fn grad_check_module_eps(
    module: &dyn Module,
    x: &Tensor,
    ctx: &ForwardCtx,
    wrt_input: bool,
    eps: f32,
) {
    let tol = 2e-2f32;
    let params: Vec<(String, Param)> = module.parameters();
    let f = |x: &Tensor| -> f32 {
        let tape = Tape::no_grad();
        let y = module.forward(&tape.constant(x.clone()), ctx).unwrap();
        project(&y, 99).unwrap().to_scalar().unwrap()
    };
    for (_, p) in &params {
        p.zero_grad();
    }
    let tape = Tape::new();
    let xv = if wrt_input {
        tape.leaf(x.clone())
    } else {
        tape.constant(x.clone())
    };
    let y = module.forward(&xv, ctx).unwrap();
    let loss = project(&y, 99).unwrap();
    let grads = tape.backward(&loss).unwrap();
    if wrt_input {
        let gx = vals(grads.get(&xv).expect("input gradient"));
        let idx = sample(x.numel(), 24);
        let num: Vec<f32> = idx
            .iter()
            .map(|&i| (f(&with_elem(x, i, eps)) - f(&with_elem(x, i, -eps))) / (2.0 * eps))
            .collect();
        check("input", &gx, &idx, &num, tol);
    }
    for (name, p) in &params {
        let g = vals(&p.grad().unwrap_or_else(|| panic!("no gradient for {name}")));
        let v0 = p.value();
        let idx = sample(v0.numel(), 24);
        let num: Vec<f32> = idx
            .iter()
            .map(|&i| {
                p.set_value(with_elem(&v0, i, eps));
                let up = f(x);
                p.set_value(with_elem(&v0, i, -eps));
                let down = f(x);
                p.set_value(v0.clone());
                (up - down) / (2.0 * eps)
            })
            .collect();
        check(name, &g, &idx, &num, tol);
        p.zero_grad();
    }
}

/// Checks the gradient of a scalar function of one input against central differences.
pub fn grad_check_fn(f: impl Fn(&Var) -> Result<Var>, x: &Tensor) {
    let eps = 1e-2f32;
    let eval = |x: &Tensor| -> f32 {
        let tape = Tape::no_grad();
        f(&tape.constant(x.clone())).unwrap().to_scalar().unwrap()
    };
    let tape = Tape::new();
    let xv = tape.leaf(x.clone());
    let loss = f(&xv).unwrap();
    let g = vals(tape.backward(&loss).unwrap().get(&xv).expect("gradient"));
    let idx = sample(x.numel(), 32);
    let num: Vec<f32> = idx
        .iter()
        .map(|&i| (eval(&with_elem(x, i, eps)) - eval(&with_elem(x, i, -eps))) / (2.0 * eps))
        .collect();
    check("input", &g, &idx, &num, 2e-2);
}
