//! Gradient clipping by global L2 norm, split into parts a pipeline can run per stage:
//! each stage computes [`grad_norm_sq`] on its own device, the driver adds them up, takes the
//! square root and the [`clip_factor`], and every stage calls [`scale_grads`] with it.
//! [`clip_grad_norm`] does the three at once for parameters in one place.

use wgpipe_tensor::{Result, Tensor};

use super::{invalid, updatable};
use crate::param::Param;

/// Sum of the squares of every gradient element (trainable parameters with a gradient, each
/// once). Each tensor is reduced on its own device in f32, one read-back per device.
pub fn grad_norm_sq(params: &[(String, Param)]) -> Result<f64> {
    let items = updatable("grad_norm_sq", params)?;
    // Per device: the running f32 sum stays on the device.
    let mut sums: Vec<Tensor> = Vec::new();
    for it in items {
        let s = it.grad.square()?.sum_all()?;
        match sums.iter_mut().find(|t| t.device() == s.device()) {
            Some(acc) => *acc = acc.add(&s)?,
            None => sums.push(s),
        }
    }
    let mut total = 0.0f64;
    for s in sums {
        total += s.to_scalar()? as f64;
    }
    Ok(total)
}

/// Multiplies every gradient (trainable parameters with a gradient, each once) by `factor`.
pub fn scale_grads(params: &[(String, Param)], factor: f32) -> Result<()> {
    let items = updatable("scale_grads", params)?;
    // Compute every scaled gradient before replacing any: a failure changes nothing.
    let scaled = items
        .iter()
        .map(|it| it.grad.mul_scalar(factor))
        .collect::<Result<Vec<_>>>()?;
    for (it, g) in items.iter().zip(scaled) {
        it.param.set_grad(Some(g));
    }
    Ok(())
}

/// The factor gradients with global norm `total_norm` are scaled by to clip them to
/// `max_norm`: `max_norm / (total_norm + 1e-6)` when that is below 1, else 1 (as PyTorch).
pub fn clip_factor(total_norm: f32, max_norm: f32) -> f32 {
    let coef = max_norm / (total_norm + 1e-6);
    if coef < 1.0 {
        coef
    } else {
        1.0
    }
}

/// Clips the gradients to a global L2 norm of at most `max_norm` and returns the norm before
/// clipping, as `torch.nn.utils.clip_grad_norm_`. A non-finite norm (an overflowing or NaN
/// gradient) is returned as is: check it to skip the step.
pub fn clip_grad_norm(params: &[(String, Param)], max_norm: f32) -> Result<f32> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(invalid(
            "clip_grad_norm",
            format!("max_norm must be >= 0, got {max_norm}"),
        ));
    }
    let total = grad_norm_sq(params)?.sqrt() as f32;
    let factor = clip_factor(total, max_norm);
    if factor != 1.0 {
        scale_grads(params, factor)?;
    }
    Ok(total)
}
