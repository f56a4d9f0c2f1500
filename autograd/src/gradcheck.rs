//! Finite-difference gradient checks: backward against central differences.
//!
//! The scalar checked is `sum(f(inputs) * W)` for fixed weights `W` (by default uniform in
//! `[-1, 1)`), so every output element matters. For each checked element `x[j]` the numeric
//! gradient is `(L(x[j] + eps) - L(x[j] - eps)) / h`, with the loss `L` accumulated in f64 over
//! the f32 outputs and `h` the perturbation actually applied after f32 rounding. An element
//! passes when `|numeric - analytic| <= atol + rtol * max(|numeric|, |analytic|)`.
//!
//! [`GradCheck::check`] checks a function of several inputs (ops, losses);
//! [`GradCheck::check_module`] checks a [`Module`]'s parameters and, optionally, its input.
//! Both panic, listing the mismatches, so they read as assertions in tests:
//!
//! ```
//! use wgpipe_autograd::gradcheck::GradCheck;
//! use wgpipe_autograd::tensor::{Device, Tensor};
//!
//! let x = Tensor::rand_uniform(&[3, 4], -1.0, 1.0, 7, &Device::cpu()).unwrap();
//! GradCheck::default().check("tanh(x) * x", &[x], |v| v[0].tanh()?.mul(&v[0]));
//!
//! // a sample of 8 elements per tensor, looser tolerances, a smaller step
//! let x = Tensor::rand_uniform(&[64], -1.0, 1.0, 8, &Device::cpu()).unwrap();
//! let check = GradCheck { eps: 1e-3, rtol: 2e-2, atol: 2e-2, sample: Some(8), ..GradCheck::default() };
//! check.check("sin", &[x], |v| v[0].sin());
//! ```

use wgpipe_tensor::{Device, Result, Tensor};

use crate::{ForwardCtx, Module, Tape, Var};

/// The output weights `W` of a check: a tensor of the given shape on the given device.
pub type Weights = fn(&[usize], &Device) -> Result<Tensor>;

/// Uniform weights in `[-1, 1)` from the fixed stream 99 (the default).
pub fn uniform_weights(shape: &[usize], device: &Device) -> Result<Tensor> {
    Tensor::rand_uniform(shape, -1.0, 1.0, 99, device)
}

/// All-one weights: the loss is `sum(f(inputs))`, i.e. `f` itself for a scalar `f`.
pub fn unit_weights(shape: &[usize], device: &Device) -> Result<Tensor> {
    Tensor::ones(shape, device)
}

/// Settings of a finite-difference gradient check. Build it with struct-update syntax from
/// [`GradCheck::default`] (`eps` 1e-2, `rtol` 1e-2, `atol` 1e-4, every element,
/// [`uniform_weights`]).
#[derive(Clone, Copy, Debug)]
pub struct GradCheck {
    /// The step of the central differences (smaller for functions with kinks, e.g. ReLU).
    pub eps: f32,
    /// Relative tolerance, on the larger of the numeric and the analytic value.
    pub rtol: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// `None` checks every element of every tensor; `Some(n)` at most `n` of each, evenly
    /// spread and the same on every run.
    pub sample: Option<usize>,
    /// The output weights `W` in the checked scalar `sum(f(inputs) * W)`.
    pub weights: Weights,
}

impl Default for GradCheck {
    fn default() -> Self {
        GradCheck {
            eps: 1e-2,
            rtol: 1e-2,
            atol: 1e-4,
            sample: None,
            weights: uniform_weights,
        }
    }
}

impl GradCheck {
    /// The output of `f` and the backward gradients of `sum(f(inputs) * W)` with respect to every
    /// input (zeros for an input `f` does not use), computed where the inputs are.
    pub fn gradients(
        &self,
        inputs: &[Tensor],
        f: impl Fn(&[Var]) -> Result<Var>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let tape = Tape::new();
        let leaves: Vec<Var> = inputs.iter().map(|t| tape.leaf(t.clone())).collect();
        let out = f(&leaves)?;
        let w = tape.constant((self.weights)(out.shape(), out.device())?);
        let grads = tape.backward(&out.mul(&w)?.sum_all()?)?;
        let gs = leaves
            .iter()
            .map(|l| match grads.get(l) {
                Some(g) => Ok(g.clone()),
                None => Tensor::zeros(l.shape(), l.device()),
            })
            .collect::<Result<_>>()?;
        Ok((out.value().clone(), gs))
    }

    /// Checks the gradient of `sum(f(inputs) * W)` with respect to every input.
    ///
    /// # Panics
    /// When an element differs from its central difference (the message lists up to 10 and
    /// says "differ from finite differences"), or when `f` fails.
    #[track_caller]
    pub fn check(&self, name: &str, inputs: &[Tensor], f: impl Fn(&[Var]) -> Result<Var>) {
        let (out, grads) = self.gradients(inputs, &f).expect("forward and backward");
        let w = weights_vec(self, &out);
        let eval = |xs: &[Tensor]| -> f64 {
            let tape = Tape::no_grad();
            let vs: Vec<Var> = xs.iter().map(|t| tape.constant(t.clone())).collect();
            weighted(f(&vs).expect("forward").value(), &w)
        };
        let mut report = Report::default();
        for (i, (x, g)) in inputs.iter().zip(&grads).enumerate() {
            self.compare(&format!("input {i}"), x, g, &mut report, |xi| {
                let mut xs = inputs.to_vec();
                xs[i] = xi;
                eval(&xs)
            });
        }
        report.finish(name);
    }

    /// Checks the gradients of `module`'s parameters (and of its input `x` if `wrt_input`) for
    /// `sum(module.forward(x, ctx) * W)`. Every parameter must get a gradient. The parameters'
    /// gradients are cleared before and after; their values are restored.
    ///
    /// # Panics
    /// As [`GradCheck::check`], and when a parameter or the input gets no gradient.
    #[track_caller]
    pub fn check_module(&self, module: &dyn Module, x: &Tensor, ctx: &ForwardCtx, wrt_input: bool) {
        let name = module.name();
        let params = module.parameters();
        for (_, p) in &params {
            p.zero_grad();
        }
        let tape = Tape::new();
        let xv = if wrt_input {
            tape.leaf(x.clone())
        } else {
            tape.constant(x.clone())
        };
        let y = module.forward(&xv, ctx).expect("forward");
        let wt = (self.weights)(y.shape(), y.device()).expect("weights");
        let loss = y.mul(&tape.constant(wt)).unwrap().sum_all().unwrap();
        let grads = tape.backward(&loss).expect("backward");
        let w = weights_vec(self, y.value());
        let eval = |x: &Tensor| -> f64 {
            let tape = Tape::no_grad();
            weighted(
                module
                    .forward(&tape.constant(x.clone()), ctx)
                    .expect("forward")
                    .value(),
                &w,
            )
        };
        let mut report = Report::default();
        if wrt_input {
            let g = grads
                .get(&xv)
                .unwrap_or_else(|| panic!("{name}: no gradient for the input"));
            self.compare("input", x, g, &mut report, |xi| eval(&xi));
        }
        for (pname, p) in &params {
            let g = p
                .grad()
                .unwrap_or_else(|| panic!("{name}: no gradient for {pname}"));
            let v0 = p.value();
            self.compare(pname, &v0, &g, &mut report, |vi| {
                p.set_value(vi);
                eval(x)
            });
            p.set_value(v0);
            p.zero_grad();
        }
        report.finish(&name);
    }

    /// Compares `analytic` (the gradient at `base`) with central differences of `eval` on the
    /// checked elements, recording mismatches in `report`.
    fn compare(
        &self,
        what: &str,
        base: &Tensor,
        analytic: &Tensor,
        report: &mut Report,
        mut eval: impl FnMut(Tensor) -> f64,
    ) {
        assert_eq!(analytic.shape(), base.shape(), "gradient shape of {what}");
        let v0 = base.to_vec().unwrap();
        let ga = analytic.to_vec().unwrap();
        for j in sample(v0.len(), self.sample) {
            let mut at = |d: f32| {
                let mut v = v0.clone();
                v[j] += d;
                eval(Tensor::from_vec(v, base.shape(), base.device()).unwrap())
            };
            let (hi, lo) = (at(self.eps), at(-self.eps));
            // the perturbation actually applied, after f32 rounding
            let h = ((v0[j] + self.eps) as f64) - ((v0[j] - self.eps) as f64);
            let num = (hi - lo) / h;
            let ana = ga[j] as f64;
            report.checked += 1;
            if (num - ana).abs() > self.atol + self.rtol * num.abs().max(ana.abs()) {
                report.bad.push(format!(
                    "{what} elem {j}: analytic {ana:.6} numeric {num:.6}"
                ));
            }
        }
    }
}

#[derive(Default)]
struct Report {
    checked: usize,
    bad: Vec<String>,
}

impl Report {
    #[track_caller]
    fn finish(self, name: &str) {
        assert!(
            self.bad.is_empty(),
            "{name}: {} of the {} checked gradient elements differ from finite differences:\n{}",
            self.bad.len(),
            self.checked,
            self.bad[..self.bad.len().min(10)].join("\n")
        );
    }
}

fn weights_vec(check: &GradCheck, out: &Tensor) -> Vec<f32> {
    (check.weights)(out.shape(), out.device())
        .and_then(|w| w.to_vec())
        .expect("weights")
}

/// `sum(out * w)` in f64.
fn weighted(out: &Tensor, w: &[f32]) -> f64 {
    out.to_vec()
        .unwrap()
        .iter()
        .zip(w)
        .map(|(&a, &b)| a as f64 * b as f64)
        .sum()
}

/// The checked element indices of a tensor with `n` elements: all, or up to `max` evenly spread.
fn sample(n: usize, max: Option<usize>) -> Vec<usize> {
    match max {
        Some(max) if n > max => (0..max)
            .map(|k| k * n / max + (k * 7) % (n / max).max(1))
            .collect(),
        _ => (0..n).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::CostHint;
    use crate::Param;

    /// `y = x * p` (elementwise), with a backward for `p` that is right or doubled.
    struct Scale {
        p: Param,
        wrong: bool,
    }

    impl Module for Scale {
        fn name(&self) -> String {
            "Scale".into()
        }
        fn forward(&self, x: &Var, _: &ForwardCtx) -> Result<Var> {
            let p = x.param(&self.p)?;
            let (xv, pv) = (x.value().clone(), p.value().clone());
            let k = if self.wrong { 2.0 } else { 1.0 };
            Var::from_op("scale", &[x, &p], xv.mul(&pv)?, move |g, _| {
                Ok(vec![Some(g.mul(&pv)?), Some(g.mul(&xv)?.mul_scalar(k)?)])
            })
        }
        fn parameters(&self) -> Vec<(String, Param)> {
            vec![("p".into(), self.p.clone())]
        }
        fn cost(&self, _: &[usize]) -> CostHint {
            CostHint::default()
        }
    }

    fn scale(wrong: bool) -> Scale {
        let p = Tensor::rand_uniform(&[40], -1.0, 1.0, 1, &Device::cpu()).unwrap();
        Scale {
            p: Param::new("p", p),
            wrong,
        }
    }

    fn x() -> Tensor {
        Tensor::rand_uniform(&[40], -1.0, 1.0, 2, &Device::cpu()).unwrap()
    }

    #[test]
    fn a_right_module_passes_and_is_left_as_found() {
        let m = scale(false);
        let v0 = m.p.value().to_vec().unwrap();
        for sample in [None, Some(8)] {
            GradCheck {
                sample,
                ..GradCheck::default()
            }
            .check_module(&m, &x(), &ForwardCtx::eval(), true);
        }
        assert_eq!(m.p.value().to_vec().unwrap(), v0);
        assert!(m.p.grad().is_none());
    }

    #[test]
    #[should_panic(expected = "differ from finite differences")]
    fn a_wrong_parameter_gradient_is_caught() {
        let check = GradCheck {
            sample: Some(8),
            ..GradCheck::default()
        };
        check.check_module(&scale(true), &x(), &ForwardCtx::eval(), false);
    }

    #[test]
    fn samples_are_spread_distinct_and_in_range() {
        assert_eq!(sample(5, Some(8)), vec![0, 1, 2, 3, 4]);
        assert_eq!(sample(5, None), vec![0, 1, 2, 3, 4]);
        let s = sample(1000, Some(24));
        assert_eq!(s.len(), 24);
        assert!(s.windows(2).all(|w| w[0] < w[1]) && s[23] < 1000);
    }
}
