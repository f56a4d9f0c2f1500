//! A Linear layer's bias and activation in one pass over its matmul output, `op(z + b)`, and the
//! backward `g * op'(z + b)` (recomputing `z + b` instead of keeping it: no pre-activation
//! tensor is stored).

use crate::backend::UnaryOp;
use wgpipe_shaders::ops::{UnaryOpT, UnaryVisitor};

use super::par::for_rows;
use super::simd;

/// `out = op(z + b)`, or with `g`, `out = g * op'(z + b)`: `z` (and `g`) contiguous
/// `[rows, b.len()]`, `b` added to every row.
pub(crate) fn bias_act(op: UnaryOp, out: &mut [f32], z: &[f32], b: &[f32], g: Option<&[f32]>) {
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
                    None => simd::bias_act::<T>(o, zr, b, s),
                    Some(g) => simd::bias_act_grad::<T>(o, zr, b, &g[at..at + cols], s),
                }
            }
        });
    }
}
