//! Batched matrix product with numpy batch broadcasting. Operands go to the kernel as strided
//! matrices ([`MatLayout`]), so transposed views and broadcast batches cost no copy. FLOPs:
//! `2 * batch * m * k * n`.

use crate::backend::{Kernels, MatDims, MatGroups, MatLayout};
use crate::dtype_policy::{DTypePolicy::WidenThenRound, Precision};
use crate::error::{Error, Result};
use crate::layout::{broadcast_shapes, Dims};
use crate::raw::RawTensor;
use crate::tensor::Tensor;

impl Tensor {
    /// `[.., m, k] @ [.., k, n] -> [.., m, n]`, batch axes broadcast numpy-style.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        const OP: &str = "matmul";
        self.same_device(OP, other)?;
        let (sa, sb) = (self.shape(), other.shape());
        if sa.len() < 2 || sb.len() < 2 {
            return Err(Error::shape(
                OP,
                format!("both operands need rank >= 2, got shapes {sa:?} and {sb:?}"),
            ));
        }
        let (m, k) = (sa[sa.len() - 2], sa[sa.len() - 1]);
        let (k2, n) = (sb[sb.len() - 2], sb[sb.len() - 1]);
        if k != k2 {
            return Err(Error::shape(
                OP,
                format!("inner dimensions differ: {sa:?} @ {sb:?} ({k} vs {k2})"),
            ));
        }
        let batch_shape =
            broadcast_shapes(OP, &sa[..sa.len() - 2], &sb[..sb.len() - 2]).map_err(|_| {
                Error::shape(
                    OP,
                    format!("batch axes of {sa:?} and {sb:?} cannot be broadcast together"),
                )
            })?;
        let batch: usize = batch_shape.iter().product();
        let mut out_shape = batch_shape.clone();
        out_shape.extend([m, n]);
        let dev = self.device();
        if batch * m * n == 0 || k == 0 {
            return Tensor::zeros_in(&out_shape, self.dtype(), dev);
        }
        // Operands whose batch needs two strides (heads split out of a row, then permuted) go
        // to the kernel as they lie where the backend walks two; elsewhere they are copied.
        let grouped = dev.kernels().matmul_grouped_batches();
        let (a, la) = as_matrix(self, &batch_shape, m, k, grouped)?;
        let (b, lb) = as_matrix(other, &batch_shape, k, n, grouped)?;
        let dims = MatDims { batch, m, k, n };
        // A native half product (f32 accumulation) where the backend has one, else the f32
        // kernel, on widened copies for half operands.
        let native =
            |kern: &dyn Kernels, [a, b]: [&RawTensor; 2]| kern.matmul_half(a, la, b, lb, dims);
        let out = match dev.run_if(OP, Precision::Half, [&a, &b], native) {
            Some(out) => out?,
            // A widened copy starts at its view's first element: its layout moves with it.
            None => dev.run(OP, WidenThenRound, [&a, &b], |kern, [a, b]| {
                let at = |l: MatLayout, x: &RawTensor| MatLayout {
                    offset: x.layout().offset,
                    ..l
                };
                kern.matmul(a, at(la, a), b, at(lb, b), dims)
            })?,
        };
        dev.add_flops(2 * (batch * m * k * n) as u64);
        out.reshape(&out_shape)
    }
}

/// `x` broadcast to `batch ++ [rows, cols]` as one strided batch of matrices. When its batch
/// axes cannot be walked with a single stride (e.g. batch `[2, 3]` broadcast from `[2, 1]`, or
/// the `[B, H]` of a `[B, T, H, D]` tensor permuted to `[B, H, T, D]`), they are walked with two
/// ([`MatGroups`]) when `grouped`; otherwise, or when even two do not do, the broadcast view is
/// materialised: correct, and costs a copy.
pub(crate) fn as_matrix(
    x: &Tensor,
    batch: &[usize],
    rows: usize,
    cols: usize,
    grouped: bool,
) -> Result<(Tensor, MatLayout)> {
    let mut shape = Dims::from_slice(batch);
    shape.extend([rows, cols]);
    let mut v = x.broadcast_to(&shape)?;
    let nb = batch.len();
    let (batch_stride, groups) = match batch_strides(batch, &v.strides()[..nb], grouped) {
        Some(walk) => walk,
        None => {
            v = v.contiguous()?;
            (rows * cols, None)
        }
    };
    let l = v.layout();
    let layout = MatLayout {
        offset: l.offset,
        batch_stride,
        row_stride: l.strides[nb],
        col_stride: l.strides[nb + 1],
        groups,
    };
    Ok((v, layout))
}

/// How a [`MatLayout`] walks batch axes of lengths `batch` and `strides`: `(batch_stride,
/// groups)`, or `None` where one stride (two, when `grouped`) cannot.
pub(crate) fn batch_strides(
    batch: &[usize],
    strides: &[usize],
    grouped: bool,
) -> Option<(usize, Option<MatGroups>)> {
    match batch_axes(batch, strides).as_slice() {
        [] => Some((0, None)),
        [(_, s)] => Some((*s, None)),
        [(_, outer), (len, inner)] if grouped => Some((
            *inner,
            Some(MatGroups {
                len: *len,
                stride: *outer,
            }),
        )),
        _ => None,
    }
}

/// The batch axes as `(length, stride)`, outermost first, with axes of length 1 left out and
/// neighbours that one stride walks (`outer stride = inner stride * inner length`) merged.
fn batch_axes(shape: &[usize], strides: &[usize]) -> Vec<(usize, usize)> {
    let mut axes: Vec<(usize, usize)> = Vec::with_capacity(shape.len());
    for (&d, &s) in shape.iter().zip(strides) {
        if d == 1 {
            continue;
        }
        match axes.last_mut() {
            Some(last) if last.1 == s * d => *last = (last.0 * d, s),
            _ => axes.push((d, s)),
        }
    }
    axes
}
