//! A Linear layer's bias and activation in one pass over its matmul output, `op(z + b)`, and the
//! backward `g * op'(z + b)` (recomputing `z + b` instead of keeping it: no pre-activation
//! tensor is stored). The whole CPU kernel lives here: the entry points `cpu/mod.rs` delegates
//! to, the row loop, and the loops built for each vector extension.

use crate::backend::UnaryOp;
use crate::error::Result;
use crate::raw::RawTensor;
use wgpipe_shaders::ops::{UnaryOpT, UnaryVisitor};

use super::host::{contig, Out};
use super::par::for_rows;
use super::simd::{by_runs, multiversion};

/// `op(z + b)`, `b` added to every row of `z` (`[.., b.len()]`).
pub(super) fn forward(op: UnaryOp, z: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
    let mut out = Out::for_overwrite(z.memory(), z.numel())?;
    bias_act(op, &mut out.data, &contig(z), &contig(b), None);
    Ok(out.into_raw(z.shape(), z.memory()))
}

/// `g * op'(z + b)`, the gradient of `z` given `g`, the gradient of [`forward`]'s output.
pub(super) fn backward(
    op: UnaryOp,
    z: &RawTensor,
    b: &RawTensor,
    g: &RawTensor,
) -> Result<RawTensor> {
    let mut out = Out::for_overwrite(z.memory(), z.numel())?;
    let g = contig(g);
    bias_act(op, &mut out.data, &contig(z), &contig(b), Some(&g));
    Ok(out.into_raw(z.shape(), z.memory()))
}

/// `out = op(z + b)`, or with `g`, `out = g * op'(z + b)`: `z` (and `g`) contiguous
/// `[rows, b.len()]`, `b` added to every row.
fn bias_act(op: UnaryOp, out: &mut [f32], z: &[f32], b: &[f32], g: Option<&[f32]>) {
    op.visit(Rows { out, z, b, g })
}

/// The arguments of [`bias_act`], waiting for the op's descriptor.
struct Rows<'a> {
    out: &'a mut [f32],
    z: &'a [f32],
    b: &'a [f32],
    g: Option<&'a [f32]>,
}

impl UnaryVisitor for Rows<'_> {
    type Out = ();
    fn visit<T: UnaryOpT>(self, s: [f32; 2]) {
        let Rows { out, z, b, g } = self;
        let cols = b.len();
        for_rows(out, cols, |r0, o| {
            for (i, o) in o.chunks_mut(cols).enumerate() {
                let at = (r0 + i) * cols;
                let zr = &z[at..at + cols];
                match g {
                    None => row::<T>(o, zr, b, s),
                    Some(g) => row_grad::<T>(o, zr, b, &g[at..at + cols], s),
                }
            }
        });
    }
}

multiversion! {
/// `o[i] = T(z[i] + b[i])`, the op inlined into the loop (see `simd::unary_grad`).
fn row<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], s: [f32; 2]) {
    by_runs::<T>(o, z, Some(b), None, s)
}
}

multiversion! {
/// `o[i] = g[i] * T'(z[i] + b[i])`, the derivative inlined into the loop.
fn row_grad<T: UnaryOpT>(o: &mut [f32], z: &[f32], b: &[f32], g: &[f32], s: [f32; 2]) {
    by_runs::<T>(o, z, Some(b), Some(g), s)
}
}
