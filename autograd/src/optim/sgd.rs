//! Stochastic gradient descent with momentum, Nesterov momentum, dampening and (L2) weight
//! decay, with exactly the semantics of `torch.optim.SGD`:
//!
//! ```text
//! g = grad + weight_decay * p
//! if momentum != 0:
//!     buf = g                                        (first step)
//!     buf = momentum * buf + (1 - dampening) * g     (later steps)
//!     g = g + momentum * buf   if nesterov   else   buf
//! p = p - lr * g
//! ```

use std::collections::BTreeMap;

use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Result, Tag, Tensor};

use super::{
    check_state_shape, counter_tensor, invalid, on_device, read_counter, read_lr, split_key,
    updatable, Item, Optimizer, LR_KEY, STEPS_KEY,
};
use crate::param::Param;

/// Hyper-parameters of [`Sgd`] (PyTorch's names and defaults, except `lr`, which has none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl SgdConfig {
    fn validate(&self) -> Result<()> {
        let op = "Sgd::step";
        let bad = |what: &str, v: f32| invalid(op, format!("{what} must be >= 0, got {v}"));
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            return Err(bad("lr", self.lr));
        }
        if !(self.momentum >= 0.0 && self.momentum.is_finite()) {
            return Err(bad("momentum", self.momentum));
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return Err(bad("weight_decay", self.weight_decay));
        }
        if !self.dampening.is_finite() {
            return Err(invalid(op, format!("dampening is {}", self.dampening)));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(invalid(
                op,
                format!(
                    "Nesterov momentum requires momentum > 0 and dampening = 0 (got momentum {}, dampening {})",
                    self.momentum, self.dampening
                ),
            ));
        }
        Ok(())
    }
}

/// SGD (see the module doc for the update). State: `{param}.momentum_buffer` when momentum > 0.
pub struct Sgd {
    cfg: SgdConfig,
    buffers: BTreeMap<String, Tensor>,
    steps: u64,
}

impl Sgd {
    /// Plain SGD: no momentum, no weight decay.
    pub fn new(lr: f32) -> Sgd {
        Sgd::with_config(SgdConfig {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        })
    }
    pub fn with_config(cfg: SgdConfig) -> Sgd {
        Sgd {
            cfg,
            buffers: BTreeMap::new(),
            steps: 0,
        }
    }
    pub fn with_momentum(mut self, momentum: f32) -> Sgd {
        self.cfg.momentum = momentum;
        self
    }
    pub fn with_nesterov(mut self, nesterov: bool) -> Sgd {
        self.cfg.nesterov = nesterov;
        self
    }
    pub fn with_weight_decay(mut self, weight_decay: f32) -> Sgd {
        self.cfg.weight_decay = weight_decay;
        self
    }
    pub fn with_dampening(mut self, dampening: f32) -> Sgd {
        self.cfg.dampening = dampening;
        self
    }
    pub fn config(&self) -> &SgdConfig {
        &self.cfg
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, params: &[(String, Param)]) -> Result<()> {
        self.cfg.validate()?;
        let items = updatable("Sgd::step", params)?;
        let SgdConfig {
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
        } = self.cfg;
        if momentum != 0.0 {
            for it in &items {
                if let Some(buf) = self.buffers.get(it.name) {
                    check_state_shape("Sgd::step", it.name, "momentum_buffer", buf, &it.value)?;
                }
            }
        }
        // Every update that needs new memory (and every momentum buffer) is computed before
        // any is applied: a failure leaves parameters and buffers as they were. A parameter that
        // nothing else holds is then stepped in place, which allocates nothing.
        let mut updates = Vec::with_capacity(items.len());
        for it in items {
            let dev = it.value.device().clone();
            // Temporaries and new buffers count as optimizer state; the new value is retagged
            // as a parameter by `set_value`.
            let update = with_tag(
                Tag::OptimizerState,
                || -> Result<(Tensor, Option<Tensor>)> {
                    let mut d_p = it.grad.clone();
                    if weight_decay != 0.0 {
                        d_p = d_p.add(&it.value.mul_scalar(weight_decay)?)?;
                    }
                    let mut new_buf = None;
                    if momentum != 0.0 {
                        let buf = match self.buffers.get(it.name) {
                            // A copy (the gradient itself is dropped by zero_grad).
                            None => d_p.mul_scalar(1.0)?,
                            Some(old) => {
                                let g = if dampening != 0.0 {
                                    d_p.mul_scalar(1.0 - dampening)?
                                } else {
                                    d_p.clone()
                                };
                                on_device(old, &dev)?.mul_scalar(momentum)?.add(&g)?
                            }
                        };
                        buf.retag(Tag::OptimizerState);
                        d_p = if nesterov {
                            d_p.add(&buf.mul_scalar(momentum)?)?
                        } else {
                            buf.clone()
                        };
                        new_buf = Some(buf);
                    }
                    Ok((d_p, new_buf))
                },
            )?;
            let (d_p, new_buf) = update;
            let Item {
                name, param, value, ..
            } = it;
            drop(value);
            let value = if param.value_is_exclusive() {
                None
            } else {
                let v = with_tag(Tag::OptimizerState, || {
                    Tensor::sgd_update(&param.value(), &d_p, lr)
                })?;
                Some(v)
            };
            updates.push((name, param, d_p, value, new_buf));
        }
        for (name, param, d_p, value, buf) in updates {
            match value {
                Some(v) => param.set_value(v),
                None => {
                    with_tag(Tag::OptimizerState, || {
                        param.update_value(|v| Tensor::sgd_update_in_place(v, &d_p, lr))
                    })?;
                }
            }
            if let Some(buf) = buf {
                self.buffers.insert(name.to_string(), buf);
            }
        }
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f32 {
        self.cfg.lr
    }
    fn set_lr(&mut self, lr: f32) {
        self.cfg.lr = lr;
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .buffers
            .iter()
            .map(|(k, v)| (format!("{k}.momentum_buffer"), v.clone()))
            .collect();
        // Creating two tiny CPU tensors cannot fail short of the CPU device refusing memory.
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
        let op = "Sgd::load_state";
        let mut buffers = BTreeMap::new();
        let mut steps = 0;
        let mut lr = self.cfg.lr;
        for (key, t) in state {
            match key.as_str() {
                STEPS_KEY => steps = read_counter(op, &key, &t)?,
                LR_KEY => lr = read_lr(op, &t)?,
                _ => {
                    let (name, slot) = split_key(op, &key)?;
                    if slot != "momentum_buffer" {
                        return Err(invalid(
                            op,
                            format!(
                                "state entry '{key}': SGD has no slot '{slot}' (its only slot is 'momentum_buffer'; is this another optimizer's state?)"
                            ),
                        ));
                    }
                    t.retag(Tag::OptimizerState);
                    buffers.insert(name.to_string(), t);
                }
            }
        }
        self.buffers = buffers;
        self.steps = steps;
        self.cfg.lr = lr;
        Ok(())
    }

    fn steps(&self) -> u64 {
        self.steps
    }
}
