//! How the ranks agree on the outcome of a step and of an optimizer step: every rank sends its
//! [`Status`] to every other, so that all go on, or all return the same error naming the
//! failing rank.

use std::time::Duration;

use wgpipe_tensor::memory::MemoryStats;
use wgpipe_tensor::Tensor;

use super::status::Status;
use super::{exchange_bytes, replicas};
use crate::error::{PipelineError, Result, StageCause};
use crate::exec::comm::{earliest_non_finite, Agreed};
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::worker::{ActionRecord, StageOutcome};
use crate::schedule::Schedule;

/// After this rank's workers finished round `round`: sends its outcome to every other rank,
/// takes theirs, and returns the same result on every rank: the outcomes, or the error of the
/// failing rank (the lowest one whose failure was its own, not a stop because of another).
pub(super) fn agree(
    comm: &MpiComm,
    round: u64,
    schedule: &Schedule,
    local: Result<Vec<StageOutcome>>,
    losses: &[Tensor],
    weight: f32,
    memory: MemoryStats,
) -> Result<Agreed> {
    comm.end_round();
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let mut loss = None;
    for t in losses {
        *loss.get_or_insert(0.0f32) += t.to_scalar()?;
    }
    let mut status = status_of(&local, me, loss, weight);
    status.memory = memory;
    let all = statuses(comm, round, k, status)?;
    if let Some(root) = root_failure(&all) {
        return Err(failure(comm, local.err(), root, &all));
    }
    let base = comm.rank() - me;
    let mut everyone: Vec<StageOutcome> = (0..all.len())
        .map(|rank| outcome_of(&all[rank], &schedule.devices[rank % k]))
        .collect();
    // Every replica skips when any does, so that they stay identical.
    let skipped = earliest_non_finite(&everyone);
    // This rank's replica's devices.
    let outcomes = everyone.drain(base..base + k).collect();
    let r = replicas(comm, k);
    let mut total = 0.0f32;
    for s in &all {
        if let Some(l) = s.loss {
            total += if r == 1 { l } else { l * s.weight };
        }
    }
    let memory = (0..k).map(|d| all[base + d].memory.clone()).collect();
    Ok(Agreed {
        outcomes: vec![outcomes],
        loss: total,
        memory: Some(memory),
        skipped,
    })
}

/// After a part of a step each rank does on its own (the optimizer step of its stages): every
/// rank learns every rank's result, so that all go on, or all return the error of the failing
/// rank (the lowest one), `local` included.
pub(super) fn agree_ok(comm: &MpiComm, round: u64, k: usize, local: Result<()>) -> Result<()> {
    let me = comm.rank() % k;
    let status = match &local {
        Ok(()) => Status {
            ok: true,
            ..Status::default()
        },
        Err(e) => error_status(e, me),
    };
    let all = statuses(comm, round, k, status)?;
    match root_failure(&all) {
        Some(root) => Err(failure(comm, local.err(), root, &all)),
        None => Ok(()),
    }
}

/// Sends this rank's `status` of round `round` to every other rank; every rank's, by rank.
fn statuses(comm: &MpiComm, round: u64, k: usize, status: Status) -> Result<Vec<Status>> {
    let me = comm.rank() % k;
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let mut theirs = exchange_bytes(comm, round, MsgKind::Status, &status.encode(), &peers, me)?;
    let mut all: Vec<Status> = Vec::with_capacity(comm.size());
    for rank in 0..comm.size() {
        all.push(if rank == comm.rank() {
            status.clone()
        } else {
            let bytes = theirs.remove(&rank).unwrap_or_default();
            Status::decode(&bytes).unwrap_or_else(|e| Status {
                root: true,
                stage: rank % k,
                device: "?".into(),
                action: "status".into(),
                cause: format!("an unreadable status: {e}"),
                ..Status::default()
            })
        });
    }
    Ok(all)
}

/// The rank whose failure every rank reports: the lowest one that failed on its own (not
/// stopped because another did), else the lowest that failed; `None` when all went well.
fn root_failure(all: &[Status]) -> Option<usize> {
    let failed: Vec<usize> = (0..all.len()).filter(|&r| !all[r].ok).collect();
    let first = *failed.first()?;
    Some(
        failed
            .iter()
            .copied()
            .find(|&r| all[r].root)
            .unwrap_or(first),
    )
}

/// The error this rank returns for `root`'s failure: its own (naming its rank) when it is
/// the root, else the root's as reported.
fn failure(
    comm: &MpiComm,
    local: Option<PipelineError>,
    root: usize,
    all: &[Status],
) -> PipelineError {
    match local {
        Some(e) if root == comm.rank() => e.at(&format!(" on rank {root}")),
        _ => remote_error(root, &all[root]),
    }
}

/// A step that timed out here: the others are told to stop, and get this rank's failure.
pub(super) fn fail_round(comm: &MpiComm, round: u64, error: &PipelineError) {
    comm.abort_peers(round, &error.to_string());
    comm.end_round();
    let status = error_status(error, 0);
    let frame = wire::encode_bytes(MsgKind::Status, round, &status.encode());
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    // Nothing to wait for: this rank returns its own error.
    let _ = comm.exchange(round, MsgKind::Status, &frame, &peers, Some(Duration::ZERO));
}

/// A rank's outcome: its device's records, loss and where non-finite values appeared, or its
/// error.
fn status_of(
    local: &Result<Vec<StageOutcome>>,
    me: usize,
    loss: Option<f32>,
    weight: f32,
) -> Status {
    match local {
        Ok(outcomes) => {
            let o = outcomes.get(me);
            Status {
                ok: true,
                loss,
                weight,
                records: o
                    .map(|o| {
                        o.records
                            .iter()
                            .map(|r| (r.start, r.end, r.flops, r.bytes))
                            .collect()
                    })
                    .unwrap_or_default(),
                skipped: o.and_then(|o| o.non_finite.clone()),
                messages: o.map_or(0, |o| o.messages_sent),
                ..Status::default()
            }
        }
        Err(e) => error_status(e, me),
    }
}

/// The status of a rank whose step failed with `e` (`me`: its device, named when the error
/// names no stage).
fn error_status(e: &PipelineError, me: usize) -> Status {
    let root = !matches!(e.cause(), Some(StageCause::Disconnected(_)));
    match e {
        PipelineError::Stage {
            stage,
            device,
            micro_batch,
            action,
            cause,
        } => Status {
            root,
            stage: *stage,
            device: device.clone(),
            micro_batch: *micro_batch,
            action: action.clone(),
            cause: cause.to_string(),
            ..Status::default()
        },
        other => Status {
            root: true,
            stage: me,
            action: "step".into(),
            cause: other.to_string(),
            ..Status::default()
        },
    }
}

/// Device d's outcome from its rank's status.
fn outcome_of(status: &Status, actions: &[crate::schedule::Action]) -> StageOutcome {
    StageOutcome {
        records: status
            .records
            .iter()
            .zip(actions)
            .map(|(&(start, end, flops, bytes), &action)| ActionRecord {
                action,
                start,
                end,
                flops,
                bytes,
            })
            .collect(),
        non_finite: status.skipped.clone(),
        messages_sent: status.messages,
    }
}

/// Another rank's failure, as this rank returns it.
fn remote_error(rank: usize, s: &Status) -> PipelineError {
    PipelineError::Stage {
        stage: s.stage,
        device: format!("{} on rank {rank}", s.device),
        micro_batch: s.micro_batch,
        action: s.action.clone(),
        cause: Box::new(StageCause::Disconnected(format!(
            "rank {rank} failed: {}",
            s.cause
        ))),
    }
}
