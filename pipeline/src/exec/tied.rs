//! Tied parameters across stages (see [`wgpipe_autograd::tied`]): each stage holds its own copy
//! on its device; after a step's last backward the copies' gradients are summed in stage order
//! and the sum given to every copy, so each stage's optimizer makes the same update and the
//! copies stay bit-identical. The exchange is a timeline event on every device holding a copy
//! (`ExchangeTied`, costed on the simulated timeline as a ring all-reduce among the holders).

use std::collections::HashSet;
use std::time::Instant;

use wgpipe_autograd::{check_tied, sum_tied_grads, tied_groups, Param};

use crate::error::{PipelineError, Result};
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::{holder_devices, TiedExchange};

/// Every parameter of the stages, with the stage that holds it, in stage order.
fn stage_params(stages: &[Stage]) -> (Vec<(String, Param)>, Vec<usize>) {
    let mut params = Vec::new();
    let mut owner = Vec::new();
    for s in stages {
        for named in s.named_parameters() {
            params.push(named);
            owner.push(s.index);
        }
    }
    (params, owner)
}

/// Each stage's parameters without the tied copies after a group's first (in stage order;
/// over MPI the first copy may be on a stage another rank holds).
pub(crate) fn without_later_copies(stages: &[Stage]) -> Vec<Vec<(String, Param)>> {
    let mut seen: HashSet<String> = HashSet::new();
    let mut out = Vec::with_capacity(stages.len());
    for s in stages {
        let (params, _) = stage_params(std::slice::from_ref(s));
        let mut kept = Vec::new();
        for (name, p) in params {
            let first = p.tie_group().is_none_or(|g| seen.insert(g));
            if first {
                kept.push((name, p));
            }
        }
        if let Some(a) = &s.absent {
            seen.extend(a.tensors.iter().filter_map(|t| t.tie.clone()));
        }
        out.push(kept);
    }
    out
}

/// Tie groups with a copy on a stage another rank holds (over MPI): summed across ranks (see
/// `distributed::exchange_tied`), not here.
pub(crate) fn groups_held_elsewhere(stages: &[Stage]) -> HashSet<String> {
    stages
        .iter()
        .filter_map(|s| s.absent.as_ref())
        .flat_map(|a| a.tensors.iter().filter_map(|t| t.tie.clone()))
        .collect()
}

/// At build: tied copies must agree in shape and value (the error names both).
pub(crate) fn check_stage_ties(stages: &[Stage]) -> Result<()> {
    check_tied(&stage_params(stages).0).map_err(|e| PipelineError::Config(e.to_string()))
}

/// Sums the tied gradients across `stages` (after a successful step); one entry per group
/// whose copies sit on more than one device.
pub(crate) fn exchange(
    stages: &[Stage],
    schedule: &Schedule,
    clock: Instant,
) -> Result<Vec<TiedExchange>> {
    let (params, owner) = stage_params(stages);
    let elsewhere = groups_held_elsewhere(stages);
    let (params, owner): (Vec<_>, Vec<_>) = params
        .into_iter()
        .zip(owner)
        .filter(|((_, p), _)| p.tie_group().is_none_or(|g| !elsewhere.contains(&g)))
        .unzip();
    let groups = tied_groups(&params);
    if groups.is_empty() {
        return Ok(Vec::new());
    }
    let start = clock.elapsed().as_secs_f64();
    let moved = sum_tied_grads(&params)?;
    let end = clock.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (group, idx) in groups {
        let Some((_, bytes)) = moved.iter().find(|(g, _)| *g == group) else {
            continue;
        };
        let devices = holder_devices(idx.iter().map(|&i| owner[i]), &schedule.placement);
        if devices.len() > 1 {
            out.push(TiedExchange {
                devices,
                bytes: *bytes as u64,
                start,
                end,
            });
        }
    }
    Ok(out)
}
