//! Dropout masks from the counter-based generator of `crate::rng`.

use wgpipe_shaders::params::{DropoutParams, ParamBlock};
use wgpipe_shaders::Kernel;

use super::{gpu, groups_for, u};
use crate::error::Result;
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// Dropout multipliers of `shape`: element i is `crate::rng::dropout_value(seed, offset, i, p)`.
pub(super) fn dropout_mask(
    ctx: &WgpuContext,
    mem: &MemoryTracker,
    shape: &[usize],
    p: f32,
    seed: u64,
    offset: u64,
) -> Result<RawTensor> {
    let out = ctx.empty(mem, shape)?;
    let n = out.numel();
    // The same f32 arithmetic as `rng::dropout_value`, so the multipliers match bit for bit.
    let scale = 1.0 / (1.0 - p);
    let params = DropoutParams {
        numel: u(n),
        seed_lo: seed as u32,
        seed_hi: (seed >> 32) as u32,
        offset_lo: offset as u32,
        offset_hi: (offset >> 32) as u32,
        p,
        scale,
    };
    ctx.dispatch(
        Kernel::Dropout,
        &params.words(&[]),
        &[Arg::of(gpu(&out)?)],
        groups_for(n.div_ceil(4)),
        1,
    )?;
    ctx.check()?;
    Ok(out)
}
