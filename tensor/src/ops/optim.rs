//! The fused optimizer step. FLOPs: one per parameter element (the kernel is memory-bound).

use crate::backend::AdamStep;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// One Adam/AdamW step (see [`AdamStep`]) on `param` with gradient `grad` and moments `m`,
    /// `v`, all of one shape: returns `(param', m', v')`.
    pub fn adam_update(
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        hp: &AdamStep,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "adam_update";
        for t in [grad, m, v] {
            param.same_device(OP, t)?;
        }
        if [grad, m, v].iter().any(|t| t.shape() != param.shape()) {
            return Err(Error::shape(
                OP,
                format!(
                    "param {:?}, grad {:?}, m {:?} and v {:?} must have one shape",
                    param.shape(),
                    grad.shape(),
                    m.shape(),
                    v.shape()
                ),
            ));
        }
        let dev = param.device();
        if param.numel() == 0 {
            let z = || Tensor::zeros(param.shape(), dev);
            return Ok((z()?, z()?, z()?));
        }
        let out = dev.kernels().adam_update(
            &param.contiguous()?,
            &grad.contiguous()?,
            &m.contiguous()?,
            &v.contiguous()?,
            hp,
        )?;
        dev.add_flops(param.numel() as u64);
        Ok(out)
    }

    /// The plain SGD step `param - lr * grad` (bit-identical to
    /// `param.sub(&grad.mul_scalar(lr)?)`), one fused pass on the CPU. Both of one shape.
    pub fn sgd_update(param: &Tensor, grad: &Tensor, lr: f32) -> Result<Tensor> {
        const OP: &str = "sgd_update";
        param.same_device(OP, grad)?;
        if grad.shape() != param.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "param {:?} and grad {:?} must have one shape",
                    param.shape(),
                    grad.shape()
                ),
            ));
        }
        let dev = param.device();
        if param.numel() > 0 {
            if let Some(out) = dev.kernels().sgd_update(param, grad, lr) {
                dev.add_flops(2 * param.numel() as u64);
                return out;
            }
        }
        param.sub(&grad.mul_scalar(lr)?)
    }
}
