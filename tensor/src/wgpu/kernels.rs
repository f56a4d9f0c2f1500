//! `impl Kernels for WgpuContext`: each trait method validates what the shaders rely on, lays
//! out the parameter block, allocates outputs (memory tracker first, then the buffer pool) and
//! records its dispatch(es).

use wgpipe_shaders::params::*;
use wgpipe_shaders::{
    EwLayout, HalfFormat, IndexKernel, Kernel, ReduceMode, RowGroup, SpatialKernel, ELEMENTWISE_WG,
    ROW_SUBGROUP_SIZES, ROW_WG_CHOICES,
};

use super::autotune::row_class;
use super::context::WgpuContext;
use super::pool::GpuBuffer;
use super::runtime::Arg;
use crate::backend::*;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{numel, Layout};
use crate::storage::{Storage, StorageData};
use crate::tensor::Tensor;

/// The GPU buffer behind a tensor (an error for a tensor of another backend).
pub(super) fn gpu(x: &Tensor) -> Result<&GpuBuffer> {
    match &x.storage().data {
        StorageData::Wgpu(b) => Ok(b),
        _ => Err(Error::invalid(
            "wgpu kernel",
            format!("tensor on {} is not a wgpu tensor", x.device()),
        )),
    }
}

/// Fails unless `t` [is exclusive](Tensor::is_exclusive): the in-place kernels' contract,
/// checked so that a broken one is an error rather than a write into a shared buffer.
fn exclusive(op: &'static str, t: &mut Tensor) -> Result<()> {
    if t.exclusive_storage().is_none() {
        return Err(Error::invalid(
            op,
            format!(
                "the tensor of shape {:?} to update in place is shared or a view",
                t.shape()
            ),
        ));
    }
    Ok(())
}

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

/// The packed format of half `dtype`.
fn half_format(dtype: DType) -> HalfFormat {
    match dtype {
        DType::BF16 => HalfFormat::Bf16,
        _ => HalfFormat::F16,
    }
}

pub(super) fn u(v: usize) -> u32 {
    v as u32
}

/// Merges the dims of several same-shaped layouts: size-1 dims go, and neighbouring dims that
/// are contiguous with each other in every layout become one. Returns the shape and each
/// layout's strides.
pub(super) fn collapse(shape: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out_strides: Vec<Vec<usize>> = vec![Vec::new(); strides.len()];
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let mergeable = !out_shape.is_empty()
            && strides.iter().zip(&out_strides).all(|(s, o)| {
                let last = *o.last().expect("same length as out_shape");
                last == s[d] * size
            });
        if mergeable {
            *out_shape.last_mut().expect("non-empty") *= size;
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                *o.last_mut().expect("non-empty") = s[d];
            }
        } else {
            out_shape.push(size);
            for (s, o) in strides.iter().zip(out_strides.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    (out_shape, out_strides)
}

/// Lavapipe (llvmpipe) ends an invocation after 65535 loop iterations summed over all its loops
/// (`LP_MAX_TGSI_LOOP_ITERATIONS`); kernels keep each invocation well under this many.
pub(super) const LOOP_BUDGET: usize = 16384;

/// Loop iterations per invocation in the first pass of a long-row reduction (its segments
/// are this many times the row workgroup size).
const REDUCE_SEGMENT_STEPS: usize = 64;

/// The grid of the rows layout (`EwLayout::StridedRows`) for a collapsed `shape`, when it
/// applies: at most 4 dims, a last dim of whole vec4s that fills a workgroup, and each grid
/// dimension within `max`. Workgroups: x along the last dim, y the dim before, z the two before
/// that.
pub(super) fn rows_grid(shape: &[usize], max: usize) -> Option<[u32; 3]> {
    let wg = EwLayout::ROWS_WG as usize;
    let (&inner, outer) = shape.split_last()?;
    if outer.len() > 3 || inner < 4 * wg || !inner.is_multiple_of(4) {
        return None;
    }
    let d2 = outer.last().copied().unwrap_or(1);
    let d01: usize = outer.iter().rev().skip(1).product();
    let x = (inner / 4).div_ceil(wg);
    (x <= max && d2 <= max && d01 <= max).then(|| [u(x), u(d2), u(d01)])
}

/// Workgroups for `n` invocations of the one-invocation-per-element kernels.
pub(super) fn groups_for(n: usize) -> u64 {
    (n as u64).div_ceil(u64::from(ELEMENTWISE_WG))
}

/// Rows of at most this many columns are reduced one invocation per row (`reduce_thin.wgsl`)
/// on a GPU: a workgroup per row would leave most of its invocations idle. (Not measured on a
/// GPU yet: longer rows read one invocation apart would not coalesce.)
const THIN_ROW_COLS: usize = 32;
/// The same on a software adapter, where each barrier of the workgroup tree costs a switch per
/// invocation: on lavapipe one invocation per row was the faster at every shape measured up to
/// 256 columns ([65536, 8] 12.5 -> 0.76 ms, [64, 128] 0.13 -> 0.04, [4096, 256] 1.8 -> 1.1).
const THIN_ROW_COLS_SOFTWARE: usize = 256;

/// The longest rows `reduce_rows` gives one invocation each, on a software adapter or a GPU.
pub(super) fn thin_row_cols(is_software: bool) -> usize {
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

impl WgpuContext {
    /// `[width]` sums of the columns of contiguous `x` seen as `[rows, width]` (`sum_leading`):
    /// passes of `sum_leading.wgsl`, each summing chunks of rows into partials, until one chunk
    /// is left. Chunks are at most `LOOP_BUDGET` rows (lavapipe's loop limit).
    fn column_sums(&self, x: &Tensor, width: usize) -> Result<Tensor> {
        let dev = x.device();
        let (mut src, mut offset) = (x.clone(), x.layout().offset);
        let mut rows = x.numel() / width.max(1);
        loop {
            let wanted = COLUMN_SUM_PARALLEL.div_ceil(width.max(1));
            let chunk = rows
                .div_ceil(wanted)
                .clamp(COLUMN_SUM_MIN_CHUNK, LOOP_BUDGET);
            let chunks = rows.div_ceil(chunk).max(1);
            let out = self.empty(dev, &[chunks * width])?;
            let params = SumLeadingParams {
                rows: u(rows),
                width: u(width),
                chunk: u(chunk),
                chunks: u(chunks),
                x_offset: u(offset),
            };
            self.dispatch(
                Kernel::SumLeading,
                &params.words(&[]),
                &[Arg::of(gpu(&src)?), Arg::of(gpu(&out)?)],
                groups_for(chunks * width),
                1,
            )?;
            self.check()?;
            if chunks == 1 {
                return Ok(out);
            }
            (src, offset, rows) = (out, 0, chunks);
        }
    }

    /// A fresh contiguous tensor of `shape` on `dev` (charged to `dev`'s tracker first).
    pub(super) fn empty(&self, dev: &Device, shape: &[usize]) -> Result<Tensor> {
        let n = numel(shape);
        if n > u32::MAX as usize {
            return Err(self.err(format!(
                "a tensor of shape {shape:?} has {n} elements; wgpu kernels index with u32"
            )));
        }
        let allocation = Storage::reserve(dev, n)?;
        let buffer = self.pool.alloc((n * 4) as u64).map_err(|m| self.err(m))?;
        Ok(Tensor::from_storage(
            Storage::new(StorageData::Wgpu(buffer), allocation),
            shape,
            dev,
        ))
    }

    /// A fresh contiguous tensor of half `dtype`: 16-bit values packed two per 32-bit word,
    /// charged at two bytes an element.
    fn empty_half(&self, dev: &Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let n = numel(shape);
        if n > u32::MAX as usize {
            return Err(self.err(format!(
                "a tensor of shape {shape:?} has {n} elements; wgpu kernels index with u32"
            )));
        }
        let allocation = Storage::reserve_dtype(dev, n, dtype)?;
        let buffer = self
            .pool
            .alloc((n.div_ceil(2) * 4) as u64)
            .map_err(|m| self.err(m))?;
        Ok(Tensor::from_storage(
            Storage::with_dtype(StorageData::Wgpu(buffer), dtype, allocation),
            shape,
            dev,
        ))
    }

    /// `x` itself when contiguous from element 0, else a contiguous copy (kernels that index
    /// their inputs as dense arrays).
    fn dense(&self, x: &Tensor) -> Result<Tensor> {
        if x.is_contiguous() && x.layout().offset == 0 {
            Ok(x.clone())
        } else {
            self.contiguous(x)
        }
    }

    /// `x` contiguous (offset allowed).
    fn packed(&self, x: &Tensor) -> Result<Tensor> {
        if x.is_contiguous() {
            Ok(x.clone())
        } else {
            self.contiguous(x)
        }
    }

    /// The elementwise template over same-shaped strided `inputs`: contiguous inputs at
    /// offsets that are multiples of 4 go four elements per invocation, other contiguous inputs
    /// one, and strided ones through their layouts.
    fn map(
        &self,
        kernel: impl Fn(EwLayout) -> Kernel,
        inputs: &[&Tensor],
        s0: f32,
        s1: f32,
    ) -> Result<Tensor> {
        let x0 = inputs[0];
        let out = self.empty(x0.device(), x0.shape())?;
        self.map_into(kernel, inputs, s0, s1, gpu(&out)?, false)?;
        Ok(out)
    }

    /// Records [`WgpuContext::map`]'s kernel writing into `out`. With `first_is_out`, input 0 is
    /// `out` itself (contiguous from 0), read by the kernel through its output binding.
    fn map_into(
        &self,
        kernel: impl Fn(EwLayout) -> Kernel,
        inputs: &[&Tensor],
        s0: f32,
        s1: f32,
        out: &GpuBuffer,
        first_is_out: bool,
    ) -> Result<()> {
        let x0 = inputs[0];
        let n = x0.numel();
        if n == 0 {
            return Ok(());
        }
        let strides: Vec<&[usize]> = inputs.iter().map(|t| t.strides()).collect();
        let (mut shape, mut cstrides) = collapse(x0.shape(), &strides);
        let contiguous = cstrides.iter().all(|s| s.is_empty() || s == &[1]);
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let mut bufs = Vec::with_capacity(inputs.len() + 1);
        for t in &inputs[usize::from(first_is_out)..] {
            bufs.push(gpu(t)?);
        }
        // The rows layout serves llvmpipe (see `elementwise.wgsl`); GPUs keep full workgroups. It
        // binds its buffers as whole vec4s (only looked at where the layout applies).
        let rows = if contiguous || !self.info.is_software {
            None
        } else {
            rows_grid(&shape, max)
        };
        let vec4_args: Option<Vec<Arg<'_>>> =
            rows.and_then(|_| bufs.iter().chain([&out]).map(|b| Arg::vec4(b)).collect());
        let rows = rows.filter(|_| vec4_args.is_some());
        let layout = if rows.is_some() {
            // rank 4: leading dims of size 1 (stride 0) where the shape is shorter
            let pad = 4 - shape.len();
            shape.splice(0..0, std::iter::repeat_n(1, pad));
            for s in &mut cstrides {
                s.splice(0..0, std::iter::repeat_n(0, pad));
            }
            EwLayout::StridedRows
        } else if !contiguous {
            EwLayout::Strided
        } else if n.is_multiple_of(4) && inputs.iter().all(|t| t.layout().offset.is_multiple_of(4))
        {
            EwLayout::Vec4
        } else {
            EwLayout::Contiguous
        };
        let strided = !contiguous;
        let block = EwParams {
            count: u(if layout == EwLayout::Vec4 { n / 4 } else { n }),
            rank: if strided { u(shape.len()) } else { 0 },
            s0,
            s1,
        };
        let mut dims: Vec<u32> = Vec::new();
        if strided {
            dims.extend(shape.iter().map(|&d| u(d)));
        }
        for (t, s) in inputs.iter().zip(&cstrides) {
            dims.push(u(t.layout().offset));
            if strided {
                dims.extend(s.iter().map(|&v| u(v)));
            }
        }
        let params = block.words(&dims);
        let count = block.count as usize;
        match (rows, vec4_args) {
            (Some(grid), Some(args)) => self.dispatch_grid(kernel(layout), &params, &args, grid)?,
            _ => {
                let args: Vec<Arg<'_>> = bufs.iter().chain([&out]).map(|b| Arg::of(b)).collect();
                self.dispatch(kernel(layout), &params, &args, groups_for(count), 1)?
            }
        }
        self.check()
    }

    /// Records the strided copy of `src` into `dst` at (`out_offset`, `out_strides`).
    fn copy_into(
        &self,
        src: &Tensor,
        dst: &GpuBuffer,
        out_offset: usize,
        out_strides: &[usize],
    ) -> Result<()> {
        let n = src.numel();
        if n == 0 {
            return Ok(());
        }
        let (shape, s) = collapse(src.shape(), &[src.strides(), out_strides]);
        let mut dims: Vec<u32> = shape.iter().map(|&d| u(d)).collect();
        dims.push(u(src.layout().offset));
        dims.extend(s[0].iter().map(|&v| u(v)));
        dims.push(u(out_offset));
        dims.extend(s[1].iter().map(|&v| u(v)));
        let params = CopyParams {
            numel: u(n),
            rank: u(shape.len()),
        }
        .words(&dims);
        self.dispatch(
            Kernel::CopyStrided,
            &params,
            &[Arg::of(gpu(src)?), Arg::of(dst)],
            groups_for(n),
            1,
        )
    }

    /// Runs a spatial kernel (conv columns, pools) with one invocation per output element:
    /// dense copies of `inputs` are bound first, then `O` fresh outputs of `out_shape`.
    fn spatial<const I: usize, const O: usize>(
        &self,
        kernel: SpatialKernel,
        params: &SpatialParams,
        inputs: [&Tensor; I],
        out_shape: &[usize],
    ) -> Result<[Tensor; O]> {
        let dev = inputs[0].device();
        let inputs = inputs.map(|x| self.dense(x));
        let inputs = inputs.into_iter().collect::<Result<Vec<_>>>()?;
        let outs = [(); O].map(|_| self.empty(dev, out_shape));
        let outs = outs.into_iter().collect::<Result<Vec<_>>>()?;
        let args = inputs
            .iter()
            .chain(&outs)
            .map(|t| gpu(t).map(Arg::of))
            .collect::<Result<Vec<_>>>()?;
        self.dispatch(
            Kernel::Spatial(kernel),
            &params.words(&[]),
            &args,
            groups_for(numel(out_shape)),
            1,
        )?;
        self.check()?;
        Ok(outs
            .try_into()
            .unwrap_or_else(|_| unreachable!("exactly O outputs were made")))
    }

    /// A pool's geometry as a spatial parameter block: dilation 1, one group.
    fn spatial_params(g: &Pool2dGeometry) -> SpatialParams {
        Self::conv_params(&Conv2dGeometry {
            n: g.n,
            c_in: g.c,
            h: g.h,
            w: g.w,
            c_out: g.c,
            kh: g.kh,
            kw: g.kw,
            stride: g.stride,
            padding: g.padding,
            dilation: (1, 1),
            groups: 1,
            h_out: g.h_out,
            w_out: g.w_out,
        })
    }

    fn conv_params(g: &Conv2dGeometry) -> SpatialParams {
        SpatialParams {
            n: u(g.n),
            c: u(g.c_in),
            h: u(g.h),
            w: u(g.w),
            kh: u(g.kh),
            kw: u(g.kw),
            sh: u(g.stride.0),
            sw: u(g.stride.1),
            ph: u(g.padding.0),
            pw: u(g.padding.1),
            dh: u(g.dilation.0),
            dw: u(g.dilation.1),
            groups: u(g.groups),
            h_out: u(g.h_out),
            w_out: u(g.w_out),
        }
    }

    /// Whether rows of `cols` columns stay within lavapipe's loop limit in the one-workgroup-
    /// per-row kernels of `wg` invocations (softmax, layer norm: three passes over the row per
    /// invocation). Always on hardware adapters.
    fn row_fits(&self, cols: usize, wg: u32) -> bool {
        !self.info.is_software || cols <= 20_000 * wg as usize
    }

    /// An error naming the software adapter when its rows are too long for its own row
    /// workgroup size (see [`Self::row_fits`]).
    fn check_row_len(&self, op: &'static str, cols: usize) -> Result<()> {
        let wg = self.row_wg();
        if !self.row_fits(cols, wg) {
            return Err(Error::invalid(
                op,
                format!(
                    "rows of {cols} columns are longer than the {} this software adapter \
                     ({}) can process per row",
                    20_000 * wg as usize,
                    self.info.name
                ),
            ));
        }
        Ok(())
    }

    /// Runs row kernel `op` as `run(group)`, `group` its workgroup: the one the autotune keeps
    /// for the op's shape class when it is on (each candidate that fits the adapter timed on
    /// first use), else the adapter's own ([`WgpuContext::row_group`]). `subgroups`: whether the
    /// op has one-subgroup variants (those with tree reductions); without, only the size counts.
    fn with_row_group<R>(
        &self,
        op: &str,
        [rows, cols]: [usize; 2],
        subgroups: bool,
        run: impl Fn(RowGroup) -> Result<R>,
    ) -> Result<R> {
        let own = match self.row_group() {
            g if g.subgroup && !subgroups => RowGroup::tree(g.wg),
            g => g,
        };
        let Some(tuner) = self.tuner().filter(|_| rows > 0 && cols > 0) else {
            return run(own);
        };
        let candidates = self.row_group_candidates(cols, subgroups);
        if candidates.len() < 2 {
            return run(own);
        }
        let class = row_class(op, rows, cols);
        let group = tuner.choose(&class, &candidates, |g| self.time_op(|| run(g)))?;
        run(group)
    }

    /// The row workgroups the autotune times for rows of `cols` columns: a tree over each size
    /// within the adapter's workgroup limits (and, on a software adapter, its loop limit), and
    /// with `subgroups` one subgroup where the adapter's subgroup size is fixed.
    pub(super) fn row_group_candidates(&self, cols: usize, subgroups: bool) -> Vec<RowGroup> {
        let l = &self.limits;
        let fits = |wg: u32| {
            wg <= l.max_compute_invocations_per_workgroup
                && wg <= l.max_compute_workgroup_size_x
                && self.row_fits(cols, wg)
        };
        let trees = ROW_WG_CHOICES
            .into_iter()
            .filter(|&wg| fits(wg))
            .map(RowGroup::tree);
        let subgroup = self
            .subgroup_size
            .filter(|&sg| subgroups && ROW_SUBGROUP_SIZES.contains(&sg) && fits(sg))
            .map(RowGroup::subgroup);
        trees.chain(subgroup).collect()
    }

    /// `reduce_rows` of packed `x` (`[rows, cols]`): short rows (the thin kernel's) one
    /// invocation each; longer whole rows a workgroup of `wg` each; long rows in segments of
    /// `wg * REDUCE_SEGMENT_STEPS` columns into (value, index) partials, then one workgroup per
    /// row over its partials.
    fn reduce_rows_in_groups(
        &self,
        op: ReduceOp,
        x: &Tensor,
        [rows, cols]: [usize; 2],
        wg: u32,
    ) -> Result<Tensor> {
        let out = self.empty(x.device(), &[rows])?;
        let off = u(x.layout().offset);
        let segment = wg as usize * REDUCE_SEGMENT_STEPS;
        let thin = cols <= thin_row_cols(self.info.is_software);
        if thin || cols <= 2 * segment {
            let (mode, wg, groups) = if thin {
                (ReduceMode::Thin, ELEMENTWISE_WG, groups_for(rows))
            } else {
                (ReduceMode::Direct, wg, rows as u64)
            };
            self.dispatch(
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
            let pv = self.empty(x.device(), &[rows, segs])?;
            let pi = self.empty(x.device(), &[rows, segs])?;
            self.dispatch(
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
            self.dispatch(
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
        self.check()?;
        Ok(out)
    }

    /// `softmax.wgsl` over the rows of `x` (`dims = [rows, cols]`): plain or causal, of
    /// `scale * x`.
    fn softmax_kernel(
        &self,
        op: &'static str,
        x: &Tensor,
        dims: [usize; 2],
        log: bool,
        scale: f32,
        causal: bool,
    ) -> Result<Tensor> {
        let [rows, cols] = dims;
        self.check_row_len(op, cols)?;
        let x = self.packed(x)?;
        self.with_row_group(op, dims, true, |group| {
            let out = self.empty(x.device(), &[rows, cols])?;
            if cols > 0 {
                self.dispatch(
                    Kernel::Softmax { log, group },
                    &SoftmaxParams {
                        rows: u(rows),
                        cols: u(cols),
                        x_offset: u(x.layout().offset),
                        scale,
                        causal: causal.into(),
                    }
                    .words(&[]),
                    &[Arg::of(gpu(&x)?), Arg::of(gpu(&out)?)],
                    rows as u64,
                    1,
                )?;
            }
            self.check()?;
            Ok(out)
        })
    }

    /// One index kernel over `dims = [outer, dim, inner, n]`, `src` and `idx` made dense. The
    /// selecting kernels (index_select, gather) write `[outer, n, inner]`, one invocation per
    /// element; the accumulating ones (index_add, scatter_add) start `[outer, dim, inner]` from
    /// zeros, one invocation per (outer, inner) column, and walk j in chunks of at most
    /// `LOOP_BUDGET` per dispatch.
    fn index_kernel(
        &self,
        k: IndexKernel,
        src: &Tensor,
        idx: &Tensor,
        dims: [usize; 4],
    ) -> Result<Tensor> {
        let [outer, dim, inner, n] = dims;
        let src = self.dense(src)?;
        let idx = self.dense(idx)?;
        let accumulates = matches!(k, IndexKernel::IndexAdd | IndexKernel::ScatterAdd);
        let (out, items) = if accumulates {
            (
                self.fill(src.device(), &[outer, dim, inner], 0.0)?,
                outer * inner,
            )
        } else {
            (
                self.empty(src.device(), &[outer, n, inner])?,
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
            self.dispatch(
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
        self.check()?;
        Ok(out)
    }
}

impl Kernels for WgpuContext {
    fn from_host(&self, dev: &Device, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        let out = self.empty(dev, shape)?;
        self.upload(gpu(&out)?, data)?;
        Ok(out)
    }

    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        let x = self.packed(x)?;
        self.read(gpu(&x)?, x.layout().offset, x.numel())
    }

    fn widen(&self, x: &Tensor) -> Result<Tensor> {
        let l = x.layout();
        let n = l.span();
        let out = self.empty(x.device(), &[n])?;
        self.dispatch(
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
        self.check()?;
        Ok(out.with_layout(Layout {
            offset: 0,
            ..l.clone()
        }))
    }

    fn narrow(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let x = self.packed(x)?;
        let out = self.empty_half(x.device(), x.shape(), dtype)?;
        let n = x.numel();
        self.dispatch(
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
        self.check()?;
        Ok(out)
    }

    fn fill(&self, dev: &Device, shape: &[usize], value: f32) -> Result<Tensor> {
        let out = self.empty(dev, shape)?;
        let n = out.numel();
        self.dispatch(
            Kernel::Fill,
            &FillParams { numel: u(n), value }.words(&[]),
            &[Arg::of(gpu(&out)?)],
            groups_for(n),
            1,
        )?;
        self.check()?;
        Ok(out)
    }

    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        self.map(|layout| Kernel::Copy { layout }, &[x], 0.0, 0.0)
    }

    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        let [s0, s1] = op.scalars();
        self.map(|layout| Kernel::unary(op, layout), &[x], s0, s1)
    }

    fn unary_grad(&self, op: UnaryOp, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        let [s0, s1] = op.scalars();
        self.map(|layout| Kernel::unary_grad(op, layout), &[x, g], s0, s1)
    }

    fn bias_act(&self, op: UnaryOp, z: &Tensor, b: &Tensor) -> Result<Tensor> {
        let [s0, s1] = op.scalars();
        let op = op.kernel_key();
        let b = b.broadcast_to(z.shape())?;
        self.map(|layout| Kernel::BiasAct { op, layout }, &[z, &b], s0, s1)
    }

    fn bias_act_grad(&self, op: UnaryOp, z: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        let [s0, s1] = op.scalars();
        let op = op.kernel_key();
        let b = b.broadcast_to(z.shape())?;
        self.map(
            |layout| Kernel::BiasActGrad { op, layout },
            &[z, &b, g],
            s0,
            s1,
        )
    }

    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.map(|layout| Kernel::Binary { op, layout }, &[a, b], 0.0, 0.0)
    }

    fn binary_assign(&self, op: BinaryOp, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        exclusive(op.name(), acc)?;
        let acc = &*acc;
        let out = gpu(acc)?;
        self.map_into(
            |layout| Kernel::BinaryAssign { op, layout },
            &[acc, x],
            0.0,
            0.0,
            out,
            true,
        )
    }

    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.map(|layout| Kernel::Where { layout }, &[cond, a, b], 0.0, 0.0)
    }

    fn sum_leading(&self, x: &Tensor, width: usize) -> Option<Result<Tensor>> {
        Some(self.column_sums(x, width))
    }

    fn reduce_rows(&self, op: ReduceOp, x: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
        let x = self.packed(x)?;
        if cols <= thin_row_cols(self.info.is_software) {
            // One invocation per row: no workgroup to tune.
            return self.reduce_rows_in_groups(op, &x, [rows, cols], self.row_wg());
        }
        self.with_row_group(op.name(), [rows, cols], false, |g| {
            self.reduce_rows_in_groups(op, &x, [rows, cols], g.wg)
        })
    }

    fn softmax_rows(&self, x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Tensor> {
        self.softmax_kernel("softmax", x, [rows, cols], log, 1.0, false)
    }

    fn causal_softmax_rows(
        &self,
        x: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        self.softmax_kernel("causal_softmax", x, [rows, cols], false, scale, true)
    }

    fn softmax_backward_rows(
        &self,
        y: &Tensor,
        g: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        self.check_row_len("softmax_backward", cols)?;
        let y = self.packed(y)?;
        let g = self.packed(g)?;
        self.with_row_group("softmax_backward", [rows, cols], true, |group| {
            let out = self.empty(y.device(), &[rows, cols])?;
            if cols > 0 {
                self.dispatch(
                    Kernel::SoftmaxBackward { group },
                    &SoftmaxBackwardParams {
                        rows: u(rows),
                        cols: u(cols),
                        scale,
                        y_offset: u(y.layout().offset),
                        g_offset: u(g.layout().offset),
                    }
                    .words(&[]),
                    &[Arg::of(gpu(&y)?), Arg::of(gpu(&g)?), Arg::of(gpu(&out)?)],
                    rows as u64,
                    1,
                )?;
            }
            self.check()?;
            Ok(out)
        })
    }

    fn matmul(
        &self,
        a: &Tensor,
        la: MatLayout,
        b: &Tensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<Tensor> {
        self.matmul_with(a, la, b, lb, dims, None)
    }

    fn matmul_half(
        &self,
        a: &Tensor,
        la: MatLayout,
        b: &Tensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Option<Result<Tensor>> {
        Some(self.matmul_tuned(a, la, b, lb, dims))
    }

    fn layer_norm_rows(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.check_row_len("layer_norm", cols)?;
        let x = self.packed(x)?;
        let gamma = self.packed(gamma)?;
        let beta = self.packed(beta)?;
        self.with_row_group("layer_norm", [rows, cols], true, |group| {
            let dev = x.device();
            let y = self.empty(dev, x.shape())?;
            let mean = self.empty(dev, &[rows])?;
            let rstd = self.empty(dev, &[rows])?;
            self.dispatch(
                Kernel::LayerNorm { group },
                &LayerNormParams {
                    rows: u(rows),
                    cols: u(cols),
                    eps,
                    x_offset: u(x.layout().offset),
                    gamma_offset: u(gamma.layout().offset),
                    beta_offset: u(beta.layout().offset),
                    r_offset: 0,
                }
                .words(&[]),
                &[
                    Arg::of(gpu(&x)?),
                    Arg::of(gpu(&gamma)?),
                    Arg::of(gpu(&beta)?),
                    Arg::of(gpu(&y)?),
                    Arg::of(gpu(&mean)?),
                    Arg::of(gpu(&rstd)?),
                ],
                rows as u64,
                1,
            )?;
            self.check()?;
            Ok((y, mean, rstd))
        })
    }

    fn cross_entropy_rows(
        &self,
        x: &Tensor,
        targets: &Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.check_row_len("cross_entropy", cols)?;
        let x = self.packed(x)?;
        let t = self.packed(targets)?;
        self.with_row_group("cross_entropy", [rows, cols], true, |group| {
            let dev = x.device();
            let loss = self.empty(dev, &[rows])?;
            let max = self.empty(dev, &[rows])?;
            let logsum = self.empty(dev, &[rows])?;
            self.dispatch(
                Kernel::CrossEntropy { group },
                &CrossEntropyParams {
                    rows: u(rows),
                    cols: u(cols),
                    x_offset: u(x.layout().offset),
                    t_offset: u(t.layout().offset),
                }
                .words(&[]),
                &[
                    Arg::of(gpu(&x)?),
                    Arg::of(gpu(&t)?),
                    Arg::of(gpu(&loss)?),
                    Arg::of(gpu(&max)?),
                    Arg::of(gpu(&logsum)?),
                ],
                rows as u64,
                1,
            )?;
            self.check()?;
            Ok((loss, max, logsum))
        })
    }

    fn cross_entropy_backward_rows(
        &self,
        x: &Tensor,
        targets: &Tensor,
        max: &Tensor,
        logsum: &Tensor,
        g: &Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<Tensor> {
        self.check_row_len("cross_entropy backward", cols)?;
        let [x, t, max, logsum, g] = [x, targets, max, logsum, g].map(|v| self.packed(v));
        let (x, t, max, logsum, g) = (x?, t?, max?, logsum?, g?);
        self.with_row_group("cross_entropy_backward", [rows, cols], false, |group| {
            let out = self.empty(x.device(), &[rows, cols])?;
            let off = |v: &Tensor| u(v.layout().offset);
            self.dispatch(
                Kernel::CrossEntropyBackward { wg: group.wg },
                &CrossEntropyBackwardParams {
                    rows: u(rows),
                    cols: u(cols),
                    x_offset: off(&x),
                    t_offset: off(&t),
                    max_offset: off(&max),
                    logsum_offset: off(&logsum),
                    g_offset: off(&g),
                }
                .words(&[]),
                &[
                    Arg::of(gpu(&x)?),
                    Arg::of(gpu(&t)?),
                    Arg::of(gpu(&max)?),
                    Arg::of(gpu(&logsum)?),
                    Arg::of(gpu(&g)?),
                    Arg::of(gpu(&out)?),
                ],
                rows as u64,
                1,
            )?;
            self.check()?;
            Ok(out)
        })
    }

    /// Mean and rstd come back as views of one `[2, rows]` buffer (the kernel's binding budget).
    fn add_layer_norm_rows(
        &self,
        x: &Tensor,
        r: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        self.check_row_len("add_layer_norm", cols)?;
        let x = self.packed(x)?;
        let r = self.packed(r)?;
        let gamma = self.packed(gamma)?;
        let beta = self.packed(beta)?;
        self.with_row_group("add_layer_norm", [rows, cols], true, |group| {
            let dev = x.device();
            let s = self.empty(dev, &[rows, cols])?;
            let y = self.empty(dev, &[rows, cols])?;
            let stats = self.empty(dev, &[2, rows])?;
            self.dispatch(
                Kernel::AddLayerNorm { group },
                &LayerNormParams {
                    rows: u(rows),
                    cols: u(cols),
                    eps,
                    x_offset: u(x.layout().offset),
                    gamma_offset: u(gamma.layout().offset),
                    beta_offset: u(beta.layout().offset),
                    r_offset: u(r.layout().offset),
                }
                .words(&[]),
                &[
                    Arg::of(gpu(&x)?),
                    Arg::of(gpu(&gamma)?),
                    Arg::of(gpu(&beta)?),
                    Arg::of(gpu(&r)?),
                    Arg::of(gpu(&y)?),
                    Arg::of(gpu(&stats)?),
                    Arg::of(gpu(&s)?),
                ],
                rows as u64,
                1,
            )?;
            self.check()?;
            let mean = stats.narrow(0, 0, 1)?.reshape(&[rows])?;
            let rstd = stats.narrow(0, 1, 1)?.reshape(&[rows])?;
            Ok((s, y, mean, rstd))
        })
    }

    fn layer_norm_backward_rows(
        &self,
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        gamma: &Tensor,
        g: &Tensor,
        carry: Option<&Tensor>,
        rows: usize,
        cols: usize,
    ) -> Result<Tensor> {
        self.check_row_len("layer_norm backward", cols)?;
        let [x, mean, rstd, gamma, g] = [x, mean, rstd, gamma, g].map(|v| self.packed(v));
        let (x, mean, rstd, gamma, g) = (x?, mean?, rstd?, gamma?, g?);
        let carry = carry.map(|c| self.packed(c)).transpose()?;
        self.with_row_group("layer_norm_backward", [rows, cols], true, |group| {
            let out = self.empty(x.device(), &[rows, cols])?;
            let off = |v: &Tensor| u(v.layout().offset);
            // Without a carry, g is bound in its place and not read.
            let c = carry.as_ref().unwrap_or(&g);
            self.dispatch(
                Kernel::LayerNormBackward { group },
                &LayerNormBackwardParams {
                    rows: u(rows),
                    cols: u(cols),
                    x_offset: off(&x),
                    mean_offset: off(&mean),
                    rstd_offset: off(&rstd),
                    gamma_offset: off(&gamma),
                    g_offset: off(&g),
                    carry_offset: off(c),
                    has_carry: carry.is_some().into(),
                }
                .words(&[]),
                &[
                    Arg::of(gpu(&x)?),
                    Arg::of(gpu(&mean)?),
                    Arg::of(gpu(&rstd)?),
                    Arg::of(gpu(&gamma)?),
                    Arg::of(gpu(&g)?),
                    Arg::of(gpu(c)?),
                    Arg::of(gpu(&out)?),
                ],
                rows as u64,
                1,
            )?;
            self.check()?;
            Ok(out)
        })
    }

    fn index_select(
        &self,
        x: &Tensor,
        idx: &Tensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<Tensor> {
        self.index_kernel(IndexKernel::IndexSelect, x, idx, [o, d, i, idx.numel()])
    }

    fn index_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<Tensor> {
        self.index_kernel(IndexKernel::IndexAdd, src, idx, [o, d, i, idx.numel()])
    }

    fn gather(&self, x: &Tensor, idx: &Tensor, o: usize, d: usize, i: usize) -> Result<Tensor> {
        let n = idx.numel().checked_div(o * i).unwrap_or(0);
        self.index_kernel(IndexKernel::Gather, x, idx, [o, d, i, n])
    }

    fn scatter_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<Tensor> {
        let n = idx.numel().checked_div(o * i).unwrap_or(0);
        self.index_kernel(IndexKernel::ScatterAdd, src, idx, [o, d, i, n])
    }

    fn concat(&self, xs: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor> {
        let dev = xs
            .first()
            .map(|x| x.device().clone())
            .ok_or_else(|| Error::invalid("concat", "no tensors to concatenate"))?;
        let out = self.empty(&dev, out_shape)?;
        let strides = out.strides().to_vec();
        let o = gpu(&out)?;
        let mut start = 0;
        for x in xs {
            self.copy_into(x, o, start * strides[axis], &strides)?;
            start += x.shape()[axis];
        }
        self.check()?;
        Ok(out)
    }

    fn im2col(&self, x: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        let shape = [g.n, g.groups, g.col_rows(), g.col_cols()];
        let [out] = self.spatial(SpatialKernel::Im2col, &Self::conv_params(g), [x], &shape)?;
        Ok(out)
    }

    fn col2im(&self, cols: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        let shape = [g.n, g.c_in, g.h, g.w];
        let [out] = self.spatial(SpatialKernel::Col2im, &Self::conv_params(g), [cols], &shape)?;
        Ok(out)
    }

    fn max_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<(Tensor, Tensor)> {
        let shape = [g.n, g.c, g.h_out, g.w_out];
        let [y, arg] = self.spatial(
            SpatialKernel::MaxPool2d,
            &Self::spatial_params(g),
            [x],
            &shape,
        )?;
        Ok((y, arg))
    }

    fn max_pool2d_backward(
        &self,
        dy: &Tensor,
        argmax: &Tensor,
        g: &Pool2dGeometry,
    ) -> Result<Tensor> {
        let shape = [g.n, g.c, g.h, g.w];
        let params = Self::spatial_params(g);
        let [dx] = self.spatial(
            SpatialKernel::MaxPool2dBackward,
            &params,
            [dy, argmax],
            &shape,
        )?;
        Ok(dx)
    }

    fn avg_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        let shape = [g.n, g.c, g.h_out, g.w_out];
        let [y] = self.spatial(
            SpatialKernel::AvgPool2d,
            &Self::spatial_params(g),
            [x],
            &shape,
        )?;
        Ok(y)
    }

    fn avg_pool2d_backward(&self, dy: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        let shape = [g.n, g.c, g.h, g.w];
        let params = Self::spatial_params(g);
        let [dx] = self.spatial(SpatialKernel::AvgPool2dBackward, &params, [dy], &shape)?;
        Ok(dx)
    }

    fn dropout_mask(
        &self,
        dev: &Device,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<Tensor> {
        let out = self.empty(dev, shape)?;
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
        self.dispatch(
            Kernel::Dropout,
            &params.words(&[]),
            &[Arg::of(gpu(&out)?)],
            groups_for(n.div_ceil(4)),
            1,
        )?;
        self.check()?;
        Ok(out)
    }

    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        hp: &AdamStep,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (p, g, m, v) = (
            self.dense(param)?,
            self.dense(grad)?,
            self.dense(m)?,
            self.dense(v)?,
        );
        let dev = param.device();
        let shape = param.shape();
        let (po, mo, vo) = (
            self.empty(dev, shape)?,
            self.empty(dev, shape)?,
            self.empty(dev, shape)?,
        );
        let n = po.numel();
        self.dispatch(
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
        self.check()?;
        Ok((po, mo, vo))
    }

    fn adam_update_in_place(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamStep,
    ) -> Result<()> {
        for t in [&mut *param, &mut *m, &mut *v] {
            exclusive("adam_update", t)?;
        }
        let g = self.dense(grad)?;
        let n = param.numel();
        self.dispatch(
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
        self.check()
    }

    fn synchronize(&self) -> Result<()> {
        self.sync()
    }
}
