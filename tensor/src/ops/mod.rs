//! Op front-ends: validation and lowering to backend kernels.
//!
//! Every op here is a method on [`Tensor`]. A front-end checks what the kernels trust (shapes,
//! axes, devices, index ranges), rewrites the op into the few [`Kernels`](crate::backend) calls
//! that compute it (broadcasting and transposes as strided views, reductions as row reductions),
//! and counts the op's FLOPs on the device so the simulated cluster can time it.
//!
//! Empty results (and empty contractions) never reach a compute kernel: front-ends return
//! `Tensor::zeros` of the right shape instead, so `fill` is the only kernel that must accept zero
//! elements.

mod bias_act;
mod copy;
mod elementwise;
mod index;
mod matmul;
pub mod nn;
mod optim;
mod reduce;

pub use nn::{Conv2dParams, Pool2dParams};

use crate::error::{Error, Result};
use crate::layout::resolve_axis;
use crate::tensor::Tensor;

/// Resolves a list of possibly negative axes against `rank`, sorted; empty means every axis.
/// A repeated axis is an error (it would be reduced twice).
pub(crate) fn resolve_axes(op: &'static str, axes: &[isize], rank: usize) -> Result<Vec<usize>> {
    if axes.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = axes
        .iter()
        .map(|&a| resolve_axis(op, a, rank))
        .collect::<Result<Vec<_>>>()?;
    out.sort_unstable();
    if out.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid(
            op,
            format!("axes {axes:?} name the same axis twice (rank {rank})"),
        ));
    }
    Ok(out)
}

/// `(outer, dim, inner)`: the sizes before, at and after `axis`, the view every
/// index kernel works on.
pub(crate) fn split_at_axis(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    )
}

/// Above this many elements an index tensor on a GPU is not read back for a range check: the
/// read-back would stall the device queue on every embedding lookup. CPU indices are always
/// checked (it costs one pass over host memory).
pub(crate) const GPU_INDEX_CHECK_LIMIT: usize = 1024;

/// Checks that every value of `idx` is an integer in `0..bound` (see [`GPU_INDEX_CHECK_LIMIT`]
/// for when a GPU tensor is skipped). The message names the op, the offending value and shape.
pub(crate) fn check_indices(op: &'static str, idx: &Tensor, bound: usize) -> Result<()> {
    let bad = |v: f32| !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < bound);
    let found = match idx.storage().as_cpu() {
        Some(data) => idx.layout().indices().map(|i| data[i]).find(|&v| bad(v)),
        None if idx.numel() <= GPU_INDEX_CHECK_LIMIT => idx.to_vec()?.into_iter().find(|&v| bad(v)),
        None => None,
    };
    match found {
        Some(v) => Err(Error::index(
            op,
            format!(
                "index {v} is not an integer in 0..{bound} (index tensor of shape {:?})",
                idx.shape()
            ),
        )),
        None => Ok(()),
    }
}
