//! Elementwise binary ops on two operands of one shape; comparisons give 1.0 / 0.0. Each op is
//! one descriptor (name, CPU function, WGSL expression over `a`, `b`); [`BinaryOp`] names them.

/// One binary op `y = f(a, b)`.
pub trait BinaryOpT: 'static {
    /// The user-facing name (method name, error messages).
    const NAME: &'static str;
    /// `y` as a WGSL expression over `a`, `b`.
    const WGSL: &'static str;
    fn f(a: f32, b: f32) -> f32;
}

/// Generic code over one op: [`BinaryOp::visit`] calls `visit::<Descriptor>()`.
pub trait BinaryVisitor {
    type Out;
    fn visit<T: BinaryOpT>(self) -> Self::Out;
}

macro_rules! binary_op {
    ($ty:ident, $name:literal, |$a:ident, $b:ident| $f:expr, $wgsl:literal) => {
        #[derive(Debug, Clone, Copy)]
        pub struct $ty;
        impl BinaryOpT for $ty {
            const NAME: &'static str = $name;
            const WGSL: &'static str = $wgsl;
            #[inline(always)]
            fn f($a: f32, $b: f32) -> f32 {
                $f
            }
        }
    };
}

/// The descriptors.
pub mod desc {
    use super::super::flag;
    use super::BinaryOpT;

    binary_op!(Add, "add", |a, b| a + b, "a + b");
    binary_op!(Sub, "sub", |a, b| a - b, "a - b");
    binary_op!(Mul, "mul", |a, b| a * b, "a * b");
    binary_op!(Div, "div", |a, b| a / b, "a / b");
    binary_op!(Maximum, "maximum", |a, b| a.max(b), "max(a, b)");
    binary_op!(Minimum, "minimum", |a, b| a.min(b), "min(a, b)");
    binary_op!(Pow, "pow", |a, b| a.powf(b), "spow(a, b)");
    binary_op!(Eq, "eq", |a, b| flag(a == b), "flag(a == b)");
    binary_op!(Ne, "ne", |a, b| flag(a != b), "flag(a != b)");
    binary_op!(Lt, "lt", |a, b| flag(a < b), "flag(a < b)");
    binary_op!(Le, "le", |a, b| flag(a <= b), "flag(a <= b)");
    binary_op!(Gt, "gt", |a, b| flag(a > b), "flag(a > b)");
    binary_op!(Ge, "ge", |a, b| flag(a >= b), "flag(a >= b)");
}

/// Defines [`BinaryOp`] with one variant per descriptor, its `ALL` and its `visit`.
macro_rules! binary_ops {
    ($($op:ident),* $(,)?) => {
        /// Elementwise binary ops on two operands of the same (broadcast) shape.
        /// Comparisons give 1.0 for true and 0.0 for false. Each variant is described by the
        /// descriptor of the same name in `desc`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum BinaryOp {
            $($op,)*
        }

        impl BinaryOp {
            pub const ALL: [BinaryOp; [$(stringify!($op)),*].len()] = [$(BinaryOp::$op),*];

            /// Calls `v.visit::<Descriptor>()` for this op.
            pub fn visit<V: BinaryVisitor>(self, v: V) -> V::Out {
                match self {
                    $(BinaryOp::$op => v.visit::<desc::$op>(),)*
                }
            }
        }
    };
}

binary_ops! { Add, Sub, Mul, Div, Maximum, Minimum, Pow, Eq, Ne, Lt, Le, Gt, Ge }

impl BinaryOp {
    fn strings(self) -> (&'static str, &'static str) {
        struct V;
        impl BinaryVisitor for V {
            type Out = (&'static str, &'static str);
            fn visit<T: BinaryOpT>(self) -> Self::Out {
                (T::NAME, T::WGSL)
            }
        }
        self.visit(V)
    }

    /// The user-facing name, for error messages.
    pub fn name(self) -> &'static str {
        self.strings().0
    }

    /// `y` as a WGSL expression over `a`, `b`.
    pub fn wgsl(self) -> &'static str {
        self.strings().1
    }

    /// `y = f(a, b)` on the CPU (one call; the CPU backend monomorphises through [`Self::visit`]).
    pub fn eval(self, a: f32, b: f32) -> f32 {
        struct V(f32, f32);
        impl BinaryVisitor for V {
            type Out = f32;
            fn visit<T: BinaryOpT>(self) -> f32 {
                T::f(self.0, self.1)
            }
        }
        self.visit(V(a, b))
    }
}
