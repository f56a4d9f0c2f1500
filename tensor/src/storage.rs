//! The memory behind tensors: host vectors or wgpu buffers, each holding its accounting token.

use std::sync::Mutex;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{Allocation, Tag};

/// Backend data. Immutable once built: ops make new storage, so views can share it freely.
pub(crate) enum StorageData {
    Cpu(Vec<f32>),
    Wgpu(crate::wgpu::GpuBuffer),
}

pub(crate) struct Storage {
    pub(crate) data: StorageData,
    allocation: Mutex<Allocation>,
}

impl Storage {
    /// Wraps backend data with the accounting token taken for it. Kernels call
    /// [`Storage::reserve`] before they allocate, so a capped device refuses before any memory
    /// is touched.
    pub(crate) fn new(data: StorageData, allocation: Allocation) -> Self {
        Storage {
            data,
            allocation: Mutex::new(allocation),
        }
    }

    /// Charges `elements` f32 values to `dev` under the thread's current tag.
    pub(crate) fn reserve(dev: &Device, elements: usize) -> Result<Allocation> {
        dev.memory().alloc(elements * std::mem::size_of::<f32>())
    }

    /// A host storage of `data`, with its token taken by `reserve` beforehand.
    pub(crate) fn cpu(data: Vec<f32>, allocation: Allocation) -> Self {
        debug_assert_eq!(data.len() * 4, allocation.bytes());
        Self::new(StorageData::Cpu(data), allocation)
    }

    pub(crate) fn retag(&self, tag: Tag) {
        self.allocation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retag(tag);
    }

    pub(crate) fn bytes(&self) -> usize {
        self.allocation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .bytes()
    }

    pub(crate) fn as_cpu(&self) -> Option<&[f32]> {
        match &self.data {
            StorageData::Cpu(v) => Some(v),
            _ => None,
        }
    }
}

impl Drop for Storage {
    /// Host buffers go back to the CPU backend's pool for the next op of their length.
    fn drop(&mut self) {
        if let StorageData::Cpu(v) = &mut self.data {
            crate::cpu::host_pool::give(std::mem::take(v));
        }
    }
}
