//! Batched matrix product with numpy batch broadcasting. Operands go to the kernel as strided
//! matrices ([`MatLayout`]), so transposed views and broadcast batches cost no copy. FLOPs:
//! `2 * batch * m * k * n`.

use crate::backend::{Kernels, MatDims, MatLayout};
use crate::dtype_policy::{DTypePolicy::WidenThenRound, Precision};
use crate::error::{Error, Result};
use crate::layout::broadcast_shapes;
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
        let (a, la) = as_matrix(self, &batch_shape, m, k)?;
        let (b, lb) = as_matrix(other, &batch_shape, k, n)?;
        let dims = MatDims { batch, m, k, n };
        // A native half product (f32 accumulation) where the backend has one, else the f32
        // kernel, on widened copies for half operands.
        let native =
            |kern: &dyn Kernels, [a, b]: [&Tensor; 2]| kern.matmul_half(a, la, b, lb, dims);
        let out = match dev.run_if(OP, Precision::Half, [&a, &b], native) {
            Some(out) => out?,
            // A widened copy starts at its view's first element: its layout moves with it.
            None => dev.run(OP, WidenThenRound, [&a, &b], |kern, [a, b]| {
                let at = |l: MatLayout, x: &Tensor| MatLayout {
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
/// axes cannot be walked with a single stride (e.g. batch `[2, 3]` broadcast from `[2, 1]`), the
/// broadcast view is materialised: correct, costs a copy, and only happens for mixed broadcasts.
fn as_matrix(x: &Tensor, batch: &[usize], rows: usize, cols: usize) -> Result<(Tensor, MatLayout)> {
    let mut shape = batch.to_vec();
    shape.extend([rows, cols]);
    let mut v = x.broadcast_to(&shape)?;
    let nb = batch.len();
    let batch_stride = match single_stride(batch, &v.strides()[..nb]) {
        Some(s) => s,
        None => {
            v = v.contiguous()?;
            rows * cols
        }
    };
    let l = v.layout();
    let layout = MatLayout {
        offset: l.offset,
        batch_stride,
        row_stride: l.strides[nb],
        col_stride: l.strides[nb + 1],
    };
    Ok((v, layout))
}

/// The one stride that walks all batch axes in row-major order, if there is one.
fn single_stride(shape: &[usize], strides: &[usize]) -> Option<usize> {
    let dims: Vec<(usize, usize)> = shape
        .iter()
        .zip(strides)
        .filter(|(&d, _)| d != 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    if dims.windows(2).all(|w| w[0].1 == w[1].1 * w[1].0) {
        Some(dims.last().map_or(0, |&(_, s)| s))
    } else {
        None
    }
}
