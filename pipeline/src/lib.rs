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
//! ```

mod absent;
pub mod builder;
#[cfg(feature = "mpi")]
pub(crate) mod distributed;
pub mod error;
pub mod microbatch;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod partition;
pub mod persist;
pub mod pipeline;
pub mod plan;
pub mod replicas;
pub mod report;
pub mod scaler;
pub mod schedule;
pub mod sim;
pub mod skips;
pub mod threads;
mod tied;
pub mod timeline;
pub mod trace;
pub mod transport;
pub mod wire;
pub mod worker;

pub use builder::{Balance, PipelineBuilder, ScheduleKind, ScheduleSpec};
pub use error::{NonFinite, PipelineError, Result, StageCause};
pub use persist::{LoadOptions, PersistError, Restored, SaveOptions};
pub use pipeline::Pipeline;
pub use plan::{PlanInputs, PlanOptions, PlanReport};
pub use report::{SimReport, StageReport, StepReport};
pub use scaler::{LossScaling, ScalerState};
pub use schedule::{
    Action, ActionKind, CheckpointMode, Link, Schedule, ScheduleError, SkipLink, SkipPort,
};
pub use sim::SimCluster;
pub use skips::{SkipRoute, StageSkips};
pub use timeline::{Collective, DeviceSpec, LinkSpec, Timeline};
pub use transport::Transport;
pub use worker::{LossFn, NonFiniteAt, Stage};
