//! The contract between the op front-ends (`ops/`) and the two backends (`cpu/`, `wgpu/`).
//!
//! Front-ends validate shapes, devices and axes, reduce every op to one of these kernels, and
//! count FLOPs. Kernels trust their arguments (already validated), allocate their output through
//! the device's memory tracker (so `OutOfMemory` surfaces), and return contiguous tensors.
//! Inputs may be arbitrary strided views unless the doc of a method says "contiguous".

use crate::dtype::DType;
use crate::error::Result;
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;

/// The op enums are shared with the shaders crate, where each op's descriptor (CPU function,
/// WGSL expression, derivative) lives: see [`wgpipe_shaders::ops`].
pub use wgpipe_shaders::ops::{BinaryOp, ReduceOp, UnaryOp};

/// How one matmul operand sits in its storage: element (b, i, j) is at
/// `offset + b * batch_stride + i * row_stride + j * col_stride` (so a transposed operand is just
/// swapped strides, and a broadcast batch is `batch_stride = 0`), or, with `groups`, at
/// `offset + (b / len) * groups.stride + (b % len) * batch_stride + ...`: two batch axes that no
/// single stride walks, such as the batch and head axes of a `[B, T, H, D]` tensor permuted to
/// `[B, H, T, D]` (see [`MatLayout::matrix_offset`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatLayout {
    pub offset: usize,
    pub batch_stride: usize,
    pub row_stride: usize,
    pub col_stride: usize,
    /// The outer batch axis, when the batch needs two (only backends whose
    /// `Kernels::matmul_grouped_batches` says so are given one).
    pub groups: Option<MatGroups>,
}

/// The outer of two batch axes of a [`MatLayout`]: matrices `g * len .. (g + 1) * len` are group
/// `g`, which starts `g * stride` after the offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatGroups {
    pub len: usize,
    pub stride: usize,
}

impl MatLayout {
    /// A one-axis batch layout.
    pub fn new(offset: usize, batch_stride: usize, row_stride: usize, col_stride: usize) -> Self {
        MatLayout {
            offset,
            batch_stride,
            row_stride,
            col_stride,
            groups: None,
        }
    }

    /// Where matrix `b` of the batch starts.
    pub fn matrix_offset(&self, b: usize) -> usize {
        match self.groups {
            None => self.offset + b * self.batch_stride,
            Some(g) => self.offset + (b / g.len) * g.stride + (b % g.len) * self.batch_stride,
        }
    }
}

/// `out[b] = a[b] (m x k) @ b[b] (k x n)` for `b` in `0..batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatDims {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
}

/// A batch of attention heads: `batch` matrices of `t` rows (queries or keys) and `dh` columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDims {
    pub batch: usize,
    pub t: usize,
    pub dh: usize,
}

/// Geometry of a 2-D convolution, NCHW input, weight `[c_out, c_in / groups, kh, kw]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dGeometry {
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
    pub h_out: usize,
    pub w_out: usize,
}

impl Conv2dGeometry {
    /// Rows of one group's im2col matrix: `c_in / groups * kh * kw`.
    pub fn col_rows(&self) -> usize {
        self.c_in / self.groups * self.kh * self.kw
    }
    /// Columns of the im2col matrix: `h_out * w_out`.
    pub fn col_cols(&self) -> usize {
        self.h_out * self.w_out
    }
}

/// Geometry of a 2-D pooling window over NCHW input (padding counts as -inf for max and as zeros
/// in the average, whose divisor is always `kh * kw`, as PyTorch's default `count_include_pad`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool2dGeometry {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub h_out: usize,
    pub w_out: usize,
}

/// Hyper-parameters of one fused Adam step, per element:
/// `g' = g + weight_decay * p` unless `decoupled`; `m' = beta1 m + (1 - beta1) g'`;
/// `v' = beta2 v + (1 - beta2) g'^2`; `p' = p - lr * (m' / bias_correction1) /
/// (sqrt(v' / bias_correction2) + eps) - (decoupled ? lr * weight_decay * p : 0)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub decoupled: bool,
    /// `1 - beta1^t`.
    pub bias_correction1: f32,
    /// `1 - beta2^t`.
    pub bias_correction2: f32,
}

/// The kernels every backend provides. See the module doc for the contract. They compute in
/// f32: the op front-ends reach them through each op's dtype policy (`dtype_policy`), which
/// refuses half operands or widens them first.
pub(crate) trait Kernels: Send + Sync {
    /// A contiguous tensor of `shape` holding `data` (row-major).
    #[allow(clippy::wrong_self_convention)] // `self` is the backend, not the source
    fn from_host(&self, mem: &MemoryTracker, data: &[f32], shape: &[usize]) -> Result<RawTensor>;
    /// [`Kernels::from_host`] taking ownership (the CPU backend keeps the vector, no copy).
    #[allow(clippy::wrong_self_convention)]
    fn from_vec(&self, mem: &MemoryTracker, data: Vec<f32>, shape: &[usize]) -> Result<RawTensor> {
        self.from_host(mem, &data, shape)
    }
    /// The elements of `x` in row-major logical order, half values widened (exactly).
    fn to_host(&self, x: &RawTensor) -> Result<Vec<f32>> {
        if x.dtype().is_half() {
            self.to_host_f32(&self.widen(x)?)
        } else {
            self.to_host_f32(x)
        }
    }
    /// [`Kernels::to_host`] into a vector with room for `extra` more values (appended later
    /// without a reallocation, which for a large tensor is a copy).
    fn to_host_reserving(&self, x: &RawTensor, extra: usize) -> Result<Vec<f32>> {
        let mut v = self.to_host(x)?;
        v.reserve_exact(extra);
        Ok(v)
    }
    /// [`Kernels::to_host`] of an f32 tensor.
    fn to_host_f32(&self, x: &RawTensor) -> Result<Vec<f32>>;
    /// Half `x` (any view) as an f32 tensor over the storage elements the view spans
    /// (`[offset, offset + span)`, widened exactly), with `x`'s shape and strides from offset 0,
    /// so every f32 kernel reads it as it would have read `x`.
    fn widen(&self, x: &RawTensor) -> Result<RawTensor>;
    /// Contiguous f32 `x` (offset allowed) rounded to half `dtype` (nearest even, overflow to
    /// infinity), as a fresh contiguous tensor charged at `dtype`'s size.
    fn narrow(&self, x: &RawTensor, dtype: DType) -> Result<RawTensor>;
    /// A contiguous tensor of `shape` filled with `value`.
    fn fill(&self, mem: &MemoryTracker, shape: &[usize], value: f32) -> Result<RawTensor>;
    /// Materialises any view as a contiguous tensor.
    fn contiguous(&self, x: &RawTensor) -> Result<RawTensor>;
    fn unary(&self, op: UnaryOp, x: &RawTensor) -> Result<RawTensor>;
    /// `g * op'(x)`: the backward of a unary op, `x` its input and `g` the output gradient (views
    /// of one shape).
    fn unary_grad(&self, op: UnaryOp, x: &RawTensor, g: &RawTensor) -> Result<RawTensor>;
    /// `op(z + b)` for contiguous `z` `[rows, cols]` and a contiguous bias `b` `[cols]` added to
    /// every row: a Linear layer's bias and activation in one pass.
    fn bias_act(&self, op: UnaryOp, z: &RawTensor, b: &RawTensor) -> Result<RawTensor>;
    /// `g * op'(z + b)`, the backward of [`Kernels::bias_act`] (`g` contiguous like `z`).
    fn bias_act_grad(
        &self,
        op: UnaryOp,
        z: &RawTensor,
        b: &RawTensor,
        g: &RawTensor,
    ) -> Result<RawTensor>;
    /// `a` and `b` are views of the same shape (broadcast already applied as zero strides).
    fn binary(&self, op: BinaryOp, a: &RawTensor, b: &RawTensor) -> Result<RawTensor>;
    /// `cond != 0 ? a : b`, all three views of the same shape.
    fn where_cond(&self, cond: &RawTensor, a: &RawTensor, b: &RawTensor) -> Result<RawTensor>;
    /// A fused sum of contiguous `x`, seen as `[x.numel() / width, width]`, over its rows,
    /// giving `[width]` (a bias gradient) without the transposing copy of the general path;
    /// `None` when the backend has none (the front-end then permutes and reduces rows).
    fn sum_leading(&self, _x: &RawTensor, _width: usize) -> Option<Result<RawTensor>> {
        None
    }
    /// A fused `param - lr * grad` (bit-identical to the two-op form), or `None` when the
    /// backend has none.
    fn sgd_update(
        &self,
        _param: &RawTensor,
        _grad: &RawTensor,
        _lr: f32,
    ) -> Option<Result<RawTensor>> {
        None
    }
    /// `acc = op(acc, x)` written into `acc`'s storage. The front-end checked that `acc` is
    /// f32, of `x`'s shape and exclusive ([`Tensor::is_exclusive`]: no other tensor sees its
    /// storage, so `x` cannot alias it); `x` is any view. The values are [`Kernels::binary`]'s.
    fn binary_assign(&self, op: BinaryOp, acc: &mut RawTensor, x: &RawTensor) -> Result<()>;
    /// [`Kernels::sgd_update`] written into exclusive `param`, or `None` when the backend has no
    /// fused step (the front-end then subtracts `grad * lr` with [`Kernels::binary_assign`]).
    fn sgd_update_in_place(
        &self,
        _param: &mut RawTensor,
        _grad: &RawTensor,
        _lr: f32,
    ) -> Option<Result<()>> {
        None
    }
    /// `x` contiguous, seen as `[rows, cols]`; reduces each row, giving `[rows]`.
    fn reduce_rows(
        &self,
        op: ReduceOp,
        x: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor>;
    /// `x` contiguous `[rows, cols]`; numerically stable (log-)softmax of each row.
    fn softmax_rows(&self, x: &RawTensor, rows: usize, cols: usize, log: bool)
        -> Result<RawTensor>;
    /// `x` contiguous `[rows, cols]`, seen as `[rows / cols, cols, cols]` attention scores (query
    /// `r % cols` on row `r`): softmax of `scale * x` over the keys `0..=r % cols`, zeros on the
    /// future keys. Bit for bit the scaled, `-1e9`-masked softmax it replaces.
    fn causal_softmax_rows(
        &self,
        x: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor>;
    /// Causal attention of `d.batch` heads in one kernel, each operand a strided batch of `[t,
    /// dh]` matrices with contiguous rows (`col_stride == 1`): `p = causal_softmax(scale * q
    /// k^T)` (as [`Kernels::causal_softmax_rows`] makes it) and `y = p v`. Returns `(y, p)`:
    /// `y` the `batch * t * dh` values of a storage that holds the matrices at `y_at` (disjoint
    /// matrices with contiguous rows, filling it), `p` contiguous `[batch, t, t]`; or `None`
    /// where the backend has no such kernel (the front-end then composes matmuls and the row
    /// kernels).
    fn causal_attention(
        &self,
        _qkv: [(&RawTensor, MatLayout); 3],
        _y_at: MatLayout,
        _d: HeadDims,
        _scale: f32,
    ) -> Option<Result<(RawTensor, RawTensor)>> {
        None
    }
    /// The backward of [`Kernels::causal_attention`]: given its `p` (contiguous `[batch, t, t]`)
    /// and `g`, the gradient of `y` (a batch like the operands), the gradients of `q`, `k` and
    /// `v`, each the `batch * t * dh` values of a storage holding the matrices at `at` (as the
    /// forward's `y_at`); `None` where the backend has no such kernel.
    fn causal_attention_backward(
        &self,
        _qkv: [(&RawTensor, MatLayout); 3],
        _p: &RawTensor,
        _g: (&RawTensor, MatLayout),
        _at: [MatLayout; 3],
        _d: HeadDims,
        _scale: f32,
    ) -> Option<Result<[RawTensor; 3]>> {
        None
    }
    /// `y` (softmaxed rows) and `g` (their gradient) contiguous `[rows, cols]`: the gradient of
    /// the rows' inputs, `scale * y * (g - sum(g * y))`, for `y = softmax(scale * x)`.
    fn softmax_backward_rows(
        &self,
        y: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> Result<RawTensor>;
    /// `x` contiguous `[rows, cols]` logits and `targets` contiguous `[rows]` (class ids as f32,
    /// already checked to be in `0..cols`). Returns `(loss, max, logsum)`, each `[rows]`:
    /// `loss = -((x[t] - max) - logsum)` with `logsum = ln(sum(exp(x - max)))`, the log-softmax's
    /// own arithmetic, so the loss is bit for bit `-log_softmax(x)[t]`.
    fn cross_entropy_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<(RawTensor, RawTensor, RawTensor)>;
    /// The backward of [`Kernels::cross_entropy_rows`], given `g [rows]` (the gradient of each
    /// row's loss) and the saved `max`, `logsum`: `dx = g * exp((x - max) - logsum)`, minus `g`
    /// at the target. All contiguous.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward_rows(
        &self,
        x: &RawTensor,
        targets: &RawTensor,
        max: &RawTensor,
        logsum: &RawTensor,
        g: &RawTensor,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor>;
    /// Whether [`Kernels::matmul`] takes operands whose batch needs two strides
    /// ([`MatLayout::groups`]); where it does not, such operands are copied to one stride first.
    fn matmul_grouped_batches(&self) -> bool {
        false
    }
    /// Batched matmul on strided operands; output contiguous `[batch, m, n]`.
    fn matmul(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
    ) -> Result<RawTensor>;
    /// [`Kernels::matmul`] on half operands of one dtype with f32 accumulation, output in their
    /// dtype; `None` when the backend has no native half matmul (the operands are then widened).
    fn matmul_half(
        &self,
        _a: &RawTensor,
        _la: MatLayout,
        _b: &RawTensor,
        _lb: MatLayout,
        _dims: MatDims,
    ) -> Option<Result<RawTensor>> {
        None
    }
    /// `x` contiguous `[rows, cols]`, `gamma`/`beta` contiguous `[cols]`. Returns
    /// `(y [rows, cols], mean [rows], rstd [rows])` with `rstd = 1/sqrt(var + eps)`
    /// (biased variance, as PyTorch).
    fn layer_norm_rows(
        &self,
        x: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor)>;
    /// [`Kernels::layer_norm_rows`] of `x + r` (both contiguous `[rows, cols]`) that also returns
    /// the sum: `(s, y, mean, rstd)`. A residual add and the layer norm after it in one pass.
    #[allow(clippy::too_many_arguments)]
    fn add_layer_norm_rows(
        &self,
        x: &RawTensor,
        r: &RawTensor,
        gamma: &RawTensor,
        beta: &RawTensor,
        rows: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(RawTensor, RawTensor, RawTensor, RawTensor)>;
    /// The gradient of layer norm's input, all contiguous (`mean`, `rstd` `[rows]`, `gamma`
    /// `[cols]`, the rest `[rows, cols]`): `rstd * ((gxhat - mean(gxhat)) - xhat *
    /// mean(gxhat * xhat))` with `gxhat = g * gamma`, `xhat = (x - mean) * rstd`, plus `carry`
    /// when given (the gradient `x` already has from its other consumers, added in the same
    /// pass), with the arithmetic of the composed ops and the tape's sum.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<RawTensor>;
    /// `x` contiguous `[outer, dim, inner]`, `idx` contiguous `[n]` (f32 holding integers,
    /// already checked to be in `0..dim`). Output `[outer, n, inner]`.
    fn index_select(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor>;
    /// Adjoint of `index_select`: `src` contiguous `[outer, n, inner]`, output
    /// `[outer, dim, inner]` = zeros with `src[:, j, :]` added at row `idx[j]` (repeats add up).
    fn index_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor>;
    /// Torch-style gather: `x` contiguous `[outer, dim, inner]`, `idx` contiguous
    /// `[outer, n, inner]` (values in `0..dim`), output `[outer, n, inner]`.
    fn gather(
        &self,
        x: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor>;
    /// Adjoint of `gather`: `src`, `idx` contiguous `[outer, n, inner]`; output
    /// `[outer, dim, inner]` = zeros with `src` added at the gathered positions.
    fn scatter_add(
        &self,
        src: &RawTensor,
        idx: &RawTensor,
        outer: usize,
        dim: usize,
        inner: usize,
    ) -> Result<RawTensor>;
    /// Concatenates strided `xs` along `axis` into a contiguous tensor of `out_shape`.
    fn concat(&self, xs: &[&RawTensor], axis: usize, out_shape: &[usize]) -> Result<RawTensor>;
    /// `x` contiguous `[n, c_in, h, w]` -> columns `[n, groups, col_rows, col_cols]`
    /// (zero where the window is in the padding).
    fn im2col(&self, x: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor>;
    /// Adjoint of `im2col`: columns `[n, groups, col_rows, col_cols]` -> `[n, c_in, h, w]`,
    /// overlapping windows adding up.
    fn col2im(&self, cols: &RawTensor, g: &Conv2dGeometry) -> Result<RawTensor>;
    /// `x` contiguous NCHW. Returns `(y [n, c, h_out, w_out], argmax)` where `argmax` holds, as
    /// f32, the flat index `iy * w + ix` of each maximum inside its `(n, c)` plane.
    fn max_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<(RawTensor, RawTensor)>;
    /// Adjoint of max-pool: `dy`, `argmax` contiguous `[n, c, h_out, w_out]` -> `dx [n, c, h, w]`.
    fn max_pool2d_backward(
        &self,
        dy: &RawTensor,
        argmax: &RawTensor,
        g: &Pool2dGeometry,
    ) -> Result<RawTensor>;
    /// `x` contiguous NCHW -> `[n, c, h_out, w_out]`.
    fn avg_pool2d(&self, x: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor>;
    /// Adjoint of avg-pool: `dy` contiguous `[n, c, h_out, w_out]` -> `dx [n, c, h, w]`.
    fn avg_pool2d_backward(&self, dy: &RawTensor, g: &Pool2dGeometry) -> Result<RawTensor>;
    /// Dropout multipliers of `shape`: element i is `crate::rng::dropout_value(seed, offset, i, p)`.
    fn dropout_mask(
        &self,
        mem: &MemoryTracker,
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
    ) -> Result<RawTensor>;
    /// One fused Adam/AdamW step on contiguous `param`, `grad`, `m`, `v` of the same shape.
    /// Returns `(param', m', v')`; see [`AdamStep`] for the arithmetic.
    fn adam_update(
        &self,
        param: &RawTensor,
        grad: &RawTensor,
        m: &RawTensor,
        v: &RawTensor,
        hp: &AdamStep,
    ) -> Result<(RawTensor, RawTensor, RawTensor)>;
    /// [`Kernels::adam_update`] written into `param`, `m` and `v`, which the front-end checked
    /// are exclusive ([`Tensor::is_exclusive`]); bit for bit the values it would return.
    fn adam_update_in_place(
        &self,
        param: &mut RawTensor,
        grad: &RawTensor,
        m: &mut RawTensor,
        v: &mut RawTensor,
        hp: &AdamStep,
    ) -> Result<()>;
    /// Waits until all queued work of this device is done (no-op on CPU).
    fn synchronize(&self) -> Result<()>;
}
