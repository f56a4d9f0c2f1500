//! The fused cross-entropy loss over rows of logits and its backward: row kernels (see `rows`).

use wgpipe_shaders::params::{CrossEntropyBackwardParams, CrossEntropyParams, ParamBlock};
use wgpipe_shaders::Kernel;

use super::u;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;

/// `(loss, max, logsum)` of logits `x` (`dims = [rows, cols]`) against class ids `targets`.
pub(super) fn forward(
    ctx: &WgpuContext,
    x: &RawTensor,
    targets: &RawTensor,
    dims: [usize; 2],
) -> Result<(RawTensor, RawTensor, RawTensor)> {
    let [rows, cols] = dims;
    let [loss, max, logsum] = ctx.row_kernel(
        "cross_entropy",
        dims,
        true,
        [x, targets],
        [&[rows], &[rows], &[rows]],
        |group, [x, t]| {
            let params = CrossEntropyParams {
                rows: u(rows),
                cols: u(cols),
                x_offset: u(x.layout().offset),
                t_offset: u(t.layout().offset),
            };
            (Kernel::CrossEntropy { group }, params.words(&[]))
        },
    )?;
    Ok((loss, max, logsum))
}

/// The gradient of the logits `x`, given `g`, the gradient of each row's loss, and the saved
/// `max` and `logsum`.
pub(super) fn backward(
    ctx: &WgpuContext,
    inputs: [&RawTensor; 5],
    dims: [usize; 2],
) -> Result<RawTensor> {
    let [rows, cols] = dims;
    // No one-subgroup variant: this kernel has no tree reduction.
    let [out] = ctx.row_kernel(
        "cross_entropy backward",
        dims,
        false,
        inputs,
        [&dims],
        |group, [x, t, max, logsum, g]| {
            let off = |v: &RawTensor| u(v.layout().offset);
            let params = CrossEntropyBackwardParams {
                rows: u(rows),
                cols: u(cols),
                x_offset: off(x),
                t_offset: off(t),
                max_offset: off(max),
                logsum_offset: off(logsum),
                g_offset: off(g),
            };
            (
                Kernel::CrossEntropyBackward { wg: group.wg },
                params.words(&[]),
            )
        },
    )?;
    Ok(out)
}
