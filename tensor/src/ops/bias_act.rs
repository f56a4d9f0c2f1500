//! A Linear layer's bias and activation as one op after its matmul: `op(z + b)` in one pass
//! where the unfused form made two (the broadcast add, then the activation), and its backward.

use wgpipe_shaders::BIAS_ACTIVATIONS;

use crate::backend::UnaryOp;
use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// `op(self + bias)`, `self` `[..., n]`, `bias` `[n]` added along the last axis; `op` one of
    /// relu, gelu, gelu_tanh. Equal bit for bit to `self.add(bias)?.unary(op)`.
    pub fn bias_act(&self, bias: &Tensor, op: UnaryOp) -> Result<Tensor> {
        const OP: &str = "bias_act";
        check(OP, self, bias, op)?;
        let dev = self.device();
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let (z, b) = (self.contiguous()?, bias.contiguous()?);
        let y = dev.run("bias_act", WidenThenRound, [&z, &b], |k, [z, b]| {
            k.bias_act(op, z, b)
        })?;
        dev.add_flops(2 * self.numel() as u64);
        Ok(y)
    }

    /// The gradient of `z` for `y = z.bias_act(bias, op)`, given `g`, the gradient of `y`:
    /// `g * op'(z + bias)` (`z + bias` recomputed, not stored). Its sum over the leading axes is
    /// the bias's gradient.
    pub fn bias_act_grad(z: &Tensor, bias: &Tensor, g: &Tensor, op: UnaryOp) -> Result<Tensor> {
        const OP: &str = "bias_act_grad";
        check(OP, z, bias, op)?;
        z.same_device(OP, g)?;
        if g.shape() != z.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "gradient {:?} must have the input's shape {:?}",
                    g.shape(),
                    z.shape()
                ),
            ));
        }
        let dev = z.device();
        if z.numel() == 0 {
            return z.zeros_like();
        }
        let (z, b, g) = (z.contiguous()?, bias.contiguous()?, g.contiguous()?);
        let dz = dev.run(OP, WidenThenRound, [&z, &b, &g], |k, [z, b, g]| {
            k.bias_act_grad(op, z, b, g)
        })?;
        dev.add_flops(3 * z.numel() as u64);
        Ok(dz)
    }
}

/// Same device, `bias` `[n]` for `z` `[..., n]`, and an activation the kernels are built for.
fn check(op: &'static str, z: &Tensor, bias: &Tensor, act: UnaryOp) -> Result<()> {
    z.same_device(op, bias)?;
    if !BIAS_ACTIVATIONS.contains(&act) {
        return Err(Error::invalid(
            op,
            format!(
                "{} is not one of the fused activations ({})",
                act.name(),
                BIAS_ACTIVATIONS.map(|a| a.name()).join(", ")
            ),
        ));
    }
    match z.shape().last() {
        Some(&n) if bias.shape() == [n] => Ok(()),
        _ => Err(Error::shape(
            op,
            format!(
                "bias {:?} must be [n] for an input [..., n], got input {:?}",
                bias.shape(),
                z.shape()
            ),
        )),
    }
}
