//! Adam and AdamW with the semantics of `torch.optim.Adam` / `torch.optim.AdamW` (no amsgrad),
//! one fused kernel per parameter ([`Tensor::adam_update`], WGSL on wgpu). Per parameter, at its
//! own step count `t` (which, as in PyTorch, only advances when the parameter is updated):
//!
//! ```text
//! Adam:  g = grad + weight_decay * p          AdamW:  p = p - lr * weight_decay * p
//! m = beta1 * m + (1 - beta1) * g
//! v = beta2 * v + (1 - beta2) * g^2
//! p = p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
//! ```

use std::collections::BTreeMap;

use wgpipe_tensor::backend::AdamStep;
use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Result, Tag, Tensor};

use super::{
    check_state_shape, counter_tensor, invalid, on_device, read_counter, read_lr, split_key,
    updatable, Item, Optimizer, LR_KEY, STEPS_KEY,
};
use crate::param::Param;

/// Hyper-parameters of [`Adam`] and [`AdamW`] (PyTorch's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl AdamConfig {
    fn validate(&self, op: &'static str) -> Result<()> {
        let in_unit = |b: f32| (0.0..1.0).contains(&b);
        let nonneg = |x: f32| x >= 0.0 && x.is_finite();
        if !nonneg(self.lr) || !nonneg(self.eps) || !nonneg(self.weight_decay) {
            return Err(invalid(
                op,
                format!(
                    "lr, eps and weight_decay must be finite and >= 0 (got {}, {}, {})",
                    self.lr, self.eps, self.weight_decay
                ),
            ));
        }
        if !in_unit(self.beta1) || !in_unit(self.beta2) {
            return Err(invalid(
                op,
                format!(
                    "betas must be in [0, 1) (got {}, {})",
                    self.beta1, self.beta2
                ),
            ));
        }
        Ok(())
    }
}

struct Moments {
    step: u64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// What Adam and AdamW share; `decoupled` picks AdamW's weight decay.
struct AdamCore {
    cfg: AdamConfig,
    decoupled: bool,
    state: BTreeMap<String, Moments>,
    steps: u64,
}

impl AdamCore {
    fn op(&self, what: &str) -> &'static str {
        match (self.decoupled, what) {
            (false, "step") => "Adam::step",
            (true, "step") => "AdamW::step",
            (false, _) => "Adam::load_state",
            (true, _) => "AdamW::load_state",
        }
    }

    fn step(&mut self, params: &[(String, Param)]) -> Result<()> {
        let op = self.op("step");
        self.cfg.validate(op)?;
        let items = updatable(op, params)?;
        for it in &items {
            if let Some(s) = self.state.get(it.name) {
                check_state_shape(op, it.name, "exp_avg", &s.exp_avg, &it.value)?;
                check_state_shape(op, it.name, "exp_avg_sq", &s.exp_avg_sq, &it.value)?;
            }
        }
        let c = self.cfg;
        // Every update that needs new memory is computed before any is applied: a failure (e.g.
        // out of memory for the moments of the third parameter) leaves parameters and state as
        // they were. The rest are made in place afterwards, which allocates nothing.
        let mut planned = Vec::with_capacity(items.len());
        for it in items {
            let dev = it.value.device().clone();
            let t = self.state.get(it.name).map_or(0, |s| s.step) + 1;
            let hp = AdamStep {
                lr: c.lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                decoupled: self.decoupled,
                bias_correction1: (1.0 - (c.beta1 as f64).powf(t as f64)) as f32,
                bias_correction2: (1.0 - (c.beta2 as f64).powf(t as f64)) as f32,
            };
            let Item {
                name,
                param,
                value,
                grad,
            } = it;
            // In place when nothing but the parameter holds its value and nothing but this
            // optimizer holds the moments (kept on the parameter's device). A clone kept
            // elsewhere (a pipeline's rollback copy, a checkpoint being written) keeps its
            // values: the step is then made out of place.
            drop(value);
            let in_place = param.value_is_exclusive()
                && self.state.get_mut(name).is_some_and(|s| {
                    s.exp_avg.device() == &dev
                        && s.exp_avg.is_exclusive()
                        && s.exp_avg_sq.is_exclusive()
                });
            let update = if in_place {
                None
            } else {
                let (m, v) = match self.state.get(name) {
                    Some(s) => (
                        on_device(&s.exp_avg, &dev)?,
                        on_device(&s.exp_avg_sq, &dev)?,
                    ),
                    None => with_tag(Tag::OptimizerState, || -> Result<_> {
                        let z = Tensor::zeros(param.value().shape(), &dev)?;
                        Ok((z.clone(), z))
                    })?,
                };
                let (p, m, v) = with_tag(Tag::OptimizerState, || {
                    Tensor::adam_update(&param.value(), &grad, &m, &v, &hp)
                })?;
                m.retag(Tag::OptimizerState);
                v.retag(Tag::OptimizerState);
                Some((p, m, v))
            };
            planned.push((name, param, grad, t, hp, update));
        }
        for (name, param, grad, t, hp, update) in planned {
            match update {
                Some((p, m, v)) => {
                    param.set_value(p);
                    self.state.insert(
                        name.to_string(),
                        Moments {
                            step: t,
                            exp_avg: m,
                            exp_avg_sq: v,
                        },
                    );
                }
                None => {
                    let s = self
                        .state
                        .get_mut(name)
                        .expect("in-place updates are planned for kept moments only");
                    with_tag(Tag::OptimizerState, || {
                        param.update_value(|value| {
                            Tensor::adam_update_in_place(
                                value,
                                &grad,
                                &mut s.exp_avg,
                                &mut s.exp_avg_sq,
                                &hp,
                            )
                        })
                    })?;
                    s.exp_avg.retag(Tag::OptimizerState);
                    s.exp_avg_sq.retag(Tag::OptimizerState);
                    s.step = t;
                }
            }
        }
        self.steps += 1;
        Ok(())
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(3 * self.state.len() + 2);
        for (name, s) in &self.state {
            out.push((format!("{name}.exp_avg"), s.exp_avg.clone()));
            out.push((format!("{name}.exp_avg_sq"), s.exp_avg_sq.clone()));
            if let Ok(t) = counter_tensor(s.step) {
                out.push((format!("{name}.step"), t));
            }
        }
        if let Ok(t) = counter_tensor(self.steps) {
            out.push((STEPS_KEY.to_string(), t));
        }
        if let Ok(t) = Tensor::scalar(self.cfg.lr, &wgpipe_tensor::Device::cpu()) {
            out.push((LR_KEY.to_string(), t));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        let op = self.op("load");
        type Partial = (Option<u64>, Option<Tensor>, Option<Tensor>);
        let mut parts: BTreeMap<String, Partial> = BTreeMap::new();
        let mut steps = 0;
        let mut lr = self.cfg.lr;
        for (key, t) in state {
            match key.as_str() {
                STEPS_KEY => steps = read_counter(op, &key, &t)?,
                LR_KEY => lr = read_lr(op, &t)?,
                _ => {
                    let (name, slot) = split_key(op, &key)?;
                    let e = parts.entry(name.to_string()).or_default();
                    match slot {
                        "step" => e.0 = Some(read_counter(op, &key, &t)?),
                        "exp_avg" => e.1 = Some(t),
                        "exp_avg_sq" => e.2 = Some(t),
                        _ => {
                            return Err(invalid(
                                op,
                                format!(
                                    "state entry '{key}': Adam has no slot '{slot}' (its slots are 'exp_avg', 'exp_avg_sq' and 'step'; is this another optimizer's state?)"
                                ),
                            ))
                        }
                    }
                }
            }
        }
        let mut state = BTreeMap::new();
        for (name, (step, m, v)) in parts {
            let missing = |slot: &str| {
                invalid(
                    op,
                    format!("state of parameter '{name}' has no '{name}.{slot}' entry"),
                )
            };
            let step = step.ok_or_else(|| missing("step"))?;
            let m = m.ok_or_else(|| missing("exp_avg"))?;
            let v = v.ok_or_else(|| missing("exp_avg_sq"))?;
            if m.shape() != v.shape() {
                return Err(invalid(
                    op,
                    format!(
                        "'{name}.exp_avg' has shape {:?} but '{name}.exp_avg_sq' has shape {:?}",
                        m.shape(),
                        v.shape()
                    ),
                ));
            }
            m.retag(Tag::OptimizerState);
            v.retag(Tag::OptimizerState);
            state.insert(
                name,
                Moments {
                    step,
                    exp_avg: m,
                    exp_avg_sq: v,
                },
            );
        }
        self.state = state;
        self.steps = steps;
        self.cfg.lr = lr;
        Ok(())
    }
}

macro_rules! adam_like {
    ($(#[$doc:meta])* $ty:ident, decoupled = $dec:expr, weight_decay = $wd:expr) => {
        $(#[$doc])*
        pub struct $ty {
            core: AdamCore,
        }

        impl $ty {
            /// Defaults as PyTorch: betas (0.9, 0.999), eps 1e-8.
            pub fn new(lr: f32) -> $ty {
                $ty::with_config(AdamConfig {
                    lr,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: $wd,
                })
            }
            pub fn with_config(cfg: AdamConfig) -> $ty {
                $ty {
                    core: AdamCore {
                        cfg,
                        decoupled: $dec,
                        state: BTreeMap::new(),
                        steps: 0,
                    },
                }
            }
            pub fn with_betas(mut self, beta1: f32, beta2: f32) -> $ty {
                self.core.cfg.beta1 = beta1;
                self.core.cfg.beta2 = beta2;
                self
            }
            pub fn with_eps(mut self, eps: f32) -> $ty {
                self.core.cfg.eps = eps;
                self
            }
            pub fn with_weight_decay(mut self, weight_decay: f32) -> $ty {
                self.core.cfg.weight_decay = weight_decay;
                self
            }
            pub fn config(&self) -> &AdamConfig {
                &self.core.cfg
            }
        }

        impl Optimizer for $ty {
            fn step(&mut self, params: &[(String, Param)]) -> Result<()> {
                self.core.step(params)
            }
            fn lr(&self) -> f32 {
                self.core.cfg.lr
            }
            fn set_lr(&mut self, lr: f32) {
                self.core.cfg.lr = lr;
            }
            fn state(&self) -> Vec<(String, Tensor)> {
                self.core.state()
            }
            fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
                self.core.load_state(state)
            }
            fn steps(&self) -> u64 {
                self.core.steps
            }
        }
    };
}

adam_like!(
    /// Adam with L2 weight decay added to the gradient (`torch.optim.Adam`; default decay 0).
    /// State: `{param}.exp_avg`, `{param}.exp_avg_sq`, `{param}.step`.
    Adam,
    decoupled = false,
    weight_decay = 0.0
);

adam_like!(
    /// AdamW: weight decay decoupled from the gradient (`torch.optim.AdamW`; default decay
    /// 0.01). State as [`Adam`].
    AdamW,
    decoupled = true,
    weight_decay = 0.01
);
