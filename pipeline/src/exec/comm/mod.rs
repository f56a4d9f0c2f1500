//! What the replicas and processes of a step agree on, behind one trait: the step's outcome
//! (failures, the overflow verdict, the loss), the gradient reduction across replicas, tied
//! gradients across processes, the parts of a clipped norm, an optimizer step's outcome and a
//! failure's broadcast. `LocalComm` is the communicator of one process (its replicas are all
//! here); the MPI one (feature `mpi`) is the communicator of a job of ranks. The training code
//! calls the trait and takes one path through the step whichever it is.

mod local;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(feature = "mpi")]
mod mpi_buckets;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_tied;
#[cfg(feature = "mpi")]
mod record;

use std::sync::Arc;
use std::time::Instant;

use wgpipe_autograd::optim::Optimizer;
use wgpipe_tensor::memory::MemoryStats;
use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result};
use crate::exec::transport::Transport;
use crate::exec::worker::{NonFiniteAt, StageOutcome};
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;
use crate::sim::timeline::Collective;

pub(crate) use local::LocalComm;

/// How one replica held by this process ran its part of a step.
pub(crate) struct ReplicaRun<'a> {
    /// Its devices' outcomes, or the root cause of its failure.
    pub outcome: Result<Vec<StageOutcome>>,
    /// The scaled loss of each micro-batch it ran (on its last stage).
    pub losses: Vec<Tensor>,
    /// Its share of the mini-batch's samples.
    pub weight: f32,
    /// Its stages (for the memory counters of the devices this process runs, which only
    /// other processes need).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub stages: &'a [Stage],
}

/// What every replica and process agreed on after a step that went well everywhere.
pub(crate) struct Agreed {
    /// Each held replica's devices' outcomes.
    pub outcomes: Vec<Vec<StageOutcome>>,
    /// The loss over the whole mini-batch.
    pub loss: f32,
    /// Each device's memory counters when other processes read them (the held replica's).
    pub memory: Option<Vec<MemoryStats>>,
    /// Under a skip policy: the earliest micro-batch (then stage) where any replica of the
    /// job met NaN or infinity, so that every replica skips alike.
    pub skipped: Option<NonFiniteAt>,
}

/// Told on a device's thread when a stage's weight gradients are final in the step (its last
/// backward or weight action ran), so that their reduction across replicas starts while the
/// rest of the backward runs.
pub(crate) trait GradsFinal: Send + Sync {
    fn stage_final(&self, stage: &Stage);
}

/// Everything a step agrees on across the replicas and processes that run it.
pub(crate) trait StepComm: Send + Sync {
    /// This process's rank in the job (0 in one process).
    fn rank(&self) -> usize;

    /// For a K-device pipeline of which this process holds `held` replicas: R, the replicas of
    /// the whole job, and the index of the first one held here.
    fn replicas(&self, k: usize, held: usize) -> (usize, usize);

    /// At build: whether the job fits a K-device pipeline.
    fn check(&self, k: usize) -> Result<()>;

    /// At build: every process has the same `settings` (name, value), else the same error on
    /// every one, naming the settings that differ and the values of each process.
    fn agree_settings(&self, settings: &[(String, String)]) -> Result<()>;

    /// At build, once the settings agree: whatever the step's collectives need for a K-device
    /// pipeline (nothing in one process).
    fn connect(&self, _k: usize) -> Result<()> {
        Ok(())
    }

    /// Before round `round` runs: the hook its devices call as stages' gradients become final
    /// (`stages`: the held replica's; `weights`: every replica's share), or `None` when the
    /// reduction waits for the end of the step (one process, or one replica).
    fn begin_round(
        &self,
        _round: u64,
        _schedule: &Schedule,
        _stages: &[Stage],
        _weights: &[f32],
        _clock: Instant,
    ) -> Option<Arc<dyn GradsFinal>> {
        None
    }

    /// A step that failed here before its outcome could be agreed (an action past its time
    /// limit): the others are told, and stop.
    fn fail_round(&self, round: u64, error: &PipelineError);

    /// After the held replicas' devices finished round `round`: the same result everywhere,
    /// the agreed outcome or the error of the failing replica or rank.
    fn agree(&self, round: u64, schedule: &Schedule, runs: Vec<ReplicaRun<'_>>) -> Result<Agreed>;

    /// The tied groups of `stages` (one held replica's) with copies in other processes:
    /// their gradients summed in stage order; one entry per exchange, for the report.
    fn exchange_tied(
        &self,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        clock: Instant,
    ) -> Result<Vec<TiedExchange>>;

    /// Every parameter's gradient becomes Σ_r weight_r x gradient_r over the job's replicas,
    /// summed in replica order, the same bits on every replica. `held`: the stages of each
    /// replica held here; `weights`: every replica's share of the samples. The buckets reduced
    /// with other processes, as they ran on the step's clock (none in one process: the
    /// pipeline times its own reduction).
    fn reduce_gradients(
        &self,
        round: u64,
        schedule: &Schedule,
        held: &[&[Stage]],
        weights: &[f32],
    ) -> Result<Vec<Collective>>;

    /// Each stage's squared gradient norm as the process that trains it computed it, from
    /// `mine` (this process's value for every stage).
    fn stage_parts(&self, round: u64, schedule: &Schedule, mine: Vec<f64>) -> Result<Vec<f64>>;

    /// After a part of a step each process does on its own (the optimizer step): all go on, or
    /// all return the failing one's error.
    fn agree_ok(&self, round: u64, k: usize, local: Result<()>) -> Result<()>;

    /// After a forward-only round that every process of this process's replica agreed on:
    /// what the last stage kept (`kept`, given by the process that holds the last stage,
    /// `None` elsewhere) on every process of the replica, on the CPU. In one process it is
    /// `kept` itself. `round` must be a fresh round (not the forward round's).
    fn share_output(&self, round: u64, schedule: &Schedule, kept: Option<Tensor>)
        -> Result<Tensor>;

    /// Every process gets every stage's parameters, buffers and optimizer state from the one
    /// that trains it (nothing to do in one process).
    fn gather_stages(
        &self,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        optimizers: &mut [Box<dyn Optimizer>],
    ) -> Result<()>;
}

/// The step communicator of `transport`.
pub(crate) fn for_transport(transport: &Transport) -> Box<dyn StepComm> {
    match transport {
        #[cfg(feature = "mpi")]
        Transport::Mpi(comm) => Box::new(mpi::MpiStepComm::new(comm.clone())),
        _ => Box::new(LocalComm),
    }
}

/// `sum += w x values`, starting from `w x values` when `sum` is `None`: the one weighted sum
/// of the gradient reduction, whichever replicas and processes take part, so that its bits do
/// not depend on where the replicas run.
pub(crate) fn add_weighted(sum: &mut Option<Vec<f32>>, values: &[f32], w: f32) {
    match sum {
        None => *sum = Some(values.iter().map(|v| v * w).collect()),
        Some(acc) => {
            for (a, v) in acc.iter_mut().zip(values) {
                *a += v * w;
            }
        }
    }
}

/// The earliest place (micro-batch, then stage) among `outcomes` where non-finite values
/// appeared.
pub(crate) fn earliest_non_finite<'a>(
    outcomes: impl IntoIterator<Item = &'a StageOutcome>,
) -> Option<NonFiniteAt> {
    outcomes
        .into_iter()
        .filter_map(|o| o.non_finite.clone())
        .min_by_key(|at| (at.micro_batch, at.stage))
}

/// `e` as the error of replica `i` of the `r` held in one process (unchanged for one).
pub(crate) fn at_replica(e: PipelineError, i: usize, r: usize) -> PipelineError {
    if r > 1 {
        e.at(&format!(", replica {i} of {r}"))
    } else {
        e
    }
}
