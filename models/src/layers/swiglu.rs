//! The gated MLP of Llama (transformers' `LlamaMLP`): `down_proj(silu(gate_proj(x)) *
//! up_proj(x))`, the three projections without bias by default (`mlp_bias`).

use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_tensor::{Device, Result};

use super::Linear;
use crate::init::sub_seed;

#[derive(Module)]
pub struct SwiGluMlp {
    #[wgpipe(module)]
    pub gate_proj: Linear,
    #[wgpipe(module)]
    pub up_proj: Linear,
    #[wgpipe(module)]
    pub down_proj: Linear,
}

impl SwiGluMlp {
    /// `hidden -> intermediate -> hidden`, PyTorch's Linear initialization from `seed`.
    pub fn new(
        hidden: usize,
        intermediate: usize,
        bias: bool,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        Ok(SwiGluMlp {
            gate_proj: Linear::with_bias(hidden, intermediate, bias, sub_seed(seed, 0), dev)?,
            up_proj: Linear::with_bias(hidden, intermediate, bias, sub_seed(seed, 1), dev)?,
            down_proj: Linear::with_bias(intermediate, hidden, bias, sub_seed(seed, 2), dev)?,
        })
    }

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let gate = self.gate_proj.forward(x, ctx)?.silu()?;
        let up = self.up_proj.forward(x, ctx)?;
        self.down_proj.forward(&gate.mul(&up)?, ctx)
    }
}
