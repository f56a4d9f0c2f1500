//! Embeddings: token lookup (`Embedding`), learned positions (`PositionalEmbedding`), and the
//! two together (`TokenPositionEmbedding`, the first element of the Transformer LM).
//!
//! Token ids travel as f32 values holding integers (the tensor library has one dtype): an
//! `[B, T]` input whose *value* holds ids gives `[B, T, dim]`. The ids get no gradient.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Result, Tensor};

use super::{f32_bytes, prefix, shape_error, Dropout};
use crate::init::{normal, sub_seed};

/// A lookup table `weight [num, dim]`, init `N(0, 1)` as PyTorch's `nn.Embedding`.
pub struct Embedding {
    pub weight: Param,
    num: usize,
    dim: usize,
}

impl Embedding {
    pub fn new(num: usize, dim: usize, seed: u64, dev: &Device) -> Result<Self> {
        Embedding::from_tensor(normal(&[num, dim], 0.0, 1.0, seed, dev)?)
    }
    /// From a given table `[num, dim]`.
    pub fn from_tensor(weight: Tensor) -> Result<Self> {
        if weight.rank() != 2 {
            return Err(shape_error(
                "Embedding",
                format!("weight must be [num, dim], got {:?}", weight.shape()),
            ));
        }
        let (num, dim) = (weight.shape()[0], weight.shape()[1]);
        Ok(Embedding {
            weight: Param::new("weight", weight),
            num,
            dim,
        })
    }
    pub fn dim(&self) -> usize {
        self.dim
    }
    pub fn num(&self) -> usize {
        self.num
    }
    /// Rows of the table for the ids held in `ids` (any shape): `[.., dim]`.
    pub fn lookup(&self, tape_of: &Var, ids: &Tensor) -> Result<Var> {
        let w = tape_of.tape().stored_param(&self.weight);
        let flat = ids.reshape(&[ids.numel()])?;
        let rows = w.index_select(0, &flat)?;
        let mut out = ids.shape().to_vec();
        out.push(self.dim);
        let y = rows.reshape(&out)?;
        // The ids are data: what follows the lookup is activation work (a split backward runs
        // it in its input part, and only the table's gradient in its weight part).
        Ok(if tape_of.is_data() {
            y.depending_on_data()
        } else {
            y
        })
    }
}

impl Module for Embedding {
    fn name(&self) -> String {
        format!("Embedding({}x{})", self.num, self.dim)
    }
    /// The lookup runs in the f32 table and its rows are cast to `ctx.compute` (see
    /// [`crate::autocast`]): repeated ids then add their gradients up in f32 (`index_add`), no
    /// half copy of the table is kept, and the f32 rows live only until the cast.
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        self.lookup(x, x.value())?.to_dtype(ctx.compute)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![("weight".into(), self.weight.clone())]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut out = input_shape.to_vec();
        out.push(self.dim);
        CostHint {
            param_bytes: 4 * self.num * self.dim,
            flops: out.iter().product::<usize>() as f64,
            // Only the ids are kept (for the scatter-add of the gradient).
            activation_bytes: f32_bytes(input_shape),
            output_shape: out,
        }
    }
}

/// Learned absolute positions: adds `weight[t]` to position `t` of a `[B, T, dim]` input
/// (`T <= max_len`). Init `N(0, 1)` like `nn.Embedding`.
pub struct PositionalEmbedding {
    pub weight: Param,
    max_len: usize,
    dim: usize,
}

impl PositionalEmbedding {
    pub fn new(max_len: usize, dim: usize, seed: u64, dev: &Device) -> Result<Self> {
        let w = normal(&[max_len, dim], 0.0, 1.0, seed, dev)?;
        Ok(PositionalEmbedding {
            weight: Param::new("weight", w),
            max_len,
            dim,
        })
    }
    pub fn max_len(&self) -> usize {
        self.max_len
    }
}

impl Module for PositionalEmbedding {
    fn name(&self) -> String {
        format!("PositionalEmbedding({}x{})", self.max_len, self.dim)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        let s = x.shape().to_vec();
        if s.len() < 2 || s[s.len() - 1] != self.dim || s[s.len() - 2] > self.max_len {
            return Err(shape_error(
                "PositionalEmbedding",
                format!(
                    "input {s:?} must be [.., T, {}] with T <= max_len = {}",
                    self.dim, self.max_len
                ),
            ));
        }
        let t = s[s.len() - 2];
        let w = x.param(&self.weight)?;
        x.add(&w.narrow(0, 0, t)?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![("weight".into(), self.weight.clone())]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint {
            param_bytes: 4 * self.max_len * self.dim,
            flops: input_shape.iter().product::<usize>() as f64,
            activation_bytes: 0,
            output_shape: input_shape.to_vec(),
        }
    }
}

/// Token embedding + learned positions (+ dropout): ids `[B, T]` to `[B, T, dim]`.
/// Parameters `tok.weight`, `pos.weight`.
pub struct TokenPositionEmbedding {
    pub tok: Embedding,
    pub pos: PositionalEmbedding,
    pub dropout: Dropout,
}

impl TokenPositionEmbedding {
    pub fn new(
        vocab: usize,
        max_len: usize,
        dim: usize,
        dropout: f32,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        Ok(TokenPositionEmbedding {
            tok: Embedding::new(vocab, dim, sub_seed(seed, 0), dev)?,
            pos: PositionalEmbedding::new(max_len, dim, sub_seed(seed, 1), dev)?,
            dropout: Dropout::new(dropout, 0)?,
        })
    }
}

impl Module for TokenPositionEmbedding {
    fn name(&self) -> String {
        format!(
            "TokenPositionEmbedding({}x{}, max_len {})",
            self.tok.num, self.tok.dim, self.pos.max_len
        )
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let h = self.tok.forward(x, ctx)?;
        let h = self.pos.forward(&h, ctx)?;
        self.dropout.forward(&h, ctx)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut v = prefix("tok", self.tok.parameters());
        v.extend(prefix("pos", self.pos.parameters()));
        v
    }
    fn set_train(&mut self, train: bool) {
        self.dropout.set_train(train);
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let a = self.tok.cost(input_shape);
        let b = self.pos.cost(&a.output_shape);
        let c = self.dropout.cost(&b.output_shape);
        CostHint {
            param_bytes: a.param_bytes + b.param_bytes,
            flops: a.flops + b.flops + c.flops,
            activation_bytes: a.activation_bytes + b.activation_bytes + c.activation_bytes,
            output_shape: c.output_shape,
        }
    }
}
