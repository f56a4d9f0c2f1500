//! Reductions over sets of axes, all through one helper ([`Tensor::reduce_axes`]): the reduced
//! axes are permuted to the end, the view is made contiguous (a no-op when they already are the
//! trailing axes of a contiguous tensor), and the kernel reduces each row of `[kept, reduced]`.
//! FLOPs: one per input element.

use crate::backend::Kernels;
use crate::backend::ReduceOp;
use crate::dtype::DType;
use crate::dtype_policy::{DTypePolicy::WidenThenRound, Precision, StaysF32};
use crate::error::{Error, Result};
use crate::layout::{resolve_axis, Layout};
use crate::ops::resolve_axes;
use crate::raw::RawTensor;
use crate::tensor::Tensor;

impl Tensor {
    /// Reduces `axes` (resolved, sorted, distinct) with `op`; `keepdim` leaves them as size 1.
    /// The one place reductions are lowered; every public reduction goes through it.
    pub(crate) fn reduce_axes(
        &self,
        name: &'static str,
        op: ReduceOp,
        axes: &[usize],
        keepdim: bool,
    ) -> Result<Tensor> {
        let shape = self.shape();
        let kept: Vec<usize> = (0..self.rank()).filter(|a| !axes.contains(a)).collect();
        let out_shape: Vec<usize> = if keepdim {
            (0..self.rank())
                .map(|a| if axes.contains(&a) { 1 } else { shape[a] })
                .collect()
        } else {
            kept.iter().map(|&a| shape[a]).collect()
        };
        let rows: usize = kept.iter().map(|&a| shape[a]).product();
        let cols: usize = axes.iter().map(|&a| shape[a]).product();
        let dev = self.device();
        if cols == 0 && rows > 0 {
            // An empty sum is 0; an extreme (or its index) of nothing does not exist.
            if op != ReduceOp::Sum {
                return Err(Error::shape(
                    name,
                    format!(
                        "cannot reduce over axes {axes:?} of shape {shape:?}: they hold no elements"
                    ),
                ));
            }
            return Tensor::zeros_in(&out_shape, self.dtype(), dev);
        }
        if rows == 0 {
            // Indices stay f32 whatever the input's dtype (as the kernel path below keeps them).
            let dtype = match op {
                ReduceOp::ArgMax | ReduceOp::ArgMin => crate::DType::F32,
                _ => self.dtype(),
            };
            return Tensor::zeros_in(&out_shape, dtype, dev);
        }
        let leading = axes.iter().enumerate().all(|(i, &a)| a == i);
        if op == ReduceOp::Sum && leading && !kept.is_empty() && self.is_contiguous() {
            // Sums over the leading axes (a bias gradient): column sums, no transposing copy,
            // where the backend has such a kernel.
            let fused = |k: &dyn Kernels, [x]: [&RawTensor; 1]| k.sum_leading(x, rows);
            if let Some(out) = dev.run_if(op.name(), Precision::F32, [self], fused) {
                dev.add_flops(self.numel() as u64);
                return out?.reshape(&out_shape);
            }
        }
        let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
        let x = self.permute(&perm)?.contiguous()?;
        let reduce = |k: &dyn Kernels, [x]: [&RawTensor; 1]| k.reduce_rows(op, x, rows, cols);
        let out = if matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) {
            // Indices stay f32 whatever the input's dtype: f16 holds integers exactly only up
            // to 2048.
            let index = |k: &dyn Kernels, [x]: [&RawTensor; 1]| reduce(k, [x]).map(StaysF32);
            dev.run(op.name(), WidenThenRound, [&x], index)?.0
        } else {
            dev.run(op.name(), WidenThenRound, [&x], reduce)?
        };
        dev.add_flops(self.numel() as u64);
        out.reshape(&out_shape)
    }

    /// Sum over `axes` (empty = all).
    pub fn sum(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let axes = resolve_axes("sum", axes, self.rank())?;
        self.reduce_axes("sum", ReduceOp::Sum, &axes, keepdim)
    }

    /// Mean over `axes` (empty = all); NaN over an empty set, like 0/0.
    pub fn mean(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        if self.dtype().is_half() {
            return self.with_f32_sum(|x| x.mean(axes, keepdim));
        }
        let axes = resolve_axes("mean", axes, self.rank())?;
        let count: usize = axes.iter().map(|&a| self.shape()[a]).product();
        self.reduce_axes("mean", ReduceOp::Sum, &axes, keepdim)?
            .mul_scalar(1.0 / count as f32)
    }

    /// Maximum over `axes` (empty = all).
    pub fn max(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let axes = resolve_axes("max", axes, self.rank())?;
        self.reduce_axes("max", ReduceOp::Max, &axes, keepdim)
    }

    /// Minimum over `axes` (empty = all).
    pub fn min(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        let axes = resolve_axes("min", axes, self.rank())?;
        self.reduce_axes("min", ReduceOp::Min, &axes, keepdim)
    }

    /// Population variance (divisor n) over `axes` (empty = all), computed in two passes
    /// (mean, then mean of squared deviations) for accuracy.
    pub fn var(&self, axes: &[isize], keepdim: bool) -> Result<Tensor> {
        if self.dtype().is_half() {
            return self.with_f32_sum(|x| x.var(axes, keepdim));
        }
        let axes = resolve_axes("var", axes, self.rank())?;
        let count: usize = axes.iter().map(|&a| self.shape()[a]).product();
        let inv = 1.0 / count as f32;
        let mean = self
            .reduce_axes("var", ReduceOp::Sum, &axes, true)?
            .mul_scalar(inv)?;
        self.sub(&mean)?
            .square()?
            .reduce_axes("var", ReduceOp::Sum, &axes, keepdim)?
            .mul_scalar(inv)
    }

    /// `f` (a mean-like reduction) on this half tensor widened to f32, its result narrowed back:
    /// the sum inside may pass the half range (f16 tops out at 65504) though the mean does not.
    fn with_f32_sum(&self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        f(&self.to_dtype(DType::F32)?)?.to_dtype(self.dtype())
    }

    /// Index (as f32) of the first maximum along `axis`.
    pub fn argmax(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let a = resolve_axis("argmax", axis, self.rank())?;
        self.reduce_axes("argmax", ReduceOp::ArgMax, &[a], keepdim)
    }

    /// Index (as f32) of the first minimum along `axis`.
    pub fn argmin(&self, axis: isize, keepdim: bool) -> Result<Tensor> {
        let a = resolve_axis("argmin", axis, self.rank())?;
        self.reduce_axes("argmin", ReduceOp::ArgMin, &[a], keepdim)
    }

    /// Sum of every element, as a 0-d tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.sum(&[], false)
    }

    /// Mean of every element, as a 0-d tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.mean(&[], false)
    }

    /// Sums a broadcast result back to `shape`, the shape of an operand that was broadcast to
    /// `self.shape()`: leading extra axes and axes stretched from 1 are summed away (the adjoint
    /// of `broadcast_to`, which autograd needs for every broadcasting op).
    pub fn sum_to_shape(&self, shape: &[usize]) -> Result<Tensor> {
        Layout::contiguous(shape)
            .broadcast_to("sum_to_shape", self.shape())
            .map_err(|_| {
                Error::shape(
                    "sum_to_shape",
                    format!(
                        "shape {:?} cannot be summed to {shape:?}: {shape:?} does not broadcast to it",
                        self.shape()
                    ),
                )
            })?;
        let lead = self.rank() - shape.len();
        let axes: Vec<usize> = (0..self.rank())
            .filter(|&a| a < lead || (shape[a - lead] == 1 && self.shape()[a] != 1))
            .collect();
        if axes.is_empty() {
            return self.reshape(shape);
        }
        self.reduce_axes("sum_to_shape", ReduceOp::Sum, &axes, true)?
            .reshape(shape)
    }
}
