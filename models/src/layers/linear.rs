//! `Linear`: `y = x W^T + b` over the last axis, weight `[out, in]` as in PyTorch.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Result, Tensor, UnaryOp, BIAS_ACTIVATIONS};

use super::{f32_bytes, shape_error};
use crate::autocast::compute_input;
use crate::init::{kaiming_uniform, sub_seed};

pub struct Linear {
    pub weight: Param,
    pub bias: Option<Param>,
    in_features: usize,
    out_features: usize,
    /// Applied to the output, fused with the bias (`Var::bias_act`) when there is one.
    activation: Option<UnaryOp>,
}

impl Linear {
    /// With a bias; PyTorch's init: weight and bias `U(-1/sqrt(in), 1/sqrt(in))`.
    pub fn new(in_features: usize, out_features: usize, seed: u64, dev: &Device) -> Result<Self> {
        Linear::with_bias(in_features, out_features, true, seed, dev)
    }

    pub fn with_bias(
        in_features: usize,
        out_features: usize,
        bias: bool,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        let w = kaiming_uniform(
            &[out_features, in_features],
            in_features,
            sub_seed(seed, 0),
            dev,
        )?;
        let b = if bias {
            Some(kaiming_uniform(
                &[out_features],
                in_features,
                sub_seed(seed, 1),
                dev,
            )?)
        } else {
            None
        };
        Linear::from_tensors(w, b)
    }

    /// From given values: `weight [out, in]`, `bias [out]`.
    pub fn from_tensors(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Linear::from_params(
            Param::new("weight", weight),
            bias.map(|b| Param::new("bias", b)),
        )
    }

    /// From given parameters (e.g. a tied copy of another layer's): `weight [out, in]`,
    /// `bias [out]`.
    pub fn from_params(weight: Param, bias: Option<Param>) -> Result<Self> {
        let (weight_p, bias_p) = (weight, bias);
        let weight = weight_p.value();
        let bias = bias_p.as_ref().map(|b| b.value());
        if weight.rank() != 2 {
            return Err(shape_error(
                "Linear",
                format!("weight must be [out, in], got {:?}", weight.shape()),
            ));
        }
        let (out_features, in_features) = (weight.shape()[0], weight.shape()[1]);
        if let Some(b) = &bias {
            if b.shape() != [out_features] {
                return Err(shape_error(
                    "Linear",
                    format!(
                        "bias must be [{out_features}], got {:?} (weight {:?})",
                        b.shape(),
                        weight.shape()
                    ),
                ));
            }
        }
        Ok(Linear {
            weight: weight_p,
            bias: bias_p,
            in_features,
            out_features,
            activation: None,
        })
    }

    /// The same layer followed by `act` (one of `wgpipe_tensor::BIAS_ACTIVATIONS`: relu, gelu,
    /// gelu_tanh), applied with the bias in one fused op.
    pub fn with_activation(mut self, act: UnaryOp) -> Result<Self> {
        if !BIAS_ACTIVATIONS.contains(&act) {
            return Err(shape_error(
                "Linear",
                format!("{} is not an activation Linear can fuse", act.name()),
            ));
        }
        self.activation = Some(act);
        Ok(self)
    }

    pub fn activation(&self) -> Option<UnaryOp> {
        self.activation
    }

    /// `act(x W^T + b)`: the forward with `act` in place of this layer's own activation (an
    /// MLP applies its GELU here, fused with the bias), in `ctx.compute` (see
    /// [`crate::autocast`]).
    pub fn forward_act(&self, x: &Var, act: Option<UnaryOp>, ctx: &ForwardCtx) -> Result<Var> {
        let shape = x.shape().to_vec();
        if shape.last() != Some(&self.in_features) {
            return Err(shape_error(
                "Linear",
                format!(
                    "input {shape:?} does not end in in_features = {} (weight [{}, {}])",
                    self.in_features, self.out_features, self.in_features
                ),
            ));
        }
        let x = &compute_input(x, ctx)?;
        let w = x.param(&self.weight)?;
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let x2 = if shape.len() == 2 {
            x.clone()
        } else {
            x.reshape(&[rows, self.in_features])?
        };
        let mut y = x2.matmul(&w.t()?)?;
        y = match (&self.bias, act) {
            (Some(b), Some(act)) => y.bias_act(&x.param(b)?, act)?,
            (Some(b), None) => y.add(&x.param(b)?)?,
            (None, Some(act)) => y.unary(act)?,
            (None, None) => y,
        };
        if shape.len() == 2 {
            return Ok(y);
        }
        let mut out = shape;
        *out.last_mut().unwrap() = self.out_features;
        y.reshape(&out)
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }
    pub fn out_features(&self) -> usize {
        self.out_features
    }
}

impl Module for Linear {
    fn name(&self) -> String {
        let act = self.activation.map(|a| format!(" + {}", a.name()));
        format!(
            "Linear({}->{}){}",
            self.in_features,
            self.out_features,
            act.unwrap_or_default()
        )
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        self.forward_act(x, self.activation, ctx)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }

    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let rows: usize = input_shape[..input_shape.len().saturating_sub(1)]
            .iter()
            .product();
        let mut out = input_shape.to_vec();
        if let Some(l) = out.last_mut() {
            *l = self.out_features;
        }
        let nparams = self.in_features * self.out_features
            + if self.bias.is_some() {
                self.out_features
            } else {
                0
            };
        CostHint {
            param_bytes: 4 * nparams,
            flops: 2.0 * (rows * self.in_features * self.out_features) as f64
                + (rows * self.out_features) as f64
                    * (self.bias.is_some() as u8 + self.activation.is_some() as u8) as f64,
            // The input is kept for the weight gradient, and the matmul's output for the
            // activation's.
            activation_bytes: f32_bytes(input_shape)
                + if self.activation.is_some() {
                    f32_bytes(&out)
                } else {
                    0
                },
            output_shape: out,
        }
    }
}
