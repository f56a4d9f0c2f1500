//! The pre-LN decoder block of `bench_train`'s `block` workload written from primitive ops, as a
//! user writing a new architecture would (and as the PyTorch reference's `Block` is written):
//! a fused QKV `Linear`, `narrow` + `reshape` + `permute` into heads, `q @ k^T` scaled,
//! `masked_fill(-inf)`, `softmax`, `@ v`, heads permuted back, projection, residual,
//! `LayerNorm`, `Linear`, `gelu`, `Linear`, residual. It measures how fast the library runs a
//! model it has no fused layer for; the library's own `TransformerBlock` computes the same
//! function through its fused attention.

use crate::autograd::{CostHint, ForwardCtx, Module, Param, Var};
use crate::models::{causal_mask, LayerNorm, Linear};
use crate::tensor::{Device, Result, Tensor};

pub struct PrimitiveBlock {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    heads: usize,
    d: usize,
    /// `[t, t]`, 1 where a query may not look (built for the sequence length it last saw).
    mask: Tensor,
}

impl PrimitiveBlock {
    /// Width `d`, `heads` heads, MLP 4x, sequences of `t` positions.
    pub fn new(d: usize, heads: usize, t: usize, seed: u64, dev: &Device) -> Result<Self> {
        Ok(PrimitiveBlock {
            ln1: LayerNorm::new(d, dev)?,
            qkv: Linear::new(d, 3 * d, seed, dev)?,
            proj: Linear::new(d, d, seed + 1, dev)?,
            ln2: LayerNorm::new(d, dev)?,
            fc1: Linear::new(d, 4 * d, seed + 2, dev)?,
            fc2: Linear::new(4 * d, d, seed + 3, dev)?,
            heads,
            d,
            mask: causal_mask(t, dev)?,
        })
    }
}

impl Module for PrimitiveBlock {
    fn name(&self) -> String {
        format!("PrimitiveBlock(d={}, heads={})", self.d, self.heads)
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let (b, t, d) = (x.shape()[0], x.shape()[1], self.d);
        let (h, hd) = (self.heads, d / self.heads);
        let qkv = self.qkv.forward(&self.ln1.forward(x, ctx)?, ctx)?;
        // [b, t, 3d] -> three [b, h, t, hd] views.
        let head = |i: usize| {
            qkv.narrow(2, i * d, d)?
                .reshape(&[b, t, h, hd])?
                .permute(&[0, 2, 1, 3])
        };
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let att = q
            .matmul(&k.transpose(-2, -1)?)?
            .mul_scalar(1.0 / (hd as f32).sqrt())?;
        let att = att
            .masked_fill(&self.mask, f32::NEG_INFINITY)?
            .softmax(-1)?;
        let y = att
            .matmul(&v)?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[b, t, d])?;
        let x = x.add(&self.proj.forward(&y, ctx)?)?;
        let m = self.fc1.forward(&self.ln2.forward(&x, ctx)?, ctx)?.gelu()?;
        x.add(&self.fc2.forward(&m, ctx)?)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        crate::autograd::module::ParamList::new()
            .child("ln1", &self.ln1)
            .child("qkv", &self.qkv)
            .child("proj", &self.proj)
            .child("ln2", &self.ln2)
            .child("fc1", &self.fc1)
            .child("fc2", &self.fc2)
            .into()
    }

    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let n: usize = input_shape.iter().product();
        let (t, d) = (input_shape[1], self.d);
        let rows = n / d;
        // The four products of the linear layers and the two of the attention.
        let flops = 2.0 * (rows * d * (3 * d + d + 8 * d)) as f64 + 4.0 * (rows * t * d) as f64;
        CostHint {
            param_bytes: 4 * (12 * d * d + 13 * d),
            flops,
            activation_bytes: 4 * (n * 16 + rows * t * self.heads * 2),
            output_shape: input_shape.to_vec(),
        }
    }
}
