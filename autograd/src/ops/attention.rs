//! Causal scaled-dot-product attention as one op: `softmax(scale * q k^T, future masked) v`.
//!
//! The forward is two matmuls around one fused row kernel (scale, mask, softmax); the backward
//! is two matmul pairs around one fused row kernel (softmax backward, scale), where the unfused
//! chain (matmul, mul_scalar, masked_fill, softmax, matmul) recorded five nodes, built and
//! uploaded a mask every call and made about nine elementwise passes over the scores. The
//! products are the ones the chain computed, with the same operand layouts, so the results agree
//! with it bit for bit on the CPU.

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
        let (q, kv, vv) = (self.value.clone(), k.value.clone(), v.value.clone());
        let p = q.matmul(&kv.t()?)?.causal_softmax(scale)?;
        let pd = match dropout {
            Some(m) => p.mul(m)?,
            None => p.clone(),
        };
        let y = pd.matmul(&vv)?;
        let mask = dropout.cloned();
        Var::from_op(OP, &[self, k, v], y, move |g, w| {
            let gv = when(w[2], || pd.t()?.matmul(g))?;
            if !w[0] && !w[1] {
                return Ok(vec![None, None, gv]);
            }
            let mut gp = g.matmul(&vv.t()?)?;
            if let Some(m) = &mask {
                gp = gp.mul(m)?;
            }
            let gs = Tensor::softmax_backward(&p, &gp, scale)?;
            let gq = when(w[0], || gs.matmul(&kv))?;
            // `(q^T gs)^T`, the product the unfused chain took through `k^T`'s transpose.
            let gk = when(w[1], || q.t()?.matmul(&gs)?.t())?;
            Ok(vec![gq, gk, gv])
        })
    }
}
