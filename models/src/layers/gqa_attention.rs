//! Causal self-attention with grouped-query heads and rotary positions, as transformers'
//! `LlamaAttention`: `q_proj` to `heads` heads of `head_dim`, `k_proj` and `v_proj` to
//! `kv_heads` heads (query head `h` reads key/value head `h / (heads / kv_heads)`), RoPE on the
//! queries and keys, scores scaled by `head_dim^-0.5`, `o_proj` back to the hidden size.

use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_tensor::{Device, Result, Tensor};

use super::{invalid, shape_error, Linear, Rope};
use crate::init::sub_seed;

/// The sizes of a [`GqaAttention`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GqaShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl GqaShape {
    /// Fails unless every size is positive and `kv_heads` divides `heads`.
    pub fn check(&self) -> Result<()> {
        let GqaShape {
            hidden,
            heads,
            kv_heads,
            head_dim,
        } = *self;
        if hidden == 0 || heads == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(invalid(
                "GqaAttention",
                format!("sizes must be positive: {self:?}"),
            ));
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(invalid(
                "GqaAttention",
                format!("num_key_value_heads = {kv_heads} does not divide num_attention_heads = {heads}"),
            ));
        }
        Ok(())
    }
}

#[derive(Module)]
pub struct GqaAttention {
    #[wgpipe(module)]
    pub q_proj: Linear,
    #[wgpipe(module)]
    pub k_proj: Linear,
    #[wgpipe(module)]
    pub v_proj: Linear,
    #[wgpipe(module)]
    pub o_proj: Linear,
    shape: GqaShape,
    rope: Rope,
    /// Keys and values kept for cached decoding (see `ForwardCtx::kv_position`).
    cache: KvCache,
}

/// The keys and values (`[B, kv_heads, positions, d]`, after the rotation) of each micro-batch
/// decoded with a KV cache, so that each new token attends to them without recomputing them.
#[derive(Default)]
struct KvCache(std::sync::Mutex<std::collections::HashMap<u64, Cached>>);

/// One micro-batch's keys and values: buffers of `[B, kv_heads, capacity, d]` whose first `len`
/// positions are filled. A new token is written into them in place (on the host), and they
/// double when full, so that decoding T tokens copies O(T) values, not O(T^2) as appending by
/// concatenation did (a fresh buffer of the whole cache per token and layer: at 1500 tokens about
/// a fifth of the profile was that copy and the new pages' faults).
struct Cached {
    k: Tensor,
    v: Tensor,
    len: usize,
}

/// The least capacity a cache starts with, in positions.
const MIN_CACHE_POSITIONS: usize = 64;

/// `buf`'s first `len` positions in a buffer of `capacity` positions, zeros after them.
fn regrown(buf: &Tensor, len: usize, capacity: usize) -> Result<Tensor> {
    let mut shape = buf.shape().to_vec();
    shape[2] = capacity;
    let mut grown = Tensor::zeros(&shape, buf.device())?.to_dtype(buf.dtype())?;
    grown.write_narrow(2, 0, &buf.narrow(2, 0, len)?)?;
    Ok(grown)
}

impl KvCache {
    /// `k`, `v` of the positions from `start` appended to micro-batch `mb`'s (its cache begun
    /// anew at `start = 0`): the keys and values of every position so far (views of the
    /// cache's buffers).
    fn extend(&self, mb: u64, start: usize, k: &Var, v: &Var) -> Result<(Tensor, Tensor)> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (k, v) = (k.value(), v.value());
        let t = k.shape()[2];
        if start == 0 {
            map.remove(&mb);
        } else {
            let held = map.get(&mb).map(|c| c.len).ok_or_else(|| {
                invalid(
                    "GqaAttention",
                    format!("no KV cache for micro-batch {mb}: decode position 0 (the prompt) first, not {start}"),
                )
            })?;
            if held != start {
                return Err(invalid(
                    "GqaAttention",
                    format!("the KV cache of micro-batch {mb} holds {held} positions; a call at position {start} does not follow it"),
                ));
            }
        }
        let need = start + t;
        let mut c = match map.remove(&mb) {
            Some(c) if c.k.shape()[2] >= need => c,
            old => {
                let capacity = need.next_power_of_two().max(MIN_CACHE_POSITIONS);
                let (ok, ov) = match &old {
                    Some(c) => (
                        regrown(&c.k, c.len, capacity)?,
                        regrown(&c.v, c.len, capacity)?,
                    ),
                    None => (regrown(k, 0, capacity)?, regrown(v, 0, capacity)?),
                };
                Cached {
                    k: ok,
                    v: ov,
                    len: start,
                }
            }
        };
        c.k.write_narrow(2, start, k)?;
        c.v.write_narrow(2, start, v)?;
        c.len = need;
        let views = (c.k.narrow(2, 0, need)?, c.v.narrow(2, 0, need)?);
        map.insert(mb, c);
        Ok(views)
    }
}

impl GqaAttention {
    /// Projections with PyTorch's Linear initialization from `seed`, biased when `bias`
    /// (transformers' `attention_bias`; `o_proj` too, as there).
    pub fn new(shape: GqaShape, rope: Rope, bias: bool, seed: u64, dev: &Device) -> Result<Self> {
        shape.check()?;
        let (h, q, kv) = (
            shape.hidden,
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        GqaAttention::from_projections(
            [
                Linear::with_bias(h, q, bias, sub_seed(seed, 0), dev)?,
                Linear::with_bias(h, kv, bias, sub_seed(seed, 1), dev)?,
                Linear::with_bias(h, kv, bias, sub_seed(seed, 2), dev)?,
                Linear::with_bias(q, h, bias, sub_seed(seed, 3), dev)?,
            ],
            shape,
            rope,
        )
    }

    /// From given `[q_proj, k_proj, v_proj, o_proj]`, checked against `shape` and `rope`.
    pub fn from_projections(projections: [Linear; 4], shape: GqaShape, rope: Rope) -> Result<Self> {
        shape.check()?;
        let [q_proj, k_proj, v_proj, o_proj] = projections;
        let (q, kv) = (
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        );
        let want = [
            (shape.hidden, q),
            (shape.hidden, kv),
            (shape.hidden, kv),
            (q, shape.hidden),
        ];
        for ((name, l), (i, o)) in ["q_proj", "k_proj", "v_proj", "o_proj"]
            .iter()
            .zip([&q_proj, &k_proj, &v_proj, &o_proj])
            .zip(want)
        {
            if (l.in_features(), l.out_features()) != (i, o) {
                return Err(shape_error(
                    "GqaAttention",
                    format!(
                        "{name} must map {i} -> {o} for {shape:?}, got {} -> {}",
                        l.in_features(),
                        l.out_features()
                    ),
                ));
            }
        }
        if rope.head_dim() != shape.head_dim {
            return Err(invalid(
                "GqaAttention",
                format!(
                    "the rotary embedding is for head_dim {}, the heads have {}",
                    rope.head_dim(),
                    shape.head_dim
                ),
            ));
        }
        Ok(GqaAttention {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            shape,
            rope,
            cache: KvCache::default(),
        })
    }

    pub fn shape(&self) -> GqaShape {
        self.shape
    }

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let s = x.shape().to_vec();
        let GqaShape {
            hidden,
            heads,
            kv_heads,
            head_dim: d,
        } = self.shape;
        if s.len() != 3 || s[2] != hidden {
            return Err(shape_error(
                "GqaAttention",
                format!("input {s:?} must be [B, T, {hidden}]"),
            ));
        }
        let (b, t, group) = (s[0], s[1], heads / kv_heads);
        let start = ctx.kv_position.unwrap_or(0);
        // [B, T, n * d] -> [B, n, T, d], then the rotation of each position.
        let split = |y: Var, n: usize| y.reshape(&[b, t, n, d])?.permute(&[0, 2, 1, 3]);
        let q = self
            .rope
            .apply(&split(self.q_proj.forward(x, ctx)?, heads)?, start)?;
        let k = self
            .rope
            .apply(&split(self.k_proj.forward(x, ctx)?, kv_heads)?, start)?;
        let v = split(self.v_proj.forward(x, ctx)?, kv_heads)?;
        let scale = 1.0 / (d as f32).sqrt();
        if ctx.kv_position.is_some() {
            let (k_all, v_all) = self.cache.extend(ctx.micro_batch, start, &k, &v)?;
            if start > 0 {
                return self.attend_cached(&q, &k_all, &v_all, [b, t, start], scale, ctx);
            }
        }
        // The queries as [B, kv_heads, group, T, d] and each key/value head broadcast over its
        // group (a view): the repeat of K and V is never written out, and their gradients sum
        // over the group in the broadcast's backward.
        let grouped = [b, kv_heads, group, t, d];
        let q = q.reshape(&grouped)?;
        let k = k.unsqueeze(2)?.broadcast_to(&grouped)?;
        let v = v.unsqueeze(2)?.broadcast_to(&grouped)?;
        let y = q
            .causal_attention(&k, &v, scale, None)?
            .reshape(&[b, heads, t, d])?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[b, t, heads * d])?;
        self.o_proj.forward(&y, ctx)
    }

    /// Attention of one new token's queries `q` (`[B, heads, 1, d]`, at position `start`) over
    /// every cached key and value (`[B, kv_heads, start + 1, d]`): nothing to mask, all of them
    /// lie at or before it.
    fn attend_cached(
        &self,
        q: &Var,
        k: &Tensor,
        v: &Tensor,
        [b, t, start]: [usize; 3],
        scale: f32,
        ctx: &ForwardCtx,
    ) -> Result<Var> {
        let GqaShape {
            heads,
            kv_heads,
            head_dim: d,
            ..
        } = self.shape;
        if t != 1 {
            return Err(invalid(
                "GqaAttention",
                format!("cached decoding takes one token per call after the prompt; got {t} at position {start}"),
            ));
        }
        let (group, total) = (heads / kv_heads, start + 1);
        let tape = q.tape();
        let grouped = |x: &Tensor| -> Result<Var> {
            tape.constant(x.clone())
                .unsqueeze(2)?
                .broadcast_to(&[b, kv_heads, group, total, d])
        };
        let q = q.reshape(&[b, kv_heads, group, 1, d])?;
        let p = q
            .matmul(&grouped(k)?.transpose(-1, -2)?)?
            .mul_scalar(scale)?
            .softmax(-1)?;
        let y = p
            .matmul(&grouped(v)?)?
            .reshape(&[b, heads, 1, d])?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[b, 1, heads * d])?;
        self.o_proj.forward(&y, ctx)
    }
}
