//! `GroupNorm` over NCHW (or any `[N, C, ..]`) as PyTorch's: the channels in `groups` groups,
//! each normalized over its channels and positions with the biased variance and `eps`, then
//! per-channel `weight` and `bias`. On the stream's dtype (autocast), its statistics
//! accumulated in f32 by the kernels, as the other norms.

use wgpipe_autograd::{ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Result, Tensor};

use super::{invalid, shape_error};

#[derive(Module)]
pub struct GroupNorm {
    pub weight: Param,
    pub bias: Param,
    groups: usize,
    channels: usize,
    eps: f32,
}

impl GroupNorm {
    /// Weight ones and bias zeros (PyTorch's `affine` initialization).
    pub fn new(groups: usize, channels: usize, eps: f32, dev: &Device) -> Result<Self> {
        if groups == 0 || !channels.is_multiple_of(groups) || !(eps.is_finite() && eps >= 0.0) {
            return Err(invalid(
                "GroupNorm",
                format!("{groups} groups must divide {channels} channels, eps {eps} must be >= 0"),
            ));
        }
        Ok(GroupNorm {
            weight: Param::new("weight", Tensor::ones(&[channels], dev)?),
            bias: Param::new("bias", Tensor::zeros(&[channels], dev)?),
            groups,
            channels,
            eps,
        })
    }

    pub fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        let shape = x.shape().to_vec();
        if shape.len() < 2 || shape[1] != self.channels {
            return Err(shape_error(
                "GroupNorm",
                format!("input {shape:?} must be [N, {}, ..]", self.channels),
            ));
        }
        let grouped = x.reshape(&[shape[0], self.groups, usize::MAX])?;
        let mean = grouped.mean(&[-1], true)?;
        let var = grouped.var(&[-1], true)?;
        let normed = grouped
            .sub(&mean)?
            .mul(&var.add_scalar(self.eps)?.rsqrt()?)?
            .reshape(&shape)?;
        let mut per_channel = vec![1; shape.len()];
        per_channel[1] = self.channels;
        let w = x.param(&self.weight)?.reshape(&per_channel)?;
        let b = x.param(&self.bias)?.reshape(&per_channel)?;
        normed.mul(&w)?.add(&b)
    }
}
