//! The memory behind tensors: host vectors or wgpu buffers, each holding its accounting token.

use std::sync::Mutex;

use crate::dtype::DType;
use crate::error::Result;
use crate::memory::{current_tag, Allocation, MemoryTracker, Tag};

/// Backend data. Immutable while shared: ops make new storage, so views can share it freely;
/// only the one holder of a storage may write into it (see `Tensor::exclusive_storage`).
pub(crate) enum StorageData {
    Cpu(Vec<f32>),
    /// f16 or bf16 values as their bit patterns (the storage's dtype says which).
    CpuHalf(Vec<u16>),
    /// f32 values, or for a half dtype 16-bit patterns packed two per 32-bit word (element `2w`
    /// in the low half of word `w`): WGSL has no bf16 and its f16 needs `SHADER_F16`, so the
    /// shaders unpack both themselves.
    Wgpu(crate::gpu_pool::GpuBuffer),
}

pub(crate) struct Storage {
    pub(crate) data: StorageData,
    dtype: DType,
    allocation: Mutex<Allocation>,
}

impl Storage {
    /// Wraps backend data with the accounting token taken for it. Kernels call
    /// [`Storage::reserve`] before they allocate, so a capped device refuses before any memory
    /// is touched.
    pub(crate) fn new(data: StorageData, allocation: Allocation) -> Self {
        Self::with_dtype(data, DType::F32, allocation)
    }

    /// [`Storage::new`] for elements of `dtype`.
    pub(crate) fn with_dtype(data: StorageData, dtype: DType, allocation: Allocation) -> Self {
        Storage {
            data,
            dtype,
            allocation: Mutex::new(allocation),
        }
    }

    /// Charges `elements` values of `dtype` to `memory` under the thread's current tag.
    pub(crate) fn reserve_dtype(
        memory: &MemoryTracker,
        elements: usize,
        dtype: DType,
    ) -> Result<Allocation> {
        let bytes = elements * dtype.size_of();
        memory.alloc_as(bytes, current_tag(), dtype)
    }

    /// A host storage of half `dtype` holding the bit patterns `bits`.
    pub(crate) fn cpu_half(bits: Vec<u16>, dtype: DType, allocation: Allocation) -> Self {
        debug_assert!(dtype.is_half() && bits.len() * 2 == allocation.bytes());
        Self::with_dtype(StorageData::CpuHalf(bits), dtype, allocation)
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Charges `elements` f32 values to `memory` under the thread's current tag.
    pub(crate) fn reserve(memory: &MemoryTracker, elements: usize) -> Result<Allocation> {
        memory.alloc(elements * std::mem::size_of::<f32>())
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

    /// The host values, for writing (the caller holds this storage exclusively).
    pub(crate) fn as_cpu_mut(&mut self) -> Option<&mut [f32]> {
        match &mut self.data {
            StorageData::Cpu(v) => Some(v),
            _ => None,
        }
    }

    /// Number of elements (of its dtype) the storage holds.
    pub(crate) fn elements(&self) -> usize {
        self.bytes() / self.dtype.size_of()
    }

    pub(crate) fn as_cpu_half(&self) -> Option<&[u16]> {
        match &self.data {
            StorageData::CpuHalf(v) => Some(v),
            _ => None,
        }
    }
}

impl Drop for Storage {
    /// Host buffers go back to the CPU backend's pool for the next op of their length.
    fn drop(&mut self) {
        if let StorageData::Cpu(v) = &mut self.data {
            crate::host_pool::give(std::mem::take(v));
        }
    }
}
