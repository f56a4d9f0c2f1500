//! Half storage (f16, bf16: two values packed per 32-bit word) widened to f32 and f32 rounded
//! to half, the two casts every half op is made of.

use wgpipe_shaders::params::{CastParams, ParamBlock};
use wgpipe_shaders::{HalfFormat, Kernel};

use super::{gpu, groups_for, u};
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::Layout;
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;
use crate::storage::{Storage, StorageData};
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// The packed format of half `dtype`.
fn half_format(dtype: DType) -> HalfFormat {
    match dtype {
        DType::BF16 => HalfFormat::Bf16,
        _ => HalfFormat::F16,
    }
}

/// A fresh contiguous tensor of half `dtype`: 16-bit values packed two per 32-bit word,
/// charged at two bytes an element.
fn empty_half(
    ctx: &WgpuContext,
    mem: &MemoryTracker,
    shape: &[usize],
    dtype: DType,
) -> Result<RawTensor> {
    let n = ctx.indexable(shape)?;
    let allocation = Storage::reserve_dtype(mem, n, dtype)?;
    let buffer = ctx
        .pool
        .alloc((n.div_ceil(2) * 4) as u64)
        .map_err(|m| ctx.err(m))?;
    Ok(RawTensor::new(
        Storage::with_dtype(StorageData::Wgpu(buffer), dtype, allocation),
        shape,
        mem,
    ))
}

/// Half `x` (any view) as f32 over the storage elements the view spans, with `x`'s shape and
/// strides from offset 0 (see `Kernels::widen`).
pub(super) fn widen(ctx: &WgpuContext, x: &RawTensor) -> Result<RawTensor> {
    let l = x.layout();
    let n = l.span();
    let out = ctx.empty(x.memory(), &[n])?;
    ctx.dispatch(
        Kernel::Widen(half_format(x.dtype())),
        &CastParams {
            numel: u(n),
            offset: u(l.offset),
        }
        .words(&[]),
        &[Arg::of(gpu(x)?), Arg::of(gpu(&out)?)],
        groups_for(n.div_ceil(2)),
        1,
    )?;
    ctx.check()?;
    Ok(out.with_layout(Layout {
        offset: 0,
        ..l.clone()
    }))
}

/// f32 `x` rounded to half `dtype`, as a fresh contiguous tensor.
pub(super) fn narrow(ctx: &WgpuContext, x: &RawTensor, dtype: DType) -> Result<RawTensor> {
    let x = ctx.packed(x)?;
    let out = empty_half(ctx, x.memory(), x.shape(), dtype)?;
    let n = x.numel();
    ctx.dispatch(
        Kernel::Narrow(half_format(dtype)),
        &CastParams {
            numel: u(n),
            offset: u(x.layout().offset),
        }
        .words(&[]),
        &[Arg::of(gpu(&x)?), Arg::of(gpu(&out)?)],
        groups_for(n.div_ceil(2)),
        1,
    )?;
    ctx.check()?;
    Ok(out)
}
