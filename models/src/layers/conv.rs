//! `Conv2d` (NCHW), weight `[c_out, c_in/groups, kh, kw]`, PyTorch's init with
//! `fan_in = c_in/groups * kh * kw`; stride, padding, dilation and groups (depthwise when
//! `groups == c_in`).

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{Device, Error, Result, Tensor};

use super::{f32_bytes, shape_error};
use crate::autocast::compute_input;
use crate::init::{kaiming_uniform, sub_seed};

pub struct Conv2d {
    pub weight: Param,
    pub bias: Option<Param>,
    c_in: usize,
    c_out: usize,
    kernel: (usize, usize),
    params: Conv2dParams,
}

/// Output size of a convolution or pooling window along one axis.
pub(crate) fn conv_out(size: usize, k: usize, stride: usize, pad: usize, dil: usize) -> usize {
    let span = dil * (k.max(1) - 1) + 1;
    (size + 2 * pad).saturating_sub(span) / stride.max(1) + 1
}

impl Conv2d {
    /// A square `k x k` convolution with bias, stride 1, padding 0.
    pub fn new(c_in: usize, c_out: usize, k: usize, seed: u64, dev: &Device) -> Result<Self> {
        Conv2d::with_params(
            c_in,
            c_out,
            (k, k),
            Conv2dParams::default(),
            true,
            seed,
            dev,
        )
    }

    /// Every option: kernel `(kh, kw)`, `params` (stride, padding, dilation, groups), bias.
    pub fn with_params(
        c_in: usize,
        c_out: usize,
        kernel: (usize, usize),
        params: Conv2dParams,
        bias: bool,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        let g = params.groups;
        if g == 0 || !c_in.is_multiple_of(g) || !c_out.is_multiple_of(g) {
            return Err(Error::Invalid {
                op: "Conv2d",
                msg: format!("groups = {g} must divide c_in = {c_in} and c_out = {c_out}"),
            });
        }
        let fan_in = c_in / g * kernel.0 * kernel.1;
        let w = kaiming_uniform(
            &[c_out, c_in / g, kernel.0, kernel.1],
            fan_in,
            sub_seed(seed, 0),
            dev,
        )?;
        let b = if bias {
            Some(kaiming_uniform(&[c_out], fan_in, sub_seed(seed, 1), dev)?)
        } else {
            None
        };
        Ok(Conv2d {
            weight: Param::new("weight", w),
            bias: b.map(|b| Param::new("bias", b)),
            c_in,
            c_out,
            kernel,
            params,
        })
    }

    /// From given values: `weight [c_out, c_in/groups, kh, kw]`, `bias [c_out]`.
    pub fn from_tensors(
        weight: Tensor,
        bias: Option<Tensor>,
        params: Conv2dParams,
    ) -> Result<Self> {
        if weight.rank() != 4 {
            return Err(shape_error(
                "Conv2d",
                format!(
                    "weight must be [c_out, c_in/groups, kh, kw], got {:?}",
                    weight.shape()
                ),
            ));
        }
        let s = weight.shape().to_vec();
        Ok(Conv2d {
            weight: Param::new("weight", weight),
            bias: bias.map(|b| Param::new("bias", b)),
            c_in: s[1] * params.groups,
            c_out: s[0],
            kernel: (s[2], s[3]),
            params,
        })
    }

    pub fn params(&self) -> Conv2dParams {
        self.params
    }
    pub fn c_out(&self) -> usize {
        self.c_out
    }

    /// `[N, c_out, H', W']` for an input `[N, c_in, H, W]`.
    pub fn output_shape(&self, input_shape: &[usize]) -> Vec<usize> {
        let p = &self.params;
        match input_shape {
            [n, _, h, w] => vec![
                *n,
                self.c_out,
                conv_out(*h, self.kernel.0, p.stride.0, p.padding.0, p.dilation.0),
                conv_out(*w, self.kernel.1, p.stride.1, p.padding.1, p.dilation.1),
            ],
            _ => input_shape.to_vec(),
        }
    }
}

impl Module for Conv2d {
    fn name(&self) -> String {
        let p = &self.params;
        format!(
            "Conv2d({}->{}, {}x{}, stride {:?}, pad {:?}{})",
            self.c_in,
            self.c_out,
            self.kernel.0,
            self.kernel.1,
            p.stride,
            p.padding,
            if p.groups > 1 {
                format!(", groups {}", p.groups)
            } else {
                String::new()
            }
        )
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if x.shape().len() != 4 || x.shape()[1] != self.c_in {
            return Err(shape_error(
                "Conv2d",
                format!("input {:?} must be [N, {}, H, W]", x.shape(), self.c_in),
            ));
        }
        let x = compute_input(x, ctx)?;
        let w = x.param(&self.weight)?;
        let b = match &self.bias {
            Some(b) => Some(x.param(b)?),
            None => None,
        };
        x.conv2d(&w, b.as_ref(), self.params)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }

    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let out = self.output_shape(input_shape);
        let per_out = self.c_in / self.params.groups.max(1) * self.kernel.0 * self.kernel.1;
        let nout: usize = out.iter().product();
        let nparams = self.c_out * per_out + if self.bias.is_some() { self.c_out } else { 0 };
        CostHint {
            param_bytes: 4 * nparams,
            flops: 2.0 * (nout * per_out) as f64,
            activation_bytes: f32_bytes(input_shape),
            output_shape: out,
        }
    }
}
