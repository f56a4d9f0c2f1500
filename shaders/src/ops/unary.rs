//! Elementwise unary ops. Each op is one descriptor below (name, CPU function, WGSL expression,
//! derivative, and what the derivative is computed from); [`UnaryOp`] names them for the public
//! API and dispatches to them. The derivative here is the only one: autograd's backward of every
//! unary op is `g * op'(...)` from the descriptor (see [`GradFrom`]).
//!
//! The WGSL expressions are over `a` (the input) and `s0`, `s1` (the op's scalars); the helpers
//! they call (`tanh_c`, `sigmoid`, `gelu`, `gelu_tanh` and their derivatives, `spow`, `flag`) are in `elementwise.wgsl`.

use std::hash::{Hash, Hasher};

/// One unary op: `y = f(x)` with up to two scalars `s` (e.g. `Affine`: `x * s[0] + s[1]`).
pub trait UnaryOpT: 'static {
    /// The user-facing name (method name, error messages).
    const NAME: &'static str;
    /// `y` as a WGSL expression over `a`, `s0`, `s1`.
    const WGSL: &'static str;
    /// `dy/dx` as a WGSL expression over `a`, `s0`, `s1`.
    const WGSL_GRAD: &'static str;
    /// `y` on the CPU.
    fn f(x: f32, s: [f32; 2]) -> f32;
    /// `dy/dx` on the CPU.
    fn df(x: f32, s: [f32; 2]) -> f32;
    /// What a backward computes `dy/dx` from, and so what it keeps of the forward.
    const GRAD_FROM: GradFrom = GradFrom::Input;
    /// Where `f` and `df` have cheaper forms, [`UnaryOpT::f_near`] and [`UnaryOpT::df_near`],
    /// that give the same bits: `|x| <= NEAR` (the GELUs' polynomials). Loops that find a whole
    /// run of values inside it run those; NaN is never inside. Negative: no such forms.
    const NEAR: f32 = -1.0;
    /// `f` for `|x| <= NEAR`.
    #[inline(always)]
    fn f_near(x: f32, s: [f32; 2]) -> f32 {
        Self::f(x, s)
    }
    /// `df` for `|x| <= NEAR`.
    #[inline(always)]
    fn df_near(x: f32, s: [f32; 2]) -> f32 {
        Self::df(x, s)
    }
}

/// What an op's backward computes `dy/dx` from, and so which tensor autograd keeps from the
/// forward until the backward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradFrom {
    /// The input `x`: `dy/dx = df(x)`.
    Input,
    /// The output `y`: `dy/dx = d'(y)` for the descriptor `d` given (an op written for this, whose
    /// derivative is this op's written in `y`). Kept for ops whose output the next op usually
    /// keeps anyway (`exp`, `tanh`, `sigmoid`, ...), so their backward costs no extra memory,
    /// and because the form in `y` is the cheaper one.
    Output(UnaryOp),
    /// Nothing: `dy/dx` is a constant (it depends on the op's scalars at most), so `g * df(g)`
    /// is the gradient and no tensor is kept.
    Nothing,
}

/// Generic code over one op: [`UnaryOp::visit`] calls `visit::<Descriptor>(scalars)`.
pub trait UnaryVisitor {
    type Out;
    fn visit<T: UnaryOpT>(self, s: [f32; 2]) -> Self::Out;
}

/// Defines one descriptor: `Type, "name", |x, s| f, "wgsl", d: df, "wgsl_grad"`, and when the
/// backward does not read the input, `from: GradFrom::...`; with cheaper forms near zero,
/// `near: bound => f_near, df_near` (see [`UnaryOpT::NEAR`]).
macro_rules! unary_op {
    ($(#[$m:meta])* $ty:ident, $name:literal, |$x:ident, $s:pat_param| $f:expr, $wgsl:literal,
     d: $df:expr, $wgsl_grad:literal $(, from: $from:expr)?
     $(, near: $near:expr => $f_near:expr, $df_near:expr)?) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy)]
        pub struct $ty;
        impl UnaryOpT for $ty {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            const WGSL_GRAD: &'static str = $wgsl_grad;
            $(const GRAD_FROM: super::GradFrom = $from;)?
            #[inline(always)]
            #[allow(unused_variables)]
            fn f($x: f32, $s: [f32; 2]) -> f32 {
                $f
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn df($x: f32, $s: [f32; 2]) -> f32 {
                $df
            }
            $(
            const NEAR: f32 = $near;
            #[inline(always)]
            #[allow(unused_variables)]
            fn f_near($x: f32, $s: [f32; 2]) -> f32 {
                $f_near
            }
            #[inline(always)]
            #[allow(unused_variables)]
            fn df_near($x: f32, $s: [f32; 2]) -> f32 {
                $df_near
            }
            )?
        }
    };
}

/// The descriptors.
pub mod desc {
    use super::super::flag;
    use super::super::math::{
        exp, gelu, gelu_grad, gelu_grad2, gelu_grad_near, gelu_near, gelu_tanh, gelu_tanh_grad,
        gelu_tanh_grad2, gelu_tanh_grad_near, gelu_tanh_near, sigmoid, GELU_NEAR,
    };
    use super::GradFrom::{Nothing, Output};
    use super::{UnaryOp, UnaryOpT};

    #[inline(always)]
    fn sign(x: f32) -> f32 {
        if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            x // keeps 0, -0 and NaN
        }
    }

    unary_op!(Neg, "neg", |x, _| -x, "-a", d: -1.0, "-1.0", from: Nothing);
    unary_op!(Exp, "exp", |x, _| exp(x), "exp(a)", d: exp(x), "exp(a)",
        from: Output(UnaryOp::ExpGradOfOutput));
    unary_op!(Log, "log", |x, _| x.ln(), "log(a)", d: 1.0 / x, "1.0 / a");
    unary_op!(Sqrt, "sqrt", |x, _| x.sqrt(), "sqrt(a)", d: 0.5 / x.sqrt(), "0.5 / sqrt(a)",
        from: Output(UnaryOp::SqrtGradOfOutput));
    unary_op!(Rsqrt, "rsqrt", |x, _| 1.0 / x.sqrt(), "inverseSqrt(a)",
        d: -0.5 / (x * x.sqrt()), "-0.5 / (a * sqrt(a))",
        from: Output(UnaryOp::RsqrtGradOfOutput));
    unary_op!(Abs, "abs", |x, _| x.abs(), "abs(a)", d: sign(x), "sign(a)");
    unary_op!(
        /// -1, 0 or 1 (0, -0 and NaN stay as they are).
        Sign, "sign", |x, _| sign(x), "sign(a)", d: 0.0, "0.0", from: Nothing);
    unary_op!(Tanh, "tanh", |x, _| x.tanh(), "tanh_c(a)",
        d: { let t = x.tanh(); 1.0 - t * t }, "1.0 - tanh_c(a) * tanh_c(a)",
        from: Output(UnaryOp::TanhGradOfOutput));
    unary_op!(Sigmoid, "sigmoid", |x, _| sigmoid(x), "sigmoid(a)",
        d: { let s = sigmoid(x); s * (1.0 - s) }, "sigmoid(a) * (1.0 - sigmoid(a))",
        from: Output(UnaryOp::SigmoidGradOfOutput));
    unary_op!(Relu, "relu", |x, _| if x < 0.0 { 0.0 } else { x }, "max(a, 0.0)",
        d: flag(x > 0.0), "flag(a > 0.0)");
    unary_op!(
        /// GELU, exact: x Phi(x) with Phi the standard normal CDF (PyTorch's `gelu`).
        Gelu, "gelu", |x, _| gelu(x), "gelu(a)", d: gelu_grad(x), "gelu_grad(a)",
        near: GELU_NEAR => gelu_near(x), gelu_grad_near(x));
    unary_op!(
        /// d/dx of the exact GELU (for its backward).
        GeluGrad, "gelu_grad", |x, _| gelu_grad(x), "gelu_grad(a)",
        d: gelu_grad2(x), "gelu_grad2(a)", near: GELU_NEAR => gelu_grad_near(x), gelu_grad2(x));
    unary_op!(
        /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        /// (PyTorch's `gelu(approximate='tanh')`).
        GeluTanh, "gelu_tanh", |x, _| gelu_tanh(x), "gelu_tanh(a)",
        d: gelu_tanh_grad(x), "gelu_tanh_grad(a)",
        near: GELU_NEAR => gelu_tanh_near(x), gelu_tanh_grad_near(x));
    unary_op!(
        /// d/dx of the tanh-form GELU (for its backward).
        GeluTanhGrad, "gelu_tanh_grad", |x, _| gelu_tanh_grad(x), "gelu_tanh_grad(a)",
        d: gelu_tanh_grad2(x), "gelu_tanh_grad2(a)",
        near: GELU_NEAR => gelu_tanh_grad_near(x), gelu_tanh_grad2(x));
    unary_op!(Sin, "sin", |x, _| x.sin(), "sin(a)", d: x.cos(), "cos(a)");
    unary_op!(Cos, "cos", |x, _| x.cos(), "cos(a)", d: -x.sin(), "-sin(a)");
    unary_op!(Square, "square", |x, _| x * x, "a * a", d: 2.0 * x, "2.0 * a");
    unary_op!(Recip, "recip", |x, _| 1.0 / x, "1.0 / a", d: -1.0 / (x * x), "-1.0 / (a * a)",
        from: Output(UnaryOp::RecipGradOfOutput));
    unary_op!(
        /// SiLU (swish): `x * sigmoid(x)`.
        Silu, "silu", |x, _| x * sigmoid(x), "a * sigmoid(a)",
        d: { let s = sigmoid(x); s * (1.0 + x * (1.0 - s)) },
        "sigmoid(a) * (1.0 + a * (1.0 - sigmoid(a)))");
    unary_op!(
        /// `x * mul + add`.
        Affine, "affine", |x, [mul, add]| x * mul + add, "a * s0 + s1", d: mul, "s0",
        from: Nothing);
    unary_op!(
        /// `x ^ p`.
        Powf, "powf", |x, [p, _]| x.powf(p), "spow(a, s0)",
        d: p * x.powf(p - 1.0), "s0 * spow(a, s0 - 1.0)");
    unary_op!(
        /// `s / x`.
        RDiv, "rdiv_scalar", |x, [s, _]| s / x, "s0 / a", d: -s / (x * x), "-s0 / (a * a)");
    unary_op!(
        /// `s - x`.
        RSub, "rsub_scalar", |x, [s, _]| s - x, "s0 - a", d: -1.0, "-1.0", from: Nothing);
    unary_op!(MaxScalar, "maximum_scalar", |x, [s, _]| x.max(s), "max(a, s0)",
        d: flag(x > s), "flag(a > s0)");
    unary_op!(MinScalar, "minimum_scalar", |x, [s, _]| x.min(s), "min(a, s0)",
        d: flag(x < s), "flag(a < s0)");
    unary_op!(
        /// 1.0 where `x > s`, else 0.0.
        GtScalar, "gt_scalar", |x, [s, _]| flag(x > s), "flag(a > s0)", d: 0.0, "0.0",
        from: Nothing);
    unary_op!(
        /// 1.0 where `x == s`, else 0.0.
        EqScalar, "eq_scalar", |x, [s, _]| flag(x == s), "flag(a == s0)", d: 0.0, "0.0",
        from: Nothing);

    // The backwards of the ops whose derivative is computed from their output `y`: in each,
    // `d` is that derivative written in `y` (checked against the op's own `d` in the tests),
    // and `f` is an antiderivative of it, so that the descriptor is a function with its
    // derivative like any other and every test of descriptors covers it.
    unary_op!(
        /// d/dx exp(x) from `y = exp(x)`: `y`.
        ExpGradOfOutput, "exp_grad_of_output", |y, _| 0.5 * y * y, "0.5 * a * a", d: y, "a");
    unary_op!(
        /// d/dx sqrt(x) from `y = sqrt(x)`: `0.5 / y`.
        SqrtGradOfOutput, "sqrt_grad_of_output", |y, _| 0.5 * y.ln(), "0.5 * log(a)",
        d: 0.5 / y, "0.5 / a");
    unary_op!(
        /// d/dx x^-1/2 from `y = x^-1/2`: `-y^3 / 2`.
        RsqrtGradOfOutput, "rsqrt_grad_of_output", |y, _| -0.125 * (y * y) * (y * y),
        "-0.125 * (a * a) * (a * a)", d: -0.5 * (y * y * y), "-0.5 * (a * a * a)");
    unary_op!(
        /// d/dx tanh(x) from `y = tanh(x)`: `1 - y^2`.
        TanhGradOfOutput, "tanh_grad_of_output", |y, _| y - y * y * y / 3.0,
        "a - a * a * a / 3.0", d: 1.0 - y * y, "1.0 - a * a");
    unary_op!(
        /// d/dx sigmoid(x) from `y = sigmoid(x)`: `y (1 - y)`.
        SigmoidGradOfOutput, "sigmoid_grad_of_output", |y, _| y * y * (0.5 - y / 3.0),
        "a * a * (0.5 - a / 3.0)", d: y * (1.0 - y), "a * (1.0 - a)");
    unary_op!(
        /// d/dx (1/x) from `y = 1/x`: `-y^2`.
        RecipGradOfOutput, "recip_grad_of_output", |y, _| -(y * y * y) / 3.0,
        "-(a * a * a) / 3.0", d: -(y * y), "-(a * a)");
}

/// Defines [`UnaryOp`] with one variant per descriptor (plain ops, then ops with one scalar,
/// then `Affine`), its `ALL` and its `visit`.
macro_rules! unary_ops {
    (plain: $($op:ident),* ; scalar: $($sop:ident),* $(;)?) => {
        /// Elementwise unary ops; each variant is described by the descriptor of the same name
        /// in `desc` (e.g. `desc::Gelu`). The scalar-carrying variants implement `x op s`
        /// without a second tensor: `Affine { mul, add }` is `x * mul + add`, `Powf(p)` is
        /// `x ^ p`, `RDiv(s)` is `s / x`, `RSub(s)` is `s - x`, `GtScalar(s)` / `EqScalar(s)`
        /// give 1.0 where `x > s` / `x == s`. Equality and hashing compare the op and the bits
        /// of its scalars.
        #[derive(Debug, Clone, Copy)]
        pub enum UnaryOp {
            $($op,)*
            $($sop(f32),)*
            Affine { mul: f32, add: f32 },
        }

        impl UnaryOp {
            /// Every op, scalars zero: one per compiled kernel.
            pub const ALL: [UnaryOp; [$(stringify!($op)),*, $(stringify!($sop)),*, "Affine"].len()] =
                [$(UnaryOp::$op,)* $(UnaryOp::$sop(0.0),)* UnaryOp::Affine { mul: 0.0, add: 0.0 }];

            /// Calls `v.visit::<Descriptor>(scalars)` for this op.
            pub fn visit<V: UnaryVisitor>(self, v: V) -> V::Out {
                match self {
                    $(UnaryOp::$op => v.visit::<desc::$op>([0.0; 2]),)*
                    $(UnaryOp::$sop(s) => v.visit::<desc::$sop>([s, 0.0]),)*
                    UnaryOp::Affine { mul, add } => v.visit::<desc::Affine>([mul, add]),
                }
            }
        }
    };
}

unary_ops! {
    plain: Neg, Exp, Log, Sqrt, Rsqrt, Abs, Sign, Tanh, Sigmoid, Relu, Gelu, GeluGrad, GeluTanh,
        GeluTanhGrad, Sin, Cos, Square, Recip, Silu, ExpGradOfOutput, SqrtGradOfOutput,
        RsqrtGradOfOutput, TanhGradOfOutput, SigmoidGradOfOutput, RecipGradOfOutput;
    scalar: Powf, RDiv, RSub, MaxScalar, MinScalar, GtScalar, EqScalar;
}

impl UnaryOp {
    /// The scalars the kernels receive as `s0`, `s1`.
    pub fn scalars(self) -> [f32; 2] {
        struct V;
        impl UnaryVisitor for V {
            type Out = [f32; 2];
            fn visit<T: UnaryOpT>(self, s: [f32; 2]) -> [f32; 2] {
                s
            }
        }
        self.visit(V)
    }

    /// The op with its scalars zeroed: the key of its compiled kernel (the scalars travel in
    /// the parameter block).
    pub fn kernel_key(self) -> UnaryOp {
        *UnaryOp::ALL
            .iter()
            .find(|k| k.name() == self.name())
            .expect("every op is in ALL")
    }

    /// What a backward computes `dy/dx` from (see [`GradFrom`]).
    pub fn grad_from(self) -> GradFrom {
        struct V;
        impl UnaryVisitor for V {
            type Out = GradFrom;
            fn visit<T: UnaryOpT>(self, _: [f32; 2]) -> GradFrom {
                T::GRAD_FROM
            }
        }
        self.visit(V)
    }

    /// `(name, WGSL, WGSL derivative)`.
    fn strings(self) -> (&'static str, &'static str, &'static str) {
        struct V;
        impl UnaryVisitor for V {
            type Out = (&'static str, &'static str, &'static str);
            fn visit<T: UnaryOpT>(self, _: [f32; 2]) -> Self::Out {
                (T::NAME, T::WGSL, T::WGSL_GRAD)
            }
        }
        self.visit(V)
    }

    pub fn name(self) -> &'static str {
        self.strings().0
    }

    /// `y` as a WGSL expression over `a`, `s0`, `s1`.
    pub fn wgsl(self) -> &'static str {
        self.strings().1
    }

    /// `dy/dx` as a WGSL expression over `a`, `s0`, `s1`.
    pub fn wgsl_grad(self) -> &'static str {
        self.strings().2
    }

    /// `y = f(x)` on the CPU (one call; the CPU backend monomorphises through [`Self::visit`]).
    pub fn eval(self, x: f32) -> f32 {
        self.at(x, false)
    }

    /// `dy/dx` on the CPU.
    pub fn grad(self, x: f32) -> f32 {
        self.at(x, true)
    }

    /// `f(x)`, or `f'(x)` when `derivative`.
    fn at(self, x: f32, derivative: bool) -> f32 {
        struct V(f32, bool);
        impl UnaryVisitor for V {
            type Out = f32;
            fn visit<T: UnaryOpT>(self, s: [f32; 2]) -> f32 {
                if self.1 {
                    T::df(self.0, s)
                } else {
                    T::f(self.0, s)
                }
            }
        }
        self.visit(V(x, derivative))
    }

    fn key(self) -> (&'static str, [u32; 2]) {
        (self.name(), self.scalars().map(f32::to_bits))
    }
}

impl PartialEq for UnaryOp {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for UnaryOp {}

impl Hash for UnaryOp {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_keys_drop_scalars() {
        let mut names: Vec<&str> = UnaryOp::ALL.iter().map(|o| o.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), UnaryOp::ALL.len());
        assert_eq!(UnaryOp::Powf(3.0).kernel_key(), UnaryOp::Powf(0.0));
        assert_ne!(UnaryOp::Powf(3.0), UnaryOp::Powf(2.0));
    }

    /// Every op, the scalar-carrying ones with scalars that are not zero.
    fn ops_with_scalars() -> [UnaryOp; UnaryOp::ALL.len()] {
        UnaryOp::ALL.map(|o| match o {
            UnaryOp::Affine { .. } => UnaryOp::Affine {
                mul: 1.5,
                add: -0.5,
            },
            UnaryOp::Powf(_) => UnaryOp::Powf(2.5),
            UnaryOp::RDiv(_) => UnaryOp::RDiv(2.0),
            UnaryOp::RSub(_) => UnaryOp::RSub(1.0),
            UnaryOp::MaxScalar(_) => UnaryOp::MaxScalar(0.05),
            UnaryOp::MinScalar(_) => UnaryOp::MinScalar(0.05),
            UnaryOp::GtScalar(_) => UnaryOp::GtScalar(0.05),
            UnaryOp::EqScalar(_) => UnaryOp::EqScalar(0.05),
            o => o,
        })
    }

    /// Each CPU derivative matches a central difference of the CPU function (away from kinks).
    #[test]
    fn derivatives_match_finite_differences() {
        for op in ops_with_scalars() {
            for x in [0.3f64, 0.7, 1.3, 2.1] {
                let h = 1e-3;
                let f = |v: f64| op.eval(v as f32) as f64;
                let num = (f(x + h) - f(x - h)) / (2.0 * h);
                let got = op.grad(x as f32) as f64;
                assert!(
                    (num - got).abs() < 2e-2 * (1.0 + num.abs()),
                    "{op:?} at {x}: numeric {num}, descriptor {got}"
                );
            }
        }
    }

    /// What a backward computes the derivative from gives the op's own derivative: a
    /// derivative in the output agrees with `df(x)`, a constant one is the same everywhere.
    #[test]
    fn derivatives_from_the_output_or_from_nothing_agree_with_df() {
        for op in ops_with_scalars() {
            for x in [-1.7f32, -0.4, 0.3, 0.7, 1.3, 2.1] {
                let want = op.grad(x);
                let got = match op.grad_from() {
                    GradFrom::Input => continue,
                    GradFrom::Output(d) => {
                        assert_eq!(d.grad_from(), GradFrom::Input, "{op:?}: {d:?}");
                        d.grad(op.eval(x))
                    }
                    GradFrom::Nothing => op.grad(x * 3.0 + 1.0),
                };
                let close = (want.is_nan() && got.is_nan())
                    || (want - got).abs() <= 1e-5 * (1.0 + want.abs());
                assert!(
                    close,
                    "{op:?} at {x}: df(x) = {want}, from {:?}: {got}",
                    op.grad_from()
                );
            }
        }
    }
}
