//! The elementwise template every one-invocation-per-element map goes through (copies, unary
//! and binary ops, bias + activation, where), the strided copy and concatenation.

use wgpipe_shaders::params::{CopyParams, EwParams, ParamBlock};
use wgpipe_shaders::{EwLayout, Kernel};

use super::{gpu, groups_for, u};
use crate::error::{Error, Result};
use crate::gpu_pool::GpuBuffer;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// Merges the dims of several same-shaped layouts: size-1 dims go, and neighbouring dims that
/// are contiguous with each other in every layout become one. Returns the shape and each
/// layout's strides.
fn collapse(shape: &[usize], strides: &[&[usize]]) -> (Vec<usize>, Vec<Vec<usize>>) {
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

/// The grid of the rows layout (`EwLayout::StridedRows`) for a collapsed `shape`, when it
/// applies: at most 4 dims, a last dim of whole vec4s that fills a workgroup, and each grid
/// dimension within `max`. Workgroups: x along the last dim, y the dim before, z the two before
/// that.
pub(in crate::wgpu) fn rows_grid(shape: &[usize], max: usize) -> Option<[u32; 3]> {
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

impl WgpuContext {
    /// The elementwise template over same-shaped strided `inputs`: contiguous inputs at
    /// offsets that are multiples of 4 go four elements per invocation, other contiguous inputs
    /// one, and strided ones through their layouts.
    pub(super) fn map(
        &self,
        kernel: impl Fn(EwLayout) -> Kernel,
        inputs: &[&RawTensor],
        s0: f32,
        s1: f32,
    ) -> Result<RawTensor> {
        let x0 = inputs[0];
        let out = self.empty(x0.memory(), x0.shape())?;
        self.map_into(kernel, inputs, s0, s1, gpu(&out)?, false)?;
        Ok(out)
    }

    /// Records [`WgpuContext::map`]'s kernel writing into `out`. With `first_is_out`, input 0 is
    /// `out` itself (contiguous from 0), read by the kernel through its output binding.
    pub(super) fn map_into(
        &self,
        kernel: impl Fn(EwLayout) -> Kernel,
        inputs: &[&RawTensor],
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
        src: &RawTensor,
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
}

/// Concatenates strided `xs` along `axis` into a fresh contiguous tensor of `out_shape`: one
/// strided copy per input, each into its slab of the output.
pub(super) fn concat(
    ctx: &WgpuContext,
    xs: &[&RawTensor],
    axis: usize,
    out_shape: &[usize],
) -> Result<RawTensor> {
    let mem = xs
        .first()
        .map(|x| x.memory().clone())
        .ok_or_else(|| Error::invalid("concat", "no tensors to concatenate"))?;
    let out = ctx.empty(&mem, out_shape)?;
    let strides = out.strides().to_vec();
    let o = gpu(&out)?;
    let mut start = 0;
    for x in xs {
        ctx.copy_into(x, o, start * strides[axis], &strides)?;
        start += x.shape()[axis];
    }
    ctx.check()?;
    Ok(out)
}
