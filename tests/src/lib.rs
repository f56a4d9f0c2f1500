//! Shared support for the cross-crate integration tests: small models, a plain (non-pipelined)
//! reference trainer, pipelined training on a simulated cluster, comparisons, and test layers
//! (fault injection, an equal-cost linear layer).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpipe_autograd::optim::{zero_grad, Optimizer, Sgd, SgdConfig};
use wgpipe_autograd::{sum_tied_grads, CostHint, ForwardCtx, Module, Param, Tape, Var};
use wgpipe_models::{
    finish_step_all, forward_all, sequence_parameters, Gelu, LayerNorm, Linear, Relu, TransformerLm,
};
use wgpipe_pipeline::{
    Balance, CheckpointMode, LinkSpec, LossFn, LossScaling, Pipeline, ScheduleKind, SimCluster,
    SkipRoute, StepReport, Transport,
};
use wgpipe_tensor::{DType, Device, Error, Result, Tensor};

pub use wgpipe_models::{cross_entropy, mse};

/// The RNG seed every pipelined and plain run uses (dropout keys).
pub const SEED: u64 = 7;
/// Learning rate and momentum of the SGD every test trains with.
pub const LR: f32 = 0.05;
pub const MOMENTUM: f32 = 0.9;

pub const ALL_MODES: [CheckpointMode; 3] = [
    CheckpointMode::Always,
    CheckpointMode::ExceptLast,
    CheckpointMode::Never,
];
/// Every schedule of the registry (the eight generators and the synthesized one).
pub const ALL_SCHEDULES: [ScheduleKind; 9] = ScheduleKind::ALL;
/// The single-chunk schedules without split backward (tests about their specific memory shape).
pub const CLASSIC_SCHEDULES: [ScheduleKind; 2] = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];

/// Whether `schedule` can run K devices and M micro-batches over `layers` layers: each of its
/// K x chunks stages needs a layer, and DualPipeV needs M >= 2K (the builder says so otherwise).
pub fn runs(schedule: ScheduleKind, k: usize, m: usize, layers: usize) -> bool {
    k * schedule.default_chunks() <= layers && (schedule != ScheduleKind::DualPipeV || m >= 2 * k)
}

/// SGD with momentum (so per-stage optimizer state matters too).
pub fn sgd() -> Box<dyn Optimizer> {
    Box::new(Sgd::with_config(SgdConfig {
        lr: LR,
        momentum: MOMENTUM,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    }))
}

mod layers;
mod models;
mod mpi;
mod runs;
mod skips;

pub use layers::*;
pub use models::*;
pub use mpi::*;
pub use runs::*;
pub use skips::*;
