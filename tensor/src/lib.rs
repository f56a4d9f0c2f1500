//! wgpipe-tensor: f32, f16 and bf16 tensors on the CPU and on wgpu devices (WGSL kernels), strided views,
//! every op training needs, and per-device memory accounting.
//!
//! Ops live in `ops/` as front-ends that validate and lower to the [`backend`] kernels, which the
//! CPU (`cpu/`) and wgpu (`wgpu/`) backends implement side by side.

pub mod backend;
mod cpu;
pub mod device;
pub mod dtype;
mod dtype_policy;
pub mod error;
mod gpu_pool;
mod host_pool;
pub mod layout;
pub mod memory;
pub mod ops;
mod raw;
pub mod rng;
mod storage;
pub mod tensor;
mod wgpu;
mod work;

pub use backend::{BinaryOp, ReduceOp, UnaryOp};
pub use cpu::matmul::timing::{take_cpu_matmul_times, time_cpu_matmuls, MatmulTime, OperandLayout};
pub use cpu::par::{
    cpu_threads, on_cpu_pool, on_spare_cpu_thread, set_cpu_threads, share_cpu_threads,
};
pub use device::{AdapterInfo, Device, DEVICE_ENV, TEST_WGPU_ENV};
pub use dtype::DType;
pub use error::{Error, Result};
pub use host_pool::{clear_host_pool, pooled_host_bytes, HOST_POOL_ENV};
pub use layout::{Dims, Layout};
pub use memory::{MemoryStats, MemoryTracker, Tag, TagGuard};
pub use tensor::Tensor;
pub use wgpipe_shaders::BIAS_ACTIVATIONS;
pub use wgpu::{AUTOTUNE_CACHE_ENV, AUTOTUNE_ENV};
pub use work::{thread_flops, thread_net_bytes};
