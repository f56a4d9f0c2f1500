//! The backward of every tensor op, as `Var` methods, by family. Every op records through
//! [`Var::from_op`](crate::var::Var::from_op), the one place a node is made.

mod attention;
mod bias_act;
mod cross_entropy;
mod elementwise;
mod index;
mod linalg;
mod nn;
mod reduce;
mod shape;
mod unary;

use wgpipe_tensor::{Error, Result, Tensor};

use crate::var::Var;

/// Fails (before any forward work) unless every var in `vars` is on one tape.
pub(crate) fn same_tape(op: &'static str, vars: &[&Var]) -> Result<()> {
    if let Some(first) = vars.first() {
        if let Some(other) = vars.iter().find(|v| !v.tape.same(&first.tape)) {
            return Err(Error::Invalid {
                op,
                msg: format!(
                    "input vars come from different tapes (ids {} and {}, shapes {:?} and {:?}); record them on one tape",
                    first.tape.id(),
                    other.tape.id(),
                    first.shape(),
                    other.shape()
                ),
            });
        }
    }
    Ok(())
}

/// Resolves reduction axes (negative from the end; empty = all), sorted.
pub(crate) fn resolve_axes(op: &'static str, axes: &[isize], rank: usize) -> Result<Vec<usize>> {
    if axes.is_empty() {
        return Ok((0..rank).collect());
    }
    let mut out = Vec::with_capacity(axes.len());
    for &a in axes {
        out.push(resolve_axis(op, a, rank)?);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

pub(crate) fn resolve_axis(op: &'static str, axis: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(Error::Axis { op, axis, rank });
    }
    Ok(a as usize)
}

/// `shape` with the reduced `axes` kept as size 1.
pub(crate) fn keep_shape(shape: &[usize], axes: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    for &a in axes {
        s[a] = 1;
    }
    s
}

/// Brings the gradient of a reduction (over `axes`, with or without `keepdim`) back to a view
/// broadcast over the input's shape.
pub(crate) fn unreduce(g: &Tensor, in_shape: &[usize], axes: &[usize]) -> Result<Tensor> {
    g.reshape(&keep_shape(in_shape, axes))?
        .broadcast_to(in_shape)
}

/// A 0-d zero on `like`'s device (broadcasts anywhere).
pub(crate) fn zero_scalar(like: &Tensor) -> Result<Tensor> {
    Tensor::scalar(0.0, like.device())?.to_dtype(like.dtype())
}

/// `Some(f())` when `want`, else `None`.
pub(crate) fn when(want: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if want {
        f().map(Some)
    } else {
        Ok(None)
    }
}
