//! A step across processes (feature `mpi`): which share of the mini-batch a rank trains on,
//! how the ranks agree on the outcome of a step and of an optimizer step (every rank learns
//! every rank's result, so all return the same error naming the failing rank, or all go on),
//! tied gradients summed across the ranks holding copies, and the gradient all-reduce across
//! data-parallel replicas.
//!
//! Rank `r*K + d` runs device d of replica r. Every rank builds the whole model from the same
//! seed and keeps only its device's stages (see [`crate::exec::absent`]).
//!
//! Here: [`MpiStepComm`], the trait's calls over the ranks, and the exchange of records they
//! share; in `outcome.rs` the agreement on a step's outcome, in `status.rs` the record each
//! rank sends for it, in `exchanges.rs` the settings, stages, output and norms exchanged; the
//! gradient buckets and tied gradients are `mpi_buckets.rs` and `mpi_tied.rs` beside this
//! folder.

mod exchanges;
mod outcome;
mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result, StageCause};
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;
use crate::sim::timeline::Collective;

use super::mpi_buckets::{set_grads, Buckets};
use super::{Agreed, GradsFinal, ReplicaRun, StepComm};
use crate::exec::threads::lock;
use exchanges::{agree_settings, gather_stages, share_output, stage_parts};
use outcome::{agree, agree_ok, fail_round};

/// R, the replicas of a job of `comm.size()` ranks over K devices.
fn replicas(comm: &MpiComm, k: usize) -> usize {
    comm.size() / k
}

/// Checks that the job fits a K-device pipeline.
fn check(comm: &MpiComm, k: usize) -> Result<()> {
    if !comm.size().is_multiple_of(k) {
        return Err(PipelineError::Config(format!(
            "the MPI job has {} ranks, but a {k}-device pipeline needs K x R ranks (one per device of each replica); run mpirun -np {k} (or a multiple)",
            comm.size()
        )));
    }
    Ok(())
}

/// Sends the record `mine` as a message of `kind` for `round` to `peers` and returns theirs,
/// by rank (an error naming a rank that died or stopped, see [`MpiComm::peer_timeout`]).
fn exchange_bytes(
    comm: &MpiComm,
    round: u64,
    kind: MsgKind,
    mine: &[u8],
    peers: &[usize],
    device: usize,
) -> Result<HashMap<usize, Vec<u8>>> {
    let theirs = comm
        .exchange(
            round,
            kind,
            &wire::encode_bytes(kind, round, mine),
            peers,
            None,
        )
        .map_err(|why| rank_error(comm.rank(), device, why))?;
    Ok(theirs
        .into_iter()
        .map(|(r, frame)| (r, wire::payload_of_message(frame.bytes()).to_vec()))
        .collect())
}

/// A failure of the exchange itself (a peer that sent nothing).
pub(super) fn rank_error(rank: usize, device: usize, why: String) -> PipelineError {
    PipelineError::Stage {
        stage: device,
        device: format!("rank {rank}"),
        micro_batch: 0,
        action: "exchange with the other ranks".into(),
        cause: Box::new(StageCause::Disconnected(why)),
    }
}

/// The step communicator of a job of ranks (rank `r*K + d` runs device d of replica r; one
/// replica is held per process).
pub(crate) struct MpiStepComm {
    comm: MpiComm,
    /// The gradient buckets of the round in progress (with R > 1).
    buckets: Mutex<Option<Arc<Buckets>>>,
}

impl MpiStepComm {
    pub(crate) fn new(comm: MpiComm) -> MpiStepComm {
        MpiStepComm {
            comm,
            buckets: Mutex::new(None),
        }
    }

    /// The buckets of `round`, if it has them.
    fn buckets_of(&self, round: u64) -> Option<Arc<Buckets>> {
        lock(&self.buckets).clone().filter(|b| b.round == round)
    }
}

impl StepComm for MpiStepComm {
    fn connect(&self, k: usize) -> Result<()> {
        if replicas(&self.comm, k) < 2 {
            return Ok(());
        }
        self.comm
            .split_devices(k)
            .map_err(|why| rank_error(self.comm.rank(), self.comm.rank() % k, why))
    }

    fn begin_round(
        &self,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        weights: &[f32],
        clock: Instant,
    ) -> Option<Arc<dyn GradsFinal>> {
        if replicas(&self.comm, schedule.num_devices()) < 2 {
            return None;
        }
        let b = Arc::new(Buckets::new(
            &self.comm, round, schedule, stages, weights, clock,
        ));
        *lock(&self.buckets) = Some(b.clone());
        // Without the overlap the buckets start when the step's outcome is agreed.
        self.comm
            .overlap_reduction()
            .then_some(b as Arc<dyn GradsFinal>)
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn replicas(&self, k: usize, _held: usize) -> (usize, usize) {
        (replicas(&self.comm, k), self.comm.rank() / k)
    }

    fn check(&self, k: usize) -> Result<()> {
        check(&self.comm, k)
    }

    fn agree_settings(&self, settings: &[(String, String)]) -> Result<()> {
        agree_settings(&self.comm, settings)
    }

    fn fail_round(&self, round: u64, error: &PipelineError) {
        if let Some(b) = self.buckets_of(round) {
            b.start_rest(None);
        }
        fail_round(&self.comm, round, error)
    }

    fn agree(&self, round: u64, schedule: &Schedule, runs: Vec<ReplicaRun<'_>>) -> Result<Agreed> {
        let Some(run) = runs.into_iter().next() else {
            return Err(PipelineError::Config(
                "an MPI rank holds one replica, this one none".into(),
            ));
        };
        if let Some(b) = self.buckets_of(round) {
            b.start_rest(run.outcome.is_ok().then_some(run.stages));
        }
        let mine = schedule.stages_of(self.comm.rank() % schedule.num_devices())[0];
        let memory = run.stages[mine].device.memory_stats();
        agree(
            &self.comm,
            round,
            schedule,
            run.outcome,
            &run.losses,
            run.weight,
            memory,
        )
    }

    fn exchange_tied(
        &self,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        clock: Instant,
    ) -> Result<Vec<TiedExchange>> {
        super::mpi_tied::exchange_tied(&self.comm, round, schedule, stages, clock)
    }

    fn reduce_gradients(
        &self,
        round: u64,
        schedule: &Schedule,
        held: &[&[Stage]],
        weights: &[f32],
    ) -> Result<Vec<Collective>> {
        let k = schedule.num_devices();
        let device = self.comm.rank() % k;
        let r = replicas(&self.comm, k);
        let Some(buckets) = self.buckets_of(round) else {
            if r < 2 {
                return Ok(Vec::new());
            }
            return Err(rank_error(
                self.comm.rank(),
                device,
                format!("round {round} has no gradient buckets (weights {weights:?})"),
            ));
        };
        let mine: Vec<&Stage> = held
            .iter()
            .flat_map(|stages| stages.iter())
            .filter(|s| schedule.placement[s.index] == device)
            .collect();
        // The early buckets first (all started by now), then the late ones in stage order.
        let mut sums = Vec::with_capacity(mine.len());
        for s in &mine {
            sums.push(buckets.take(s.index)?);
        }
        for (s, sum) in mine.iter().zip(sums.iter_mut()) {
            if sum.is_none() {
                *sum = Some(buckets.start_late(s)?);
            }
        }
        let _waiting = self.comm.waiting();
        let mut reduced = Vec::with_capacity(mine.len());
        let mut spans = Vec::with_capacity(mine.len());
        for (s, sum) in mine.iter().zip(sums) {
            let (sum, start) = sum.expect("every bucket started");
            let (values, done) = sum
                .recv()
                .map_err(|_| "the MPI thread stopped during the reduction".to_string())
                .and_then(|r| r)
                .map_err(|why| {
                    rank_error(
                        self.comm.rank(),
                        device,
                        format!("reducing stage {}'s gradients: {why}", s.index),
                    )
                })?;
            spans.push(Collective {
                device,
                start,
                end: done.duration_since(buckets.clock).as_secs_f64(),
                bytes: 4 * values.len() as u64,
                replicas: r,
            });
            reduced.push(values);
        }
        *lock(&self.buckets) = None;
        for (s, sum) in mine.iter().zip(&reduced) {
            set_grads(s, sum)?;
        }
        Ok(spans)
    }

    fn stage_parts(&self, round: u64, schedule: &Schedule, mine: Vec<f64>) -> Result<Vec<f64>> {
        stage_parts(&self.comm, round, schedule, &mine)
    }

    fn agree_ok(&self, round: u64, k: usize, local: Result<()>) -> Result<()> {
        agree_ok(&self.comm, round, k, local)
    }

    fn share_output(
        &self,
        round: u64,
        schedule: &Schedule,
        kept: Option<Tensor>,
    ) -> Result<Tensor> {
        share_output(&self.comm, round, schedule, kept)
    }

    fn gather_stages(
        &self,
        round: u64,
        schedule: &Schedule,
        stages: &[Stage],
        optimizers: &mut [Box<dyn wgpipe_autograd::optim::Optimizer>],
    ) -> Result<()> {
        gather_stages(&self.comm, round, schedule, stages, optimizers)
    }
}
