//! wgpipe: GPipe in Rust. This facade re-exports the workspace crates.
pub use wgpipe_autograd as autograd;
pub use wgpipe_models as models;
pub use wgpipe_pipeline as pipeline;
pub use wgpipe_shaders as shaders;
pub use wgpipe_tensor as tensor;
