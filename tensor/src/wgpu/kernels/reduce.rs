//! Row reductions (sum, mean, max, min, argmax, argmin), the column sums of `sum_leading`,
//! and softmax (plain, log, causal) with its backward.

use wgpipe_shaders::params::{
    ParamBlock, ReduceParams, SoftmaxBackwardParams, SoftmaxParams, SumLeadingParams,
};
use wgpipe_shaders::{Kernel, ReduceMode, ELEMENTWISE_WG};

use super::{gpu, groups_for, u, LOOP_BUDGET};
use crate::backend::ReduceOp;
use crate::error::Result;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// Loop iterations per invocation in the first pass of a long-row reduction (its segments
/// are this many times the row workgroup size).
const REDUCE_SEGMENT_STEPS: usize = 64;

/// Rows of at most this many columns are reduced one invocation per row (`reduce_thin.wgsl`)
/// on a GPU: a workgroup per row would leave most of its invocations idle. (Not measured on a
/// GPU yet: longer rows read one invocation apart would not coalesce.)
const THIN_ROW_COLS: usize = 32;
/// The same on a software adapter, where each barrier of the workgroup tree costs a switch per
/// invocation: on lavapipe one invocation per row was the faster at every shape measured up to
/// 256 columns ([65536, 8] 12.5 -> 0.76 ms, [64, 128] 0.13 -> 0.04, [4096, 256] 1.8 -> 1.1).
const THIN_ROW_COLS_SOFTWARE: usize = 256;

/// The longest rows `reduce_rows` gives one invocation each, on a software adapter or a GPU.
pub(in crate::wgpu) fn thin_row_cols(is_software: bool) -> usize {
    if is_software {
        THIN_ROW_COLS_SOFTWARE
    } else {
        THIN_ROW_COLS
    }
}

/// Invocations a column-sum pass aims for, so that a narrow matrix still fills the adapter.
const COLUMN_SUM_PARALLEL: usize = 16384;
/// Fewest rows per chunk of a column-sum pass: fewer would only move the work to the next pass.
const COLUMN_SUM_MIN_CHUNK: usize = 32;

/// `[width]` sums of the columns of contiguous `x` seen as `[rows, width]` (`sum_leading`):
/// passes of `sum_leading.wgsl`, each summing chunks of rows into partials, until one chunk
/// is left. Chunks are at most `LOOP_BUDGET` rows (lavapipe's loop limit).
pub(super) fn column_sums(ctx: &WgpuContext, x: &RawTensor, width: usize) -> Result<RawTensor> {
    let mem = x.memory();
    let (mut src, mut offset) = (x.clone(), x.layout().offset);
    let mut rows = x.numel() / width.max(1);
    loop {
        let wanted = COLUMN_SUM_PARALLEL.div_ceil(width.max(1));
        let chunk = rows
            .div_ceil(wanted)
            .clamp(COLUMN_SUM_MIN_CHUNK, LOOP_BUDGET);
        let chunks = rows.div_ceil(chunk).max(1);
        let out = ctx.empty(mem, &[chunks * width])?;
        let params = SumLeadingParams {
            rows: u(rows),
            width: u(width),
            chunk: u(chunk),
            chunks: u(chunks),
            x_offset: u(offset),
        };
        ctx.dispatch(
            Kernel::SumLeading,
            &params.words(&[]),
            &[Arg::of(gpu(&src)?), Arg::of(gpu(&out)?)],
            groups_for(chunks * width),
            1,
        )?;
        ctx.check()?;
        if chunks == 1 {
            return Ok(out);
        }
        (src, offset, rows) = (out, 0, chunks);
    }
}

/// `reduce_rows` of contiguous `x` seen as `[rows, cols]`. Its workgroup is picked as the
/// other row kernels' is, but it is not one dispatch of one workgroup per row: see
/// [`reduce_rows_in_groups`].
pub(super) fn reduce_rows(
    ctx: &WgpuContext,
    op: ReduceOp,
    x: &RawTensor,
    [rows, cols]: [usize; 2],
) -> Result<RawTensor> {
    let x = ctx.packed(x)?;
    if cols <= thin_row_cols(ctx.info.is_software) {
        // One invocation per row: no workgroup to tune.
        return reduce_rows_in_groups(ctx, op, &x, [rows, cols], ctx.row_wg());
    }
    ctx.with_row_group(op.name(), [rows, cols], false, |g| {
        reduce_rows_in_groups(ctx, op, &x, [rows, cols], g.wg)
    })
}

/// `reduce_rows` of packed `x` (`[rows, cols]`): short rows (the thin kernel's) one
/// invocation each; longer whole rows a workgroup of `wg` each; long rows in segments of
/// `wg * REDUCE_SEGMENT_STEPS` columns into (value, index) partials, then one workgroup per
/// row over its partials.
fn reduce_rows_in_groups(
    ctx: &WgpuContext,
    op: ReduceOp,
    x: &RawTensor,
    [rows, cols]: [usize; 2],
    wg: u32,
) -> Result<RawTensor> {
    let out = ctx.empty(x.memory(), &[rows])?;
    let off = u(x.layout().offset);
    let segment = wg as usize * REDUCE_SEGMENT_STEPS;
    let thin = cols <= thin_row_cols(ctx.info.is_software);
    if thin || cols <= 2 * segment {
        let (mode, wg, groups) = if thin {
            (ReduceMode::Thin, ELEMENTWISE_WG, groups_for(rows))
        } else {
            (ReduceMode::Direct, wg, rows as u64)
        };
        ctx.dispatch(
            Kernel::Reduce { op, mode, wg },
            &ReduceParams {
                rows: u(rows),
                cols: u(cols),
                x_offset: off,
                segments: 1,
                seg_len: u(cols.max(1)),
            }
            .words(&[]),
            &[Arg::of(gpu(x)?), Arg::of(gpu(&out)?)],
            groups,
            1,
        )?;
    } else {
        let segs = cols.div_ceil(segment);
        let pv = ctx.empty(x.memory(), &[rows, segs])?;
        let pi = ctx.empty(x.memory(), &[rows, segs])?;
        ctx.dispatch(
            Kernel::Reduce {
                op,
                mode: ReduceMode::Partial,
                wg,
            },
            &ReduceParams {
                rows: u(rows),
                cols: u(cols),
                x_offset: off,
                segments: u(segs),
                seg_len: u(segment),
            }
            .words(&[]),
            &[Arg::of(gpu(x)?), Arg::of(gpu(&pv)?), Arg::of(gpu(&pi)?)],
            (rows * segs) as u64,
            1,
        )?;
        ctx.dispatch(
            Kernel::Reduce {
                op,
                mode: ReduceMode::Final,
                wg,
            },
            &ReduceParams {
                rows: u(rows),
                cols: u(segs),
                x_offset: 0,
                segments: 1,
                seg_len: u(segs),
            }
            .words(&[]),
            &[Arg::of(gpu(&pv)?), Arg::of(gpu(&pi)?), Arg::of(gpu(&out)?)],
            rows as u64,
            1,
        )?;
    }
    ctx.check()?;
    Ok(out)
}

/// `softmax.wgsl` over the rows of `x` (`dims = [rows, cols]`): plain or causal, of
/// `scale * x`.
pub(super) fn softmax(
    ctx: &WgpuContext,
    op: &'static str,
    x: &RawTensor,
    dims: [usize; 2],
    log: bool,
    scale: f32,
    causal: bool,
) -> Result<RawTensor> {
    let [rows, cols] = dims;
    let [out] = ctx.row_kernel(op, dims, true, [x], [&dims], |group, [x]| {
        let params = SoftmaxParams {
            rows: u(rows),
            cols: u(cols),
            x_offset: u(x.layout().offset),
            scale,
            causal: causal.into(),
        };
        (Kernel::Softmax { log, group }, params.words(&[]))
    })?;
    Ok(out)
}

/// The gradient of softmaxed rows `y` given theirs, `g` (`dims = [rows, cols]`).
pub(super) fn softmax_backward(
    ctx: &WgpuContext,
    y: &RawTensor,
    g: &RawTensor,
    dims: [usize; 2],
    scale: f32,
) -> Result<RawTensor> {
    let [rows, cols] = dims;
    let [out] = ctx.row_kernel(
        "softmax_backward",
        dims,
        true,
        [y, g],
        [&dims],
        |group, [y, g]| {
            let params = SoftmaxBackwardParams {
                rows: u(rows),
                cols: u(cols),
                scale,
                y_offset: u(y.layout().offset),
                g_offset: u(g.layout().offset),
            };
            (Kernel::SoftmaxBackward { group }, params.words(&[]))
        },
    )?;
    Ok(out)
}
