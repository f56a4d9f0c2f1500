//! A step across processes (feature `mpi`): which share of the mini-batch a rank trains on,
//! how the ranks agree on the outcome of a step and of an optimizer step (every rank learns
//! every rank's result, so all return the same error naming the failing rank, or all go on),
//! tied gradients summed across the ranks holding copies, and the gradient all-reduce across
//! data-parallel replicas.
//!
//! Rank `r*K + d` runs device d of replica r. Every rank builds the whole model from the same
//! seed and keeps only its device's stages (see [`crate::exec::absent`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wgpipe_tensor::memory::MemoryStats;
use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result, StageCause};
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::worker::{ActionRecord, NonFiniteAt, StageOutcome};
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;
use crate::sim::timeline::Collective;

use super::mpi_buckets::{set_grads, Buckets};
use super::record::{Reader, Writer};
use super::{earliest_non_finite, Agreed, GradsFinal, ReplicaRun, StepComm};
use crate::exec::threads::lock;

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

/// After this rank's workers finished round `round`: sends its outcome to every other rank,
/// takes theirs, and returns the same result on every rank: the outcomes, or the error of the
/// failing rank (the lowest one whose failure was its own, not a stop because of another).
fn agree(
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

/// A rank's outcome of a step (or of its own part of one), as every rank reads it.
#[derive(Clone, Default)]
struct Status {
    ok: bool,
    /// Its failure was its own, not a stop because another rank failed.
    root: bool,
    loss: Option<f32>,
    weight: f32,
    /// Its device's actions: start, end, flops, bytes.
    records: Vec<(f64, f64, f64, u64)>,
    skipped: Option<NonFiniteAt>,
    messages: u64,
    memory: MemoryStats,
    /// Where and why it failed.
    stage: usize,
    device: String,
    micro_batch: usize,
    action: String,
    cause: String,
}

impl Status {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u8(self.ok as u8)
            .u8(self.root as u8)
            .u8(self.loss.is_some() as u8)
            .f64(self.loss.unwrap_or(0.0) as f64)
            .f64(self.weight as f64)
            .u64(self.records.len() as u64);
        for &(start, end, flops, bytes) in &self.records {
            w.f64(start).f64(end).f64(flops).u64(bytes);
        }
        match &self.skipped {
            Some(at) => w
                .u8(1)
                .u64(at.stage as u64)
                .u64(at.micro_batch as u64)
                .str(&at.what),
            None => w.u8(0),
        };
        let m = &self.memory;
        w.u64(self.messages)
            .u64(m.live as u64)
            .u64(m.peak as u64)
            .u8(m.capacity.is_some() as u8)
            .u64(m.capacity.unwrap_or(0) as u64)
            .usizes(&m.live_by_tag)
            .usizes(&m.peak_by_tag)
            .usizes(&m.live_by_dtype)
            .usizes(&m.peak_by_dtype)
            .u64(self.stage as u64)
            .str(&self.device)
            .u64(self.micro_batch as u64)
            .str(&self.action)
            .str(&self.cause);
        w.0
    }

    fn decode(bytes: &[u8]) -> std::result::Result<Status, String> {
        fn fixed<const N: usize>(v: Vec<usize>) -> [usize; N] {
            let mut t = [0; N];
            for (a, b) in t.iter_mut().zip(v) {
                *a = b;
            }
            t
        }
        let mut r = Reader::new(bytes);
        let ok = r.u8("outcome")? != 0;
        let root = r.u8("root")? != 0;
        let has_loss = r.u8("loss")? != 0;
        let loss = r.f64("loss")? as f32;
        let weight = r.f64("weight")? as f32;
        let n = r.u64("records")? as usize;
        let mut records = Vec::with_capacity(n.min(1 << 20));
        for _ in 0..n {
            records.push((
                r.f64("record")?,
                r.f64("record")?,
                r.f64("record")?,
                r.u64("record")?,
            ));
        }
        let skipped = if r.u8("skip")? != 0 {
            Some(NonFiniteAt {
                stage: r.u64("skip")? as usize,
                micro_batch: r.u64("skip")? as usize,
                what: r.str("skip")?,
            })
        } else {
            None
        };
        let messages = r.u64("messages")?;
        let live = r.u64("memory")? as usize;
        let peak = r.u64("memory")? as usize;
        let has_capacity = r.u8("memory")? != 0;
        let capacity = r.u64("memory")? as usize;
        let memory = MemoryStats {
            live,
            peak,
            capacity: has_capacity.then_some(capacity),
            live_by_tag: fixed(r.usizes("memory")?),
            peak_by_tag: fixed(r.usizes("memory")?),
            live_by_dtype: fixed(r.usizes("memory")?),
            peak_by_dtype: fixed(r.usizes("memory")?),
        };
        Ok(Status {
            ok,
            root,
            loss: has_loss.then_some(loss),
            weight,
            records,
            skipped,
            messages,
            memory,
            stage: r.u64("failure")? as usize,
            device: r.str("failure")?,
            micro_batch: r.u64("failure")? as usize,
            action: r.str("failure")?,
            cause: r.str("failure")?,
        })
    }
}

/// After a part of a step each rank does on its own (the optimizer step of its stages): every
/// rank learns every rank's result, so that all go on, or all return the error of the failing
/// rank (the lowest one), `local` included.
fn agree_ok(comm: &MpiComm, round: u64, k: usize, local: Result<()>) -> Result<()> {
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
fn fail_round(comm: &MpiComm, round: u64, error: &PipelineError) {
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

/// [`StepComm::agree_settings`] over the ranks: each sends its settings to every other, and
/// every rank compares all of them in rank order, so that all fail alike, naming each setting
/// that differs and every rank's value.
fn agree_settings(comm: &MpiComm, settings: &[(String, String)]) -> Result<()> {
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let round = comm.next_setup_round();
    let mut w = Writer::default();
    w.u64(settings.len() as u64);
    for (name, value) in settings {
        w.str(name).str(value);
    }
    let mine = w.0;
    let theirs = exchange_bytes(comm, round, MsgKind::Status, &mine, &peers, 0)?;
    let read = |bytes: &[u8]| -> std::result::Result<Vec<(String, String)>, String> {
        let mut r = Reader::new(bytes);
        let n = r.u64("count")? as usize;
        (0..n)
            .map(|_| Ok((r.str("setting")?, r.str("value")?)))
            .collect()
    };
    let mut all: Vec<Vec<(String, String)>> = Vec::with_capacity(comm.size());
    for rank in 0..comm.size() {
        let bytes = if rank == comm.rank() {
            &mine
        } else {
            &theirs[&rank]
        };
        all.push(read(bytes).map_err(|e| {
            PipelineError::Config(format!("rank {rank} sent unreadable settings: {e}"))
        })?);
    }
    let mut names: Vec<&str> = Vec::new();
    for list in &all {
        for (n, _) in list {
            if !names.contains(&n.as_str()) {
                names.push(n);
            }
        }
    }
    let mut differ = Vec::new();
    for name in names {
        let values: Vec<Option<&str>> = all
            .iter()
            .map(|list| {
                list.iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_str())
            })
            .collect();
        if values.iter().any(|v| *v != values[0]) {
            let each: Vec<String> = values
                .iter()
                .enumerate()
                .map(|(rank, v)| format!("rank {rank}: {}", v.unwrap_or("(not given)")))
                .collect();
            differ.push(format!("{name} ({})", each.join(", ")));
        }
    }
    if differ.is_empty() {
        return Ok(());
    }
    Err(PipelineError::Config(format!(
        "the ranks of this job were started with different settings: {}; every rank must be given the same",
        differ.join("; ")
    )))
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

/// Every rank gets every stage's current parameters, buffers and optimizer state from the rank
/// that trains it in replica 0 (rank = its device), so that each holds the whole trained model
/// (for evaluation, or to save it in one file). `round` must be a fresh round on every rank.
fn gather_stages(
    comm: &MpiComm,
    round: u64,
    schedule: &Schedule,
    stages: &[Stage],
    optimizers: &mut [Box<dyn wgpipe_autograd::optim::Optimizer>],
) -> Result<()> {
    let k = schedule.num_devices();
    let owned = |s: &Stage| comm.rank() < k && schedule.placement[s.index] == comm.rank();
    // Per stage held: its index, its parameters' and buffers' values (in the layers' order),
    // its optimizer state (name, shape, values).
    let mut w = Writer::default();
    let mine: Vec<&Stage> = stages.iter().filter(|s| owned(s)).collect();
    w.u64(mine.len() as u64);
    for s in mine {
        w.u64(s.index as u64);
        let params: Vec<_> = s.layers.iter().flat_map(|l| l.parameters()).collect();
        let buffers: Vec<_> = s.layers.iter().flat_map(|l| l.buffers()).collect();
        for list in [&params, &buffers] {
            w.u64(list.len() as u64);
            for (_, p) in list.iter() {
                w.f32s(&p.value().to_vec()?);
            }
        }
        let state = optimizers
            .get(s.index)
            .map(|o| o.state())
            .unwrap_or_default();
        w.u64(state.len() as u64);
        for (name, t) in state {
            w.str(&name).usizes(t.shape()).f32s(&t.to_vec()?);
        }
    }
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let theirs = exchange_bytes(comm, round, MsgKind::Status, &w.0, &peers, comm.rank() % k)?;
    let bad = |why: String| PipelineError::Config(format!("gathering the stages: {why}"));
    for (rank, bytes) in theirs {
        let unreadable = |e: String| bad(format!("rank {rank} sent an unreadable state: {e}"));
        let mut r = Reader::new(&bytes);
        let n = r.u64("stage count").map_err(unreadable)?;
        for _ in 0..n {
            let index = r.u64("stage index").map_err(unreadable)? as usize;
            let s = stages
                .get(index)
                .ok_or_else(|| bad(format!("rank {rank} sent stage {index}")))?;
            let params: Vec<_> = s.layers.iter().flat_map(|l| l.parameters()).collect();
            let buffers: Vec<_> = s.layers.iter().flat_map(|l| l.buffers()).collect();
            for list in [&params, &buffers] {
                let count = r.u64("tensor count").map_err(unreadable)? as usize;
                if count != list.len() {
                    return Err(bad(format!(
                        "rank {rank}'s stage {index} has other parameters"
                    )));
                }
                for (_, p) in list.iter() {
                    let v = r.f32s("values").map_err(unreadable)?;
                    p.set_value(Tensor::from_slice(
                        &v,
                        p.value().shape(),
                        p.value().device(),
                    )?);
                }
            }
            let entries = r.u64("optimizer state").map_err(unreadable)? as usize;
            let mut state = Vec::with_capacity(entries.min(1 << 16));
            for _ in 0..entries {
                let name = r.str("state name").map_err(unreadable)?;
                let shape = r.usizes("state shape").map_err(unreadable)?;
                let v = r.f32s("state values").map_err(unreadable)?;
                // Counters ('@' keys) live on the CPU, moments beside their parameter.
                let device = if name.starts_with('@') {
                    wgpipe_tensor::Device::cpu()
                } else {
                    s.device.clone()
                };
                state.push((name, Tensor::from_slice(&v, &shape, &device)?));
            }
            if let Some(o) = optimizers.get_mut(index) {
                o.load_state(state)?;
            }
        }
    }
    Ok(())
}

/// [`StepComm::share_output`] over the ranks of this rank's replica: the rank holding the last
/// stage sends its tensor (shape and f32 values, a binary record) to the others; all return
/// it. `round` must be a fresh round on every rank of the replica.
fn share_output(
    comm: &MpiComm,
    round: u64,
    schedule: &Schedule,
    kept: Option<Tensor>,
) -> Result<Tensor> {
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let base = comm.rank() - me;
    let last_device = schedule.placement[schedule.num_stages() - 1];
    let root = base + last_device;
    let mut w = Writer::default();
    if let (Some(t), true) = (&kept, root == comm.rank()) {
        w.usizes(t.shape()).f32s(&t.to_vec()?);
    }
    let peers: Vec<usize> = (base..base + k).filter(|&p| p != comm.rank()).collect();
    let theirs = exchange_bytes(comm, round, MsgKind::Status, &w.0, &peers, me)?;
    let cpu = wgpipe_tensor::Device::cpu();
    if root == comm.rank() {
        let kept =
            kept.ok_or_else(|| rank_error(root, me, "the last stage kept no output".into()))?;
        return Ok(kept.to_device(&cpu)?);
    }
    let unreadable = |why: String| rank_error(root, last_device, format!("its output: {why}"));
    let bytes = theirs
        .get(&root)
        .ok_or_else(|| unreadable("nothing came".into()))?;
    let mut r = Reader::new(bytes);
    let shape = r.usizes("shape").map_err(unreadable)?;
    let data = r.f32s("values").map_err(unreadable)?;
    Ok(Tensor::from_vec(data, &shape, &cpu)?)
}

/// Each stage's squared gradient norm as computed by the rank that trains it (replica 0's
/// ranks; after the all-reduce every replica holds the same gradients), from `mine` (this
/// rank's value for every stage). For gradient clipping in round `round`.
fn stage_parts(comm: &MpiComm, round: u64, schedule: &Schedule, mine: &[f64]) -> Result<Vec<f64>> {
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let base = comm.rank() - me;
    let peers: Vec<usize> = (base..base + k).filter(|&p| p != comm.rank()).collect();
    // The f64 bits, NaN and infinity included.
    let mut w = Writer::default();
    w.u64(mine.len() as u64);
    for &v in mine {
        w.f64(v);
    }
    let theirs = exchange_bytes(comm, round, MsgKind::Norm, &w.0, &peers, me)?;
    let mut parts = Vec::with_capacity(mine.len());
    for (s, &own) in mine.iter().enumerate() {
        let owner = base + schedule.placement[s];
        parts.push(if owner == comm.rank() {
            own
        } else {
            let unreadable = |e: String| rank_error(owner, me, format!("an unreadable norm: {e}"));
            let mut r = Reader::new(&theirs[&owner]);
            let n = r.u64("count").map_err(unreadable)? as usize;
            if n != mine.len() {
                return Err(unreadable(format!("{n} stages, {} expected", mine.len())));
            }
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(r.f64("norm").map_err(unreadable)?);
            }
            v[s]
        });
    }
    Ok(parts)
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
