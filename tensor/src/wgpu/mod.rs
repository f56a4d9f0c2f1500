//! The wgpu backend: every kernel of [`crate::backend::Kernels`] as a WGSL compute shader from
//! `wgpipe-shaders`, on any Vulkan, Metal or DX12 adapter (lavapipe included).
//!
//! - `discovery`: the adapters of this machine, in a stable order.
//! - `context`: `WgpuContext::open` (the adapter's real limits; `SHADER_F16` where present),
//!   the error sink (wgpu errors become `Error::Wgpu`, never a panic).
//! - `pool`: size-bucketed buffer pool; `GpuBuffer` goes back to it on drop.
//! - `pipelines`: one compiled pipeline per kernel variant, cached.
//! - `runtime`: batching of dispatches into one encoder, parameter blocks, submit, read-back.
//! - `kernels`: `impl Kernels for WgpuContext`.

mod context;
mod discovery;
mod kernels;
mod pipelines;
mod pool;
mod runtime;
#[cfg(test)]
mod tests;

pub(crate) use context::WgpuContext;
pub use discovery::{list_adapters, AdapterInfo};
pub(crate) use pool::GpuBuffer;
