//! The cost of collectives on a timeline: the ring all-reduce of replicas' gradients and the
//! exchange of tied weights' gradients, measured (wall clock) or modelled (simulated). The
//! runtime's reports and the planner's predictions both draw them with these functions, so a
//! plan is predicted as the simulated cluster then runs it.

use crate::schedule::{ActionKind, Schedule};
use crate::sim::timeline::{Collective, Event, LinkSpec, Timeline};
use crate::sim::topology::Topology;

/// Seconds a ring all-reduce of `bytes` across `replicas` takes on `link`.
pub fn ring_all_reduce_secs(bytes: u64, replicas: usize, link: &LinkSpec) -> f64 {
    if replicas <= 1 {
        return 0.0;
    }
    let r = replicas as f64;
    let steps = 2.0 * (r - 1.0);
    steps / r * bytes as f64 / link.bandwidth_bytes_per_sec + steps * link.latency_sec
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

/// Adds the exchanges to a timeline: measured (`links` `None`), or simulated from when the last
/// of the holders finished its work, as a ring all-reduce among them over the slowest link its
/// ring crosses (`links` indexed as the timeline's devices).
pub(crate) fn add_to_timeline(
    t: &mut Timeline,
    schedule: &Schedule,
    exchanges: &[TiedExchange],
    links: Option<&Topology>,
) {
    for x in exchanges {
        let (start, end) = match links {
            None => (x.start, x.end),
            Some(links) => {
                let link = links.ring_link(x.devices.iter().map(|&(d, _)| d));
                let start = t
                    .events
                    .iter()
                    .filter(|e| x.devices.iter().any(|(d, _)| *d == e.device))
                    .map(|e| e.end)
                    .fold(0.0, f64::max);
                (
                    start,
                    start + ring_all_reduce_secs(x.bytes, x.devices.len(), &link),
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

/// The simulated step of R replicas of a K-device pipeline: their timelines side by side
/// (replica r's device d is row rK + d) with each device's ring all-reduce of `grad_bytes[d]`
/// after them, over the slowest link its ring crosses (`links` indexed as the rows). The
/// planner predicts a replicated candidate by the same rule ([`all_reduce_window`]).
pub(crate) fn replicated_timeline(
    parts: &[&Timeline],
    k: usize,
    grad_bytes: &[u64],
    links: &Topology,
) -> Timeline {
    let r = parts.len();
    let mut t = concat_timelines(parts.iter().copied(), k);
    add_ring_all_reduce(&mut t, k, r, grad_bytes, links);
    t
}

/// The link of pipeline position `d`'s ring across `r` replicas of `k` devices (rows rK + d).
pub(crate) fn position_ring_link(links: &Topology, k: usize, r: usize, d: usize) -> LinkSpec {
    links.ring_link((0..r).map(|i| i * k + d))
}

/// When a ring all-reduce of `bytes` across `r` replicas over `link` runs: from `ready` (the
/// last of its devices done with its work) for [`ring_all_reduce_secs`].
pub(crate) fn all_reduce_window(ready: f64, bytes: u64, r: usize, link: &LinkSpec) -> (f64, f64) {
    (ready, ready + ring_all_reduce_secs(bytes, r, link))
}

/// The timelines of the replicas side by side: replica r's device d becomes row rK + d.
pub(crate) fn concat_timelines<'a>(
    parts: impl Iterator<Item = &'a Timeline>,
    k: usize,
) -> Timeline {
    let mut out = Timeline {
        events: Vec::new(),
        makespan: 0.0,
        busy: Vec::new(),
        collectives: Vec::new(),
    };
    for (i, t) in parts.enumerate() {
        out.events.extend(t.events.iter().map(|e| {
            let mut e = *e;
            e.device += i * k;
            e.peer = e.peer.map(|p| p + i * k);
            e
        }));
        out.busy.extend(&t.busy);
        out.makespan = out.makespan.max(t.makespan);
    }
    out.events
        .sort_by(|a, b| a.start.total_cmp(&b.start).then(a.device.cmp(&b.device)));
    out
}

/// Each device's ring all-reduce across its R replicas: from when the last of them finished
/// its work (compute and sends) to that plus [`ring_all_reduce_secs`].
fn add_ring_all_reduce(t: &mut Timeline, k: usize, r: usize, bytes: &[u64], links: &Topology) {
    for (d, &bytes) in bytes.iter().enumerate().take(k) {
        let start = (0..r)
            .flat_map(|i| {
                let row = i * k + d;
                t.events
                    .iter()
                    .filter(move |e| e.device == row)
                    .map(|e| e.end)
            })
            .fold(0.0, f64::max);
        let link = position_ring_link(links, k, r, d);
        let (start, end) = all_reduce_window(start, bytes, r, &link);
        for i in 0..r {
            t.collectives.push(Collective {
                device: i * k + d,
                start,
                end,
                bytes,
                replicas: r,
            });
        }
        t.makespan = t.makespan.max(end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_cost_by_hand() {
        let link = LinkSpec {
            bandwidth_bytes_per_sec: 1e9,
            latency_sec: 1e-5,
        };
        // R = 4: 6 steps of a quarter of 8 MB each, 6 latencies.
        let t = ring_all_reduce_secs(8_000_000, 4, &link);
        assert!((t - (1.5 * 8e-3 + 6e-5)).abs() < 1e-12, "{t}");
        assert_eq!(ring_all_reduce_secs(8_000_000, 1, &link), 0.0);
    }
}
