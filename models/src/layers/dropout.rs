//! `Dropout`: zeroes elements with probability `p` in training and scales the rest by
//! `1/(1-p)`. The mask comes from the counter-based RNG keyed by the [`ForwardCtx`] (seed, step,
//! micro-batch, layer) and this layer's `site`, so a recompute replays it bit for bit.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Error, Result, Tensor};

use super::f32_bytes;

#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    p: f32,
    /// Distinguishes the random ops inside one sequence element (e.g. 0: attention
    /// probabilities, 1: after attention, 2: after the MLP).
    site: u64,
    train: bool,
}

impl Dropout {
    pub fn new(p: f32, site: u64) -> Result<Self> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Invalid {
                op: "Dropout",
                msg: format!("p must be in [0, 1), got {p}"),
            });
        }
        Ok(Dropout {
            p,
            site,
            train: true,
        })
    }
    pub fn p(&self) -> f32 {
        self.p
    }
    /// Whether this call drops anything.
    pub fn active(&self, ctx: &ForwardCtx) -> bool {
        self.p > 0.0 && self.train && ctx.train
    }
    /// The multipliers this layer would apply to an input of `shape` (for a fused op that
    /// applies them itself), or `None` when it drops nothing.
    pub fn mask(&self, shape: &[usize], ctx: &ForwardCtx, dev: &Device) -> Result<Option<Tensor>> {
        if !self.active(ctx) {
            return Ok(None);
        }
        ctx.dropout_mask(shape, self.p, self.site, dev)
    }
}

impl Module for Dropout {
    fn name(&self) -> String {
        format!("Dropout({})", self.p)
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if !self.active(ctx) {
            return Ok(x.clone());
        }
        x.dropout(self.p, ctx, self.site)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn set_train(&mut self, train: bool) {
        self.train = train;
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let n = input_shape.iter().product::<usize>();
        CostHint {
            param_bytes: 0,
            flops: if self.p > 0.0 { 2.0 * n as f64 } else { 0.0 },
            // The mask is kept (or replayed) for backward.
            activation_bytes: if self.p > 0.0 {
                f32_bytes(input_shape)
            } else {
                0
            },
            output_shape: input_shape.to_vec(),
        }
    }
}
