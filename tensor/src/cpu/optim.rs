//! The optimizer steps: the plain SGD step, and the fused Adam/AdamW step elementwise over
//! contiguous parameter, gradient and moments.

use rayon::prelude::*;

use crate::backend::AdamStep;
use crate::error::Result;
use crate::raw::RawTensor;

use super::elementwise;
use super::host::{data, exclusive_host, Out};
use super::par::rows_per_chunk;
use super::simd::multiversion;

/// The plain SGD step `param - lr * grad` in one pass (CPU tensors of one shape), with exactly the
/// arithmetic of `param.sub(&grad.mul_scalar(lr)?)`: `p - (g * lr + 0.0)`.
pub(super) fn sgd_update(param: &RawTensor, grad: &RawTensor, lr: f32) -> Result<RawTensor> {
    let mut out = Out::for_overwrite(param.memory(), param.numel())?;
    elementwise::map2(
        &mut out.data,
        data(param),
        param.layout(),
        data(grad),
        grad.layout(),
        move |p, g| p - (g * lr + 0.0),
    );
    Ok(out.into_raw(param.shape(), param.memory()))
}

/// [`sgd_update`] written into exclusive `param`: `p = p - (g * lr + 0.0)`.
pub(super) fn sgd_update_in_place(param: &mut RawTensor, grad: &RawTensor, lr: f32) -> Result<()> {
    let p = exclusive_host("sgd_update", param)?;
    elementwise::map2_assign(p, data(grad), grad.layout(), move |p, g| p - (g * lr + 0.0));
    Ok(())
}

/// One element: returns `(p', m', v')` exactly as documented on [`AdamStep`].
#[inline]
pub(crate) fn adam_scalar(p: f32, g: f32, m: f32, v: f32, hp: &AdamStep) -> (f32, f32, f32) {
    let g = if hp.decoupled {
        g
    } else {
        g + hp.weight_decay * p
    };
    let m = hp.beta1 * m + (1.0 - hp.beta1) * g;
    let v = hp.beta2 * v + (1.0 - hp.beta2) * g * g;
    let mut p2 =
        p - hp.lr * (m / hp.bias_correction1) / ((v / hp.bias_correction2).sqrt() + hp.eps);
    if hp.decoupled {
        p2 -= hp.lr * hp.weight_decay * p;
    }
    (p2, m, v)
}

/// The values an Adam step reads `p`, `m` and `v` from: the outputs themselves (an in-place
/// update), or separate inputs of the outputs' length.
pub(crate) type AdamInputs<'a> = Option<(&'a [f32], &'a [f32], &'a [f32])>;

/// Fills `(p_out, m_out, v_out)` from `inputs` (or updates them in place when `None`) and
/// `g`, all of one length.
pub(crate) fn adam(
    p_out: &mut [f32],
    m_out: &mut [f32],
    v_out: &mut [f32],
    inputs: AdamInputs<'_>,
    g: &[f32],
    hp: &AdamStep,
) {
    let run = |s: usize, po: &mut [f32], mo: &mut [f32], vo: &mut [f32]| {
        let e = s + po.len();
        let src = inputs.map(|(p, m, v)| (&p[s..e], &m[s..e], &v[s..e]));
        adam_block(po, mo, vo, src, &g[s..e], hp);
    };
    match rows_per_chunk(p_out.len(), 1) {
        None => run(0, p_out, m_out, v_out),
        Some(c) => p_out
            .par_chunks_mut(c)
            .zip(m_out.par_chunks_mut(c))
            .zip(v_out.par_chunks_mut(c))
            .enumerate()
            .for_each(|(k, ((po, mo), vo))| run(k * c, po, mo, vo)),
    }
}

multiversion! {
/// [`adam_scalar`] over slices of one length, in fixed-size blocks through local arrays (no
/// aliasing for LLVM to check, so the arithmetic vectorises). `src` holds the old `(p, m, v)`,
/// or is `None` when they are the outputs' current values: both read the same values into the
/// blocks, so the in-place step is bit for bit the other.
fn adam_block(
    po: &mut [f32],
    mo: &mut [f32],
    vo: &mut [f32],
    src: AdamInputs<'_>,
    g: &[f32],
    hp: &AdamStep,
) {
    const B: usize = 16;
    let mut i = 0;
    while i < po.len() {
        let n = B.min(po.len() - i);
        let (mut pb, mut gb, mut mb, mut vb) = ([0f32; B], [0f32; B], [0f32; B], [0f32; B]);
        let (p, m, v) = match src {
            Some((p, m, v)) => (&p[i..i + n], &m[i..i + n], &v[i..i + n]),
            None => (&po[i..i + n], &mo[i..i + n], &vo[i..i + n]),
        };
        pb[..n].copy_from_slice(p);
        mb[..n].copy_from_slice(m);
        vb[..n].copy_from_slice(v);
        gb[..n].copy_from_slice(&g[i..i + n]);
        for k in 0..B {
            (pb[k], mb[k], vb[k]) = adam_scalar(pb[k], gb[k], mb[k], vb[k], hp);
        }
        po[i..i + n].copy_from_slice(&pb[..n]);
        mo[i..i + n].copy_from_slice(&mb[..n]);
        vo[i..i + n].copy_from_slice(&vb[..n]);
        i += n;
    }
}
}
