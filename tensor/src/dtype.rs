//! Element types of tensors: f32, and the two 16-bit floats kept for storage and transfer
//! (f16 and bf16). Half tensors hold their values as 16-bit patterns; kernels compute in f32
//! (see `half_compute`), so a half dtype halves memory and bytes moved, not arithmetic accuracy
//! inside one op.

use half::{bf16, f16};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    #[default]
    F32,
    /// IEEE binary16: 10-bit mantissa, largest finite value 65504.
    F16,
    /// bfloat16: f32's exponent range with a 7-bit mantissa.
    BF16,
}

impl DType {
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// f16 or bf16.
    pub fn is_half(self) -> bool {
        self != DType::F32
    }

    /// `v` rounded to this dtype (nearest even) and widened back: what storing it keeps.
    pub fn round(self, v: f32) -> f32 {
        match self {
            DType::F32 => v,
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::BF16 => bf16::from_f32(v).to_f32(),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::DType;

    #[test]
    fn rounding_matches_hand_computed_values() {
        // 1 + 2^-11 is halfway between two f16 values: ties to even (1.0).
        assert_eq!(DType::F16.round(1.0 + 2f32.powi(-11)), 1.0);
        assert_eq!(DType::F16.round(70000.0), f32::INFINITY);
        assert_eq!(DType::BF16.round(70000.0), 70144.0);
        assert_eq!(DType::BF16.round(-2.5), -2.5);
        assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
        assert!("f8".parse::<DType>().is_err());
    }
}
