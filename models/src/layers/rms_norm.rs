//! `RmsNorm` over the last axis, as transformers' `LlamaRMSNorm`: the statistics in f32
//! whatever the stream's dtype, `x * rsqrt(mean(x^2) + eps)` rounded back to the input's dtype,
//! then times the weight (read in that dtype).

use wgpipe_autograd::{ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{DType, Device, Result, Tensor};

use super::{invalid, shape_error};

#[derive(Module)]
pub struct RmsNorm {
    pub weight: Param,
    dim: usize,
    eps: f32,
}

impl RmsNorm {
    /// Weight ones (transformers' initialization), `eps` (Llama's `rms_norm_eps`, e.g. 1e-6).
    pub fn new(dim: usize, eps: f32, dev: &Device) -> Result<Self> {
        RmsNorm::from_weight(Tensor::ones(&[dim], dev)?, eps)
    }

    /// From a given weight `[dim]`.
    pub fn from_weight(weight: Tensor, eps: f32) -> Result<Self> {
        if weight.rank() != 1 || !(eps.is_finite() && eps >= 0.0) {
            return Err(invalid(
                "RmsNorm",
                format!(
                    "weight must be [dim] and eps finite and >= 0, got weight {:?} and eps {eps}",
                    weight.shape()
                ),
            ));
        }
        Ok(RmsNorm {
            dim: weight.shape()[0],
            weight: Param::new("weight", weight),
            eps,
        })
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    pub fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        if x.shape().last() != Some(&self.dim) {
            return Err(shape_error(
                "RmsNorm",
                format!("input {:?} does not end in dim = {}", x.shape(), self.dim),
            ));
        }
        let dtype = x.value().dtype();
        let h = x.to_dtype(DType::F32)?;
        let mean_square = h.square()?.mean(&[-1], true)?;
        let h = h
            .mul(&mean_square.add_scalar(self.eps)?.rsqrt()?)?
            .to_dtype(dtype)?;
        h.param(&self.weight)?.mul(&h)
    }
}
