//! wgpipe: GPipe in Rust. This facade re-exports the workspace crates. The code of the examples
//! (flags, checkpoint files, the training loop, progress) lives in the `wgpipe-apps` crate
//! (folder `apps/`), which the facade does not depend on.
//!
//! The README follows (its Rust block is compiled as a doc test, so it stays true).
#![doc = include_str!("../README.md")]
pub use wgpipe_autograd as autograd;
pub use wgpipe_models as models;
pub use wgpipe_pipeline as pipeline;
pub use wgpipe_shaders as shaders;
pub use wgpipe_tensor as tensor;
