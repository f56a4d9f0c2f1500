//! The host buffers the CPU kernels read and write: an output charged to its device before any
//! memory is touched, an input's values in row-major order, a tensor's values for writing in
//! place.

use std::borrow::Cow;

use super::elementwise;
use crate::error::{Error, Result};
use crate::host_pool;
use crate::memory::Allocation;
use crate::memory::MemoryTracker;
use crate::raw::RawTensor;
use crate::storage::Storage;

/// A fresh output buffer whose bytes are already charged to its device.
pub(super) struct Out {
    pub(super) data: Vec<f32>,
    pub(super) alloc: Allocation,
}

impl Out {
    /// Reserves `n` values on `mem` (failing with `OutOfMemory` before any memory is touched),
    /// then takes them zeroed, for kernels that add into their output or leave parts of it.
    pub(super) fn zeros(mem: &MemoryTracker, n: usize) -> Result<Out> {
        let alloc = Storage::reserve(mem, n)?;
        Ok(Out {
            data: host_pool::take_zeroed(n),
            alloc,
        })
    }

    /// [`Out::zeros`] without the zeroing, for kernels that write every value.
    pub(super) fn for_overwrite(mem: &MemoryTracker, n: usize) -> Result<Out> {
        let alloc = Storage::reserve(mem, n)?;
        Ok(Out {
            data: host_pool::take_for_overwrite(n),
            alloc,
        })
    }

    pub(super) fn into_raw(self, shape: &[usize], mem: &MemoryTracker) -> RawTensor {
        RawTensor::new(Storage::cpu(self.data, self.alloc), shape, mem)
    }
}

/// The host values of `t` for writing in place: the front-ends call in-place kernels only on
/// exclusive tensors, so the error is a broken contract, reported rather than written through.
pub(super) fn exclusive_host<'a>(op: &'static str, t: &'a mut RawTensor) -> Result<&'a mut [f32]> {
    let shape = t.shape().to_vec();
    t.exclusive_storage()
        .and_then(Storage::as_cpu_mut)
        .ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "the tensor of shape {shape:?} to update in place is shared, a view or not f32 on the host"
                ),
            )
        })
}

/// The whole host storage behind `x`.
pub(super) fn data(x: &RawTensor) -> &[f32] {
    x.storage()
        .as_cpu()
        .expect("CPU kernel called with a tensor whose storage is not on the host")
}

/// The elements of a tensor the contract says is contiguous, in row-major order (a view that is
/// not contiguous after all is copied rather than misread).
pub(super) fn contig(x: &RawTensor) -> Cow<'_, [f32]> {
    let l = x.layout();
    let d = data(x);
    if l.is_contiguous() {
        Cow::Borrowed(&d[l.offset..l.offset + l.numel()])
    } else {
        let mut v = vec![0.0; l.numel()];
        elementwise::copy(&mut v, d, l);
        Cow::Owned(v)
    }
}
