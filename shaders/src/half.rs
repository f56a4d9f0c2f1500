//! The 16-bit float formats of the cast kernels and of half-precision matmul operands, and the
//! names `half.wgsl`'s conversion functions give them. A module of its own because both the
//! kernel list (`kernel.rs`) and the matmul family (`matmul.rs`) name them.

/// The 16-bit float formats the cast kernels convert (stored two per u32 word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HalfFormat {
    F16,
    Bf16,
}

impl HalfFormat {
    pub const ALL: [HalfFormat; 2] = [HalfFormat::F16, HalfFormat::Bf16];

    /// The name `half.wgsl`'s conversion functions use.
    pub(crate) fn wgsl(self) -> &'static str {
        match self {
            HalfFormat::F16 => "f16",
            HalfFormat::Bf16 => "bf16",
        }
    }
}
