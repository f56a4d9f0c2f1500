//! Tied parameters whose copies sit on stages of several ranks (feature `mpi`): the ranks
//! holding copies of a group swap their copies' gradients and each sums them in stage order.

use std::collections::HashMap;

use wgpipe_tensor::Tensor;

use crate::error::Result;
use crate::exec::transport::mpi::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::Stage;
use crate::schedule::Schedule;

use super::mpi::rank_error;

/// One copy of a tied parameter: the stage holding it, its parameter when this rank holds the
/// stage, or the rank that does.
struct TiedCopy {
    stage: usize,
    shape: Vec<usize>,
    here: Option<wgpipe_autograd::Param>,
    rank: usize,
}

/// The tie groups of `stages` with copies on more than one rank, each with its copies in stage
/// order (the order one process sums them in), groups by first appearance.
fn groups_across_ranks(comm: &MpiComm, stages: &[Stage]) -> Vec<(String, Vec<TiedCopy>)> {
    let mut groups: Vec<(String, Vec<TiedCopy>)> = Vec::new();
    let mut add = |group: String, copy: TiedCopy| match groups.iter_mut().find(|(g, _)| *g == group)
    {
        Some((_, copies)) => copies.push(copy),
        None => groups.push((group, vec![copy])),
    };
    for s in stages {
        match &s.absent {
            Some(a) => {
                for t in a.tensors.iter().filter(|t| !t.buffer) {
                    if let Some(g) = &t.tie {
                        let copy = TiedCopy {
                            stage: s.index,
                            shape: t.shape.clone(),
                            here: None,
                            rank: a.rank,
                        };
                        add(g.clone(), copy);
                    }
                }
            }
            None => {
                for (_, p) in s.layers.iter().flat_map(|l| l.parameters()) {
                    if let Some(g) = p.tie_group() {
                        let copy = TiedCopy {
                            stage: s.index,
                            shape: p.shape(),
                            here: Some(p),
                            rank: comm.rank(),
                        };
                        add(g, copy);
                    }
                }
            }
        }
    }
    groups.retain(|(_, copies)| copies.iter().any(|c| c.rank != copies[0].rank));
    groups
}

/// Tied parameters whose copies sit on stages of several ranks (of this rank's replica): the
/// ranks holding copies of a group send each other their copies' gradients, and each sums
/// every copy's gradient in stage order (what one process does, so the sum has the same bits
/// on every rank) and gives the sum to its own copies, which so stay bit-identical. One entry
/// per group this rank takes part in, for the report.
pub(crate) fn exchange_tied(
    comm: &MpiComm,
    round: u64,
    schedule: &Schedule,
    stages: &[Stage],
    clock: std::time::Instant,
) -> Result<Vec<crate::sim::collectives::TiedExchange>> {
    let groups = groups_across_ranks(comm, stages);
    let me = comm.rank();
    let device = me % schedule.num_devices();
    let mine: Vec<&(String, Vec<TiedCopy>)> = groups
        .iter()
        .filter(|(_, copies)| copies.iter().any(|c| c.rank == me))
        .collect();
    if mine.is_empty() {
        return Ok(Vec::new());
    }
    let start = clock.elapsed().as_secs_f64();
    // This rank's copies of every group it takes part in, in order: 1 and the gradient's
    // values, or 0 for a copy without a gradient.
    let mut values = Vec::new();
    for (_, copies) in &mine {
        for c in copies.iter().filter(|c| c.rank == me) {
            match c.here.as_ref().and_then(|p| p.grad()) {
                Some(g) => {
                    values.push(1.0);
                    values.extend(g.to_vec()?);
                }
                None => values.push(0.0),
            }
        }
    }
    let mut peers: Vec<usize> = mine
        .iter()
        .flat_map(|(_, copies)| copies.iter().map(|c| c.rank))
        .filter(|&r| r != me)
        .collect();
    peers.sort_unstable();
    peers.dedup();
    let msg = wire::encode_values(MsgKind::Tied, round, device, values);
    let theirs = comm
        .exchange(round, MsgKind::Tied, &msg, &peers, None)
        .map_err(|why| rank_error(me, device, why))?;
    let bad = |rank: usize, why: String| {
        rank_error(me, device, format!("rank {rank}'s tied gradients: {why}"))
    };
    // Each peer's values, read in the order it wrote them: its copies of the groups it takes
    // part in (which may include groups this rank does not).
    let mut received: HashMap<(usize, usize), Option<Vec<f32>>> = HashMap::new();
    for &peer in &peers {
        let v = wire::decode(theirs[&peer].bytes())
            .map_err(|e| bad(peer, e.to_string()))?
            .1;
        let mut at = 0;
        for (gi, (_, copies)) in groups.iter().enumerate() {
            if !copies.iter().any(|c| c.rank == peer) {
                continue;
            }
            for (ci, c) in copies.iter().enumerate().filter(|(_, c)| c.rank == peer) {
                let flag = *v
                    .get(at)
                    .ok_or_else(|| bad(peer, "too few values".into()))?;
                at += 1;
                let g = if flag == 1.0 {
                    let n: usize = c.shape.iter().product();
                    let g = v
                        .get(at..at + n)
                        .ok_or_else(|| bad(peer, "too few values".into()))?;
                    at += n;
                    Some(g.to_vec())
                } else {
                    None
                };
                received.insert((gi, ci), g);
            }
        }
        if at != v.len() {
            return Err(bad(peer, format!("{} values, {at} expected", v.len())));
        }
    }
    let mut out = Vec::new();
    let mut sums = Vec::new();
    for (gi, (_, copies)) in groups.iter().enumerate() {
        let Some(first_here) = copies.iter().find_map(|c| c.here.clone()) else {
            continue;
        };
        let dev = first_here.device();
        let mut sum: Option<Tensor> = None;
        for (ci, c) in copies.iter().enumerate() {
            let g = match &c.here {
                Some(p) => p.grad().map(|g| g.to_device(&dev)).transpose()?,
                None => match received.get(&(gi, ci)).cloned().flatten() {
                    Some(v) => Some(Tensor::from_slice(&v, &c.shape, &dev)?),
                    None => None,
                },
            };
            if let Some(g) = g {
                sum = Some(match sum {
                    Some(s) => s.add(&g)?,
                    None => g,
                });
            }
        }
        let Some(sum) = sum else { continue };
        for p in copies.iter().filter_map(|c| c.here.as_ref()) {
            sums.push((p.clone(), sum.to_device(&p.device())?));
        }
        out.push(crate::sim::collectives::TiedExchange {
            devices: crate::sim::collectives::holder_devices(
                copies.iter().map(|c| c.stage),
                &schedule.placement,
            ),
            bytes: 4 * sum.numel() as u64,
            start,
            end: clock.elapsed().as_secs_f64(),
        });
    }
    // Every sum built before any is stored: an error above changes nothing.
    for (p, g) in sums {
        p.set_grad(Some(g));
    }
    Ok(out)
}
