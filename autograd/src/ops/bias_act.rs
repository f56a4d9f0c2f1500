//! A Linear layer's bias and activation after its matmul as one op (see `Tensor::bias_act`).

use wgpipe_tensor::{Result, Tensor, UnaryOp};

use super::{same_tape, when};
use crate::var::Var;

impl Var {
    /// `op(self + bias)`, `bias` `[n]` added along the last axis of `self` `[..., n]`; `op` one
    /// of relu, gelu, gelu_tanh. Backward: `dz = g * op'(z + bias)` in one pass (the sum
    /// recomputed, not stored), `dbias` its sum over the leading axes. Equal bit for bit to
    /// `self.add(bias)?` followed by the activation.
    pub fn bias_act(&self, bias: &Var, op: UnaryOp) -> Result<Var> {
        same_tape("bias_act", &[self, bias])?;
        let y = self.value.bias_act(&bias.value, op)?;
        let (z, b) = (self.value.clone(), bias.value.clone());
        Var::from_op("bias_act", &[self, bias], y, move |g, w| {
            let dz = Tensor::bias_act_grad(&z, &b, g, op)?;
            let db = when(w[1], || dz.sum_to_shape(b.shape()))?;
            Ok(vec![w[0].then_some(dz), db])
        })
    }
}
