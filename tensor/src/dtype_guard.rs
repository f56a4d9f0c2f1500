//! The one place dtypes meet the kernels: every `Device::kernels()` call goes through
//! [`DTypeGuard`], which checks that an op's operands share one dtype (a clear error naming the
//! op and both dtypes otherwise), runs f32 operands on the backend's kernels unchanged, and runs
//! half operands either on a native half kernel or by widening them to f32, calling the f32
//! kernel and rounding the result back (so every half op accumulates in f32). Ops that have no
//! half path yet fail with an error naming op, dtype and backend. The op front-ends stay
//! dtype-agnostic.

use std::sync::Arc;

use crate::backend::*;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

pub(crate) struct DTypeGuard {
    inner: Arc<dyn Kernels>,
    /// The backend's name in errors ("cpu", "wgpu").
    backend: &'static str,
}

impl DTypeGuard {
    pub(crate) fn new(inner: Arc<dyn Kernels>, backend: &'static str) -> Self {
        DTypeGuard { inner, backend }
    }

    /// The dtype all of `inputs` share, or a mismatch error naming `op`.
    fn common(op: &'static str, inputs: &[&Tensor]) -> Result<DType> {
        let first = inputs.first().map_or(DType::F32, |x| x.dtype());
        match inputs.iter().find(|x| x.dtype() != first) {
            Some(x) => Err(Error::DTypeMismatch {
                op,
                a: first,
                b: x.dtype(),
            }),
            None => Ok(first),
        }
    }

    /// The error for an op that has no kernel for half `dtype` on this backend.
    fn unsupported(&self, op: &'static str, dtype: DType) -> Error {
        Error::UnsupportedDType {
            op,
            dtype,
            backend: self.backend,
        }
    }

    /// Fails unless every one of `inputs` is f32 (ops with no half path).
    fn f32_only(&self, op: &'static str, inputs: &[&Tensor]) -> Result<()> {
        match inputs.iter().find(|x| x.dtype().is_half()) {
            Some(x) => Err(self.unsupported(op, x.dtype())),
            None => Ok(()),
        }
    }

    /// Runs `f` on the backend: directly for f32 operands; for half ones on their f32 widening,
    /// with every output rounded back to their dtype.
    fn compute<const N: usize>(
        &self,
        op: &'static str,
        inputs: &[&Tensor],
        f: impl FnOnce(&dyn Kernels, &[&Tensor]) -> Result<[Tensor; N]>,
    ) -> Result<[Tensor; N]> {
        let dtype = Self::common(op, inputs)?;
        if !dtype.is_half() {
            return f(&*self.inner, inputs);
        }
        let wide = inputs
            .iter()
            .map(|x| self.inner.widen(x))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = wide.iter().collect();
        let outs = f(&*self.inner, &refs)?;
        drop(wide);
        let mut narrowed = Vec::with_capacity(N);
        for y in &outs {
            narrowed.push(self.inner.narrow(y, dtype)?);
        }
        Ok(narrowed
            .try_into()
            .unwrap_or_else(|_| unreachable!("N outputs")))
    }

    /// [`DTypeGuard::compute`] for a kernel with one output.
    fn compute1(
        &self,
        op: &'static str,
        inputs: &[&Tensor],
        f: impl FnOnce(&dyn Kernels, &[&Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let [y] = self.compute(op, inputs, |k, xs| Ok([f(k, xs)?]))?;
        Ok(y)
    }
}

impl Kernels for DTypeGuard {
    fn from_host(&self, dev: &Device, data: &[f32], shape: &[usize]) -> Result<Tensor> {
        self.inner.from_host(dev, data, shape)
    }
    fn from_vec(&self, dev: &Device, data: Vec<f32>, shape: &[usize]) -> Result<Tensor> {
        self.inner.from_vec(dev, data, shape)
    }
    fn to_host(&self, x: &Tensor) -> Result<Vec<f32>> {
        if x.dtype().is_half() {
            self.inner.to_host(&self.inner.widen(x)?)
        } else {
            self.inner.to_host(x)
        }
    }
    fn widen(&self, x: &Tensor) -> Result<Tensor> {
        self.inner.widen(x)
    }
    fn narrow(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.inner.narrow(x, dtype)
    }
    fn fill(&self, dev: &Device, shape: &[usize], value: f32) -> Result<Tensor> {
        self.inner.fill(dev, shape, value)
    }
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        self.compute1("contiguous", &[x], |k, xs| k.contiguous(xs[0]))
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        self.compute1(op.name(), &[x], |k, xs| k.unary(op, xs[0]))
    }
    fn unary_grad(&self, op: UnaryOp, x: &Tensor, g: &Tensor) -> Result<Tensor> {
        self.compute1(op.name(), &[x, g], |k, xs| k.unary_grad(op, xs[0], xs[1]))
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.compute1(op.name(), &[a, b], |k, xs| k.binary(op, xs[0], xs[1]))
    }
    fn bias_act(&self, op: UnaryOp, z: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.compute1("bias_act", &[z, b], |k, xs| k.bias_act(op, xs[0], xs[1]))
    }
    fn bias_act_grad(&self, op: UnaryOp, z: &Tensor, b: &Tensor, g: &Tensor) -> Result<Tensor> {
        self.compute1("bias_act_grad", &[z, b, g], |k, xs| {
            k.bias_act_grad(op, xs[0], xs[1], xs[2])
        })
    }
    /// The condition is a mask read as "non-zero": it may have any dtype.
    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let cond = if cond.dtype() == a.dtype() {
            cond.clone()
        } else {
            cond.to_dtype(a.dtype())?
        };
        self.compute1("where_cond", &[a, b, &cond], |k, xs| {
            k.where_cond(xs[2], xs[0], xs[1])
        })
    }
    fn sum_leading(&self, x: &Tensor, width: usize) -> Option<Result<Tensor>> {
        // Half tensors take the front-end's general path (permute, then reduce rows).
        if x.dtype().is_half() {
            return None;
        }
        self.inner.sum_leading(x, width)
    }
    fn sgd_update(&self, param: &Tensor, grad: &Tensor, lr: f32) -> Option<Result<Tensor>> {
        if let Err(e) = Self::common("sgd_update", &[param, grad]) {
            return Some(Err(e));
        }
        if param.dtype().is_half() {
            return None;
        }
        self.inner.sgd_update(param, grad, lr)
    }
    /// In-place ops are f32 only: the front-ends take the out-of-place path for half tensors.
    fn binary_assign(&self, op: BinaryOp, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        Self::common(op.name(), &[acc, x])?;
        self.f32_only(op.name(), &[acc])?;
        self.inner.binary_assign(op, acc, x)
    }
    fn sgd_update_in_place(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        lr: f32,
    ) -> Option<Result<()>> {
        if let Err(e) = Self::common("sgd_update", &[param, grad]) {
            return Some(Err(e));
        }
        if param.dtype().is_half() {
            return None;
        }
        self.inner.sgd_update_in_place(param, grad, lr)
    }
    /// Indices (argmax, argmin) stay f32 whatever the input's dtype: f16 holds integers exactly
    /// only up to 2048.
    fn reduce_rows(&self, op: ReduceOp, x: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
        if matches!(op, ReduceOp::ArgMax | ReduceOp::ArgMin) && x.dtype().is_half() {
            return self
                .inner
                .reduce_rows(op, &self.inner.widen(x)?, rows, cols);
        }
        self.compute1(op.name(), &[x], |k, xs| {
            k.reduce_rows(op, xs[0], rows, cols)
        })
    }
    fn softmax_rows(&self, x: &Tensor, rows: usize, cols: usize, log: bool) -> Result<Tensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        self.compute1(op, &[x], |k, xs| k.softmax_rows(xs[0], rows, cols, log))
    }
    fn causal_softmax_rows(
        &self,
        x: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        self.compute1("causal_softmax", &[x], |k, xs| {
            k.causal_softmax_rows(xs[0], rows, cols, scale)
        })
    }
    fn softmax_backward_rows(
        &self,
        y: &Tensor,
        g: &Tensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<Tensor> {
        self.compute1("softmax_backward", &[y, g], |k, xs| {
            k.softmax_backward_rows(xs[0], xs[1], rows, cols, scale)
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
        let dtype = Self::common("matmul", &[a, b])?;
        if dtype.is_half() {
            if let Some(out) = self.inner.matmul_half(a, la, b, lb, dims) {
                return out;
            }
        }
        // The widened copies start at the views' first element: the layouts move with them.
        let rebased = |l: MatLayout, x: &Tensor| -> Result<MatLayout> {
            let offset = l.offset.checked_sub(x.layout().offset).ok_or_else(|| {
                Error::invalid(
                    "matmul",
                    format!(
                        "an operand layout {l:?} starts before its tensor's view (offset {})",
                        x.layout().offset
                    ),
                )
            })?;
            Ok(MatLayout { offset, ..l })
        };
        let (la, lb) = if dtype.is_half() {
            (rebased(la, a)?, rebased(lb, b)?)
        } else {
            (la, lb)
        };
        self.compute1("matmul", &[a, b], |k, xs| {
            k.matmul(xs[0], la, xs[1], lb, dims)
        })
    }
    fn matmul_half(
        &self,
        a: &Tensor,
        la: MatLayout,
        b: &Tensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Option<Result<Tensor>> {
        self.inner.matmul_half(a, la, b, lb, dims)
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
        let [y, mean, rstd] = self.compute("layer_norm", &[x, gamma, beta], |k, xs| {
            let (y, m, r) = k.layer_norm_rows(xs[0], xs[1], xs[2], rows, cols, eps)?;
            Ok([y, m, r])
        })?;
        Ok((y, mean, rstd))
    }
    /// The targets and the saved row statistics stay f32 (indices, and what the backward
    /// recomputes the probabilities from); half logits are widened and the loss rounded back.
    fn cross_entropy_rows(
        &self,
        x: &Tensor,
        targets: &Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.f32_only("cross_entropy (targets)", &[targets])?;
        if !x.dtype().is_half() {
            return self.inner.cross_entropy_rows(x, targets, rows, cols);
        }
        let (loss, max, logsum) =
            self.inner
                .cross_entropy_rows(&self.inner.widen(x)?, targets, rows, cols)?;
        Ok((self.inner.narrow(&loss, x.dtype())?, max, logsum))
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
        self.f32_only(
            "cross_entropy backward (targets, statistics)",
            &[targets, max, logsum],
        )?;
        self.compute1("cross_entropy backward", &[x, g], |k, xs| {
            k.cross_entropy_backward_rows(xs[0], targets, max, logsum, xs[1], rows, cols)
        })
    }
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
        let [s, y, mean, rstd] =
            self.compute("add_layer_norm", &[x, r, gamma, beta], |k, xs| {
                let (s, y, m, v) =
                    k.add_layer_norm_rows(xs[0], xs[1], xs[2], xs[3], rows, cols, eps)?;
                Ok([s, y, m, v])
            })?;
        Ok((s, y, mean, rstd))
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
        let mut inputs = vec![x, mean, rstd, gamma, g];
        inputs.extend(carry);
        self.compute1("layer_norm backward", &inputs, |k, xs| {
            k.layer_norm_backward_rows(
                xs[0],
                xs[1],
                xs[2],
                xs[3],
                xs[4],
                xs.get(5).copied(),
                rows,
                cols,
            )
        })
    }
    fn index_select(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        self.f32_only("index_select", &[x, idx])?;
        self.inner.index_select(x, idx, outer, dim, inner)
    }
    fn index_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        self.f32_only("index_add", &[src, idx])?;
        self.inner.index_add(src, idx, outer, dim, inner)
    }
    fn gather(
        &self,
        x: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        self.f32_only("gather", &[x, idx])?;
        self.inner.gather(x, idx, outer, dim, inner)
    }
    fn scatter_add(
        &self,
        src: &Tensor,
        idx: &Tensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<Tensor> {
        self.f32_only("scatter_add", &[src, idx])?;
        self.inner.scatter_add(src, idx, outer, dim, inner)
    }
    fn concat(&self, xs: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor> {
        self.compute1("concat", xs, |k, xs| k.concat(xs, axis, out_shape))
    }
    fn im2col(&self, x: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        self.compute1("conv2d (im2col)", &[x], |k, xs| k.im2col(xs[0], g))
    }
    fn col2im(&self, cols: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
        self.compute1("conv2d backward (col2im)", &[cols], |k, xs| {
            k.col2im(xs[0], g)
        })
    }
    /// The argmax positions stay f32, like every index tensor.
    fn max_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<(Tensor, Tensor)> {
        if !x.dtype().is_half() {
            return self.inner.max_pool2d(x, g);
        }
        let (y, argmax) = self.inner.max_pool2d(&self.inner.widen(x)?, g)?;
        Ok((self.inner.narrow(&y, x.dtype())?, argmax))
    }
    fn max_pool2d_backward(
        &self,
        dy: &Tensor,
        argmax: &Tensor,
        g: &Pool2dGeometry,
    ) -> Result<Tensor> {
        self.f32_only("max_pool2d backward (argmax)", &[argmax])?;
        self.compute1("max_pool2d backward", &[dy], |k, xs| {
            k.max_pool2d_backward(xs[0], argmax, g)
        })
    }
    fn avg_pool2d(&self, x: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        self.compute1("avg_pool2d", &[x], |k, xs| k.avg_pool2d(xs[0], g))
    }
    fn avg_pool2d_backward(&self, dy: &Tensor, g: &Pool2dGeometry) -> Result<Tensor> {
        self.compute1("avg_pool2d backward", &[dy], |k, xs| {
            k.avg_pool2d_backward(xs[0], g)
        })
    }
    fn dropout_mask(
        &self,
        dev: &Device,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<Tensor> {
        self.inner.dropout_mask(dev, shape, p, seed, offset)
    }
    /// Refused for half tensors on purpose: optimizer updates belong on f32 master weights.
    fn adam_update(
        &self,
        param: &Tensor,
        grad: &Tensor,
        m: &Tensor,
        v: &Tensor,
        hp: &AdamStep,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.f32_only("adam_update", &[param, grad, m, v])?;
        self.inner.adam_update(param, grad, m, v, hp)
    }
    fn adam_update_in_place(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        hp: &AdamStep,
    ) -> Result<()> {
        self.f32_only("adam_update", &[param, grad, m, v])?;
        self.inner.adam_update_in_place(param, grad, m, v, hp)
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
}
