//! The identity of every elementwise and reduction op, shared by the tensor front-ends, both
//! backends and the WGSL generators: one enum per family, one descriptor per op.
//!
//! A descriptor ([`UnaryOpT`], [`BinaryOpT`]) is a zero-sized type that carries everything about
//! one op: its name, its CPU function (the reference the WGSL is tested against and what the CPU
//! backend runs, monomorphised per op), its WGSL expression and, for unary ops, its derivative in
//! both forms. The public enums ([`UnaryOp`], [`BinaryOp`], [`ReduceOp`]) name the ops and
//! dispatch to the descriptors with a visitor ([`UnaryVisitor`], [`BinaryVisitor`]), so a backend
//! writes one generic loop instead of one match arm per op.
//!
//! Adding a unary op = its descriptor (one `unary_op!` line) and its name in the `unary_ops!`
//! list, both in `unary.rs`; the tensor method and the autograd method are one line each, and
//! autograd's backward is the descriptor's derivative (`Var::unary`), written nowhere else.

mod binary;
pub mod math;
mod reduce;
mod unary;

pub use binary::{BinaryOp, BinaryOpT, BinaryVisitor};
pub use reduce::ReduceOp;
pub use unary::{GradFrom, UnaryOp, UnaryOpT, UnaryVisitor};

/// Descriptor types, one per op (e.g. `desc::Silu`), for generic code that names an op directly.
pub mod desc {
    pub use super::binary::desc::*;
    pub use super::unary::desc::*;
}

/// `1.0` for true, `0.0` for false (the comparisons' values).
#[inline(always)]
pub fn flag(b: bool) -> f32 {
    if b {
        1.0
    } else {
        0.0
    }
}
