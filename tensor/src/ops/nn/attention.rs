//! The row kernels of fused causal attention: the scaled, causally masked softmax of the scores
//! and its backward, each one pass over the score matrix where the unfused chain (scale, mask,
//! softmax; and softmax's four-op backward, unmask, unscale) made several.

use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// `softmax(scale * x)` over the last axis of `x` `[..., t, t]` (attention scores, queries on
    /// the second-last axis), where query `i` sees keys `0..=i` only: the future gets exact zeros.
    /// Equal bit for bit to `x.mul_scalar(scale).masked_fill(future, -1e9).softmax(-1)`.
    pub fn causal_softmax(&self, scale: f32) -> Result<Tensor> {
        const OP: &str = "causal_softmax";
        let t = square_last_two(OP, self.shape())?;
        if !scale.is_finite() {
            return Err(Error::invalid(
                OP,
                format!("scale must be finite, got {scale}"),
            ));
        }
        let dev = self.device();
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let rows = self.numel() / t;
        let x = self.contiguous()?;
        let y = dev.run(OP, WidenThenRound, [&x], |k, [x]| {
            k.causal_softmax_rows(x, rows, t, scale)
        })?;
        // scale, max, exp, sum, normalise over the half that is not masked.
        dev.add_flops(5 * self.numel() as u64 / 2);
        y.reshape(self.shape())
    }

    /// The gradient of `x` for `y = softmax(scale * x)` over the last axis (causally masked or
    /// not: masked entries of `y` are 0 and get 0), given `g`, the gradient of `y`:
    /// `scale * y * (g - sum(g * y))` in one kernel.
    pub fn softmax_backward(y: &Tensor, g: &Tensor, scale: f32) -> Result<Tensor> {
        const OP: &str = "softmax_backward";
        y.same_device(OP, g)?;
        if y.shape() != g.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "y {:?} and its gradient {:?} must have one shape",
                    y.shape(),
                    g.shape()
                ),
            ));
        }
        let Some(&cols) = y.shape().last() else {
            return Err(Error::shape(
                OP,
                "needs rank >= 1, got a 0-d tensor (shape [])",
            ));
        };
        let dev = y.device();
        if y.numel() == 0 {
            return y.zeros_like();
        }
        let rows = y.numel() / cols;
        let (y, g) = (y.contiguous()?, g.contiguous()?);
        let dx = dev.run(OP, WidenThenRound, [&y, &g], |k, [y, g]| {
            k.softmax_backward_rows(y, g, rows, cols, scale)
        })?;
        dev.add_flops(5 * y.numel() as u64);
        dx.reshape(y.shape())
    }
}

/// `t` for a shape `[..., t, t]`, else an error naming the shape.
fn square_last_two(op: &'static str, shape: &[usize]) -> Result<usize> {
    match shape {
        [.., a, b] if a == b => Ok(*b),
        _ => Err(Error::shape(
            op,
            format!("needs square scores [..., t, t] (queries x keys), got {shape:?}"),
        )),
    }
}
