//! Matrix products.

use wgpipe_tensor::{Result, Tensor};

use super::{same_tape, when};
use crate::var::Var;

/// True when `x` is the transpose of a contiguous tensor (its last two axes swapped), e.g. the
/// `w.t()` of a Linear layer.
fn is_transposed_contiguous(x: &Tensor) -> bool {
    x.rank() >= 2 && !x.is_contiguous() && x.t().is_ok_and(|t| t.is_contiguous())
}

/// `p @ q`; when `transposed` (the input this gradient is for is a transposed contiguous tensor)
/// and no batch axis is broadcast, computed as `(q^T @ p^T)^T` (the same products, operands read
/// in place by the kernel), so the result is laid out like that input and the gradient flowing
/// back through the `t()` that made it arrives contiguous: no transposing copy later (e.g. in
/// `Param::accumulate_grad`).
fn matmul_like(p: &Tensor, q: &Tensor, transposed: bool, shape: &[usize]) -> Result<Tensor> {
    let batch = &shape[..shape.len().saturating_sub(2)];
    let same_batch = |x: &Tensor| x.rank() == shape.len() && &x.shape()[..batch.len()] == batch;
    if transposed && same_batch(p) && same_batch(q) {
        return q.t()?.matmul(&p.t()?)?.t();
    }
    p.matmul(q)
}

impl Var {
    /// `[.., m, k] @ [.., k, n]` with numpy-broadcast batch dims; either side may be a transposed
    /// view. Gradients: `dA = dY @ B^T`, `dB = A^T @ dY`, each summed over broadcast batch dims;
    /// a gradient is laid out like its input when that input is a transposed contiguous tensor.
    pub fn matmul(&self, other: &Var) -> Result<Var> {
        same_tape("matmul", &[self, other])?;
        let y = self.value.matmul(&other.value)?;
        let a = other.requires_grad.then(|| self.value.clone());
        let b = self.requires_grad.then(|| other.value.clone());
        let (a_t, b_t) = (
            is_transposed_contiguous(&self.value),
            is_transposed_contiguous(&other.value),
        );
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Var::from_op("matmul", &[self, other], y, move |g, w| {
            let ga = when(w[0], || {
                let bt = b.as_ref().unwrap().t()?;
                let t = matmul_like(g, &bt, a_t, &sa)?;
                if t.shape() == sa.as_slice() {
                    Ok(t)
                } else {
                    t.sum_to_shape(&sa)
                }
            })?;
            let gb = when(w[1], || {
                let at = a.as_ref().unwrap().t()?;
                let t = matmul_like(&at, g, b_t, &sb)?;
                if t.shape() == sb.as_slice() {
                    Ok(t)
                } else {
                    t.sum_to_shape(&sb)
                }
            })?;
            Ok(vec![ga, gb])
        })
    }
}
