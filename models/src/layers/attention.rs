//! Causal multi-head self-attention: `q, k, v, out` projections (`Linear(d, d)` each; q, k and v
//! may be joined into one `Linear(d, 3 d)`, see [`QkvProjection`]), scores
//! `q k^T / sqrt(d_head)`, the future masked out, softmax, optional dropout on the
//! probabilities, heads merged and projected. Input and output `[B, T, d]`.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Error, Result, Tensor};

use super::{f32_bytes, prefix, shape_error, Dropout, Linear};
use crate::init::sub_seed;

/// Added where a query may not look in the unfused form of the attention (what
/// `Var::causal_attention` replaces, kept as its reference): large and finite, so softmax gives an
/// exact 0 there and no `inf - inf` can appear on any backend.
pub const MASK_VALUE: f32 = -1e9;

/// `[t, t]` with 1 where key `j` lies in the future of query `i` (`j > i`), else 0.
pub fn causal_mask(t: usize, dev: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t)
        .map(|k| if k % t > k / t { 1.0 } else { 0.0 })
        .collect();
    Tensor::from_vec(v, &[t, t], dev)
}

/// How [`CausalSelfAttention`] projects its input to queries, keys and values.
pub enum QkvProjection {
    /// Three `Linear(d, d)`; parameters `q.*`, `k.*`, `v.*` (the layout of the main job's
    /// model and of its PyTorch reference).
    Separate { q: Linear, k: Linear, v: Linear },
    /// One `Linear(d, 3 d)` whose outputs are the queries, keys and values in that order;
    /// parameters `qkv.*` (nanoGPT's `c_attn`, the fused QKV of `bench_train`'s PyTorch block).
    /// One product where `Separate` makes three, both forward and backward, and the input's
    /// gradient comes out of one product instead of three summed
    /// ([`Var::causal_attention_packed`] takes the packed output as it is).
    Packed(Linear),
}

pub struct CausalSelfAttention {
    pub qkv: QkvProjection,
    pub out: Linear,
    heads: usize,
    d_model: usize,
    /// Dropout on the attention probabilities (site 0).
    pub attn_dropout: Dropout,
}

impl CausalSelfAttention {
    /// With separate q, k and v projections ([`CausalSelfAttention::packed`] joins them).
    pub fn new(
        d_model: usize,
        heads: usize,
        attn_dropout: f32,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        if heads == 0 || !d_model.is_multiple_of(heads) {
            return Err(Error::Invalid {
                op: "CausalSelfAttention",
                msg: format!("d_model = {d_model} is not a multiple of heads = {heads}"),
            });
        }
        Ok(CausalSelfAttention {
            qkv: QkvProjection::Separate {
                q: Linear::new(d_model, d_model, sub_seed(seed, 0), dev)?,
                k: Linear::new(d_model, d_model, sub_seed(seed, 1), dev)?,
                v: Linear::new(d_model, d_model, sub_seed(seed, 2), dev)?,
            },
            out: Linear::new(d_model, d_model, sub_seed(seed, 3), dev)?,
            heads,
            d_model,
            attn_dropout: Dropout::new(attn_dropout, 0)?,
        })
    }

    /// The same attention with its q, k and v projections joined into one `Linear(d, 3 d)`
    /// ([`QkvProjection::Packed`]): its weight is q's, k's and v's stacked (rows `0..d` q's),
    /// its bias theirs concatenated, so it computes the same function. A packed one stays so.
    pub fn packed(mut self) -> Result<Self> {
        if let QkvProjection::Separate { q, k, v } = &self.qkv {
            let stacked = |ts: [Tensor; 3]| Tensor::concat(&[&ts[0], &ts[1], &ts[2]], 0);
            let weight = stacked([q.weight.value(), k.weight.value(), v.weight.value()])?;
            let bias = match (&q.bias, &k.bias, &v.bias) {
                (Some(a), Some(b), Some(c)) => Some(stacked([a.value(), b.value(), c.value()])?),
                (None, None, None) => None,
                _ => {
                    return Err(Error::Invalid {
                        op: "CausalSelfAttention::packed",
                        msg: "q, k and v must all have a bias or all have none".into(),
                    })
                }
            };
            self.qkv = QkvProjection::Packed(Linear::from_tensors(weight, bias)?);
        }
        Ok(self)
    }

    pub fn heads(&self) -> usize {
        self.heads
    }
}

impl Module for CausalSelfAttention {
    fn name(&self) -> String {
        format!(
            "CausalSelfAttention(d={}, heads={})",
            self.d_model, self.heads
        )
    }

    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if let Some(p) = ctx.kv_position {
            // Without its keys and values, one new token would attend to itself alone.
            return Err(super::invalid(
                "CausalSelfAttention",
                format!(
                    "keeps no KV cache (asked to decode at position {p}): generate without one"
                ),
            ));
        }
        let s = x.shape().to_vec();
        if s.len() != 3 || s[2] != self.d_model {
            return Err(shape_error(
                "CausalSelfAttention",
                format!("input {s:?} must be [B, T, {}]", self.d_model),
            ));
        }
        let (b, t, h) = (s[0], s[1], self.heads);
        let dh = self.d_model / h;
        let scale = 1.0 / (dh as f32).sqrt();
        // The multipliers in the scores' dtype (autocast), `1 / (1 - p)` rounded once.
        let drop = |dtype| -> Result<Option<Tensor>> {
            self.attn_dropout
                .mask(&[b, h, t, t], ctx, x.value().device())?
                .map(|m| m.to_dtype(dtype))
                .transpose()
        };
        // Each fused attention op equals the unfused chain `(q k^T * scale)
        // .masked_fill(causal_mask, MASK_VALUE).softmax(-1)`, dropout, `@ v` (the reference the
        // tests compare with).
        let y = match &self.qkv {
            QkvProjection::Separate { q, k, v } => {
                // [B, T, d] -> [B, H, T, dh]
                let split =
                    |y: Var| -> Result<Var> { y.reshape(&[b, t, h, dh])?.permute(&[0, 2, 1, 3]) };
                let q = split(q.forward(x, ctx)?)?;
                let k = split(k.forward(x, ctx)?)?;
                let v = split(v.forward(x, ctx)?)?;
                let drop = drop(q.value().dtype())?;
                q.causal_attention(&k, &v, scale, drop.as_ref())?
                    // [B, H, T, dh] -> [B, T, d]
                    .permute(&[0, 2, 1, 3])?
                    .reshape(&[b, t, self.d_model])?
            }
            QkvProjection::Packed(qkv) => {
                let qkv = qkv.forward(x, ctx)?;
                let drop = drop(qkv.value().dtype())?;
                qkv.causal_attention_packed(h, scale, drop.as_ref())?
            }
        };
        self.out.forward(&y, ctx)
    }

    fn parameters(&self) -> Vec<(String, Param)> {
        let mut p = match &self.qkv {
            QkvProjection::Separate { q, k, v } => {
                let mut p = prefix("q", q.parameters());
                p.extend(prefix("k", k.parameters()));
                p.extend(prefix("v", v.parameters()));
                p
            }
            QkvProjection::Packed(qkv) => prefix("qkv", qkv.parameters()),
        };
        p.extend(prefix("out", self.out.parameters()));
        p
    }

    fn set_train(&mut self, train: bool) {
        self.attn_dropout.set_train(train);
    }

    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let proj = self.out.cost(input_shape);
        let (b, t) = match input_shape {
            [b, t, _] => (*b, *t),
            _ => (1, 1),
        };
        let d = self.d_model;
        let scores = b * self.heads * t * t;
        // 4 projections, q k^T and probs v (2 * b * t * t * d each), softmax (~5 per score).
        let flops = 4.0 * proj.flops + 4.0 * (b * t * t * d) as f64 + 5.0 * scores as f64;
        // Projection inputs (x once for q/k/v, y for out), q, k, v, probs (and mask).
        let act = 2 * f32_bytes(input_shape)
            + 3 * f32_bytes(input_shape)
            + 4 * scores * if self.attn_dropout.p() > 0.0 { 2 } else { 1 };
        CostHint {
            param_bytes: 4 * proj.param_bytes,
            flops,
            activation_bytes: act,
            output_shape: input_shape.to_vec(),
        }
    }
}
