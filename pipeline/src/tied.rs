//! Tied parameters across stages (see [`wgpipe_autograd::tied`]): each stage holds its own copy
//! on its device; after a step's last backward the copies' gradients are summed in stage order
//! and the sum given to every copy, so each stage's optimizer makes the same update and the
//! copies stay bit-identical. The exchange is a timeline event on every device holding a copy
//! (`ExchangeTied`, costed on the simulated timeline as a ring all-reduce among the holders).

use std::collections::HashSet;
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

/// The (device, first stage there) pairs of the stages holding a group's copies (given in
/// stage order), one per device: the ring of the group's exchange.
pub(crate) fn holder_devices(
    stages: impl IntoIterator<Item = usize>,
    placement: &[usize],
) -> Vec<(usize, usize)> {
    let mut devices: Vec<(usize, usize)> = Vec::new();
    for stage in stages {
        let device = placement[stage];
        if !devices.iter().any(|(d, _)| *d == device) {
            devices.push((device, stage));
        }
    }
    devices
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
pub(crate) fn add_to_timeline(
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
