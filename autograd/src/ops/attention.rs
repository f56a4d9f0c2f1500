//! Causal scaled-dot-product attention as one op: `softmax(scale * q k^T, future masked) v`.
//!
//! Without dropout the forward and the backward are one kernel each on the CPU
//! ([`Tensor::causal_attention`], [`Tensor::causal_attention_backward`]: each head's scores used
//! while in cache, no product of a masked score); elsewhere, and with dropout, the forward is two
//! matmuls around one fused row kernel (scale, mask, softmax) and the backward two matmul pairs
//! around one (softmax backward, scale). The unfused chain (matmul, mul_scalar, masked_fill,
//! softmax, matmul) recorded five nodes, built and uploaded a mask every call and made about
//! nine elementwise passes over the scores. The composed path takes the chain's products with
//! the same operand layouts, so it agrees with the chain bit for bit on the CPU; the one-kernel
//! path agrees to rounding.

use wgpipe_tensor::{Error, Result, Tensor};

use super::{same_tape, when};
use crate::var::Var;

impl Var {
    /// Causal attention of queries `self`, keys `k` and values `v`, each `[..., t, d]` (one
    /// batch shape, no broadcasting): `p = softmax(scale * self k^T)` with query `i` seeing keys
    /// `0..=i`, then `(p * dropout) v`, `dropout` being the multipliers of an inverted dropout on
    /// the probabilities (`[..., t, t]`), if any. Returns `[..., t, d]`.
    ///
    /// The backward keeps `p` (one `[..., t, t]` tensor; no recompute): `dv = p'^T g`,
    /// `dp = (g v^T) * dropout`, `ds = scale * p (dp - rowsum(dp p))`, `dq = ds k`,
    /// `dk = ds^T q`.
    pub fn causal_attention(
        &self,
        k: &Var,
        v: &Var,
        scale: f32,
        dropout: Option<&Tensor>,
    ) -> Result<Var> {
        const OP: &str = "causal_attention";
        same_tape(OP, &[self, k, v])?;
        let (sq, sk, sv) = (self.shape(), k.shape(), v.shape());
        if sq.len() < 2 || sq != sk || sq != sv {
            return Err(Error::Shape {
                op: OP,
                msg: format!("q {sq:?}, k {sk:?} and v {sv:?} must be one shape [..., t, d]"),
            });
        }
        let mut score_shape = sq.to_vec();
        *score_shape.last_mut().unwrap() = sq[sq.len() - 2];
        if let Some(m) = dropout {
            if m.shape() != score_shape.as_slice() {
                return Err(Error::Shape {
                    op: OP,
                    msg: format!(
                        "dropout multipliers {:?} must match the scores {score_shape:?}",
                        m.shape()
                    ),
                });
            }
        }
        let (y, saved) = Attended::forward(&self.value, &k.value, &v.value, scale, dropout)?;
        Var::from_op(OP, &[self, k, v], y, move |g, w| {
            let [gq, gk, gv] = saved.backward(g, [w[0], w[1], w[2]])?;
            Ok(vec![gq, gk, gv])
        })
    }

    /// Causal attention over `heads` heads whose queries, keys and values come packed in one
    /// tensor: `self` is `[..., t, 3 d]`, each position's row its queries, then its keys, then
    /// its values, each `d = heads * d_head` values head after head (the output of one
    /// `Linear(d, 3 d)`: nanoGPT's `c_attn`, PyTorch's `in_proj`, FlashAttention's
    /// `qkvpacked`). Returns `[..., t, d]`, the heads merged back head after head. `dropout`, if
    /// any, holds the multipliers on the probabilities, `[..., heads, t, t]`.
    ///
    /// The values are those of splitting the heads out (`narrow`, `reshape`, `permute`) and
    /// calling [`Var::causal_attention`]; the backward writes the three gradients into one
    /// `[..., t, 3 d]` in one pass, where the split's three slices would each be padded with
    /// zeros to the full width and summed.
    pub fn causal_attention_packed(
        &self,
        heads: usize,
        scale: f32,
        dropout: Option<&Tensor>,
    ) -> Result<Var> {
        const OP: &str = "causal_attention_packed";
        let s = self.shape().to_vec();
        let r = s.len();
        if r < 2 || heads == 0 || s[r - 1] == 0 || !s[r - 1].is_multiple_of(3 * heads) {
            return Err(Error::Shape {
                op: OP,
                msg: format!(
                    "input {s:?} must be [..., t, 3 d] with d a multiple of heads = {heads}"
                ),
            });
        }
        let (t, d) = (s[r - 2], s[r - 1] / 3);
        let dh = d / heads;
        let n: usize = s[..r - 2].iter().product();
        let mut score_shape = s[..r - 2].to_vec();
        score_shape.extend([heads, t, t]);
        let dropout = match dropout {
            Some(m) if m.shape() != score_shape.as_slice() => {
                return Err(Error::Shape {
                    op: OP,
                    msg: format!(
                        "dropout multipliers {:?} must match the scores {score_shape:?} (input {s:?}, {heads} heads)",
                        m.shape()
                    ),
                });
            }
            Some(m) => Some(m.reshape(&[n, heads, t, t])?),
            None => None,
        };
        // [n, t, 3, heads, dh]; part i is [n, heads, t, dh], a view (`squeeze`, not
        // `reshape`: a reshape of the strided slice would copy it).
        let packed = self.value.reshape(&[n, t, 3, heads, dh])?;
        let part = |i: usize| -> Result<Tensor> {
            packed.narrow(2, i, 1)?.squeeze(2)?.permute(&[0, 2, 1, 3])
        };
        let (y, saved) =
            Attended::forward(&part(0)?, &part(1)?, &part(2)?, scale, dropout.as_ref())?;
        let mut out_shape = s.clone();
        out_shape[r - 1] = d;
        // [n, heads, t, dh] -> [..., t, d]
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&out_shape)?;
        Var::from_op(OP, &[self], y, move |g, _| {
            let g = g.reshape(&[n, t, heads, dh])?.permute(&[0, 2, 1, 3])?;
            let grads = saved.backward(&g, [true; 3])?;
            // Each [n, heads, t, dh] read as [n, t, heads, dh] and stacked into the packed row.
            let rows = grads
                .into_iter()
                .map(|gi| {
                    gi.expect("every gradient was asked for")
                        .permute(&[0, 2, 1, 3])
                })
                .collect::<Result<Vec<_>>>()?;
            let gx = Tensor::stack(&rows.iter().collect::<Vec<_>>(), 2)?.reshape(&s)?;
            Ok(vec![Some(gx)])
        })
    }
}

/// What the backward of causal attention keeps: the operands and `p` (no recompute).
struct Attended {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: f32,
    /// The probabilities.
    p: Tensor,
    /// The probabilities after dropout (`p` without it).
    pd: Tensor,
    mask: Option<Tensor>,
}

impl Attended {
    fn forward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
        dropout: Option<&Tensor>,
    ) -> Result<(Tensor, Attended)> {
        let (y, p, pd) = match dropout {
            // One kernel on the CPU (see `Tensor::causal_attention`).
            None => {
                let (y, p) = q.causal_attention(k, v, scale)?;
                (y, p.clone(), p)
            }
            Some(m) => {
                let p = q.matmul(&k.t()?)?.causal_softmax(scale)?;
                let pd = p.mul(m)?;
                (pd.matmul(v)?, p, pd)
            }
        };
        let saved = Attended {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
            scale,
            p,
            pd,
            mask: dropout.cloned(),
        };
        Ok((y, saved))
    }

    /// The gradients of q, k and v (each where `want` asks) for the output gradient `g`.
    fn backward(&self, g: &Tensor, want: [bool; 3]) -> Result<[Option<Tensor>; 3]> {
        if self.mask.is_none() {
            // One kernel on the CPU, all three gradients (see `Tensor::causal_attention_backward`).
            let [gq, gk, gv] = self
                .q
                .causal_attention_backward(&self.k, &self.v, &self.p, g, self.scale)?;
            return Ok([
                want[0].then_some(gq),
                want[1].then_some(gk),
                want[2].then_some(gv),
            ]);
        }
        let gv = when(want[2], || self.pd.t()?.matmul(g))?;
        if !want[0] && !want[1] {
            return Ok([None, None, gv]);
        }
        let mut gp = g.matmul(&self.v.t()?)?;
        if let Some(m) = &self.mask {
            gp = gp.mul(m)?;
        }
        let gs = Tensor::softmax_backward(&self.p, &gp, self.scale)?;
        let gq = when(want[0], || gs.matmul(&self.k))?;
        // `(q^T gs)^T`, the product the unfused chain took through `k^T`'s transpose.
        let gk = when(want[1], || self.q.t()?.matmul(&gs)?.t())?;
        Ok([gq, gk, gv])
    }
}
