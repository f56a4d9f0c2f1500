//! `LayerNorm` over the last axis: gamma 1, beta 0, eps 1e-5 (PyTorch's defaults).

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Result, Tensor};

use super::{f32_bytes, shape_error};

pub struct LayerNorm {
    pub weight: Param,
    pub bias: Param,
    dim: usize,
    eps: f32,
}

impl LayerNorm {
    pub fn new(dim: usize, dev: &Device) -> Result<Self> {
        LayerNorm::with_eps(dim, 1e-5, dev)
    }
    pub fn with_eps(dim: usize, eps: f32, dev: &Device) -> Result<Self> {
        Ok(LayerNorm {
            weight: Param::new("weight", Tensor::ones(&[dim], dev)?),
            bias: Param::new("bias", Tensor::zeros(&[dim], dev)?),
            dim,
            eps,
        })
    }
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// `(x + r, self(x + r))` in one fused pass (a pre-LN block's residual add and the norm
    /// after it), bit for bit the add and then [`Module::forward`].
    pub fn forward_residual(&self, x: &Var, r: &Var) -> Result<(Var, Var)> {
        self.check_input(x)?;
        x.add_layer_norm(r, &x.param(&self.weight)?, &x.param(&self.bias)?, self.eps)
    }

    fn check_input(&self, x: &Var) -> Result<()> {
        if x.shape().last() != Some(&self.dim) {
            return Err(shape_error(
                "LayerNorm",
                format!("input {:?} does not end in dim = {}", x.shape(), self.dim),
            ));
        }
        Ok(())
    }
}

impl Module for LayerNorm {
    fn name(&self) -> String {
        format!("LayerNorm({})", self.dim)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        self.check_input(x)?;
        // On the stream's dtype (autocast); the statistics accumulate in f32 in the kernel.
        x.layer_norm(&x.param(&self.weight)?, &x.param(&self.bias)?, self.eps)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("weight".into(), self.weight.clone()),
            ("bias".into(), self.bias.clone()),
        ]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let n = input_shape.iter().product::<usize>();
        let rows = n / self.dim.max(1);
        CostHint {
            param_bytes: 8 * self.dim,
            flops: 8.0 * n as f64,
            // The input plus mean and rstd per row.
            activation_bytes: f32_bytes(input_shape) + 8 * rows,
            output_shape: input_shape.to_vec(),
        }
    }
}
