//! wgpipe-autograd: a tape-based reverse mode over `wgpipe-tensor`, parameters and the `Module`
//! trait, re-materialization (`checkpoint`), optimizers, safetensors save/load, and a
//! finite-difference gradient checker (`gradcheck`).

pub mod checkpoint;
pub mod gradcheck;
pub mod module;
mod ops;
pub mod optim;
pub mod param;
pub mod serialize;
pub mod skips;
pub mod tape;
pub mod tied;
/// `Var`, the tape's handle to a recorded value (its module lives in [`tape`]).
pub use tape::var;

pub use checkpoint::{checkpoint, checkpoint_rerun_later, Rerun};
pub use module::{layer_param_name, measured_cost, CostHint, ForwardCtx, ModelFactory, Module};
pub use optim::{Adam, AdamW, LrSchedule, Optimizer, Sgd};
pub use param::Param;
pub use skips::{resolve_skips, SkipEdge, SkipError, SkipRouter, Skips};
pub use tape::{BackwardFn, Grads, MultiBackwardFn, Tape, WeightGrads};
pub use tied::{check_tied, sum_tied_grads, tied_groups};
pub use var::Var;
/// `#[derive(Module)]`: a layer's parameters declared once, as its fields (see the
/// `wgpipe-derive` crate for the field attributes).
pub use wgpipe_derive::Module;
pub use wgpipe_tensor as tensor;
