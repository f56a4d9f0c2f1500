//! `RawTensor`: what the kernels read and make, a storage seen through a layout (shape,
//! strides, offset), with the memory tracker of the device it belongs to, which the outputs
//! made from it are charged to. The public [`crate::Tensor`] is one of these with its device;
//! the backends (`cpu`, `wgpu`) see only this, never a `Device` or a `Tensor`, so the crate's
//! modules import one way: storage and layout, then the kernels, then the device, then the
//! tensor and its ops.

use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::memory::MemoryTracker;
use crate::storage::Storage;

#[derive(Clone)]
pub(crate) struct RawTensor {
    storage: Arc<Storage>,
    layout: Layout,
    memory: MemoryTracker,
}

impl RawTensor {
    /// A contiguous view of `shape` over freshly made `storage`, charged to `memory`.
    pub(crate) fn new(storage: Storage, shape: &[usize], memory: &MemoryTracker) -> RawTensor {
        RawTensor {
            storage: Arc::new(storage),
            layout: Layout::contiguous(shape),
            memory: memory.clone(),
        }
    }

    /// `storage` seen through `layout`, belonging to the device whose tracker is `memory`.
    pub(crate) fn from_parts(
        storage: Arc<Storage>,
        layout: Layout,
        memory: &MemoryTracker,
    ) -> RawTensor {
        RawTensor {
            storage,
            layout,
            memory: memory.clone(),
        }
    }

    /// A view of the same storage with another layout.
    pub(crate) fn with_layout(&self, layout: Layout) -> RawTensor {
        RawTensor {
            storage: self.storage.clone(),
            layout,
            memory: self.memory.clone(),
        }
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }
    pub(crate) fn shared_storage(&self) -> &Arc<Storage> {
        &self.storage
    }
    /// The tracker of the device this view belongs to: what a kernel charges its outputs to.
    pub(crate) fn memory(&self) -> &MemoryTracker {
        &self.memory
    }
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }
    pub(crate) fn shape(&self) -> &[usize] {
        &self.layout.shape
    }
    pub(crate) fn rank(&self) -> usize {
        self.layout.rank()
    }
    pub(crate) fn numel(&self) -> usize {
        self.layout.numel()
    }
    pub(crate) fn strides(&self) -> &[usize] {
        &self.layout.strides
    }
    pub(crate) fn dtype(&self) -> DType {
        self.storage.dtype()
    }
    pub(crate) fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// Axis `axis` narrowed to `start .. start + len` (a view).
    pub(crate) fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<RawTensor> {
        Ok(self.with_layout(self.layout.narrow("narrow", axis, start, len)?))
    }

    /// The same elements in `shape`, as a view (an error where the strides allow none: the
    /// kernels reshape only outputs they made contiguous).
    pub(crate) fn reshape(&self, shape: &[usize]) -> Result<RawTensor> {
        match self.layout.reshape(shape) {
            Some(l) => Ok(self.with_layout(l)),
            None => Err(Error::invalid(
                "reshape",
                format!(
                    "a kernel's view of shape {:?} cannot be seen as {shape:?}",
                    self.shape()
                ),
            )),
        }
    }

    /// The axes in the order `perm` (a view), for the kernels' tests' strided operands.
    #[cfg(test)]
    pub(crate) fn permute(&self, perm: &[usize]) -> Result<RawTensor> {
        Ok(self.with_layout(self.layout.permute("permute", perm)?))
    }

    /// The last two axes swapped (a view), for the kernels' tests.
    #[cfg(test)]
    pub(crate) fn t(&self) -> Result<RawTensor> {
        let r = self.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.permute(&perm)
    }

    /// Broadcast to `shape` (a view with zero strides).
    pub(crate) fn broadcast_to(&self, shape: &[usize]) -> Result<RawTensor> {
        Ok(self.with_layout(self.layout.broadcast_to("broadcast_to", shape)?))
    }

    /// The storage for writing, when this handle is its only holder and views every element
    /// of it densely from the start (see `Tensor::is_exclusive`).
    pub(crate) fn exclusive_storage(&mut self) -> Option<&mut Storage> {
        if self.layout.offset != 0 || !self.layout.is_contiguous() {
            return None;
        }
        let n = self.layout.numel();
        let storage = Arc::get_mut(&mut self.storage)?;
        (storage.elements() == n).then_some(storage)
    }
}

/// Shape, dtype and device, as a tensor's `Debug` says them (what a failed test prints).
impl std::fmt::Debug for RawTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RawTensor({:?}, {}, on {})",
            self.shape(),
            self.dtype(),
            self.memory
        )
    }
}
