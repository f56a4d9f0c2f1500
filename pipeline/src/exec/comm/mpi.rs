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

use serde_json::{json, Value};
use wgpipe_tensor::memory::MemoryStats;
use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result, StageCause};
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::worker::{ActionRecord, NonFiniteAt, StageOutcome};
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;

use super::mpi_buckets::{set_grads, Buckets};
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
    status["memory"] = memory_json(&memory);
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
        if let Some(l) = s["loss"].as_f64() {
            let w = s["weight"].as_f64().unwrap_or(1.0) as f32;
            total += if r == 1 { l as f32 } else { l as f32 * w };
        }
    }
    let memory = (0..k)
        .map(|d| memory_of(&all[base + d]["memory"]))
        .collect();
    Ok(Agreed {
        outcomes: vec![outcomes],
        loss: total,
        memory: Some(memory),
        skipped,
    })
}

/// A device's memory counters as a status carries them.
fn memory_json(m: &MemoryStats) -> Value {
    json!([
        m.live,
        m.peak,
        m.capacity,
        m.live_by_tag,
        m.peak_by_tag,
        m.live_by_dtype,
        m.peak_by_dtype
    ])
}

/// [`memory_json`] read back (zeros for what is missing).
fn memory_of(v: &Value) -> MemoryStats {
    let n = |v: &Value| v.as_u64().unwrap_or(0) as usize;
    fn counts<const N: usize>(v: &Value) -> [usize; N] {
        let mut t = [0usize; N];
        for (i, x) in v.as_array().into_iter().flatten().take(N).enumerate() {
            t[i] = x.as_u64().unwrap_or(0) as usize;
        }
        t
    }
    MemoryStats {
        live: n(&v[0]),
        peak: n(&v[1]),
        capacity: v[2].as_u64().map(|c| c as usize),
        live_by_tag: counts(&v[3]),
        peak_by_tag: counts(&v[4]),
        live_by_dtype: counts(&v[5]),
        peak_by_dtype: counts(&v[6]),
    }
}

/// After a part of a step each rank does on its own (the optimizer step of its stages): every
/// rank learns every rank's result, so that all go on, or all return the error of the failing
/// rank (the lowest one), `local` included.
fn agree_ok(comm: &MpiComm, round: u64, k: usize, local: Result<()>) -> Result<()> {
    let me = comm.rank() % k;
    let status = match &local {
        Ok(()) => json!({"ok": true}),
        Err(e) => error_status(e, me),
    };
    let all = statuses(comm, round, k, status)?;
    match root_failure(&all) {
        Some(root) => Err(failure(comm, local.err(), root, &all)),
        None => Ok(()),
    }
}

/// Sends this rank's `status` of round `round` to every other rank; every rank's, by rank.
fn statuses(comm: &MpiComm, round: u64, k: usize, status: Value) -> Result<Vec<Value>> {
    let me = comm.rank() % k;
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let mut theirs = exchange_text(
        comm,
        round,
        MsgKind::Status,
        &status.to_string(),
        &peers,
        me,
    )?;
    let mut all: Vec<Value> = Vec::with_capacity(comm.size());
    for rank in 0..comm.size() {
        all.push(if rank == comm.rank() {
            status.clone()
        } else {
            let text = theirs.remove(&rank).unwrap_or_default();
            serde_json::from_str(&text).unwrap_or_else(
                |e| json!({"ok": false, "root": true, "stage": rank % k, "device": "?", "micro_batch": 0, "action": "status", "cause": format!("an unreadable status: {e}")}),
            )
        });
    }
    Ok(all)
}

/// The rank whose failure every rank reports: the lowest one that failed on its own (not
/// stopped because another did), else the lowest that failed; `None` when all went well.
fn root_failure(all: &[Value]) -> Option<usize> {
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r]["ok"] != true).collect();
    let first = *failed.first()?;
    Some(
        failed
            .iter()
            .copied()
            .find(|&r| all[r]["root"] == true)
            .unwrap_or(first),
    )
}

/// The error this rank returns for `root`'s failure: its own (naming its rank) when it is
/// the root, else the root's as reported.
fn failure(
    comm: &MpiComm,
    local: Option<PipelineError>,
    root: usize,
    all: &[Value],
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
    let frame = wire::encode_bytes(MsgKind::Status, round, status.to_string().as_bytes());
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    // Nothing to wait for: this rank returns its own error.
    let _ = comm.exchange(round, MsgKind::Status, &frame, &peers, Some(Duration::ZERO));
}

/// A rank's outcome as JSON: its device's records, loss and where non-finite values appeared,
/// or its error.
fn status_of(
    local: &Result<Vec<StageOutcome>>,
    me: usize,
    loss: Option<f32>,
    weight: f32,
) -> Value {
    match local {
        Ok(outcomes) => {
            let o = outcomes.get(me);
            let records: Vec<Value> = o
                .map(|o| {
                    o.records
                        .iter()
                        .map(|r| json!([r.start, r.end, r.flops, r.bytes]))
                        .collect()
                })
                .unwrap_or_default();
            let skipped = o
                .and_then(|o| o.non_finite.as_ref())
                .map(|at| json!([at.stage, at.micro_batch, at.what]));
            let messages = o.map_or(0, |o| o.messages_sent);
            json!({"ok": true, "loss": loss, "weight": weight, "records": records, "skipped": skipped, "messages": messages})
        }
        Err(e) => error_status(e, me),
    }
}

/// The status of a rank whose step failed with `e` (`me`: its device, named when the error
/// names no stage).
fn error_status(e: &PipelineError, me: usize) -> Value {
    let root = !matches!(e.cause(), Some(StageCause::Disconnected(_)));
    match e {
        PipelineError::Stage {
            stage,
            device,
            micro_batch,
            action,
            cause,
        } => json!({
            "ok": false, "root": root, "stage": stage, "device": device,
            "micro_batch": micro_batch, "action": action, "cause": cause.to_string()
        }),
        other => json!({
            "ok": false, "root": true, "stage": me, "device": "", "micro_batch": 0,
            "action": "step", "cause": other.to_string()
        }),
    }
}

/// Device d's outcome from its rank's status.
fn outcome_of(status: &Value, actions: &[crate::schedule::Action]) -> StageOutcome {
    let records = status["records"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .zip(actions)
                .map(|(r, &action)| ActionRecord {
                    action,
                    start: r[0].as_f64().unwrap_or(0.0),
                    end: r[1].as_f64().unwrap_or(0.0),
                    flops: r[2].as_f64().unwrap_or(0.0),
                    bytes: r[3].as_u64().unwrap_or(0),
                })
                .collect()
        })
        .unwrap_or_default();
    let non_finite = status["skipped"].as_array().map(|s| NonFiniteAt {
        stage: s[0].as_u64().unwrap_or(0) as usize,
        micro_batch: s[1].as_u64().unwrap_or(0) as usize,
        what: s[2].as_str().unwrap_or("").to_string(),
    });
    StageOutcome {
        records,
        non_finite,
        messages_sent: status["messages"].as_u64().unwrap_or(0),
    }
}

/// Another rank's failure, as this rank returns it.
fn remote_error(rank: usize, s: &Value) -> PipelineError {
    PipelineError::Stage {
        stage: s["stage"].as_u64().unwrap_or(0) as usize,
        device: format!("{} on rank {rank}", s["device"].as_str().unwrap_or("?")),
        micro_batch: s["micro_batch"].as_u64().unwrap_or(0) as usize,
        action: s["action"].as_str().unwrap_or("?").to_string(),
        cause: Box::new(StageCause::Disconnected(format!(
            "rank {rank} failed: {}",
            s["cause"].as_str().unwrap_or("?")
        ))),
    }
}

/// Sends `text` as a message of `kind` for `round` to `peers` and returns their texts, by
/// rank (an error naming a rank that died or stopped, see [`MpiComm::peer_timeout`]).
fn exchange_text(
    comm: &MpiComm,
    round: u64,
    kind: MsgKind,
    text: &str,
    peers: &[usize],
    device: usize,
) -> Result<HashMap<usize, String>> {
    let theirs = comm
        .exchange(
            round,
            kind,
            &wire::encode_bytes(kind, round, text.as_bytes()),
            peers,
            None,
        )
        .map_err(|why| rank_error(comm.rank(), device, why))?;
    Ok(theirs
        .into_iter()
        .map(|(r, frame)| (r, wire::text_of(frame.bytes())))
        .collect())
}

/// [`StepComm::agree_settings`] over the ranks: each sends its settings to every other, and
/// every rank compares all of them in rank order, so that all fail alike, naming each setting
/// that differs and every rank's value.
fn agree_settings(comm: &MpiComm, settings: &[(String, String)]) -> Result<()> {
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let round = comm.next_setup_round();
    let mine = json!(settings).to_string();
    let theirs = exchange_text(comm, round, MsgKind::Status, &mine, &peers, 0)?;
    let mut all: Vec<Vec<(String, String)>> = Vec::with_capacity(comm.size());
    for rank in 0..comm.size() {
        let text = if rank == comm.rank() {
            &mine
        } else {
            &theirs[&rank]
        };
        all.push(serde_json::from_str(text).map_err(|e| {
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
    let values = |p: &wgpipe_autograd::Param| -> Result<Value> { Ok(json!(p.value().to_vec()?)) };
    let mut mine = Vec::new();
    for s in stages.iter().filter(|s| owned(s)) {
        let mut params = Vec::new();
        let mut buffers = Vec::new();
        for l in &s.layers {
            for (_, p) in l.parameters() {
                params.push(values(&p)?);
            }
            for (_, b) in l.buffers() {
                buffers.push(values(&b)?);
            }
        }
        let mut optim = Vec::new();
        if let Some(o) = optimizers.get(s.index) {
            for (name, t) in o.state() {
                optim.push(json!([name, t.shape(), t.to_vec()?]));
            }
        }
        mine.push(json!({"index": s.index, "params": params, "buffers": buffers, "optim": optim}));
    }
    let text = json!({ "stages": mine }).to_string();
    let peers: Vec<usize> = (0..comm.size()).filter(|&p| p != comm.rank()).collect();
    let theirs = exchange_text(comm, round, MsgKind::Status, &text, &peers, comm.rank() % k)?;
    let bad = |why: String| PipelineError::Config(format!("gathering the stages: {why}"));
    for (rank, text) in theirs {
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("rank {rank} sent an unreadable state: {e}")))?;
        for st in v["stages"].as_array().cloned().unwrap_or_default() {
            let index = st["index"].as_u64().unwrap_or(u64::MAX) as usize;
            let s = stages
                .get(index)
                .ok_or_else(|| bad(format!("rank {rank} sent stage {index}")))?;
            let floats = |v: &Value| -> Vec<f32> {
                v.as_array()
                    .map(|a| {
                        a.iter()
                            .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let set = |p: &wgpipe_autograd::Param, v: &Value| -> Result<()> {
                let t = Tensor::from_slice(&floats(v), p.value().shape(), p.value().device())?;
                p.set_value(t);
                Ok(())
            };
            let params: Vec<_> = s.layers.iter().flat_map(|l| l.parameters()).collect();
            let buffers: Vec<_> = s.layers.iter().flat_map(|l| l.buffers()).collect();
            let (pv, bv) = (st["params"].as_array(), st["buffers"].as_array());
            if pv.map(Vec::len) != Some(params.len()) || bv.map(Vec::len) != Some(buffers.len()) {
                return Err(bad(format!(
                    "rank {rank}'s stage {index} has other parameters"
                )));
            }
            for ((_, p), v) in params.iter().zip(pv.into_iter().flatten()) {
                set(p, v)?;
            }
            for ((_, b), v) in buffers.iter().zip(bv.into_iter().flatten()) {
                set(b, v)?;
            }
            if let Some(o) = optimizers.get_mut(index) {
                let mut state = Vec::new();
                for e in st["optim"].as_array().cloned().unwrap_or_default() {
                    let name = e[0].as_str().unwrap_or("").to_string();
                    let shape: Vec<usize> = e[1]
                        .as_array()
                        .map(|a| a.iter().map(|d| d.as_u64().unwrap_or(0) as usize).collect())
                        .unwrap_or_default();
                    // Counters ('@' keys) live on the CPU, moments beside their parameter.
                    let device = if name.starts_with('@') {
                        wgpipe_tensor::Device::cpu()
                    } else {
                        s.device.clone()
                    };
                    state.push((name, Tensor::from_slice(&floats(&e[2]), &shape, &device)?));
                }
                o.load_state(state)?;
            }
        }
    }
    Ok(())
}

/// Each stage's squared gradient norm as computed by the rank that trains it (replica 0's
/// ranks; after the all-reduce every replica holds the same gradients), from `mine` (this
/// rank's value for every stage). For gradient clipping in round `round`.
fn stage_parts(comm: &MpiComm, round: u64, schedule: &Schedule, mine: &[f64]) -> Result<Vec<f64>> {
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let base = comm.rank() - me;
    let peers: Vec<usize> = (base..base + k).filter(|&p| p != comm.rank()).collect();
    // JSON keeps every finite f64 exactly; NaN and infinity travel as null.
    let theirs = exchange_text(
        comm,
        round,
        MsgKind::Norm,
        &json!(mine).to_string(),
        &peers,
        me,
    )?;
    let mut parts = Vec::with_capacity(mine.len());
    for (s, &own) in mine.iter().enumerate() {
        let owner = base + schedule.placement[s];
        parts.push(if owner == comm.rank() {
            own
        } else {
            let v: Value = serde_json::from_str(&theirs[&owner])
                .map_err(|e| rank_error(owner, me, format!("an unreadable norm: {e}")))?;
            v[s].as_f64().unwrap_or(f64::NAN)
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
    ) -> Option<Arc<dyn GradsFinal>> {
        if replicas(&self.comm, schedule.num_devices()) < 2 {
            return None;
        }
        let b = Arc::new(Buckets::new(&self.comm, round, schedule, stages, weights));
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
    ) -> Result<()> {
        let k = schedule.num_devices();
        let device = self.comm.rank() % k;
        let Some(buckets) = self.buckets_of(round) else {
            if replicas(&self.comm, k) < 2 {
                return Ok(());
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
        for (s, sum) in mine.iter().zip(sums) {
            let got = sum
                .expect("every bucket started")
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
            reduced.push(got);
        }
        *lock(&self.buckets) = None;
        for (s, sum) in mine.iter().zip(&reduced) {
            set_grads(s, sum)?;
        }
        Ok(())
    }

    fn stage_parts(&self, round: u64, schedule: &Schedule, mine: Vec<f64>) -> Result<Vec<f64>> {
        stage_parts(&self.comm, round, schedule, &mine)
    }

    fn agree_ok(&self, round: u64, k: usize, local: Result<()>) -> Result<()> {
        agree_ok(&self.comm, round, k, local)
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
