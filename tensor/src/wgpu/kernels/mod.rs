//! `impl Kernels for WgpuContext`, split by kernel family as `cpu/` is: each trait method lays
//! out its parameter block, allocates its outputs (memory tracker first, then the buffer pool)
//! and records its dispatch(es), in the module of its family. This file holds what every family
//! uses (the buffer behind a tensor, fresh outputs, dense inputs) and the trait impl, whose
//! methods are one call into their family.
//!
//! - `elementwise`: the elementwise template (contiguous, vec4, strided, rows layouts) and copies.
//! - `half_cast`: widening half storage to f32 and rounding f32 to half.
//! - `rows`: the workgroup of the row kernels (autotuned) and the one way to dispatch them.
//! - `reduce`: row reductions, column sums, softmax and its backward.
//! - `norm`: layer norm, its residual-add form and its backward.
//! - `cross_entropy`: the fused loss and its backward.
//! - `index`: index_select, index_add, gather, scatter_add.
//! - `spatial`: im2col, col2im and the pools (one invocation per output element).
//! - `optim`: the Adam steps.
//! - `random`: dropout masks.
//!
//! The matmul variants live in `super::matmul`.

use wgpipe_shaders::params::{FillParams, ParamBlock};
use wgpipe_shaders::{IndexKernel, Kernel, ELEMENTWISE_WG};

use super::context::WgpuContext;
use super::runtime::Arg;
use crate::backend::*;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu_pool::GpuBuffer;
use crate::layout::numel;
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;
use crate::storage::{Storage, StorageData};

mod cross_entropy;
mod elementwise;
mod half_cast;
mod index;
mod norm;
mod optim;
mod random;
mod reduce;
mod rows;
mod spatial;

// The tests reach these through `kernels`, as when it was one file.
#[cfg(test)]
pub(super) use elementwise::rows_grid;
#[cfg(test)]
pub(super) use reduce::thin_row_cols;

/// The GPU buffer behind a tensor (an error for a tensor of another backend).
pub(super) fn gpu(x: &RawTensor) -> Result<&GpuBuffer> {
    match &x.storage().data {
        StorageData::Wgpu(b) => Ok(b),
        _ => Err(Error::invalid(
            "wgpu kernel",
            format!("tensor on {} is not a wgpu tensor", x.memory()),
        )),
    }
}

/// Fails unless `t` [is exclusive](Tensor::is_exclusive): the in-place kernels' contract,
/// checked so that a broken one is an error rather than a write into a shared buffer.
fn exclusive(op: &'static str, t: &mut RawTensor) -> Result<()> {
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

pub(super) fn u(v: usize) -> u32 {
    v as u32
}

/// Lavapipe (llvmpipe) ends an invocation after 65535 loop iterations summed over all its loops
/// (`LP_MAX_TGSI_LOOP_ITERATIONS`); kernels keep each invocation well under this many.
pub(super) const LOOP_BUDGET: usize = 16384;

/// Workgroups for `n` invocations of the one-invocation-per-element kernels.
pub(super) fn groups_for(n: usize) -> u64 {
    (n as u64).div_ceil(u64::from(ELEMENTWISE_WG))
}

/// All of `results` when each is `Ok`, else the first error (the kernels' fixed-size lists of
/// inputs and outputs, made one `Result` at a time).
fn all_ok<T, const N: usize>(results: [Result<T>; N]) -> Result<[T; N]> {
    let values = results.into_iter().collect::<Result<Vec<T>>>()?;
    Ok(values
        .try_into()
        .unwrap_or_else(|_| unreachable!("N results give N values")))
}

impl WgpuContext {
    /// A fresh contiguous tensor of `shape` on `mem` (charged to `mem`'s tracker first).
    pub(super) fn empty(&self, mem: &MemoryTracker, shape: &[usize]) -> Result<RawTensor> {
        let n = self.indexable(shape)?;
        let allocation = Storage::reserve(mem, n)?;
        let buffer = self.pool.alloc((n * 4) as u64).map_err(|m| self.err(m))?;
        Ok(RawTensor::new(
            Storage::new(StorageData::Wgpu(buffer), allocation),
            shape,
            mem,
        ))
    }

    /// The elements of a tensor of `shape`, or an error when the kernels' u32 indices cannot
    /// reach them all.
    fn indexable(&self, shape: &[usize]) -> Result<usize> {
        let n = numel(shape);
        if n > u32::MAX as usize {
            return Err(self.err(format!(
                "a tensor of shape {shape:?} has {n} elements; wgpu kernels index with u32"
            )));
        }
        Ok(n)
    }

    /// `x` itself when contiguous from element 0, else a contiguous copy (kernels that index
    /// their inputs as dense arrays).
    fn dense(&self, x: &RawTensor) -> Result<RawTensor> {
        if x.is_contiguous() && x.layout().offset == 0 {
            Ok(x.clone())
        } else {
            self.contiguous(x)
        }
    }

    /// `x` contiguous (offset allowed).
    fn packed(&self, x: &RawTensor) -> Result<RawTensor> {
        if x.is_contiguous() {
            Ok(x.clone())
        } else {
            self.contiguous(x)
        }
    }
}

impl Kernels for WgpuContext {
    fn from_host(&self, mem: &MemoryTracker, data: &[f32], shape: &[usize]) -> Result<RawTensor> {
        let out = self.empty(mem, shape)?;
        self.upload(gpu(&out)?, data)?;
        Ok(out)
    }

    fn to_host_f32(&self, x: &RawTensor) -> Result<Vec<f32>> {
        let x = self.packed(x)?;
        self.read(gpu(&x)?, x.layout().offset, x.numel())
    }

    fn widen(&self, x: &RawTensor) -> Result<RawTensor> {
        half_cast::widen(self, x)
    }

    fn narrow(&self, x: &RawTensor, dtype: DType) -> Result<RawTensor> {
        half_cast::narrow(self, x, dtype)
    }

    fn fill(&self, mem: &MemoryTracker, shape: &[usize], value: f32) -> Result<RawTensor> {
        let out = self.empty(mem, shape)?;
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

    fn contiguous(&self, x: &RawTensor) -> Result<RawTensor> {
        self.map(|layout| Kernel::Copy { layout }, &[x], 0.0, 0.0)
    }

    fn unary(&self, op: UnaryOp, x: &RawTensor) -> Result<RawTensor> {
        let [s0, s1] = op.scalars();
        self.map(|layout| Kernel::unary(op, layout), &[x], s0, s1)
    }

    fn unary_grad(&self, op: UnaryOp, x: &RawTensor, g: &RawTensor) -> Result<RawTensor> {
        let [s0, s1] = op.scalars();
        self.map(|layout| Kernel::unary_grad(op, layout), &[x, g], s0, s1)
    }

    fn bias_act(&self, op: UnaryOp, z: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        let [s0, s1] = op.scalars();
        let op = op.kernel_key();
        let b = b.broadcast_to(z.shape())?;
        self.map(|layout| Kernel::BiasAct { op, layout }, &[z, &b], s0, s1)
    }

    fn bias_act_grad(
        &self,
        op: UnaryOp,
        z: &RawTensor,
        b: &RawTensor,
        g: &RawTensor,
    ) -> Result<RawTensor> {
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

    fn binary(&self, op: BinaryOp, a: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        self.map(|layout| Kernel::Binary { op, layout }, &[a, b], 0.0, 0.0)
    }

    fn binary_assign(&self, op: BinaryOp, acc: &mut RawTensor, x: &RawTensor) -> Result<()> {
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

    fn where_cond(&self, cond: &RawTensor, a: &RawTensor, b: &RawTensor) -> Result<RawTensor> {
        self.map(|layout| Kernel::Where { layout }, &[cond, a, b], 0.0, 0.0)
    }

    fn sum_leading(&self, x: &RawTensor, width: usize) -> Option<Result<RawTensor>> {
        Some(reduce::column_sums(self, x, width))
    }

    fn reduce_rows(
        &self,
        op: ReduceOp,
        x: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        reduce::reduce_rows(self, op, x, [rows, cols])
    }

    fn softmax_rows(
        &self,
        x: &RawTensor,
        rows: usize,
        cols: usize,
        log: bool,
    ) -> Result<RawTensor> {
        reduce::softmax(self, "softmax", x, [rows, cols], log, 1.0, false)
    }

    fn causal_softmax_rows(
        &self,
        x: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor> {
        reduce::softmax(self, "causal_softmax", x, [rows, cols], false, scale, true)
    }

    fn softmax_backward_rows(
        &self,
        y: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor> {
        reduce::softmax_backward(self, y, g, [rows, cols], scale)
    }

    fn matmul(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<RawTensor> {
        super::matmul::one_batch_stride(&la, &lb)?;
        self.matmul_with(a, la, b, lb, dims, None)
    }

    fn matmul_half(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Option<Result<RawTensor>> {
        Some(
            super::matmul::one_batch_stride(&la, &lb)
                .and_then(|()| self.matmul_tuned(a, la, b, lb, dims)),
        )
    }

    fn layer_norm_rows(
        &self,
        x: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        norm::layer_norm(self, x, gamma, beta, [rows, cols], eps)
    }

    fn cross_entropy_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        cross_entropy::forward(self, x, targets, [rows, cols])
    }

    fn cross_entropy_backward_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        max: &RawTensor,
        logsum: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        cross_entropy::backward(self, [x, targets, max, logsum, g], [rows, cols])
    }

    fn add_layer_norm_rows(
        &self,
        x: &RawTensor,
        r: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor, RawTensor)> {
        norm::add_layer_norm(self, [x, r, gamma, beta], [rows, cols], eps)
    }

    fn layer_norm_backward_rows(
        &self,
        x: &RawTensor,
        mean: &RawTensor,
        rstd: &RawTensor,
        gamma: &RawTensor,
        g: &RawTensor,
        carry: Option<&RawTensor>,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor> {
        norm::layer_norm_backward(self, [x, mean, rstd, gamma, g], carry, [rows, cols])
    }

    fn index_select(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<RawTensor> {
        index::run(
            self,
            IndexKernel::IndexSelect,
            x,
            idx,
            [o, d, i, idx.numel()],
        )
    }

    fn index_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<RawTensor> {
        index::run(
            self,
            IndexKernel::IndexAdd,
            src,
            idx,
            [o, d, i, idx.numel()],
        )
    }

    fn gather(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<RawTensor> {
        let n = idx.numel().checked_div(o * i).unwrap_or(0);
        index::run(self, IndexKernel::Gather, x, idx, [o, d, i, n])
    }

    fn scatter_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        o: usize,
        d: usize,
        i: usize,
    ) -> Result<RawTensor> {
        let n = idx.numel().checked_div(o * i).unwrap_or(0);
        index::run(self, IndexKernel::ScatterAdd, src, idx, [o, d, i, n])
    }

    fn concat(&self, xs: &[&RawTensor], axis: usize, out_shape: &[usize]) -> Result<RawTensor> {
        elementwise::concat(self, xs, axis, out_shape)
    }

    fn im2col(&self, x: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
        spatial::im2col(self, x, g)
    }

    fn col2im(&self, cols: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor> {
        spatial::col2im(self, cols, g)
    }

    fn max_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<(RawTensor, RawTensor)> {
        spatial::max_pool2d(self, x, g)
    }

    fn max_pool2d_backward(
        &self,
        dy: &RawTensor,
        argmax: &RawTensor,
        g: &Pool2dGeometry,
    ) -> Result<RawTensor> {
        spatial::max_pool2d_backward(self, dy, argmax, g)
    }

    fn avg_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor> {
        spatial::avg_pool2d(self, x, g)
    }

    fn avg_pool2d_backward(&self, dy: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor> {
        spatial::avg_pool2d_backward(self, dy, g)
    }

    fn dropout_mask(
        &self,
        mem: &MemoryTracker,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<RawTensor> {
        random::dropout_mask(self, mem, shape, p, seed, offset)
    }

    fn adam_update(
        &self,
        param: &RawTensor,
        grad: &RawTensor,
        m: &RawTensor,
        v: &RawTensor,
        hp: &AdamStep,
    ) -> Result<(RawTensor, RawTensor, RawTensor)> {
        optim::adam(self, [param, grad, m, v], hp)
    }

    fn adam_update_in_place(
        &self,
        param: &mut RawTensor,
        grad: &RawTensor,
        m: &mut RawTensor,
        v: &mut RawTensor,
        hp: &AdamStep,
    ) -> Result<()> {
        for t in [&mut *param, &mut *m, &mut *v] {
            exclusive("adam_update", t)?;
        }
        optim::adam_in_place(self, [&*param, grad, &*m, &*v], hp)
    }

    fn synchronize(&self) -> Result<()> {
        self.sync()
    }
}
