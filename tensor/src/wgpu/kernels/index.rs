//! index_select, index_add, gather and scatter_add: one kernel (`index.wgsl`) in four modes.

use wgpipe_shaders::params::{IndexParams, ParamBlock};
use wgpipe_shaders::{IndexKernel, Kernel};

use super::{gpu, groups_for, u, LOOP_BUDGET};
use crate::backend::Kernels;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// One index kernel over `dims = [outer, dim, inner, n]`, `src` and `idx` made dense. The
/// selecting kernels (index_select, gather) write `[outer, n, inner]`, one invocation per
/// element; the accumulating ones (index_add, scatter_add) start `[outer, dim, inner]` from
/// zeros, one invocation per (outer, inner) column, and walk j in chunks of at most
/// `LOOP_BUDGET` per dispatch.
pub(super) fn run(
    ctx: &WgpuContext,
    k: IndexKernel,
    src: &RawTensor,
    idx: &RawTensor,
    dims: [usize; 4],
) -> Result<RawTensor> {
    let [outer, dim, inner, n] = dims;
    let src = ctx.dense(src)?;
    let idx = ctx.dense(idx)?;
    let accumulates = matches!(k, IndexKernel::IndexAdd | IndexKernel::ScatterAdd);
    let (out, items) = if accumulates {
        (
            ctx.fill(src.memory(), &[outer, dim, inner], 0.0)?,
            outer * inner,
        )
    } else {
        (
            ctx.empty(src.memory(), &[outer, n, inner])?,
            outer * n * inner,
        )
    };
    let step = if accumulates { LOOP_BUDGET } else { n.max(1) };
    let mut j0 = 0;
    loop {
        let j1 = (j0 + step).min(n);
        let params = IndexParams {
            outer: u(dims[0]),
            dim: u(dims[1]),
            inner: u(dims[2]),
            n: u(dims[3]),
            j_begin: u(j0),
            j_end: u(j1),
        };
        ctx.dispatch(
            Kernel::Index(k),
            &params.words(&[]),
            &[
                Arg::of(gpu(&src)?),
                Arg::of(gpu(&idx)?),
                Arg::of(gpu(&out)?),
            ],
            groups_for(items),
            1,
        )?;
        j0 = j1;
        if j0 >= n {
            break;
        }
    }
    ctx.check()?;
    Ok(out)
}
