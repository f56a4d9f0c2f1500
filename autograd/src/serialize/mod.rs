//! Save and load tensors, parameters and whole training checkpoints in the
//! [safetensors](https://github.com/huggingface/safetensors) format, with hierarchical names
//! (`blocks.3.attn.q.weight`), so weights move to and from PyTorch and Hugging Face tools.
//!
//! - Saving is atomic: the file is written to a temporary file of a unique name in the same
//!   folder (`.<name>.<pid>-<n>.wgpipe-tmp`, created exclusively), synced to disk, then renamed
//!   over `path`. A crash leaves the old file or the new one, never half of one; concurrent
//!   saves to one path each publish a whole file; temporaries left by a process that died are
//!   removed by the next save to that path.
//! - Tensors are saved as little-endian F32. Loading accepts F32, F16 and BF16 (widened to f32).
//! - Loading into a model ([`load_into`]) checks every name, shape and dtype first and reports
//!   every mismatch at once; on error no parameter has changed.
//! - A training state ([`save_training_state`]; "checkpoint" in the API means re-materialization
//!   only) holds parameters and buffers under their names, the
//!   optimizer's state under `optim.`, and the step in the metadata (`wgpipe.step`), so that
//!   save → load → continue trains bit-identically to an uninterrupted run.
//!
//! Every error is a [`wgpipe_tensor::Error::Invalid`] whose message names the file and the
//! problem (I/O errors and the safetensors parser's errors included).

mod load_into;
mod read;
mod temporary;
mod training_state;
mod write;

use std::path::Path;

use wgpipe_tensor::Error;

pub use load_into::{load_into, LoadReport};
pub use read::{load_file, load_metadata, load_tensors, Loaded, TensorFile};
pub use temporary::write_atomically;
pub use training_state::{load_training_state, save_training_state, TrainingStateInfo};
pub use write::{save_tensors, save_tensors_checked};

/// Prefix of optimizer-state tensors in a checkpoint.
pub const OPTIM_PREFIX: &str = "optim.";
/// Metadata key of the step in a checkpoint.
pub const STEP_KEY: &str = "wgpipe.step";
/// Metadata key marking a checkpoint, with its format version.
pub const FORMAT_KEY: &str = "wgpipe.format";
const FORMAT_VALUE: &str = "checkpoint/1";
/// Per-parameter optimizer slots that are counters, not parameter-shaped.
const COUNTER_SLOTS: [&str; 1] = ["step"];

fn err(op: &'static str, path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op,
        msg: format!("{}: {msg}", path.display()),
    }
}
