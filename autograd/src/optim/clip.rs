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
/// Every scaled gradient is computed before any is replaced: a failure changes nothing.
pub fn scale_grads(params: &[(String, Param)], factor: f32) -> Result<()> {
    for (p, g) in scaled_grads(params, factor)? {
        p.set_grad(Some(g));
    }
    Ok(())
}

/// The gradients of [`scale_grads`] times `factor`, not yet stored: a caller that scales several
/// groups (the stages of a pipeline) computes every group's first and then stores them all, so
/// a failure in one group changes no group.
pub fn scaled_grads(params: &[(String, Param)], factor: f32) -> Result<Vec<(Param, Tensor)>> {
    updatable("scale_grads", params)?
        .into_iter()
        .map(|it| Ok((it.param.clone(), it.grad.mul_scalar(factor)?)))
        .collect()
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
/// gradient) is an error, and no gradient changes (PyTorch's `error_if_nonfinite=True`): it
/// cannot be clipped, and stepping on it would make every parameter it reaches NaN.
pub fn clip_grad_norm(params: &[(String, Param)], max_norm: f32) -> Result<f32> {
    if max_norm.is_nan() || max_norm < 0.0 {
        return Err(invalid(
            "clip_grad_norm",
            format!("max_norm must be >= 0, got {max_norm}"),
        ));
    }
    let total = grad_norm_sq(params)?.sqrt() as f32;
    if !total.is_finite() {
        return Err(invalid(
            "clip_grad_norm",
            format!("the gradient norm is {total}: some gradient holds NaN or infinity"),
        ));
    }
    let factor = clip_factor(total, max_norm);
    if factor != 1.0 {
        scale_grads(params, factor)?;
    }
    Ok(total)
}
