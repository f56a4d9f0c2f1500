//! The fused Adam/AdamW step, elementwise over contiguous parameter, gradient and moments.

use rayon::prelude::*;

use crate::backend::AdamStep;

use super::par::rows_per_chunk;
use super::simd::multiversion;

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

/// Fills `(p_out, m_out, v_out)` from `(p, g, m, v)`, all of one length.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam(
    p_out: &mut [f32],
    m_out: &mut [f32],
    v_out: &mut [f32],
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    hp: &AdamStep,
) {
    let run = |s: usize, po: &mut [f32], mo: &mut [f32], vo: &mut [f32]| {
        let e = s + po.len();
        adam_block(po, mo, vo, &p[s..e], &g[s..e], &m[s..e], &v[s..e], hp);
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
/// aliasing for LLVM to check, so the arithmetic vectorises).
#[allow(clippy::too_many_arguments)]
fn adam_block(
    po: &mut [f32],
    mo: &mut [f32],
    vo: &mut [f32],
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    hp: &AdamStep,
) {
    const B: usize = 16;
    let mut i = 0;
    while i < po.len() {
        let n = B.min(po.len() - i);
        let (mut pb, mut gb, mut mb, mut vb) = ([0f32; B], [0f32; B], [0f32; B], [0f32; B]);
        pb[..n].copy_from_slice(&p[i..i + n]);
        gb[..n].copy_from_slice(&g[i..i + n]);
        mb[..n].copy_from_slice(&m[i..i + n]);
        vb[..n].copy_from_slice(&v[i..i + n]);
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
