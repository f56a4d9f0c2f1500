//! wgpipe-pipeline: GPipe micro-batch pipelining across devices, re-materialization, schedules
//! as data, a simulated multi-accelerator cluster, and reports/traces of every step.
//!
//! ```ignore
//! let mut pipe = Pipeline::builder(layers)
//!     .devices(vec![dev0, dev1])
//!     .balance(Balance::Explicit(vec![3, 3]))
//!     .micro_batches(8)
//!     .checkpoint(CheckpointMode::ExceptLast)
//!     .optimizer(|| Box::new(Sgd::new(0.1)))
//!     .build()?;
//! let report = pipe.train_step(&x, &y, &loss_fn)?;
//! pipe.optimizer_step()?;
//! // Or a whole loop, back to back where it can run so (see `Pipeline::train_steps`):
//! let opts = StepsOptions { steps: 100, clip: Some(1.0), ..StepsOptions::default() };
//! pipe.train_steps(&opts, |i| batch(i), &loss_fn, |report| ControlFlow::Continue(()))?;
//! ```

//! The crate in layers, each folder importing only from those below it (a test in the
//! workspace's `tests/tests/pipeline/layering.rs` reads every `use crate::` and holds it):
//!
//! - [`schedule`]: the action IR, validation, text form, generators and their registry;
//! - [`sim`]: simulated time (timelines, the virtual cluster, collectives' cost, pictures);
//! - [`exec`]: stages, the worker, threads, transports and the step communicator;
//! - [`plan`]: the planner (profile, cost, search), on schedule and sim only;
//! - [`train`]: the public `Pipeline`, its builder, reports and checkpoints.
//!
//! Beside them, leaf modules every layer may use: [`error`], [`partition`], [`microbatch`],
//! [`skips`] and the [`LossFn`] type.

pub mod error;
pub mod exec;
mod fast_hash;
pub mod microbatch;
pub mod partition;
pub mod plan;
pub mod schedule;
pub mod sim;
pub mod skips;
pub mod train;

pub use error::{NonFinite, PipelineError, Result, StageCause};
#[cfg(feature = "mpi")]
pub use exec::transport::mpi::MpiComm;
pub use exec::transport::Transport;
pub use exec::{NonFiniteAt, Stage};
pub use plan::{PlanError, PlanInputs, PlanOptions, PlanReport};
pub use schedule::{
    Action, ActionKind, CheckpointMode, Link, Schedule, ScheduleError, ScheduleKind, SkipLink,
    SkipPort,
};
pub use sim::timeline::{Collective, DeviceSpec, LinkSpec, Timeline};
pub use sim::{SimCluster, Topology, TopologyError};
pub use skips::{SkipRoute, StageSkips};
pub use train::builder::{Balance, PipelineBuilder, ScheduleSpec};
pub use train::persist::{LoadOptions, OtherSetting, PersistError, Restored, SaveOptions};
pub use train::report::{SimReport, StageReport, StepReport};
pub use train::scaler::{LossScaling, ScalerState};
pub use train::shards::{checkpoint_metadata, consolidate, is_sharded, split, INDEX_FILE};
pub use train::steps::{StepPhase, StepSpan, StepsError, StepsOptions, StepsPath, StepsReport};
pub use train::Pipeline;

use wgpipe_autograd::Var;
use wgpipe_tensor::Tensor;

/// The loss of one micro-batch: `(output of the last stage, targets) -> scalar mean loss`.
pub type LossFn = dyn Fn(&Var, &Tensor) -> wgpipe_tensor::Result<Var> + Sync;

/// What a forward-only round ([`Pipeline::predict`]) keeps of the last stage's output of each
/// micro-batch (the logits of the last position, say), computed where the last stage is.
pub type HeadFn = dyn Fn(&Tensor) -> wgpipe_tensor::Result<Tensor> + Sync;
