//! Parameter-free activations: `Relu`, `Gelu`.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Result, UnaryOp};

use super::f32_bytes;

fn elementwise_cost(input_shape: &[usize], flops_per: f64) -> CostHint {
    CostHint {
        param_bytes: 0,
        flops: flops_per * input_shape.iter().product::<usize>() as f64,
        activation_bytes: f32_bytes(input_shape),
        output_shape: input_shape.to_vec(),
    }
}

/// `max(x, 0)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Relu;

impl Module for Relu {
    fn name(&self) -> String {
        "ReLU".into()
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        x.relu()
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        elementwise_cost(input_shape, 1.0)
    }
}

/// GELU, as PyTorch's `nn.GELU(approximate=...)`: `Exact` is `x Phi(x)` (the tensor op `gelu`),
/// `Tanh` the tanh approximation (`gelu_tanh`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gelu {
    #[default]
    Exact,
    Tanh,
}

impl Gelu {
    /// The tensor op of this form.
    pub fn op(self) -> UnaryOp {
        match self {
            Gelu::Exact => UnaryOp::Gelu,
            Gelu::Tanh => UnaryOp::GeluTanh,
        }
    }
}

impl Module for Gelu {
    fn name(&self) -> String {
        match self {
            Gelu::Exact => "GELU".into(),
            Gelu::Tanh => "GELU(tanh)".into(),
        }
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        match self {
            Gelu::Exact => x.gelu(),
            Gelu::Tanh => x.gelu_tanh(),
        }
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        elementwise_cost(input_shape, 8.0)
    }
}
