//! wgpipe-shaders: what every op and kernel is, shared by both backends of the tensor crate.
//!
//! - [`ops`]: the identity of every elementwise and reduction op (one enum per family, one
//!   descriptor per op carrying its CPU function, WGSL expression and derivative).
//! - [`params`]: the parameter block of every kernel as a `#[repr(C)]` struct, mirrored by the
//!   WGSL struct of the same name.
//! - [`Kernel`]: one compute kernel variant; [`Kernel::source`] gives its WGSL.
//!
//! The WGSL lives in the `.wgsl` files next to this one, included verbatim; a few are templates
//! whose `{{NAME}}` placeholders are filled by the kernel families (`elementwise.rs`, `rows.rs`,
//! `matmul.rs`), each placeholder named and described at the top of its file. Every source gets
//! `common.wgsl` (helpers) prepended.
//!
//! `tests/validate.rs` parses and validates every variant ([`Kernel::all`]) with naga, so a typo
//! fails `cargo test` without a GPU; `tests/params.rs` checks the parameter blocks.

mod elementwise;
mod half;
mod kernel;
mod matmul;
pub mod ops;
pub mod params;
mod rows;
mod wgsl;

pub use elementwise::EwLayout;
pub use half::HalfFormat;
pub use kernel::{IndexKernel, Kernel, KernelSpec, SpatialKernel, BIAS_ACTIVATIONS};
pub use matmul::{MatmulConfig, OperandLoad, SubgroupMatmulConfig};
pub use ops::{BinaryOp, GradFrom, ReduceOp, UnaryOp};
pub use rows::{ReduceMode, RowGroup};

/// Invocations per workgroup of the one-invocation-per-element kernels.
pub const ELEMENTWISE_WG: u32 = 256;
/// Invocations per workgroup of the one-workgroup-per-row kernels (reduce, softmax, layer norm)
/// on GPUs. CPU-backed adapters take one subgroup per row instead (see `ROW_SUBGROUP_SIZES`).
pub const ROW_WG: u32 = 256;

/// The row-kernel workgroup sizes the runtime may ask for (powers of two): the autotune's
/// candidates.
pub const ROW_WG_CHOICES: [u32; 6] = [8, 16, 32, 64, 128, 256];

/// The subgroup sizes the row kernels have a one-subgroup variant for ([`RowGroup::subgroup`]).
pub const ROW_SUBGROUP_SIZES: [u32; 4] = [8, 16, 32, 64];

/// Fills the `{{KEY}}` placeholders of `template`; panics if one is left (a bug caught by the
/// validation test).
pub fn render(template: &str, vars: &[(&str, &str)]) -> String {
    let mut s = template.to_string();
    for (k, v) in vars {
        s = s.replace(&format!("{{{{{k}}}}}"), v);
    }
    if let Some(p) = s.find("{{") {
        let end = s[p..].find("}}").map(|e| p + e + 2).unwrap_or(s.len());
        panic!("unfilled shader placeholder {}", &s[p..end]);
    }
    s
}

/// How a binding is used: the parameter block and inputs are read-only, outputs read-write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_fills_and_complains() {
        assert_eq!(render("x{{A}}y", &[("A", "1")]), "x1y");
        let r = std::panic::catch_unwind(|| render("{{B}}", &[]));
        assert!(r.is_err());
    }

    #[test]
    fn bindings_are_distinct() {
        for k in Kernel::all() {
            let b = k.bindings();
            let mut ids: Vec<u32> = b.iter().map(|x| x.0).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), b.len(), "{k:?}");
        }
    }
}
