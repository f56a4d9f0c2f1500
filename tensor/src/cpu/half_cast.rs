//! f32 <-> f16/bf16 conversion of host slices (the `half` crate's vectorised loops), split over
//! threads for large tensors.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::par::for_rows;
use crate::dtype::DType;

/// `out[i] = bits[i]` read as `dtype` (exact).
pub(super) fn widen(out: &mut [f32], bits: &[u16], dtype: DType) {
    for_rows(out, 1, |s, o| {
        let src = &bits[s..s + o.len()];
        match dtype {
            DType::F16 => bytemuck::cast_slice::<u16, f16>(src).convert_to_f32_slice(o),
            DType::BF16 => bytemuck::cast_slice::<u16, bf16>(src).convert_to_f32_slice(o),
            DType::F32 => unreachable!("widen of an f32 tensor"),
        }
    });
}

/// `out[i] = x[i]` rounded to `dtype` (nearest even), as bits.
pub(super) fn narrow(out: &mut [u16], x: &[f32], dtype: DType) {
    for_rows(out, 1, |s, o| {
        let src = &x[s..s + o.len()];
        match dtype {
            DType::F16 => bytemuck::cast_slice_mut::<u16, f16>(o).convert_from_f32_slice(src),
            DType::BF16 => bytemuck::cast_slice_mut::<u16, bf16>(o).convert_from_f32_slice(src),
            DType::F32 => unreachable!("narrow to f32"),
        }
    });
}
