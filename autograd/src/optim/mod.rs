//! Optimizers (SGD, Adam, AdamW), gradient clipping by global norm and learning-rate schedules.
//!
//! # Keyed by parameter name
//!
//! An optimizer takes the parameters it updates on every [`Optimizer::step`] as
//! `(name, Param)` pairs and keeps its state (momentum buffers, moments) under those names. A
//! pipeline stage therefore runs its own optimizer over its own parameters, on its own device:
//! every update runs where the parameter lives (the fused Adam kernel is WGSL on wgpu), and the
//! state it allocates is accounted as [`Tag::OptimizerState`](wgpipe_tensor::Tag).
//! Parameters without a gradient, or not trainable, are skipped (their state does not change,
//! as in PyTorch). A parameter listed twice (tied weights) is updated once.
//!
//! # Gradient accumulation and loss scaling
//!
//! Gradients **accumulate** (sum) over backward calls until [`zero_grad`]. A pipeline splits a
//! mini-batch of `N` samples into micro-batches of sizes `n_1 + … + n_M = N` and runs one backward
//! per micro-batch. To make the accumulated gradient equal the gradient of the *mean* loss over
//! the whole mini-batch, however it was split, each micro-batch's mean loss is scaled by
//! `n_i / N` ([`loss_scale`]) before its backward:
//!
//! `Σ_i (n_i / N) · ∇ mean_{j ∈ i} ℓ_j = Σ_i (1 / N) · Σ_{j ∈ i} ∇ℓ_j = ∇ mean_j ℓ_j`.
//!
//! Summing (not averaging) across backward calls is what makes unequal micro-batches exact. For
//! a sum loss, use a scale of 1.
//!
//! # A training step
//!
//! ```ignore
//! zero_grad(&params);
//! for (i, mb) in micro_batches.iter().enumerate() {
//!     let loss = model_loss(mb)?.mul_scalar(loss_scale(mb.len(), n))?;
//!     tape.backward(&loss)?;
//! }
//! let norm = clip_grad_norm(&params, 1.0)?;
//! schedule.apply(&mut opt, base_lr);
//! opt.step(&params)?;
//! ```

mod adam;
mod clip;
mod schedule;
mod sgd;

use std::collections::HashMap;

pub use adam::{Adam, AdamConfig, AdamW};
pub use clip::{clip_factor, clip_grad_norm, grad_norm_sq, scale_grads, scaled_grads};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

use wgpipe_tensor::{Device, Error, Result, Tensor};

use crate::param::Param;

/// An optimizer over named parameters. `Send` so a pipeline stage can own it on its thread.
pub trait Optimizer: Send {
    /// Updates every trainable parameter that has a gradient, on the parameter's device.
    /// Validates everything (shapes, devices, state) before changing anything.
    fn step(&mut self, params: &[(String, Param)]) -> Result<()>;
    /// The learning rate of the next step.
    fn lr(&self) -> f32;
    fn set_lr(&mut self, lr: f32);
    /// The state (buffers, moments, counters, learning rate) as named tensors, sorted by name:
    /// `{param}.{slot}` for per-parameter state (PyTorch's slot names: `momentum_buffer`,
    /// `exp_avg`, `exp_avg_sq`, `step`) and `@steps`, `@lr` for the optimizer's own.
    fn state(&self) -> Vec<(String, Tensor)>;
    /// Replaces the whole state with one from [`Optimizer::state`] (possibly saved and loaded).
    /// Checks every entry first: on error nothing changes. `load_state(state())` must restore
    /// the optimizer exactly (moments, counters, learning rate): a pipeline relies on it to roll
    /// every stage back when one stage's step or load fails.
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()>;
    /// How many times `step` ran (restored by `load_state`).
    fn steps(&self) -> u64;
}

/// Drops every parameter's gradient (the next backward stores a fresh one).
pub fn zero_grad(params: &[(String, Param)]) {
    for (_, p) in params {
        p.zero_grad();
    }
}

/// The factor a micro-batch's mean loss is multiplied by so that gradients accumulated over the
/// micro-batches equal the gradient of the mean loss over the mini-batch: `micro / mini`.
pub fn loss_scale(micro_batch_size: usize, mini_batch_size: usize) -> f32 {
    (micro_batch_size as f64 / mini_batch_size as f64) as f32
}

pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        op,
        msg: msg.into(),
    }
}

/// A parameter an optimizer updates this step.
pub(crate) struct Item<'a> {
    pub name: &'a str,
    pub param: &'a Param,
    pub value: Tensor,
    pub grad: Tensor,
}

/// The trainable parameters with a gradient, each once; checks names, shapes and devices.
pub(crate) fn updatable<'a>(
    op: &'static str,
    params: &'a [(String, Param)],
) -> Result<Vec<Item<'a>>> {
    let mut by_name: HashMap<&str, &Param> = HashMap::new();
    // Tied weights have the same shape: compare handles only within a shape.
    let mut by_shape: HashMap<Vec<usize>, Vec<&Param>> = HashMap::new();
    let mut out = Vec::new();
    for (name, p) in params {
        if let Some(prev) = by_name.get(name.as_str()) {
            if prev.same(p) {
                continue;
            }
            return Err(invalid(
                op,
                format!("two different parameters are both named '{name}'"),
            ));
        }
        by_name.insert(name, p);
        let value = p.value();
        let seen = by_shape.entry(value.shape().to_vec()).or_default();
        if seen.iter().any(|q| q.same(p)) {
            continue;
        }
        seen.push(p);
        if !p.is_trainable() {
            continue;
        }
        let Some(grad) = p.grad() else { continue };
        if grad.shape() != value.shape() {
            return Err(invalid(
                op,
                format!(
                    "parameter '{name}' has shape {:?} but its gradient has shape {:?}",
                    value.shape(),
                    grad.shape()
                ),
            ));
        }
        if grad.device() != value.device() {
            return Err(invalid(
                op,
                format!(
                    "parameter '{name}' is on {} but its gradient is on {}",
                    value.device().name(),
                    grad.device().name()
                ),
            ));
        }
        out.push(Item {
            name,
            param: p,
            value,
            grad,
        });
    }
    Ok(out)
}

/// Checks that the state tensor `slot` of parameter `name` has the parameter's shape.
pub(crate) fn check_state_shape(
    op: &'static str,
    name: &str,
    slot: &str,
    state: &Tensor,
    param: &Tensor,
) -> Result<()> {
    if state.shape() != param.shape() {
        return Err(invalid(
            op,
            format!(
                "optimizer state '{name}.{slot}' has shape {:?} but parameter '{name}' has shape {:?}",
                state.shape(),
                param.shape()
            ),
        ));
    }
    Ok(())
}

/// Global state keys (they cannot clash with `{param}.{slot}` keys of real parameters).
pub(crate) const STEPS_KEY: &str = "@steps";
pub(crate) const LR_KEY: &str = "@lr";

const COUNTER_SPLIT: f64 = (1u64 << 24) as f64;

/// A step counter as an exact f32 tensor `[high, low]` (`value = high * 2^24 + low`), on the CPU.
pub(crate) fn counter_tensor(value: u64) -> Result<Tensor> {
    let v = value as f64;
    let high = (v / COUNTER_SPLIT).floor();
    let low = v - high * COUNTER_SPLIT;
    Tensor::from_vec(vec![high as f32, low as f32], &[2], &Device::cpu())
}

/// Reads back a counter written by [`counter_tensor`].
pub(crate) fn read_counter(op: &'static str, key: &str, t: &Tensor) -> Result<u64> {
    let bad = || {
        invalid(
            op,
            format!(
                "state entry '{key}' must be a counter of shape [2] holding non-negative integers, got shape {:?}",
                t.shape()
            ),
        )
    };
    if t.shape() != [2] {
        return Err(bad());
    }
    let v = t.to_vec()?;
    let ok = |x: f32| x >= 0.0 && x.fract() == 0.0 && (x as f64) < COUNTER_SPLIT;
    if !ok(v[0]) || !ok(v[1]) {
        return Err(bad());
    }
    Ok(v[0] as u64 * (1u64 << 24) + v[1] as u64)
}

/// Reads the `@lr` entry.
pub(crate) fn read_lr(op: &'static str, t: &Tensor) -> Result<f32> {
    if t.numel() != 1 {
        return Err(invalid(
            op,
            format!(
                "state entry '{LR_KEY}' must hold one value, got shape {:?}",
                t.shape()
            ),
        ));
    }
    let lr = t.to_scalar()?;
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(invalid(
            op,
            format!("state entry '{LR_KEY}' holds {lr}, not a learning rate"),
        ));
    }
    Ok(lr)
}

/// Splits a per-parameter state key `{param}.{slot}`.
pub(crate) fn split_key<'k>(op: &'static str, key: &'k str) -> Result<(&'k str, &'k str)> {
    match key.rsplit_once('.') {
        Some((p, s)) if !p.is_empty() && !s.is_empty() => Ok((p, s)),
        _ => Err(invalid(
            op,
            format!("state entry '{key}' is neither '@steps', '@lr' nor '<param>.<slot>'"),
        )),
    }
}

/// The tensor stored (moved to the parameter's device when it lives elsewhere, e.g. after a
/// load onto the CPU), accounted as optimizer state.
pub(crate) fn on_device(t: &Tensor, device: &Device) -> Result<Tensor> {
    let t = if t.device() == device {
        t.clone()
    } else {
        wgpipe_tensor::memory::with_tag(wgpipe_tensor::Tag::OptimizerState, || t.to_device(device))?
    };
    t.retag(wgpipe_tensor::Tag::OptimizerState);
    Ok(t)
}
