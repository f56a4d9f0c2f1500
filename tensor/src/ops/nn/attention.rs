//! Fused causal attention: the whole op (forward and backward) in one kernel where the backend has
//! one (the CPU's), else two products around its row kernel; and the row kernels: the scaled,
//! causally masked softmax of the scores and its backward, each one pass over the score matrix
//! where the unfused chain (scale, mask, softmax; and softmax's four-op backward, unmask,
//! unscale) made several.

use crate::backend::{HeadDims, Kernels, MatLayout};
use crate::dtype_policy::{DTypePolicy::WidenThenRound, Precision};
use crate::error::{Error, Result};
use crate::layout::{Dims, Layout};
use crate::ops::matmul::{as_matrix, batch_strides};
use crate::raw::RawTensor;
use crate::tensor::Tensor;

impl Tensor {
    /// Causal attention of queries `self`, keys `k` and values `v`, each `[..., t, dh]` (one
    /// shape): `p = softmax(scale * self k^T)`, query `i` seeing keys `0..=i` (see
    /// [`Tensor::causal_softmax`]), and `y = p v`. Returns `(y [..., t, dh], p [..., t, t])`;
    /// `p` is what [`Tensor::causal_attention_backward`] takes.
    ///
    /// On the CPU with f32 operands one kernel runs each head through the scores, softmax and
    /// product while they sit in cache, and computes no product of a masked score, and `y`
    /// keeps the axis order of `self`'s layout (heads split out of `[b, t, h, dh]` rows come
    /// back in that layout; see `output_layout`); elsewhere it is `self.matmul(k.t())`,
    /// `causal_softmax`, `matmul(v)`, contiguous. The two agree to rounding.
    pub fn causal_attention(&self, k: &Tensor, v: &Tensor, scale: f32) -> Result<(Tensor, Tensor)> {
        const OP: &str = "causal_attention";
        let d = head_dims(OP, [self, k, v], scale)?;
        let batch_shape = &self.shape()[..self.rank() - 2];
        let score_shape = [batch_shape, &[d.t, d.t]].concat();
        let dev = self.device();
        if d.batch * d.t * d.dh > 0 {
            let [(q, lq), (k, lk), (v, lv)] = [
                heads(self, batch_shape, d)?,
                heads(k, batch_shape, d)?,
                heads(v, batch_shape, d)?,
            ];
            let (y_layout, y_at) = output_layout(self, batch_shape, d);
            let fused = |kern: &dyn Kernels, [q, k, v]: [&RawTensor; 3]| {
                kern.causal_attention([(q, lq), (k, lk), (v, lv)], y_at, d, scale)
            };
            let ops = [&q, &k, &v];
            if let Some(out) = dev.run_if(OP, Precision::F32, ops, fused) {
                let (y, p) = out?;
                dev.add_flops(attention_flops(d));
                return Ok((y.with_layout(y_layout), p.reshape(&score_shape)?));
            }
        }
        let p = self.matmul(&k.t()?)?.causal_softmax(scale)?;
        let y = p.matmul(v)?;
        Ok((y, p))
    }

    /// The gradients `[gq, gk, gv]` of [`Tensor::causal_attention`]'s `q` (`self`), `k` and
    /// `v`, given its `p` and `g`, the gradient of its `y`: `gv = p^T g`,
    /// `gs = scale * p (g v^T - rowsum(g v^T * p))`, `gq = gs k`, `gk = gs^T q`. One kernel on
    /// the CPU with f32 operands (no product of a masked score; each gradient laid out as
    /// [`Tensor::causal_attention`]'s `y`, in the axis order of its operand), products around
    /// [`Tensor::softmax_backward`] elsewhere.
    pub fn causal_attention_backward(
        &self,
        k: &Tensor,
        v: &Tensor,
        p: &Tensor,
        g: &Tensor,
        scale: f32,
    ) -> Result<[Tensor; 3]> {
        const OP: &str = "causal_attention_backward";
        let q = self;
        let d = head_dims(OP, [q, k, v], scale)?;
        let batch_shape = &q.shape()[..q.rank() - 2];
        let score_shape = [batch_shape, &[d.t, d.t]].concat();
        for (name, x, want) in [("p", p, &score_shape[..]), ("g", g, q.shape())] {
            if x.shape() != want {
                return Err(Error::shape(
                    OP,
                    format!(
                        "{name} {:?} must be {want:?} (q {:?})",
                        x.shape(),
                        q.shape()
                    ),
                ));
            }
        }
        let dev = q.device();
        if d.batch * d.t * d.dh > 0 {
            let [(q2, lq), (k2, lk), (v2, lv), (g2, lg)] = [
                heads(q, batch_shape, d)?,
                heads(k, batch_shape, d)?,
                heads(v, batch_shape, d)?,
                heads(g, batch_shape, d)?,
            ];
            let p = p.contiguous()?;
            let [(lgq, gq_at), (lgk, gk_at), (lgv, gv_at)] =
                [q, k, v].map(|x| output_layout(x, batch_shape, d));
            let at = [gq_at, gk_at, gv_at];
            let fused = |kern: &dyn Kernels, [q, k, v, p, g]: [&RawTensor; 5]| {
                let qkv = [(q, lq), (k, lk), (v, lv)];
                kern.causal_attention_backward(qkv, p, (g, lg), at, d, scale)
            };
            if let Some(out) = dev.run_if(OP, Precision::F32, [&q2, &k2, &v2, &p, &g2], fused) {
                let [gq, gk, gv] = out?;
                // Four products and the softmax backward (5 a score), as the composed op counts
                // them: twice the forward's two products and softmax (5 / 2 a score).
                dev.add_flops(2 * attention_flops(d));
                return Ok([
                    gq.with_layout(lgq),
                    gk.with_layout(lgk),
                    gv.with_layout(lgv),
                ]);
            }
        }
        let gv = p.t()?.matmul(g)?;
        let gs = Tensor::softmax_backward(p, &g.matmul(&v.t()?)?, scale)?;
        let gq = gs.matmul(k)?;
        // `(q^T gs)^T`: the product the unfused chain took through `k^T`'s transpose.
        let gk = q.t()?.matmul(&gs)?.t()?;
        Ok([gq, gk, gv])
    }

    /// `softmax(scale * x)` over the last axis of `x` `[..., t, t]` (attention scores, queries on
    /// the second-last axis), where query `i` sees keys `0..=i` only: the future gets exact zeros.
    /// Equal bit for bit to `x.mul_scalar(scale).masked_fill(future, -1e9).softmax(-1)`.
    pub fn causal_softmax(&self, scale: f32) -> Result<Tensor> {
        const OP: &str = "causal_softmax";
        let t = square_last_two(OP, self.shape())?;
        if !scale.is_finite() {
            return Err(Error::invalid(
                OP,
                format!("scale must be finite, got {scale}"),
            ));
        }
        let dev = self.device();
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let rows = self.numel() / t;
        let x = self.contiguous()?;
        let y = dev.run(OP, WidenThenRound, [&x], |k, [x]| {
            k.causal_softmax_rows(x, rows, t, scale)
        })?;
        // scale, max, exp, sum, normalise over the half that is not masked.
        dev.add_flops(5 * self.numel() as u64 / 2);
        y.reshape(self.shape())
    }

    /// The gradient of `x` for `y = softmax(scale * x)` over the last axis (causally masked or
    /// not: masked entries of `y` are 0 and get 0), given `g`, the gradient of `y`:
    /// `scale * y * (g - sum(g * y))` in one kernel.
    pub fn softmax_backward(y: &Tensor, g: &Tensor, scale: f32) -> Result<Tensor> {
        const OP: &str = "softmax_backward";
        y.same_device(OP, g)?;
        if y.shape() != g.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "y {:?} and its gradient {:?} must have one shape",
                    y.shape(),
                    g.shape()
                ),
            ));
        }
        let Some(&cols) = y.shape().last() else {
            return Err(Error::shape(
                OP,
                "needs rank >= 1, got a 0-d tensor (shape [])",
            ));
        };
        let dev = y.device();
        if y.numel() == 0 {
            return y.zeros_like();
        }
        let rows = y.numel() / cols;
        let (y, g) = (y.contiguous()?, g.contiguous()?);
        let dx = dev.run(OP, WidenThenRound, [&y, &g], |k, [y, g]| {
            k.softmax_backward_rows(y, g, rows, cols, scale)
        })?;
        dev.add_flops(5 * y.numel() as u64);
        dx.reshape(y.shape())
    }
}

/// `t` for a shape `[..., t, t]`, else an error naming the shape.
fn square_last_two(op: &'static str, shape: &[usize]) -> Result<usize> {
    match shape {
        [.., a, b] if a == b => Ok(*b),
        _ => Err(Error::shape(
            op,
            format!("needs square scores [..., t, t] (queries x keys), got {shape:?}"),
        )),
    }
}

/// The heads of `q`, `k` and `v` (one shape `[..., t, dh]`, one device, finite `scale`).
fn head_dims(op: &'static str, [q, k, v]: [&Tensor; 3], scale: f32) -> Result<HeadDims> {
    q.same_device(op, k)?;
    q.same_device(op, v)?;
    let (sq, sk, sv) = (q.shape(), k.shape(), v.shape());
    if sq.len() < 2 || sq != sk || sq != sv {
        return Err(Error::shape(
            op,
            format!("q {sq:?}, k {sk:?} and v {sv:?} must be one shape [..., t, dh]"),
        ));
    }
    if !scale.is_finite() {
        return Err(Error::invalid(
            op,
            format!("scale must be finite, got {scale}"),
        ));
    }
    let r = sq.len();
    Ok(HeadDims {
        batch: sq[..r - 2].iter().product(),
        t: sq[r - 2],
        dh: sq[r - 1],
    })
}

/// `x` as a batch of `[t, dh]` matrices with contiguous rows, as it lies where it can (heads
/// split out of a row and permuted take two batch strides), else copied.
fn heads(x: &Tensor, batch_shape: &[usize], d: HeadDims) -> Result<(Tensor, MatLayout)> {
    let (v, l) = as_matrix(x, batch_shape, d.t, d.dh, true)?;
    if l.col_stride == 1 || d.dh == 1 {
        return Ok((v, MatLayout { col_stride: 1, ..l }));
    }
    as_matrix(&x.contiguous()?, batch_shape, d.t, d.dh, true)
}

/// Where the kernel writes an output shaped like `x` (`[..., t, dh]`, `d.batch` heads of
/// `batch_shape`): every value once, the axes in the order of `x`'s strides, `dh` innermost
/// (as PyTorch's `empty_like` keeps a permuted tensor's layout, and its CPU flash attention
/// writes `[b, t, h, dh]`). Heads split out of `[b, t, h, dh]` rows (`permute(0, 2, 1, 3)`)
/// so get their output and gradients in that layout, and merging them back is a view, not a
/// copy. Contiguous where the batch would take more than two strides. Returns the tensor's
/// layout and the kernel's view of it.
fn output_layout(x: &Tensor, batch_shape: &[usize], d: HeadDims) -> (Layout, MatLayout) {
    let (shape, r) = (x.shape(), x.rank());
    // Outermost first; a stable sort keeps ties (and axes of length 1) in their order.
    let mut order: Vec<usize> = (0..r - 1).collect();
    order.sort_by_key(|&a| std::cmp::Reverse(x.strides()[a]));
    let mut strides = Dims::from_elem(1, r);
    let mut step = d.dh;
    for &a in order.iter().rev() {
        strides[a] = step;
        step *= shape[a];
    }
    let nb = batch_shape.len();
    let Some((batch_stride, groups)) = batch_strides(batch_shape, &strides[..nb], true) else {
        let layout = Layout::contiguous(shape);
        return (layout, MatLayout::new(0, d.t * d.dh, d.dh, 1));
    };
    let at = MatLayout {
        offset: 0,
        batch_stride,
        row_stride: strides[nb],
        col_stride: 1,
        groups,
    };
    let layout = Layout {
        shape: Dims::from_slice(shape),
        strides,
        offset: 0,
    };
    (layout, at)
}

/// The FLOPs of the forward as the composed op counts them: two products, the softmax.
fn attention_flops(d: HeadDims) -> u64 {
    let scores = (d.batch * d.t * d.t) as u64;
    4 * scores * d.dh as u64 + 5 * scores / 2
}
