//! Matrix products.

use wgpipe_tensor::Result;

use super::{same_tape, when};
use crate::var::Var;

impl Var {
    /// `[.., m, k] @ [.., k, n]` with numpy-broadcast batch dims; either side may be a transposed
    /// view. Gradients: `dA = dY @ B^T`, `dB = A^T @ dY`, each summed over broadcast batch dims.
    pub fn matmul(&self, other: &Var) -> Result<Var> {
        same_tape("matmul", &[self, other])?;
        let y = self.value.matmul(&other.value)?;
        let a = other.requires_grad.then(|| self.value.clone());
        let b = self.requires_grad.then(|| other.value.clone());
        let (sa, sb) = (self.shape().to_vec(), other.shape().to_vec());
        Var::from_op("matmul", &[self, other], y, move |g, w| {
            let ga = when(w[0], || {
                let t = g.matmul(&b.as_ref().unwrap().t()?)?;
                if t.shape() == sa.as_slice() {
                    Ok(t)
                } else {
                    t.sum_to_shape(&sa)
                }
            })?;
            let gb = when(w[1], || {
                let t = a.as_ref().unwrap().t()?.matmul(g)?;
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
