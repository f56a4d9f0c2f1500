//! `Flatten`: merges every axis from `start` on (default 1: `[N, C, H, W]` to `[N, C*H*W]`).

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::Result;

#[derive(Debug, Clone, Copy)]
pub struct Flatten {
    pub start: usize,
}

impl Default for Flatten {
    fn default() -> Self {
        Flatten { start: 1 }
    }
}

impl Module for Flatten {
    fn name(&self) -> String {
        format!("Flatten({})", self.start)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        if x.shape().len() <= self.start + 1 {
            return Ok(x.clone());
        }
        x.flatten(self.start as isize, -1)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut out: Vec<usize> = input_shape.iter().take(self.start).copied().collect();
        if input_shape.len() > self.start {
            out.push(input_shape[self.start..].iter().product());
        }
        CostHint {
            output_shape: out,
            ..CostHint::default()
        }
    }
}
