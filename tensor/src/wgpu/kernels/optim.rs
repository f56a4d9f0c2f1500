//! The fused Adam/AdamW steps, out of place and in place (the in-place one over exclusive
//! tensors, checked by the caller).

use wgpipe_shaders::params::{AdamParams, ParamBlock};
use wgpipe_shaders::Kernel;

use super::{gpu, groups_for, u};
use crate::backend::AdamStep;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// The parameter block of both Adam kernels for `n` elements.
fn adam_params(n: usize, hp: &AdamStep) -> AdamParams {
    AdamParams {
        numel: u(n),
        lr: hp.lr,
        beta1: hp.beta1,
        beta2: hp.beta2,
        eps: hp.eps,
        weight_decay: hp.weight_decay,
        decoupled: u32::from(hp.decoupled),
        bc1: hp.bias_correction1,
        bc2: hp.bias_correction2,
    }
}

/// `(param', m', v')` of one Adam step, as fresh tensors.
pub(super) fn adam(
    ctx: &WgpuContext,
    [param, grad, m, v]: [&RawTensor; 4],
    hp: &AdamStep,
) -> Result<(RawTensor, RawTensor, RawTensor)> {
    let (p, g, m, v) = (
        ctx.dense(param)?,
        ctx.dense(grad)?,
        ctx.dense(m)?,
        ctx.dense(v)?,
    );
    let mem = param.memory();
    let shape = param.shape();
    let (po, mo, vo) = (
        ctx.empty(mem, shape)?,
        ctx.empty(mem, shape)?,
        ctx.empty(mem, shape)?,
    );
    let n = po.numel();
    ctx.dispatch(
        Kernel::Adam,
        &adam_params(n, hp).words(&[]),
        &[
            Arg::of(gpu(&p)?),
            Arg::of(gpu(&g)?),
            Arg::of(gpu(&m)?),
            Arg::of(gpu(&v)?),
            Arg::of(gpu(&po)?),
            Arg::of(gpu(&mo)?),
            Arg::of(gpu(&vo)?),
        ],
        groups_for(n),
        1,
    )?;
    ctx.check()?;
    Ok((po, mo, vo))
}

/// One Adam step written into `param`, `m` and `v` (exclusive, contiguous from 0).
pub(super) fn adam_in_place(
    ctx: &WgpuContext,
    [param, grad, m, v]: [&RawTensor; 4],
    hp: &AdamStep,
) -> Result<()> {
    let g = ctx.dense(grad)?;
    let n = param.numel();
    ctx.dispatch(
        Kernel::AdamInPlace,
        &adam_params(n, hp).words(&[]),
        &[
            Arg::of(gpu(&g)?),
            Arg::of(gpu(param)?),
            Arg::of(gpu(m)?),
            Arg::of(gpu(v)?),
        ],
        groups_for(n),
        1,
    )?;
    ctx.check()
}
