//! The wgpu backend: every kernel of [`crate::backend::Kernels`] as a WGSL compute shader from
//! `wgpipe-shaders`, on any Vulkan, Metal or DX12 adapter (lavapipe included).
//!
//! - `discovery`: the adapters of this machine, in a stable order.
//! - `context`: `WgpuContext::open` (the adapter's real limits; `SHADER_F16` where present),
//!   the error sink (wgpu errors become `Error::Wgpu`, never a panic).
//! - (`crate::gpu_pool`: the size-bucketed buffer pool; a `GpuBuffer` goes back to it on drop.)
//! - `pipelines`: one compiled pipeline per kernel variant, cached.
//! - `runtime`: batching of dispatches into one encoder, parameter blocks, submit, read-back.
//! - `kernels`: `impl Kernels for WgpuContext`.
//! - `matmul`: the matmul variants (tiled for GPUs, packed + subgroup for CPU adapters).
//! - `autotune`: the variant of each hot kernel (matmul, half matmul, row kernels) per shape
//!   class, timed on first use, saved per adapter.
//!
//! Lavapipe (llvmpipe) ends any invocation after 65535 loop iterations in all, so kernels whose
//! loops grow with the data (long rows, long k, long index lists) are split over several
//! workgroups or dispatches; and on CPU adapters the row kernels use one subgroup per row
//! (barriers there are coroutine switches).

mod autotune;
mod context;
mod discovery;
mod kernels;
mod matmul;
mod pipelines;
mod runtime;
#[cfg(test)]
mod tests;

pub use autotune::{AUTOTUNE_CACHE_ENV, AUTOTUNE_ENV};
pub(crate) use context::WgpuContext;
pub use discovery::{list_adapters, AdapterInfo};
