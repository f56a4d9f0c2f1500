//! The `Module` trait: what a layer must say so that it can run plain or inside a pipeline stage.

use wgpipe_tensor::{Device, Result};

use crate::param::Param;
use crate::var::Var;

/// Where a forward call happens: which step, micro-batch and layer (the keys of the counter-based
/// RNG, so dropout replays bit-identically on recompute), whether the model trains, and whether
/// this call is a re-materialization (layers with side effects, like batch-norm statistics,
/// must not apply them twice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardCtx {
    pub seed: u64,
    pub step: u64,
    pub micro_batch: u64,
    /// Index of the layer in the whole sequence (not in its stage), so results do not depend
    /// on how the model is cut.
    pub layer: u64,
    pub train: bool,
    pub recompute: bool,
}

impl ForwardCtx {
    /// Context for evaluation (no dropout, no statistics updates).
    pub fn eval() -> Self {
        ForwardCtx {
            seed: 0,
            step: 0,
            micro_batch: 0,
            layer: 0,
            train: false,
            recompute: false,
        }
    }
    /// Context for training step `step`, micro-batch `micro_batch`, with RNG seed `seed`.
    pub fn train(seed: u64, step: u64, micro_batch: u64) -> Self {
        ForwardCtx {
            seed,
            step,
            micro_batch,
            layer: 0,
            train: true,
            recompute: false,
        }
    }
    pub fn at_layer(self, layer: u64) -> Self {
        ForwardCtx { layer, ..self }
    }
    /// The RNG stream of random op number `site` inside this layer: `(seed, offset)` for
    /// `Tensor::dropout_mask`. Distinct for every (step, micro-batch, layer, site).
    pub fn rng_stream(&self, site: u64) -> (u64, u64) {
        let mut h = self.seed ^ 0x9E37_79B9_7F4A_7C15;
        for v in [self.step, self.micro_batch, self.layer, site] {
            h = splitmix64(h ^ v);
        }
        (self.seed, h)
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// What a layer costs for a given input shape; the pipeline balances stages with these.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CostHint {
    pub param_bytes: usize,
    /// Forward FLOPs for the input shape (backward is about twice that).
    pub flops: f64,
    /// Bytes of activations the forward keeps for backward.
    pub activation_bytes: usize,
    pub output_shape: Vec<usize>,
}

/// The name of parameter (or buffer) `name` of layer `layer` in a layer sequence:
/// `"{layer}.{name}"` (e.g. `3.attn.q.weight`). Checkpoint files key tensors by it, so every
/// place that names a sequence's parameters (plain sequences, pipeline stages, checkpoints)
/// calls this one function.
pub fn layer_param_name(layer: usize, name: &str) -> String {
    format!("{layer}.{name}")
}

/// A layer, or a sequence of layers. `Send` so a pipeline stage can own it on its own thread.
pub trait Module: Send {
    /// A short name for reports, e.g. `"Linear(512->512)"`.
    fn name(&self) -> String;
    /// Runs the layer on `x`, recording on `x`'s tape (or not, if the tape does not record).
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var>;
    /// Trainable parameters with hierarchical names relative to this module (e.g. `attn.q.weight`).
    fn parameters(&self) -> Vec<(String, Param)>;
    /// Non-trainable state saved with the model (e.g. batch-norm running statistics).
    fn buffers(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    /// Moves every parameter and buffer to `device`.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        for (_, p) in self.parameters().into_iter().chain(self.buffers()) {
            p.to_device(device)?;
        }
        Ok(())
    }
    /// Train or eval mode (dropout, batch norm).
    fn set_train(&mut self, _train: bool) {}
    /// Called once after all micro-batches of a mini-batch ran forward: deferred updates that
    /// must not depend on the number of micro-batches (batch-norm running statistics).
    fn finish_step(&self) -> Result<()> {
        Ok(())
    }
    /// Cost of one forward on an input of `input_shape`.
    fn cost(&self, input_shape: &[usize]) -> CostHint;
}
