//! `StdConv2d`, the weight-standardized convolution of BiT (timm's `StdConv2d`): each output
//! filter's weight is normalized over its input channels and kernel positions (mean and biased
//! variance, `eps` inside the square root) before the convolution; timm's padding
//! `((stride - 1) + dilation (k - 1)) / 2` by default. The standardization runs in f32 from
//! the master weight (as torch's autocast runs batch_norm in f32), the convolution in the
//! compute dtype.

use wgpipe_autograd::{ForwardCtx, Module, Param, Var};
use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{DType, Device, Result};

use super::{shape_error, Conv2d};
use crate::autocast::compute_input;

#[derive(Module)]
pub struct StdConv2d {
    pub weight: Param,
    pub bias: Option<Param>,
    params: Conv2dParams,
    eps: f32,
}

impl StdConv2d {
    /// A `k x k` convolution without bias (as BiT's) with timm's default padding for
    /// `stride`, PyTorch's Conv2d initialization from `seed`; [`StdConv2d::from_conv`] takes
    /// any other.
    pub fn new(
        c_in: usize,
        c_out: usize,
        k: usize,
        stride: usize,
        eps: f32,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        let pad = StdConv2d::same_padding(k, stride);
        let params = Conv2dParams {
            stride: (stride, stride),
            padding: (pad, pad),
            ..Conv2dParams::default()
        };
        let conv = Conv2d::with_params(c_in, c_out, (k, k), params, false, seed, dev)?;
        Ok(StdConv2d::from_conv(conv, eps))
    }

    /// timm's default padding for a `k x k` kernel at `stride` (dilation 1).
    pub fn same_padding(k: usize, stride: usize) -> usize {
        ((stride - 1) + (k - 1)) / 2
    }

    /// `conv`'s weight, bias and geometry, standardized.
    pub fn from_conv(conv: Conv2d, eps: f32) -> Self {
        StdConv2d {
            params: conv.params(),
            weight: conv.weight,
            bias: conv.bias,
            eps,
        }
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// The standardized weight, in f32.
    pub fn standardized_weight(&self, x: &Var) -> Result<Var> {
        let w = x.tape().param_in(&self.weight, DType::F32)?;
        let shape = w.shape().to_vec();
        let rows = w.reshape(&[shape[0], usize::MAX])?;
        let mean = rows.mean(&[-1], true)?;
        let var = rows.var(&[-1], true)?;
        rows.sub(&mean)?
            .mul(&var.add_scalar(self.eps)?.rsqrt()?)?
            .reshape(&shape)
    }

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let c_in = self.weight.shape()[1] * self.params.groups;
        if x.rank() != 4 || x.shape()[1] != c_in {
            return Err(shape_error(
                "StdConv2d",
                format!("input {:?} must be [N, {c_in}, H, W]", x.shape()),
            ));
        }
        let x = compute_input(x, ctx)?;
        let w = self.standardized_weight(&x)?.to_dtype(x.value().dtype())?;
        let b = match &self.bias {
            Some(b) => Some(x.param(b)?),
            None => None,
        };
        x.conv2d(&w, b.as_ref(), self.params)
    }
}
