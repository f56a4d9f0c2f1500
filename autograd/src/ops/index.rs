//! Indexing ops: `index_select` (adjoint: `index_add`) and `gather` (adjoint: `scatter_add`).
//! Index tensors are f32 tensors holding integers; they get no gradient.

use wgpipe_tensor::{Result, Tensor};

use super::resolve_axis;
use crate::var::Var;

impl Var {
    /// Rows `idx` (1-D) of `axis`, e.g. an embedding lookup. Repeated indices add up in backward.
    pub fn index_select(&self, axis: isize, idx: &Tensor) -> Result<Var> {
        let y = self.value.index_select(axis, idx)?;
        let a = resolve_axis("index_select", axis, self.rank())?;
        let (i, n) = (idx.clone(), self.shape()[a]);
        Var::from_op("index_select", &[self], y, move |g, _| {
            Ok(vec![Some(Tensor::index_add(a as isize, &i, g, n)?)])
        })
    }

    /// Torch-style gather along `axis` (`idx` has the rank of `self`; the output its shape).
    pub fn gather(&self, axis: isize, idx: &Tensor) -> Result<Var> {
        let y = self.value.gather(axis, idx)?;
        let a = resolve_axis("gather", axis, self.rank())?;
        let (i, n) = (idx.clone(), self.shape()[a]);
        Var::from_op("gather", &[self], y, move |g, _| {
            Ok(vec![Some(Tensor::scatter_add(a as isize, &i, g, n)?)])
        })
    }
}
