//! The pre-LayerNorm Transformer block: `x + drop(attn(ln1(x)))`, then
//! `x + drop(mlp(ln2(x)))` with a 4x MLP and GELU (tanh form unless chosen otherwise). One block is one sequence element.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Result};

use super::{prefix, CausalSelfAttention, Dropout, Gelu, LayerNorm, Linear};
use crate::init::sub_seed;

/// `fc2(gelu(fc1(x)))`, `fc1: d -> hidden`, `fc2: hidden -> d`.
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
    pub gelu: Gelu,
}

impl Mlp {
    /// With the tanh-form GELU (GPT-2's, and this crate's models' from the start).
    pub fn new(d: usize, hidden: usize, seed: u64, dev: &Device) -> Result<Self> {
        Ok(Mlp {
            fc1: Linear::new(d, hidden, sub_seed(seed, 0), dev)?,
            fc2: Linear::new(hidden, d, sub_seed(seed, 1), dev)?,
            gelu: Gelu::Tanh,
        })
    }
}

impl Module for Mlp {
    fn name(&self) -> String {
        format!(
            "Mlp({}->{}->{})",
            self.fc1.in_features(),
            self.fc1.out_features(),
            self.fc2.out_features()
        )
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        // fc1's bias and the GELU in one fused op.
        let h = self.fc1.forward_act(x, Some(self.gelu.op()), ctx)?;
        self.fc2.forward(&h, ctx)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut p = prefix("fc1", self.fc1.parameters());
        p.extend(prefix("fc2", self.fc2.parameters()));
        p
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        chain(&[&self.fc1, &self.gelu, &self.fc2], input_shape)
    }
}

/// Costs of modules applied one after the other.
pub(crate) fn chain(mods: &[&dyn Module], input_shape: &[usize]) -> CostHint {
    let mut total = CostHint::pass_through(input_shape);
    for m in mods {
        let c = m.cost(&total.output_shape);
        total.param_bytes += c.param_bytes;
        total.flops += c.flops;
        total.activation_bytes += c.activation_bytes;
        total.output_shape = c.output_shape;
    }
    total
}

/// Parameters `ln1.*`, `attn.{q,k,v,out}.*` (`attn.{qkv,out}.*` once
/// [packed](TransformerBlock::with_packed_qkv)), `ln2.*`, `mlp.{fc1,fc2}.*`.
/// Dropout sites: 0 attention probabilities, 1 after attention, 2 after the MLP.
pub struct TransformerBlock {
    pub ln1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln2: LayerNorm,
    pub mlp: Mlp,
    pub drop1: Dropout,
    pub drop2: Dropout,
}

impl TransformerBlock {
    pub fn new(
        d_model: usize,
        heads: usize,
        dropout: f32,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        Ok(TransformerBlock {
            ln1: LayerNorm::new(d_model, dev)?,
            attn: CausalSelfAttention::new(d_model, heads, dropout, sub_seed(seed, 0), dev)?,
            ln2: LayerNorm::new(d_model, dev)?,
            mlp: Mlp::new(d_model, 4 * d_model, sub_seed(seed, 1), dev)?,
            drop1: Dropout::new(dropout, 1)?,
            drop2: Dropout::new(dropout, 2)?,
        })
    }

    /// The same block with `gelu` in its MLP (`new` gives the tanh form).
    pub fn with_gelu(mut self, gelu: Gelu) -> Self {
        self.mlp.gelu = gelu;
        self
    }

    /// The same block with its attention's q, k and v projections joined into one
    /// `Linear(d, 3 d)` ([`CausalSelfAttention::packed`]: the same function, fewer passes).
    pub fn with_packed_qkv(mut self) -> Result<Self> {
        self.attn = self.attn.packed()?;
        Ok(self)
    }
}

impl Module for TransformerBlock {
    fn name(&self) -> String {
        format!(
            "TransformerBlock(d={}, heads={})",
            self.mlp.fc1.in_features(),
            self.attn.heads()
        )
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let a = self.attn.forward(&self.ln1.forward(x, ctx)?, ctx)?;
        // The first residual add and ln2 in one pass. The second add stays plain: the next
        // block's ln1 is in another layer (a pipeline stage may end here).
        let (x, h) = self
            .ln2
            .forward_residual(x, &self.drop1.forward(&a, ctx)?)?;
        let m = self.mlp.forward(&h, ctx)?;
        x.add(&self.drop2.forward(&m, ctx)?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut p = prefix("ln1", self.ln1.parameters());
        p.extend(prefix("attn", self.attn.parameters()));
        p.extend(prefix("ln2", self.ln2.parameters()));
        p.extend(prefix("mlp", self.mlp.parameters()));
        p
    }
    fn set_train(&mut self, train: bool) {
        self.attn.set_train(train);
        self.drop1.set_train(train);
        self.drop2.set_train(train);
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut c = chain(
            &[
                &self.ln1,
                &self.attn,
                &self.drop1,
                &self.ln2,
                &self.mlp,
                &self.drop2,
            ],
            input_shape,
        );
        // The two residual additions.
        c.flops += 2.0 * input_shape.iter().product::<usize>() as f64;
        c
    }
}
