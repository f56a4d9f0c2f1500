//! How half tensors (f16, bf16) meet the kernels. The backends' kernels compute in f32 (the
//! native half matmul aside), so every op front-end reaches them through
//! [`Device::run`] (or [`Device::run_all`]) with the op's [`DTypePolicy`], declared once, where
//! the op is:
//!
//! - [`DTypePolicy::F32Only`]: the op has no half path (index lists, optimizer steps), and a
//!   half operand is an `UnsupportedDType` error naming op, dtype and backend.
//! - [`DTypePolicy::WidenThenRound`]: the operands must share one dtype (a `DTypeMismatch`
//!   naming the op and both dtypes otherwise); half ones are widened to f32, the f32 kernel
//!   runs, and its outputs are rounded back, so every half op accumulates in f32. Outputs that
//!   must stay f32 whatever the operands' dtype (indices, saved statistics) are returned as
//!   [`StaysF32`].
//!
//! A kernel that only some backends have for one precision (a fused f32 step, the native half
//! matmul) is asked for with [`Device::run_if`], `None` sending the front-end to its general
//! path. The in-place kernels are f32 only and called directly: their front-ends send any other
//! dtype to the out-of-place op. Kernels without tensor operands (fill, dropout masks) and the
//! casts themselves need no policy.
//!
//! The op front-ends thus say which policy an op follows and nothing else about dtypes, and a
//! new kernel is written in the `Kernels` trait and the two backends, not a fourth time in a
//! wrapper that repeats every method (as the dtype guard this module replaces did).

use crate::backend::Kernels;
use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::raw::RawTensor;
use crate::tensor::Tensor;

/// How an op's kernel meets half operands (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DTypePolicy {
    /// Every operand must be f32.
    F32Only,
    /// Operands of one dtype; half ones computed in f32 and the outputs rounded back.
    WidenThenRound,
}

/// A kernel output that stays f32 under [`DTypePolicy::WidenThenRound`]: indices (f16 holds
/// integers exactly only up to 2048) and the row statistics a backward recomputes from.
pub(crate) struct StaysF32<T>(pub(crate) T);

/// What a kernel returns, as [`DTypePolicy::WidenThenRound`] rounds it back to half `dtype`
/// (each tensor rounded, in order, except those wrapped in [`StaysF32`]), and as the front-end
/// gets it: each [`RawTensor`] a [`Tensor`] on the device that ran the kernel.
pub(crate) trait KernelOutputs: Sized {
    type Tensors;
    fn round_to(self, dtype: DType, k: &dyn Kernels) -> Result<Self>;
    fn on(self, device: &Device) -> Self::Tensors;
}

impl KernelOutputs for RawTensor {
    type Tensors = Tensor;
    fn round_to(self, dtype: DType, k: &dyn Kernels) -> Result<Self> {
        k.narrow(&self, dtype)
    }
    fn on(self, device: &Device) -> Tensor {
        Tensor::from_raw(self, device)
    }
}

impl KernelOutputs for StaysF32<RawTensor> {
    type Tensors = StaysF32<Tensor>;
    fn round_to(self, _: DType, _: &dyn Kernels) -> Result<Self> {
        Ok(self)
    }
    fn on(self, device: &Device) -> StaysF32<Tensor> {
        StaysF32(Tensor::from_raw(self.0, device))
    }
}

impl<const N: usize> KernelOutputs for [RawTensor; N] {
    type Tensors = [Tensor; N];
    fn round_to(self, dtype: DType, k: &dyn Kernels) -> Result<Self> {
        let rounded = self
            .into_iter()
            .map(|x| k.narrow(&x, dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(rounded
            .try_into()
            .unwrap_or_else(|_| unreachable!("N tensors round to N")))
    }
    fn on(self, device: &Device) -> [Tensor; N] {
        self.map(|x| Tensor::from_raw(x, device))
    }
}

/// Tuples of outputs round element by element, first to last.
macro_rules! tuple_outputs {
    ($($t:ident),+) => {
        impl<$($t: KernelOutputs),+> KernelOutputs for ($($t,)+) {
            type Tensors = ($($t::Tensors,)+);
            #[allow(non_snake_case)]
            fn round_to(self, dtype: DType, k: &dyn Kernels) -> Result<Self> {
                let ($($t,)+) = self;
                Ok(($($t.round_to(dtype, k)?,)+))
            }
            #[allow(non_snake_case)]
            fn on(self, device: &Device) -> Self::Tensors {
                let ($($t,)+) = self;
                ($($t.on(device),)+)
            }
        }
    };
}
tuple_outputs!(A, B);
tuple_outputs!(A, B, C);
tuple_outputs!(A, B, C, D);

/// The dtype all of `operands` share (f32 for none), or a mismatch error naming `op`.
fn common_dtype(op: &'static str, operands: &[&Tensor]) -> Result<DType> {
    let first = operands.first().map_or(DType::F32, |x| x.dtype());
    match operands.iter().find(|x| x.dtype() != first) {
        Some(x) => Err(Error::DTypeMismatch {
            op,
            a: first,
            b: x.dtype(),
        }),
        None => Ok(first),
    }
}

impl Device {
    /// Runs `kernel` on this device's backend under `policy` (see the module doc): on
    /// `operands` themselves when they are f32, else as the policy says; its outputs are
    /// tensors on this device.
    pub(crate) fn run<const N: usize, O: KernelOutputs>(
        &self,
        op: &'static str,
        policy: DTypePolicy,
        operands: [&Tensor; N],
        kernel: impl FnOnce(&dyn Kernels, [&RawTensor; N]) -> Result<O>,
    ) -> Result<O::Tensors> {
        self.run_all(op, policy, &operands, |k, xs| {
            let xs: [&RawTensor; N] = xs.try_into().expect("as many operands as were given");
            kernel(k, xs)
        })
    }

    /// [`Device::run`] over a list of operands of any length (concatenation, optional inputs).
    pub(crate) fn run_all<O: KernelOutputs>(
        &self,
        op: &'static str,
        policy: DTypePolicy,
        operands: &[&Tensor],
        kernel: impl FnOnce(&dyn Kernels, &[&RawTensor]) -> Result<O>,
    ) -> Result<O::Tensors> {
        let k = self.kernels();
        let dtype = match policy {
            DTypePolicy::F32Only => {
                self.require_f32(op, operands)?;
                DType::F32
            }
            DTypePolicy::WidenThenRound => common_dtype(op, operands)?,
        };
        if !dtype.is_half() {
            let raws: Vec<&RawTensor> = operands.iter().map(|x| x.raw()).collect();
            return Ok(kernel(k, &raws)?.on(self));
        }
        let wide = operands
            .iter()
            .map(|x| k.widen(x.raw()))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&RawTensor> = wide.iter().collect();
        let outs = kernel(k, &refs)?;
        // The widened copies go before the outputs are rounded: a lower peak of memory.
        drop(refs);
        drop(wide);
        Ok(outs.round_to(dtype, k)?.on(self))
    }

    /// Runs a kernel that some backends have for operands of one `precision` only (a fused f32
    /// step, a native half product): `None` when the operands (which must share one dtype) are
    /// of the other precision or the backend has no such kernel, for the front-end to take its
    /// general path.
    pub(crate) fn run_if<const N: usize, O: KernelOutputs>(
        &self,
        op: &'static str,
        precision: Precision,
        operands: [&Tensor; N],
        kernel: impl FnOnce(&dyn Kernels, [&RawTensor; N]) -> Option<Result<O>>,
    ) -> Option<Result<O::Tensors>> {
        let dtype = match common_dtype(op, &operands) {
            Ok(d) => d,
            Err(e) => return Some(Err(e)),
        };
        let wanted = match precision {
            Precision::F32 => !dtype.is_half(),
            Precision::Half => dtype.is_half(),
        };
        if wanted {
            kernel(self.kernels(), operands.map(|x| x.raw())).map(|r| r.map(|o| o.on(self)))
        } else {
            None
        }
    }

    /// Fails unless every one of `tensors` is f32 ([`DTypePolicy::F32Only`]'s check, also for
    /// operands that stay f32 under another policy: indices, saved statistics).
    pub(crate) fn require_f32(&self, op: &'static str, tensors: &[&Tensor]) -> Result<()> {
        match tensors.iter().find(|x| x.dtype().is_half()) {
            Some(x) => Err(Error::UnsupportedDType {
                op,
                dtype: x.dtype(),
                backend: self.backend_name(),
            }),
            None => Ok(()),
        }
    }
}

/// Which operands a kernel of [`Device::run_if`] exists for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Precision {
    F32,
    Half,
}
