//! The deterministic simulated timeline of a K-accelerator pipeline run.
//!
//! Real runs on a laptop cannot show what K accelerators would do, so this module replays a
//! [`Schedule`] against a cost model: each stage has its own clock and walks its actions in order,
//! compute takes FLOPs over the device's rate, and a message arrives after the link's latency plus
//! its bytes over the bandwidth (transfers on one link queue behind each other). The result is a
//! list of timed events, the makespan, and the bubble: the share of device time spent idle.
//! All times are simulated seconds.

use crate::fast_hash::FastMap;
use crate::schedule::{Action, ActionKind, Schedule, ScheduleError};
use crate::sim::topology::Topology;

/// One simulated accelerator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSpec {
    /// Compute rate; a compute action lasts `flops / flops_per_sec` seconds.
    pub flops_per_sec: f64,
    /// Memory capacity. Carried for the simulated cluster; the timeline does not model memory.
    pub memory_bytes: u64,
}

/// The link between two neighbouring stages (one such link per direction per pair).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkSpec {
    /// Bytes per second; `f64::INFINITY` makes transfers take no time beyond the latency.
    pub bandwidth_bytes_per_sec: f64,
    /// Fixed delay added to every message, in seconds.
    pub latency_sec: f64,
}

impl LinkSpec {
    /// A link that costs nothing: infinite bandwidth, zero latency.
    pub const FREE: LinkSpec = LinkSpec {
        bandwidth_bytes_per_sec: f64::INFINITY,
        latency_sec: 0.0,
    };

    /// Seconds the link is occupied by a message of `bytes` (latency excluded: it overlaps).
    fn occupancy(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bandwidth_bytes_per_sec
    }
}

/// The measured or estimated cost of one action: `flops` for compute actions, `bytes` for sends.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ActionCost {
    pub flops: f64,
    pub bytes: u64,
}

/// One timed interval on one device: a compute action, or a message (`kind` is then the send,
/// `SendActivation` or `SendGrad`; `device` is the sender and `peer` the receiving device,
/// `start` is when the message got the link and `end` when it arrived).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub device: usize,
    /// The virtual stage the work belongs to (the sending stage of a transfer).
    pub stage: usize,
    /// The stage's chunk index on its device (0 when devices hold one stage each).
    pub chunk: usize,
    pub kind: ActionKind,
    pub micro_batch: usize,
    pub start: f64,
    pub end: f64,
    /// The receiving device of a transfer; `None` for compute events.
    pub peer: Option<usize>,
}

/// The simulated run: events sorted by start time (then device), the makespan, and per-device
/// compute-busy seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub events: Vec<Event>,
    pub makespan: f64,
    pub busy: Vec<f64>,
    /// Gradient all-reduces across data-parallel replicas (empty with one replica).
    pub collectives: Vec<Collective>,
}

/// One device's part in the all-reduce of its stages' gradients across the replicas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Collective {
    pub device: usize,
    pub start: f64,
    pub end: f64,
    /// Gradient bytes this device contributes (and receives back averaged).
    pub bytes: u64,
    /// R, the replicas taking part.
    pub replicas: usize,
}

impl Timeline {
    /// Share of device time not spent computing: 1 − Σ busy / (K × makespan). Computed as
    /// idle / total so that with exact (integer) times it equals the ideal fraction bit for bit.
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.busy.len() as f64 * self.makespan;
        if total <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.busy.iter().sum();
        (total - busy) / total
    }

    /// The idle share inside each device's own span, from the start of its first compute event
    /// to the end of its last: Σ (span − busy) / Σ span. This is the zero-bubble papers'
    /// measure: the ramps at the two ends of a step are filled by the previous and the next
    /// step when steps run back to back, the gaps inside a span are not.
    pub fn steady_bubble_fraction(&self) -> f64 {
        let mut span = 0.0;
        let mut idle = 0.0;
        for (device, &busy) in self.busy.iter().enumerate() {
            let mut compute = self
                .events
                .iter()
                .filter(|e| e.device == device && e.kind.is_compute());
            let Some(first) = compute.next() else {
                continue;
            };
            let (start, end) = compute.fold((first.start, first.end), |(s, e), ev| {
                (s.min(ev.start), e.max(ev.end))
            });
            span += end - start;
            idle += (end - start) - busy;
        }
        if span <= 0.0 {
            0.0
        } else {
            idle / span
        }
    }

    /// Number of devices (rows).
    pub fn num_devices(&self) -> usize {
        self.busy.len()
    }
}

/// Why a simulation could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TimelineError {
    /// The schedule failed [`Schedule::validate`].
    #[error("invalid schedule: {0}")]
    Schedule(#[from] ScheduleError),
    /// One device spec per device is needed.
    #[error("schedule has {schedule} devices but {given} device specs were given")]
    DeviceCount { schedule: usize, given: usize },
    /// A device's rate is zero, negative or NaN.
    #[error("device {device} has rate {flops_per_sec} FLOP/s; it must be positive")]
    InvalidDevice { device: usize, flops_per_sec: f64 },
    /// Bandwidth must be positive (infinity allowed); latency finite and non-negative.
    #[error(
        "link bandwidth {bandwidth} B/s must be positive and latency {latency} s finite and \
         non-negative"
    )]
    InvalidLink { bandwidth: f64, latency: f64 },
    /// The cost of a compute action is negative, NaN or infinite.
    #[error("device {device}: {action} costs {flops} FLOPs; it must be finite and non-negative")]
    InvalidCost {
        device: usize,
        action: Action,
        flops: f64,
    },
}

fn check_specs(
    schedule: &Schedule,
    devices: &[DeviceSpec],
    links: &Topology,
) -> Result<(), TimelineError> {
    if devices.len() != schedule.num_devices() {
        return Err(TimelineError::DeviceCount {
            schedule: schedule.num_devices(),
            given: devices.len(),
        });
    }
    if let Some((device, d)) = devices
        .iter()
        .enumerate()
        .find(|(_, d)| d.flops_per_sec.is_nan() || d.flops_per_sec <= 0.0)
    {
        return Err(TimelineError::InvalidDevice {
            device,
            flops_per_sec: d.flops_per_sec,
        });
    }
    for link in [links.intra(), links.inter()] {
        let bandwidth_ok = link.bandwidth_bytes_per_sec > 0.0; // false for NaN
        let latency_ok = link.latency_sec.is_finite() && link.latency_sec >= 0.0;
        if !bandwidth_ok || !latency_ok {
            return Err(TimelineError::InvalidLink {
                bandwidth: link.bandwidth_bytes_per_sec,
                latency: link.latency_sec,
            });
        }
    }
    Ok(())
}

/// The mutable state of one simulation, advanced action by action.
struct Sim<'a> {
    schedule: &'a Schedule,
    devices: &'a [DeviceSpec],
    /// The links between the schedule's devices.
    links: &'a Topology,
    clock: Vec<f64>,
    /// When each directed device-to-device link is next free.
    link_free: FastMap<(usize, usize), f64>,
    busy: Vec<f64>,
    /// Whether to keep the events (the planner needs only the makespan and busy times).
    record: bool,
    events: Vec<Event>,
    /// The latest end of any event, kept or not.
    latest_end: f64,
    /// Per device, the latest end of its events (compute, and the arrival of its sends), kept
    /// or not.
    ends: Vec<f64>,
    error: Option<TimelineError>,
}

impl Sim<'_> {
    /// Runs one action on `device` and returns the device's clock, or the arrival time for a
    /// send.
    fn step(
        &mut self,
        device: usize,
        action: Action,
        cost: ActionCost,
        arrival: Option<f64>,
    ) -> f64 {
        if action.is_compute() {
            return self.compute(device, action, cost.flops);
        }
        match action.kind {
            kind if kind.is_send() => {
                let to_stage = action
                    .link(self.schedule.num_stages())
                    .map_or(action.stage, |l| l.to);
                let to = self.schedule.placement[to_stage];
                self.send(device, to, action, cost.bytes)
            }
            _ => {
                let t = arrival.unwrap_or(0.0);
                self.clock[device] = self.clock[device].max(t);
                self.clock[device]
            }
        }
    }

    fn compute(&mut self, device: usize, action: Action, flops: f64) -> f64 {
        if !flops.is_finite() || flops < 0.0 {
            self.error.get_or_insert(TimelineError::InvalidCost {
                device,
                action,
                flops,
            });
        }
        let start = self.clock[device];
        let end = start + flops / self.devices[device].flops_per_sec;
        self.push(device, action, start, end, None);
        self.busy[device] += end - start;
        self.clock[device] = end;
        end
    }

    /// Queues a message on the directed link `from -> to`; the sender does not wait. A message
    /// to a stage on the same device is a hand-over in memory and costs nothing.
    fn send(&mut self, from: usize, to: usize, action: Action, bytes: u64) -> f64 {
        if from == to {
            return self.clock[from];
        }
        let free = self.link_free.entry((from, to)).or_insert(0.0);
        let link = self.links.link(from, to);
        let start = self.clock[from].max(*free);
        *free = start + link.occupancy(bytes);
        let arrival = *free + link.latency_sec;
        self.push(from, action, start, arrival, Some(to));
        arrival
    }

    fn push(&mut self, device: usize, action: Action, start: f64, end: f64, peer: Option<usize>) {
        self.latest_end = self.latest_end.max(end);
        self.ends[device] = self.ends[device].max(end);
        if !self.record {
            return;
        }
        self.events.push(Event {
            device,
            stage: action.stage,
            chunk: self.schedule.chunk_of(action.stage),
            kind: action.kind,
            micro_batch: action.micro_batch,
            start,
            end,
            peer,
        });
    }
}

/// Simulates `schedule` on one device spec per device joined by identical `link`s (between every
/// pair of devices, one per direction; stages on the same device hand over for free), with
/// `cost(device, action)` giving the FLOPs of compute actions and the bytes of sends (it is not
/// asked about receives). Deterministic: the same inputs give the same timeline.
pub fn simulate<F>(
    schedule: &Schedule,
    devices: &[DeviceSpec],
    link: &LinkSpec,
    cost: F,
) -> Result<Timeline, TimelineError>
where
    F: FnMut(usize, Action) -> ActionCost,
{
    simulate_on(schedule, devices, &Topology::flat(*link), cost)
}

/// [`simulate`] on devices joined by the links of `links` (a device's link to another of its
/// node, or to one of another node), indexed as the schedule's devices.
pub fn simulate_on<F>(
    schedule: &Schedule,
    devices: &[DeviceSpec],
    links: &Topology,
    cost: F,
) -> Result<Timeline, TimelineError>
where
    F: FnMut(usize, Action) -> ActionCost,
{
    schedule.validate()?;
    simulate_valid(schedule, devices, links, true, cost)
}

/// [`simulate`] for a schedule known to be valid (the planner's: generated, then recomputes
/// removed), without validating it again: the same simulation, for the many candidates a search
/// replays. Without `record` the timeline has no events (makespan and busy times only).
pub(crate) fn simulate_valid<F>(
    schedule: &Schedule,
    devices: &[DeviceSpec],
    links: &Topology,
    record: bool,
    cost: F,
) -> Result<Timeline, TimelineError>
where
    F: FnMut(usize, Action) -> ActionCost,
{
    simulate_with_ends(schedule, devices, links, record, cost).map(|(t, _)| t)
}

/// [`simulate_valid`], with each device's end of work: the latest end of its events (compute,
/// and the arrival of its sends), recorded or not. A replicated plan's all-reduce starts
/// from these, so the planner need not keep (and sort) the events to know them.
pub(crate) fn simulate_with_ends<F>(
    schedule: &Schedule,
    devices: &[DeviceSpec],
    links: &Topology,
    record: bool,
    mut cost: F,
) -> Result<(Timeline, Vec<f64>), TimelineError>
where
    F: FnMut(usize, Action) -> ActionCost,
{
    check_specs(schedule, devices, links)?;
    let k = schedule.num_devices();
    let mut sim = Sim {
        schedule,
        devices,
        links,
        clock: vec![0.0; k],
        link_free: FastMap::default(),
        busy: vec![0.0; k],
        record,
        events: Vec::new(),
        latest_end: 0.0,
        ends: vec![0.0; k],
        error: None,
    };
    schedule.drive(|device, action, arrival: Option<f64>| {
        let c = match action.kind {
            kind if kind.is_recv() => ActionCost::default(),
            _ => cost(device, action),
        };
        sim.step(device, action, c, arrival)
    })?;
    if let Some(e) = sim.error {
        return Err(e);
    }
    let makespan = sim.clock.iter().copied().fold(sim.latest_end, f64::max);
    let mut events = sim.events;
    events.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.device.cmp(&b.device)));
    Ok((
        Timeline {
            events,
            makespan,
            busy: sim.busy,
            collectives: Vec::new(),
        },
        sim.ends,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{gpipe, one_f_one_b, CheckpointMode};

    fn unit_devices(k: usize) -> Vec<DeviceSpec> {
        vec![
            DeviceSpec {
                flops_per_sec: 1.0,
                memory_bytes: 1 << 30,
            };
            k
        ]
    }

    /// One FLOP per compute action, `bytes` per message.
    fn unit_cost(bytes: u64) -> impl FnMut(usize, Action) -> ActionCost {
        move |_, _| ActionCost { flops: 1.0, bytes }
    }

    fn unit_run(s: &Schedule, link: &LinkSpec, bytes: u64) -> Timeline {
        simulate(s, &unit_devices(s.num_devices()), link, unit_cost(bytes)).unwrap()
    }

    fn compute_events(t: &Timeline, stage: usize) -> Vec<(ActionKind, usize, f64, f64)> {
        t.events
            .iter()
            .filter(|e| e.device == stage && e.kind.is_compute())
            .map(|e| (e.kind, e.micro_batch, e.start, e.end))
            .collect()
    }

    #[test]
    fn gpipe_unit_costs_give_ideal_makespan_and_bubble() {
        for k in 1..=6 {
            for m in 1..=9 {
                let s = gpipe(k, m, CheckpointMode::Never).unwrap();
                let t = unit_run(&s, &LinkSpec::FREE, 100);
                assert_eq!(t.makespan, (2 * (m + k - 1)) as f64, "K={k} M={m}");
                let ideal = (k - 1) as f64 / (m + k - 1) as f64;
                assert_eq!(t.bubble_fraction(), ideal, "K={k} M={m}");
                assert_eq!(t.busy, vec![(2 * m) as f64; k]);
            }
        }
    }

    #[test]
    fn one_f_one_b_has_the_same_bubble_as_gpipe() {
        for k in 1..=5 {
            for m in 1..=8 {
                let s = one_f_one_b(k, m, CheckpointMode::Never).unwrap();
                let ideal = (k - 1) as f64 / (m + k - 1) as f64;
                assert_eq!(unit_run(&s, &LinkSpec::FREE, 1).bubble_fraction(), ideal);
            }
        }
    }

    #[test]
    fn unit_timeline_agrees_with_clock_grid() {
        for k in 1..=4 {
            for m in 1..=5 {
                for mode in [CheckpointMode::Always, CheckpointMode::ExceptLast] {
                    for s in [gpipe(k, m, mode).unwrap(), one_f_one_b(k, m, mode).unwrap()] {
                        let t = unit_run(&s, &LinkSpec::FREE, 1);
                        for (j, row) in s.clock_grid().iter().enumerate() {
                            let from_grid: Vec<(ActionKind, usize, f64)> = row
                                .iter()
                                .enumerate()
                                .filter_map(|(tick, c)| {
                                    c.map(|a| (a.kind, a.micro_batch, tick as f64))
                                })
                                .collect();
                            let from_timeline: Vec<(ActionKind, usize, f64)> =
                                compute_events(&t, j)
                                    .into_iter()
                                    .map(|(kind, mb, start, _)| (kind, mb, start))
                                    .collect();
                            assert_eq!(from_grid, from_timeline);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn slow_link_two_stages_one_micro_batch() {
        // 10 bytes at 10 B/s = 1 s on the wire, plus 0.5 s latency, each way.
        // Stage 0 F [0,1]; activation arrives 2.5; stage 1 F [2.5,3.5], B [3.5,4.5];
        // gradient arrives 6.0; stage 0 B [6,7]. Free links would give 4.
        let s = gpipe(2, 1, CheckpointMode::Never).unwrap();
        let link = LinkSpec {
            bandwidth_bytes_per_sec: 10.0,
            latency_sec: 0.5,
        };
        let t = unit_run(&s, &link, 10);
        assert_eq!(t.makespan, 7.0);
        assert_eq!(unit_run(&s, &LinkSpec::FREE, 10).makespan, 4.0);
        assert_eq!(
            compute_events(&t, 0),
            vec![
                (ActionKind::Forward, 0, 0.0, 1.0),
                (ActionKind::Backward, 0, 6.0, 7.0)
            ]
        );
        let transfers: Vec<(usize, Option<usize>, f64, f64)> = t
            .events
            .iter()
            .filter(|e| !e.kind.is_compute())
            .map(|e| (e.device, e.peer, e.start, e.end))
            .collect();
        assert_eq!(
            transfers,
            vec![(0, Some(1), 1.0, 2.5), (1, Some(0), 4.5, 6.0)]
        );
        assert_eq!(t.busy, vec![2.0, 2.0]);
        assert_eq!(t.bubble_fraction(), 10.0 / 14.0);
    }

    #[test]
    fn transfers_on_one_link_serialise() {
        // 3 s per message, no latency. Activations leave stage 0 at 1 and 2, but the second
        // waits for the link until 4 and arrives at 7.
        let s = gpipe(2, 2, CheckpointMode::Never).unwrap();
        let link = LinkSpec {
            bandwidth_bytes_per_sec: 1.0,
            latency_sec: 0.0,
        };
        let t = unit_run(&s, &link, 3);
        assert_eq!(
            compute_events(&t, 1)[..2],
            [
                (ActionKind::Forward, 0, 4.0, 5.0),
                (ActionKind::Forward, 1, 7.0, 8.0)
            ]
        );
    }

    #[test]
    fn recompute_overlaps_waiting_for_the_gradient() {
        // Latency 5 each way. Stage 0 recomputes at [1,2] while the gradient is on its way,
        // so the makespan is 15, not 16: F0 [0,1] | stage 1 F [6,7] R [7,8] B [8,9] | B [14,15].
        let s = gpipe(2, 1, CheckpointMode::Always).unwrap();
        let link = LinkSpec {
            bandwidth_bytes_per_sec: f64::INFINITY,
            latency_sec: 5.0,
        };
        let t = unit_run(&s, &link, 1);
        assert_eq!(t.makespan, 15.0);
        assert_eq!(
            compute_events(&t, 0),
            vec![
                (ActionKind::Forward, 0, 0.0, 1.0),
                (ActionKind::Recompute, 0, 1.0, 2.0),
                (ActionKind::Backward, 0, 14.0, 15.0)
            ]
        );
        assert_eq!(t.busy, vec![3.0, 3.0]);
    }

    #[test]
    fn slower_device_stretches_its_stage() {
        let s = gpipe(2, 1, CheckpointMode::Never).unwrap();
        let mut devices = unit_devices(2);
        devices[1].flops_per_sec = 0.5;
        let t = simulate(&s, &devices, &LinkSpec::FREE, unit_cost(0)).unwrap();
        assert_eq!(t.makespan, 6.0);
        assert_eq!(t.busy, vec![2.0, 4.0]);
    }

    #[test]
    fn cost_is_looked_up_by_stage_and_action() {
        let s = gpipe(2, 2, CheckpointMode::Never).unwrap();
        let mut asked = Vec::new();
        let t = simulate(&s, &unit_devices(2), &LinkSpec::FREE, |stage, action| {
            asked.push((stage, action));
            let flops = match action.kind {
                ActionKind::Backward => 2.0,
                _ => 1.0,
            };
            ActionCost { flops, bytes: 0 }
        })
        .unwrap();
        assert!(asked.contains(&(1, Action::new(ActionKind::Backward, 1, 1))));
        assert!(asked
            .iter()
            .all(|(_, a)| !matches!(a.kind, ActionKind::RecvActivation | ActionKind::RecvGrad)));
        // Backward costs 2. Stage 1: F0 [1,2] F1 [2,3] B1 [3,5] B0 [5,7];
        // stage 0: F0 [0,1] F1 [1,2] B1 [5,7] B0 [7,9].
        assert_eq!(t.makespan, 9.0);
    }

    #[test]
    fn deterministic() {
        let s = one_f_one_b(4, 7, CheckpointMode::ExceptLast).unwrap();
        let link = LinkSpec {
            bandwidth_bytes_per_sec: 3.0,
            latency_sec: 0.25,
        };
        let cost = |stage: usize, action: Action| ActionCost {
            flops: 1.0 + stage as f64 * 0.3 + action.micro_batch as f64 * 0.1,
            bytes: 2 + action.micro_batch as u64,
        };
        let a = simulate(&s, &unit_devices(4), &link, cost).unwrap();
        let b = simulate(&s, &unit_devices(4), &link, cost).unwrap();
        assert_eq!(a, b);
        assert!(a.events.windows(2).all(|w| w[0].start <= w[1].start));
    }

    #[test]
    fn rejects_bad_inputs_with_named_causes() {
        let s = gpipe(2, 2, CheckpointMode::Never).unwrap();
        let e = simulate(&s, &unit_devices(3), &LinkSpec::FREE, unit_cost(0)).unwrap_err();
        assert_eq!(
            e,
            TimelineError::DeviceCount {
                schedule: 2,
                given: 3
            }
        );
        assert!(e.to_string().contains("2 devices but 3 device specs"));

        let mut devices = unit_devices(2);
        devices[1].flops_per_sec = 0.0;
        let e = simulate(&s, &devices, &LinkSpec::FREE, unit_cost(0)).unwrap_err();
        assert!(matches!(e, TimelineError::InvalidDevice { device: 1, .. }));

        let bad_link = LinkSpec {
            bandwidth_bytes_per_sec: 0.0,
            latency_sec: 0.0,
        };
        let e = simulate(&s, &unit_devices(2), &bad_link, unit_cost(0)).unwrap_err();
        assert!(matches!(e, TimelineError::InvalidLink { .. }));

        let nan_cost = |_, _| ActionCost {
            flops: f64::NAN,
            bytes: 0,
        };
        let e = simulate(&s, &unit_devices(2), &LinkSpec::FREE, nan_cost).unwrap_err();
        assert!(
            matches!(e, TimelineError::InvalidCost { device: 0, .. }),
            "{e}"
        );

        let mut broken = s.clone();
        broken.devices[1].retain(|a| *a != Action::new(ActionKind::SendGrad, 1, 0));
        let e = simulate(&broken, &unit_devices(2), &LinkSpec::FREE, unit_cost(0)).unwrap_err();
        assert!(matches!(e, TimelineError::Schedule(_)));
        assert!(
            e.to_string().starts_with("invalid schedule: device 1"),
            "{e}"
        );
    }
}
