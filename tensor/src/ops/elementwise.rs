//! Elementwise ops: unary, scalar (lowered to the scalar-carrying unary kernels), binary with
//! numpy broadcasting, and selection. Broadcasting is free: both operands become zero-stride views
//! of the output shape, so the kernels only ever see equal shapes. FLOPs: one per output element.

use crate::backend::{BinaryOp, UnaryOp};
use crate::dtype::DType;
use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::Result;
use crate::layout::broadcast_shapes;
use crate::tensor::Tensor;

impl Tensor {
    /// Any unary op (including the scalar-carrying ones), elementwise.
    pub fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let out = self
            .device()
            .run(op.name(), WidenThenRound, [self], |k, [x]| k.unary(op, x))?;
        self.device().add_flops(self.numel() as u64);
        Ok(out)
    }

    /// `grad * op'(self)`: the backward of [`Tensor::unary`] (`self` its input, `grad` the
    /// output gradient, of one shape), from the op's descriptor in one fused kernel.
    pub fn unary_grad(&self, op: UnaryOp, grad: &Tensor) -> Result<Tensor> {
        self.same_device(op.name(), grad)?;
        if grad.shape() != self.shape() {
            return Err(crate::error::Error::shape(
                op.name(),
                format!(
                    "gradient {:?} does not match the input {:?}",
                    grad.shape(),
                    self.shape()
                ),
            ));
        }
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let out = self
            .device()
            .run(op.name(), WidenThenRound, [self, grad], |k, [x, g]| {
                k.unary_grad(op, x, g)
            })?;
        self.device().add_flops(2 * self.numel() as u64);
        Ok(out)
    }

    /// Any binary op, with numpy broadcasting of the two shapes.
    pub fn binary(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        let name = op.name();
        self.same_device(name, other)?;
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        let dev = self.device();
        if shape.iter().product::<usize>() == 0 {
            return Tensor::zeros_in(&shape, self.dtype(), dev);
        }
        let a = self.broadcast_to(&shape)?;
        let b = other.broadcast_to(&shape)?;
        let out = dev.run(name, WidenThenRound, [&a, &b], |k, [a, b]| {
            k.binary(op, a, b)
        })?;
        dev.add_flops(out.numel() as u64);
        Ok(out)
    }

    /// `self = self op other`, `other` broadcast to `self`'s shape. Written into `self`'s
    /// storage when `self` [is exclusive](Tensor::is_exclusive) and f32 (no other tensor can see
    /// the write), else a new tensor as [`Tensor::binary`] makes; the values are the same either
    /// way. When the broadcast result is larger than `self`, `self` becomes that result.
    pub fn binary_assign(&mut self, op: BinaryOp, other: &Tensor) -> Result<()> {
        let name = op.name();
        self.same_device(name, other)?;
        let shape = broadcast_shapes(name, self.shape(), other.shape())?;
        let f32s = self.dtype() == DType::F32 && other.dtype() == DType::F32;
        if shape[..] == *self.shape() && self.numel() > 0 && f32s && self.is_exclusive() {
            let b = other.broadcast_to(&shape)?;
            let dev = self.device().clone();
            // In-place kernels are f32 only: half tensors took the out-of-place path below.
            dev.kernels().binary_assign(op, self.raw_mut(), b.raw())?;
            dev.add_flops(self.numel() as u64);
            return Ok(());
        }
        *self = self.binary(op, other)?;
        Ok(())
    }

    /// `self += other` (see [`Tensor::binary_assign`]): in place when `self` is exclusive.
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        self.binary_assign(BinaryOp::Add, other)
    }

    /// `self -= other` (see [`Tensor::binary_assign`]): in place when `self` is exclusive.
    pub fn sub_assign(&mut self, other: &Tensor) -> Result<()> {
        self.binary_assign(BinaryOp::Sub, other)
    }

    /// `cond != 0 ? a : b`, the three shapes broadcast together.
    pub fn where_cond(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        select("where_cond", cond, a, b)
    }

    /// `value` where `mask != 0`, else `self` (mask broadcast against `self`).
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Tensor> {
        self.same_device("masked_fill", mask)?;
        let v = Tensor::scalar(value, self.device())?.to_dtype(self.dtype())?;
        select("masked_fill", mask, &v, self)
    }
}

/// Shared body of `where_cond` and `masked_fill`: `op` is the name errors report.
fn select(op: &'static str, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    cond.same_device(op, a)?;
    cond.same_device(op, b)?;
    let shape = broadcast_shapes(op, cond.shape(), a.shape())
        .and_then(|s| broadcast_shapes(op, &s, b.shape()))
        .map_err(|_| {
            crate::error::Error::shape(
                op,
                format!(
                    "condition {:?}, values {:?} and {:?} cannot be broadcast together",
                    cond.shape(),
                    a.shape(),
                    b.shape()
                ),
            )
        })?;
    let dev = cond.device();
    if shape.iter().product::<usize>() == 0 {
        return Tensor::zeros_in(&shape, a.dtype(), dev);
    }
    let cond = cond.broadcast_to(&shape)?;
    let (a, b) = (a.broadcast_to(&shape)?, b.broadcast_to(&shape)?);
    // The condition is a mask read as "non-zero": any dtype, brought to the values' own.
    let cond = cond.to_dtype(a.dtype())?;
    let out = dev.run(
        "where_cond",
        WidenThenRound,
        [&a, &b, &cond],
        |k, [a, b, cond]| k.where_cond(cond, a, b),
    )?;
    dev.add_flops(out.numel() as u64);
    Ok(out)
}

/// Generates a named method per binary op.
macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $($(#[$doc])* pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
                self.binary(BinaryOp::$op, other)
            })*
        }
    };
}

binary_methods! {
    add => Add;
    sub => Sub;
    mul => Mul;
    div => Div;
    maximum => Maximum;
    minimum => Minimum;
    /// `self ^ other`, elementwise.
    pow => Pow;
    /// 1.0 where equal, else 0.0 (likewise for the other comparisons).
    eq => Eq;
    ne => Ne;
    lt => Lt;
    le => Le;
    gt => Gt;
    ge => Ge;
}

/// Generates a named method per parameterless unary op.
macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $($(#[$doc])* pub fn $name(&self) -> Result<Tensor> {
                self.unary(UnaryOp::$op)
            })*
        }
    };
}

unary_methods! {
    neg => Neg;
    exp => Exp;
    log => Log;
    sqrt => Sqrt;
    rsqrt => Rsqrt;
    abs => Abs;
    /// -1, 0 or 1.
    sign => Sign;
    tanh => Tanh;
    sigmoid => Sigmoid;
    relu => Relu;
    /// GELU, exact: `x Phi(x)` (PyTorch's `gelu`).
    gelu => Gelu;
    /// Derivative of [`Tensor::gelu`].
    gelu_grad => GeluGrad;
    /// GELU, tanh approximation (PyTorch's `gelu(approximate='tanh')`).
    gelu_tanh => GeluTanh;
    /// Derivative of [`Tensor::gelu_tanh`].
    gelu_tanh_grad => GeluTanhGrad;
    sin => Sin;
    cos => Cos;
    square => Square;
    /// `1 / x`.
    recip => Recip;
    /// SiLU (swish), `x * sigmoid(x)`.
    silu => Silu;
}

impl Tensor {
    /// `x * mul + add`.
    pub fn affine(&self, mul: f32, add: f32) -> Result<Tensor> {
        self.unary(UnaryOp::Affine { mul, add })
    }
    pub fn add_scalar(&self, s: f32) -> Result<Tensor> {
        self.affine(1.0, s)
    }
    pub fn sub_scalar(&self, s: f32) -> Result<Tensor> {
        self.affine(1.0, -s)
    }
    /// `x * s`, exactly as the product rounds (a -0.0 product stays -0.0: the affine map adds
    /// -0.0, the one addend that changes no value, where + 0.0 would turn -0.0 into +0.0).
    pub fn mul_scalar(&self, s: f32) -> Result<Tensor> {
        self.affine(s, -0.0)
    }
    /// `x * (1 / s)` (may differ from `x / s` in the last bit; signed zeros kept as in
    /// [`Tensor::mul_scalar`]).
    pub fn div_scalar(&self, s: f32) -> Result<Tensor> {
        self.affine(1.0 / s, -0.0)
    }
    /// `x ^ p`.
    pub fn powf(&self, p: f32) -> Result<Tensor> {
        self.unary(UnaryOp::Powf(p))
    }
    pub fn maximum_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::MaxScalar(s))
    }
    pub fn minimum_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::MinScalar(s))
    }
    /// `s - x`.
    pub fn rsub_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::RSub(s))
    }
    /// `s / x`.
    pub fn rdiv_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::RDiv(s))
    }
    /// 1.0 where `x > s`, else 0.0.
    pub fn gt_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::GtScalar(s))
    }
    /// 1.0 where `x == s`, else 0.0.
    pub fn eq_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::EqScalar(s))
    }
}
