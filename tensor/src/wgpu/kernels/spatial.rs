//! The spatial kernels of convolution (im2col, col2im) and pooling (max and average, and their
//! backwards): one invocation per output element over NCHW tensors (`cpu/conv.rs` and
//! `cpu/pool.rs` on the CPU).

use wgpipe_shaders::params::{ParamBlock, SpatialParams};
use wgpipe_shaders::{Kernel, SpatialKernel};

use super::{all_ok, gpu, groups_for, u};
use crate::backend::{Conv2dGeometry, Pool2dGeometry};
use crate::error::Result;
use crate::layout::numel;
use crate::raw::RawTensor;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

/// Runs a spatial kernel (conv columns, pools) with one invocation per output element:
/// dense copies of `inputs` are bound first, then `O` fresh outputs of `out_shape`.
fn spatial<const I: usize, const O: usize>(
    ctx: &WgpuContext,
    kernel: SpatialKernel,
    params: &SpatialParams,
    inputs: [&RawTensor; I],
    out_shape: &[usize],
) -> Result<[RawTensor; O]> {
    let mem = inputs[0].memory();
    let inputs = all_ok(inputs.map(|x| ctx.dense(x)))?;
    let outs = all_ok([(); O].map(|_| ctx.empty(mem, out_shape)))?;
    let args = inputs
        .iter()
        .chain(&outs)
        .map(|t| gpu(t).map(Arg::of))
        .collect::<Result<Vec<_>>>()?;
    ctx.dispatch(
        Kernel::Spatial(kernel),
        &params.words(&[]),
        &args,
        groups_for(numel(out_shape)),
        1,
    )?;
    ctx.check()?;
    Ok(outs)
}

/// A pool's geometry as a spatial parameter block: dilation 1, one group.
fn spatial_params(g: &Pool2dGeometry) -> SpatialParams {
    conv_params(&Conv2dGeometry {
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

pub(super) fn im2col(ctx: &WgpuContext, x: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
    let shape = [g.n, g.groups, g.col_rows(), g.col_cols()];
    let [out] = spatial(ctx, SpatialKernel::Im2col, &conv_params(g), [x], &shape)?;
    Ok(out)
}

pub(super) fn col2im(ctx: &WgpuContext, cols: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
    let shape = [g.n, g.c_in, g.h, g.w];
    let [out] = spatial(ctx, SpatialKernel::Col2im, &conv_params(g), [cols], &shape)?;
    Ok(out)
}

pub(super) fn max_pool2d(
    ctx: &WgpuContext,
    x: &RawTensor,
    g: &Pool2dGeometry,
) -> Result<(RawTensor, RawTensor)> {
    let shape = [g.n, g.c, g.h_out, g.w_out];
    let params = spatial_params(g);
    let [y, arg] = spatial(ctx, SpatialKernel::MaxPool2d, &params, [x], &shape)?;
    Ok((y, arg))
}

pub(super) fn max_pool2d_backward(
    ctx: &WgpuContext,
    dy: &RawTensor,
    argmax: &RawTensor,
    g: &Pool2dGeometry,
) -> Result<RawTensor> {
    let shape = [g.n, g.c, g.h, g.w];
    let params = spatial_params(g);
    let kernel = SpatialKernel::MaxPool2dBackward;
    let [dx] = spatial(ctx, kernel, &params, [dy, argmax], &shape)?;
    Ok(dx)
}

pub(super) fn avg_pool2d(
    ctx: &WgpuContext,
    x: &RawTensor,
    g: &Pool2dGeometry,
) -> Result<RawTensor> {
    let shape = [g.n, g.c, g.h_out, g.w_out];
    let params = spatial_params(g);
    let [y] = spatial(ctx, SpatialKernel::AvgPool2d, &params, [x], &shape)?;
    Ok(y)
}

pub(super) fn avg_pool2d_backward(
    ctx: &WgpuContext,
    dy: &RawTensor,
    g: &Pool2dGeometry,
) -> Result<RawTensor> {
    let shape = [g.n, g.c, g.h, g.w];
    let params = spatial_params(g);
    let [dx] = spatial(ctx, SpatialKernel::AvgPool2dBackward, &params, [dy], &shape)?;
    Ok(dx)
}
