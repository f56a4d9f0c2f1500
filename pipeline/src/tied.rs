//! Tied parameters across stages (see [`wgpipe_autograd::tied`]): each stage holds its own copy
//! on its device; after a step's last backward the copies' gradients are summed in stage order
//! and the sum given to every copy, so each stage's optimizer makes the same update and the
//! copies stay bit-identical. The exchange is a timeline event on every device holding a copy
//! (`ExchangeTied`, costed on the simulated timeline as a ring all-reduce among the holders).

use std::time::Instant;

use wgpipe_autograd::{check_tied, sum_tied_grads, tied_groups, Param};

use crate::error::{PipelineError, Result};
use crate::replicas::ring_all_reduce_secs;
use crate::report::StepReport;
use crate::schedule::{ActionKind, Schedule};
use crate::sim::SimCluster;
use crate::timeline::{Event, LinkSpec, Timeline};
use crate::worker::Stage;

/// Every parameter of the stages, with the stage that holds it, in stage order.
fn stage_params(stages: &[Stage]) -> (Vec<(String, Param)>, Vec<usize>) {
    let mut params = Vec::new();
    let mut owner = Vec::new();
    for s in stages {
        for (i, l) in s.layers.iter().enumerate() {
            for (n, p) in l.parameters() {
                params.push((wgpipe_autograd::layer_param_name(s.first_layer + i, &n), p));
                owner.push(s.index);
            }
        }
    }
    (params, owner)
}

/// Each stage's parameters without the tied copies after a group's first (in stage order).
pub(crate) fn without_later_copies(stages: &[Stage]) -> Vec<Vec<(String, Param)>> {
    let (params, owner) = stage_params(stages);
    let later: Vec<usize> = tied_groups(&params)
        .into_iter()
        .flat_map(|(_, idx)| idx.into_iter().skip(1))
        .collect();
    let mut out = vec![Vec::new(); stages.len()];
    for (i, p) in params.into_iter().enumerate() {
        if !later.contains(&i) {
            out[owner[i]].push(p);
        }
    }
    out
}

/// The first tie group with copies on more than one device, by name (what an MPI run cannot
/// sum yet: each rank holds only its own stages' gradients).
#[cfg(feature = "mpi")]
pub(crate) fn group_across_devices(stages: &[Stage], placement: &[usize]) -> Option<String> {
    let (params, owner) = stage_params(stages);
    tied_groups(&params).into_iter().find_map(|(group, idx)| {
        let first = placement[owner[idx[0]]];
        idx.iter()
            .any(|&i| placement[owner[i]] != first)
            .then_some(group)
    })
}

/// At build: tied copies must agree in shape and value (the error names both).
pub(crate) fn check_stage_ties(stages: &[Stage]) -> Result<()> {
    check_tied(&stage_params(stages).0).map_err(|e| PipelineError::Config(e.to_string()))
}

/// One tie group's exchange: the devices holding its copies (in stage order, deduplicated) and
/// the bytes of its gradient.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TiedExchange {
    pub devices: Vec<(usize, usize)>,
    pub bytes: u64,
    /// Wall-clock interval of the exchange, in seconds since `clock`.
    pub start: f64,
    pub end: f64,
}

/// Sums the tied gradients across `stages` (after a successful step); one entry per group
/// whose copies sit on more than one device.
pub(crate) fn exchange(
    stages: &[Stage],
    schedule: &Schedule,
    clock: Instant,
) -> Result<Vec<TiedExchange>> {
    let (params, owner) = stage_params(stages);
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
        let mut devices: Vec<(usize, usize)> = Vec::new();
        for &i in &idx {
            let stage = owner[i];
            let device = schedule.placement[stage];
            if !devices.iter().any(|(d, _)| *d == device) {
                devices.push((device, stage));
            }
        }
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

/// Adds the exchanges to a step's wall-clock and simulated timelines.
pub(crate) fn add_to_report(
    report: &mut StepReport,
    schedule: &Schedule,
    exchanges: &[TiedExchange],
    sim: Option<&SimCluster>,
) {
    if exchanges.is_empty() {
        return;
    }
    add_to_timeline(&mut report.wall_timeline, schedule, exchanges, None);
    report.wall_bubble_fraction = report.wall_timeline.bubble_fraction();
    if let (Some(s), Some(cluster)) = (report.simulated.as_mut(), sim) {
        add_to_timeline(&mut s.timeline, schedule, exchanges, Some(&cluster.link()));
        s.makespan_secs = s.timeline.makespan;
        s.bubble_fraction = s.timeline.bubble_fraction();
        s.steady_bubble_fraction = s.timeline.steady_bubble_fraction();
    }
}

/// Adds the exchanges to a timeline: measured (`link` `None`), or simulated from when the last
/// of the holders finished its work, as a ring all-reduce among them over `link`.
fn add_to_timeline(
    t: &mut Timeline,
    schedule: &Schedule,
    exchanges: &[TiedExchange],
    link: Option<&LinkSpec>,
) {
    for x in exchanges {
        let (start, end) = match link {
            None => (x.start, x.end),
            Some(link) => {
                let start = t
                    .events
                    .iter()
                    .filter(|e| x.devices.iter().any(|(d, _)| *d == e.device))
                    .map(|e| e.end)
                    .fold(0.0, f64::max);
                (
                    start,
                    start + ring_all_reduce_secs(x.bytes, x.devices.len(), link),
                )
            }
        };
        for (i, &(device, stage)) in x.devices.iter().enumerate() {
            let next = x.devices[(i + 1) % x.devices.len()].0;
            t.events.push(Event {
                device,
                stage,
                chunk: schedule.chunk_of(stage),
                kind: ActionKind::ExchangeTied,
                micro_batch: 0,
                start,
                end,
                peer: Some(next),
            });
        }
        t.makespan = t.makespan.max(end);
    }
    t.events
        .sort_by(|a, b| a.start.total_cmp(&b.start).then(a.device.cmp(&b.device)));
}
