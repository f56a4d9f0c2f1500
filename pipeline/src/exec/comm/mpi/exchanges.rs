//! What the ranks exchange besides a step's outcome: the settings every rank checks at build,
//! the stages' state gathered to every rank, the last stage's output shared within a replica,
//! and each stage's squared gradient norm for clipping.

use wgpipe_tensor::Tensor;

use super::{exchange_bytes, rank_error};
use crate::error::{PipelineError, Result};
use crate::exec::comm::record::{Reader, Writer};
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::MsgKind;
use crate::exec::Stage;
use crate::schedule::Schedule;

/// [`StepComm::agree_settings`] over the ranks: each sends its settings to every other, and
/// every rank compares all of them in rank order, so that all fail alike, naming each setting
/// that differs and every rank's value.
pub(super) fn agree_settings(comm: &MpiComm, settings: &[(String, String)]) -> Result<()> {
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

/// Every rank gets every stage's current parameters, buffers and optimizer state from the rank
/// that trains it in replica 0 (rank = its device), so that each holds the whole trained model
/// (for evaluation, or to save it in one file). `round` must be a fresh round on every rank.
pub(super) fn gather_stages(
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
pub(super) fn share_output(
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
pub(super) fn stage_parts(
    comm: &MpiComm,
    round: u64,
    schedule: &Schedule,
    mine: &[f64],
) -> Result<Vec<f64>> {
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
