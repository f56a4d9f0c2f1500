//! The fused optimizer steps, out of place and in place. FLOPs: one per parameter element for
//! Adam (the kernel is memory-bound), two for SGD.

use crate::backend::AdamStep;
use crate::backend::Kernels;
use crate::dtype::DType;
use crate::dtype_policy::{DTypePolicy::F32Only, Precision};
use crate::error::{Error, Result};
use crate::raw::RawTensor;
use crate::tensor::Tensor;

/// Checks the operands of an Adam step: one device, one shape.
fn check_adam(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
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
    Ok(())
}

/// Checks the operands of an SGD step: one device, one shape.
fn check_sgd(param: &Tensor, grad: &Tensor) -> Result<()> {
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
    Ok(())
}

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
        check_adam(param, grad, m, v)?;
        let dev = param.device();
        if param.numel() == 0 {
            let z = || Tensor::zeros(param.shape(), dev);
            return Ok((z()?, z()?, z()?));
        }
        let (p, g) = (param.contiguous()?, grad.contiguous()?);
        let (m, v) = (m.contiguous()?, v.contiguous()?);
        // Refused for half tensors on purpose: optimizer steps belong on f32 master weights.
        let out = dev.run(
            "adam_update",
            F32Only,
            [&p, &g, &m, &v],
            |k, [p, g, m, v]| k.adam_update(p, g, m, v, hp),
        )?;
        dev.add_flops(param.numel() as u64);
        Ok(out)
    }

    /// [`Tensor::adam_update`] into `param`, `m` and `v`: written into their storage when all
    /// three [are exclusive](Tensor::is_exclusive) f32 tensors (no allocation, and no other
    /// tensor sees the change), else replaced by new tensors. The values are the same either
    /// way. Returns whether the update was made in place.
    pub fn adam_update_in_place(
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamStep,
    ) -> Result<bool> {
        check_adam(param, grad, m, v)?;
        let f32s = [&*param, grad, &*m, &*v]
            .iter()
            .all(|t| t.dtype() == DType::F32);
        if param.numel() > 0 && f32s && param.is_exclusive() && m.is_exclusive() && v.is_exclusive()
        {
            let dev = param.device().clone();
            // In-place kernels are f32 only: anything else took the out-of-place path below.
            dev.kernels().adam_update_in_place(
                param.raw_mut(),
                grad.raw(),
                m.raw_mut(),
                v.raw_mut(),
                hp,
            )?;
            dev.add_flops(param.numel() as u64);
            return Ok(true);
        }
        let (p2, m2, v2) = Tensor::adam_update(param, grad, m, v, hp)?;
        (*param, *m, *v) = (p2, m2, v2);
        Ok(false)
    }

    /// The plain SGD step `param - lr * grad` (bit-identical to
    /// `param.sub(&grad.mul_scalar(lr)?)`), one fused pass on the CPU. Both of one shape.
    pub fn sgd_update(param: &Tensor, grad: &Tensor, lr: f32) -> Result<Tensor> {
        check_sgd(param, grad)?;
        let dev = param.device();
        if param.numel() > 0 {
            // The fused step is f32 only; half tensors take the composed path below.
            let fused = |k: &dyn Kernels, [p, g]: [&RawTensor; 2]| k.sgd_update(p, g, lr);
            if let Some(out) = dev.run_if("sgd_update", Precision::F32, [param, grad], fused) {
                dev.add_flops(2 * param.numel() as u64);
                return out;
            }
        }
        param.sub(&grad.mul_scalar(lr)?)
    }

    /// [`Tensor::sgd_update`] into `param`: written into its storage when it
    /// [is exclusive](Tensor::is_exclusive) and f32, else replaced by a new tensor, with the same
    /// values either way. Returns whether the update was made in place.
    pub fn sgd_update_in_place(param: &mut Tensor, grad: &Tensor, lr: f32) -> Result<bool> {
        check_sgd(param, grad)?;
        let f32s = param.dtype() == DType::F32 && grad.dtype() == DType::F32;
        if param.numel() > 0 && f32s && param.is_exclusive() {
            let dev = param.device().clone();
            // In-place kernels are f32 only: anything else took the out-of-place path below.
            if let Some(r) = dev
                .kernels()
                .sgd_update_in_place(param.raw_mut(), grad.raw(), lr)
            {
                r?;
                dev.add_flops(2 * param.numel() as u64);
                return Ok(true);
            }
            param.sub_assign(&grad.mul_scalar(lr)?)?;
            return Ok(true);
        }
        *param = Tensor::sgd_update(param, grad, lr)?;
        Ok(false)
    }
}
