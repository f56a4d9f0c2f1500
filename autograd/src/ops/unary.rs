//! Unary ops. Every one records through [`Var::unary`], whose backward is `g * op'(..)` from the
//! op's descriptor (`UnaryOpT::df` on the CPU, `UnaryOpT::WGSL_GRAD` on wgpu, one fused kernel):
//! a derivative is written once, in `wgpipe_shaders::ops::unary`, and autograd has none of its
//! own. A new unary op needs its descriptor and, for a named method, one line below.

use wgpipe_shaders::GradFrom;
use wgpipe_tensor::{Result, Tensor, UnaryOp};

use crate::var::Var;

impl Var {
    /// Any unary op, scalar-carrying ones included; its gradient is the descriptor's.
    pub fn unary(&self, op: UnaryOp) -> Result<Var> {
        let y = self.value.unary(op)?;
        // Keep only what the descriptor's derivative reads (see `GradFrom`): the input, the
        // output (with the descriptor whose derivative is this op's written in the output),
        // or nothing for a constant derivative, which `g * df(g)` then evaluates.
        let saved: Option<(Tensor, UnaryOp)> = match op.grad_from() {
            GradFrom::Input => Some((self.value.clone(), op)),
            GradFrom::Output(d) => Some((y.clone(), d)),
            GradFrom::Nothing => None,
        };
        Var::from_op(op.name(), &[self], y, move |g, _| {
            let dx = match &saved {
                Some((t, d)) => t.unary_grad(*d, g)?,
                None => g.unary_grad(op, g)?,
            };
            Ok(vec![Some(dx)])
        })
    }

    /// `self ^ p`.
    pub fn powf(&self, p: f32) -> Result<Var> {
        self.unary(UnaryOp::Powf(p))
    }
}

/// Generates one named method per parameterless op, `name => Variant`, each [`Var::unary`] of
/// that op, and the list of them (`NAMED`) the tests walk.
macro_rules! named_unary {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Var {
            $($(#[$doc])* pub fn $name(&self) -> Result<Var> {
                self.unary(UnaryOp::$op)
            })*
        }

        /// Every named method with its op.
        #[cfg(test)]
        pub(crate) const NAMED: &[(&str, fn(&Var) -> Result<Var>, UnaryOp)] =
            &[$((stringify!($name), Var::$name, UnaryOp::$op)),*];
    };
}

named_unary! {
    neg => Neg;
    exp => Exp;
    log => Log;
    sqrt => Sqrt;
    rsqrt => Rsqrt;
    abs => Abs;
    tanh => Tanh;
    sigmoid => Sigmoid;
    relu => Relu;
    /// GELU, exact: `x Phi(x)` (PyTorch's `gelu`).
    gelu => Gelu;
    /// GELU, tanh approximation (PyTorch's `gelu(approximate='tanh')`).
    gelu_tanh => GeluTanh;
    sin => Sin;
    cos => Cos;
    square => Square;
    recip => Recip;
    /// SiLU (swish), `x * sigmoid(x)`.
    silu => Silu;
}

#[cfg(test)]
mod tests {
    use wgpipe_shaders::GradFrom;
    use wgpipe_tensor::{Device, Tensor};

    use super::NAMED;
    use crate::tape::Tape;

    /// Each named method is named after its op, computes the op and back-propagates the op's
    /// descriptor derivative: on the CPU the gradient of `sum(f(x))` is the descriptor's
    /// derivative, from the input or the output as the descriptor says, bit for bit.
    #[test]
    fn named_methods_take_their_derivative_from_the_descriptor() {
        let xs: Vec<f32> = (0..12).map(|i| 0.25 + 0.3 * i as f32).collect();
        let x = Tensor::from_vec(xs.clone(), &[3, 4], &Device::cpu()).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        for &(name, method, op) in NAMED {
            assert_eq!(name, op.name(), "the method is named after its op");
            let tape = Tape::new();
            let v = tape.leaf(x.clone());
            let y = method(&v).unwrap();
            let grads = tape.backward(&y.sum(&[], false).unwrap()).unwrap();
            let want_y: Vec<f32> = xs.iter().map(|&x| op.eval(x)).collect();
            let want_g: Vec<f32> = xs
                .iter()
                .map(|&x| match op.grad_from() {
                    GradFrom::Input => op.grad(x),
                    GradFrom::Output(d) => d.grad(op.eval(x)),
                    GradFrom::Nothing => op.grad(1.0),
                })
                .collect();
            assert_eq!(
                bits(y.value().to_vec().unwrap()),
                bits(want_y),
                "{name}: value"
            );
            let g = grads.get(&v).unwrap().to_vec().unwrap();
            assert_eq!(bits(g), bits(want_g), "{name}: gradient");
        }
    }
}
