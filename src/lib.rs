//! wgpipe: GPipe in Rust. This facade re-exports the workspace crates, and holds the code of
//! the examples ([`apps`]) with the flags and helpers they share ([`cli`]), so that tests can
//! run each example in-process through its `run` function.
//!
//! The README follows (its Rust block is compiled as a doc test, so it stays true).
#![doc = include_str!("../README.md")]
pub use wgpipe_autograd as autograd;
pub use wgpipe_models as models;
pub use wgpipe_pipeline as pipeline;
pub use wgpipe_shaders as shaders;
pub use wgpipe_tensor as tensor;

pub mod apps;
pub mod cli;
