//! Layer norm over rows, its residual-add form, and its backward: row kernels (see `rows`).

use wgpipe_shaders::params::{LayerNormBackwardParams, LayerNormParams, ParamBlock};
use wgpipe_shaders::Kernel;

use super::u;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;

/// `(y, mean, rstd)` of the rows of `x` (`dims = [rows, cols]`), scaled by `gamma`, shifted by
/// `beta`.
pub(super) fn layer_norm(
    ctx: &WgpuContext,
    x: &RawTensor,
    gamma: &RawTensor,
    beta: &RawTensor,
    dims: [usize; 2],
    eps: f32,
) -> Result<(RawTensor, RawTensor, RawTensor)> {
    let rows = dims[0];
    let [y, mean, rstd] = ctx.row_kernel(
        "layer_norm",
        dims,
        true,
        [x, gamma, beta],
        [&dims, &[rows], &[rows]],
        |group, [x, gamma, beta]| {
            let params = norm_params(dims, eps, [x, gamma, beta], 0);
            (Kernel::LayerNorm { group }, params.words(&[]))
        },
    )?;
    Ok((y, mean, rstd))
}

/// The parameter block of both forward kernels (`r_offset`: the residual's, 0 without one).
fn norm_params(
    [rows, cols]: [usize; 2],
    eps: f32,
    [x, gamma, beta]: [&RawTensor; 3],
    r_offset: u32,
) -> LayerNormParams {
    LayerNormParams {
        rows: u(rows),
        cols: u(cols),
        eps,
        x_offset: u(x.layout().offset),
        gamma_offset: u(gamma.layout().offset),
        beta_offset: u(beta.layout().offset),
        r_offset,
    }
}

/// [`layer_norm`] of `x + r` that also returns the sum: `(s, y, mean, rstd)`. Mean and rstd
/// come back as views of one `[2, rows]` buffer (the kernel's binding budget).
pub(super) fn add_layer_norm(
    ctx: &WgpuContext,
    [x, r, gamma, beta]: [&RawTensor; 4],
    dims: [usize; 2],
    eps: f32,
) -> Result<(RawTensor, RawTensor, RawTensor, RawTensor)> {
    let rows = dims[0];
    let [y, stats, s] = ctx.row_kernel(
        "add_layer_norm",
        dims,
        true,
        [x, gamma, beta, r],
        [&dims, &[2, rows], &dims],
        |group, [x, gamma, beta, r]| {
            let params = norm_params(dims, eps, [x, gamma, beta], u(r.layout().offset));
            (Kernel::AddLayerNorm { group }, params.words(&[]))
        },
    )?;
    let mean = stats.narrow(0, 0, 1)?.reshape(&[rows])?;
    let rstd = stats.narrow(0, 1, 1)?.reshape(&[rows])?;
    Ok((s, y, mean, rstd))
}

/// The gradient of layer norm's input (see `Kernels::layer_norm_backward_rows`), `carry` added
/// in the same pass when given.
pub(super) fn layer_norm_backward(
    ctx: &WgpuContext,
    [x, mean, rstd, gamma, g]: [&RawTensor; 5],
    carry: Option<&RawTensor>,
    dims: [usize; 2],
) -> Result<RawTensor> {
    let [rows, cols] = dims;
    // Without a carry, g is bound in its place and not read.
    let has_carry = carry.is_some();
    let inputs = [x, mean, rstd, gamma, g, carry.unwrap_or(g)];
    let [out] = ctx.row_kernel(
        "layer_norm backward",
        dims,
        true,
        inputs,
        [&dims],
        |group, [x, mean, rstd, gamma, g, carry]| {
            let off = |v: &RawTensor| u(v.layout().offset);
            let params = LayerNormBackwardParams {
                rows: u(rows),
                cols: u(cols),
                x_offset: off(x),
                mean_offset: off(mean),
                rstd_offset: off(rstd),
                gamma_offset: off(gamma),
                g_offset: off(g),
                carry_offset: off(carry),
                has_carry: has_carry.into(),
            };
            (Kernel::LayerNormBackward { group }, params.words(&[]))
        },
    )?;
    Ok(out)
}
