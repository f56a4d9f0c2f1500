//! What one training step did: time, bubble, per-stage busy time and memory, bytes moved.

use std::fmt::Write as _;
use std::ops::Range;

use wgpipe_tensor::{DType, MemoryStats, Tag};

use crate::error::Result;
use crate::exec::worker::StageOutcome;
use crate::exec::worker::{ActionRecord, NonFiniteAt};
use crate::schedule::Action;
use crate::schedule::Schedule;
use crate::sim::collectives::{add_to_timeline, TiedExchange};
use crate::sim::timeline::{simulate_on, ActionCost};
use crate::sim::timeline::{Event, Timeline};
use crate::sim::trace::{chrome_trace_json_on, svg_timeline_on, Clock};
use crate::sim::SimCluster;

/// One device's share of a step (a pipeline stage, or several virtual stages when the schedule
/// places more than one chunk on a device).
#[derive(Debug, Clone)]
pub struct StageReport {
    /// The device index in the pipeline (its row in the timeline).
    pub stage: usize,
    pub device: String,
    /// The virtual stages (chunks) the device holds, in model order.
    pub chunks: Vec<usize>,
    /// Global indices of the layers of each chunk.
    pub layers: Vec<Range<usize>>,
    pub num_params: usize,
    /// Wall seconds spent in forward, backward and recompute.
    pub busy_secs: f64,
    /// FLOPs counted on the stage's device during the stage's compute actions.
    pub flops: f64,
    /// Bytes this stage sent to its neighbours.
    pub bytes_sent: u64,
    /// Messages this stage sent to its neighbours (one per tensor).
    pub messages_sent: u64,
    /// Memory counters of the stage's device, with peaks since the step began. By tag:
    /// `Activations` are forward values (stashed stage inputs, saved tensors of the tapes,
    /// recomputes, activations in flight); `Gradients` are the accumulated parameter gradients
    /// and everything the backward pass allocates (received and sent gradients, per-micro-batch
    /// parameter gradients before accumulation). Stages that share one device (e.g. the same
    /// `Device::cpu()` given twice) share these counters and its FLOP counter: give each stage
    /// its own device (`Device::new_cpu`, a `SimCluster`) for per-stage figures.
    pub memory: MemoryStats,
}

impl StageReport {
    pub fn peak_activations(&self) -> usize {
        self.memory.peak_of(Tag::Activations)
    }
}

/// The simulated view of a step (labelled simulated wherever it is printed).
#[derive(Debug, Clone)]
pub struct SimReport {
    pub makespan_secs: f64,
    /// Idle share of the step: 1 − Σ busy / (K × makespan).
    pub bubble_fraction: f64,
    /// Idle share inside each device's own span (see [`Timeline::steady_bubble_fraction`]).
    pub steady_bubble_fraction: f64,
    pub timeline: Timeline,
}

/// Everything measured in one `train_step`.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: u64,
    /// Mean loss over the mini-batch.
    pub loss: f32,
    pub num_micro_batches: usize,
    pub wall_secs: f64,
    /// Idle share of stage time measured on the wall clock: 1 − Σ busy / (K × wall).
    pub wall_bubble_fraction: f64,
    /// The measured timeline (wall-clock seconds since the step began).
    pub wall_timeline: Timeline,
    pub stages: Vec<StageReport>,
    pub simulated: Option<SimReport>,
    /// Under [`crate::NonFinite::SkipStep`]: where NaN or infinity first appeared, when it did;
    /// the step's gradients were then dropped and the optimizer step must be skipped.
    pub skipped: Option<NonFiniteAt>,
    /// With loss scaling: the scale this step's backward was seeded with (its gradients carry
    /// it until `clip_grad_norm` or `optimizer_step` unscales them).
    pub loss_scale: Option<f32>,
}

impl StepReport {
    pub fn bytes_sent(&self) -> u64 {
        self.stages.iter().map(|s| s.bytes_sent).sum()
    }

    /// The bubble fraction to show: simulated when in simulated mode, else measured.
    pub fn bubble_fraction(&self) -> f64 {
        self.simulated
            .as_ref()
            .map_or(self.wall_bubble_fraction, |s| s.bubble_fraction)
    }

    /// The timeline to show and its clock: simulated in simulated mode, else measured.
    pub fn timeline(&self) -> (&Timeline, Clock) {
        match &self.simulated {
            Some(s) => (&s.timeline, Clock::Simulated),
            None => (&self.wall_timeline, Clock::Wall),
        }
    }

    /// [`StepReport::timeline`] as Chrome trace-event JSON, labelled with its clock.
    pub fn chrome_trace_json(&self, label: &str) -> String {
        let (t, clock) = self.timeline();
        chrome_trace_json_on(t, label, clock)
    }

    /// [`StepReport::timeline`] as an SVG picture, labelled with its clock.
    pub fn svg_timeline(&self, title: &str) -> String {
        let (t, clock) = self.timeline();
        svg_timeline_on(t, title, clock)
    }

    /// A per-device summary table (markdown): a row per device, with the virtual stages
    /// (chunks) it holds and their layers.
    pub fn stage_table(&self) -> String {
        let mut s = String::new();
        let sim = self.simulated.is_some();
        let _ = writeln!(
            s,
            "| device | name | stages (chunks) | layers | params | busy % (wall) | peak params MiB | peak grads MiB | peak optim MiB | peak activations MiB | peak f32 / f16 / bf16 MiB | sent MiB |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for st in &self.stages {
            let mib = |t: Tag| st.memory.peak_of(t) as f64 / (1 << 20) as f64;
            let by_dtype = DType::ALL
                .map(|d| {
                    format!(
                        "{:.2}",
                        st.memory.peak_of_dtype(d) as f64 / (1 << 20) as f64
                    )
                })
                .join(" / ");
            let busy = if self.wall_secs > 0.0 {
                100.0 * st.busy_secs / self.wall_secs
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.2} |",
                st.stage,
                st.device,
                st.chunks
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                st.layers
                    .iter()
                    .map(|r| format!("{}..{}", r.start, r.end))
                    .collect::<Vec<_>>()
                    .join(" + "),
                st.num_params,
                busy,
                mib(Tag::Parameters),
                mib(Tag::Gradients),
                mib(Tag::OptimizerState),
                mib(Tag::Activations),
                by_dtype,
                st.bytes_sent as f64 / (1 << 20) as f64
            );
        }
        if let Some(simr) = &self.simulated {
            let _ = writeln!(
                s,
                "\nsimulated step time {:.3} ms, simulated bubble {:.1}% (steady {:.1}%)",
                simr.makespan_secs * 1e3,
                simr.bubble_fraction * 100.0,
                simr.steady_bubble_fraction * 100.0
            );
        } else if !sim {
            let _ = writeln!(
                s,
                "\nwall step time {:.3} ms, measured bubble {:.1}%",
                self.wall_secs * 1e3,
                self.wall_bubble_fraction * 100.0
            );
        }
        s
    }
}

/// Builds the wall-clock timeline from the workers' records (one list per device): compute
/// actions as compute events, and each receive from another device as a transfer from its sender
/// (the hand-off copy runs on the receiver).
pub(crate) fn wall_timeline(
    schedule: &Schedule,
    records: &[Vec<ActionRecord>],
    wall: f64,
) -> Timeline {
    let mut events = Vec::new();
    let mut busy = vec![0.0; records.len()];
    for (device, recs) in records.iter().enumerate() {
        for r in recs {
            let a = r.action;
            let (from, to) = match a.kind {
                _ if a.is_compute() => (device, None),
                kind if kind.is_recv() => {
                    let Some(link) = a.link(schedule.num_stages()) else {
                        continue;
                    };
                    let from = schedule.placement[link.from];
                    if from == device {
                        continue; // a hand-over between chunks of one device
                    }
                    (from, Some(device))
                }
                _ => continue,
            };
            if a.is_compute() {
                busy[device] += r.end - r.start;
            }
            let stage = a.link(schedule.num_stages()).map_or(a.stage, |l| l.from);
            events.push(Event {
                device: from,
                stage,
                chunk: schedule.chunk_of(stage),
                kind: a.kind.as_send(),
                micro_batch: a.micro_batch,
                start: r.start,
                end: r.end,
                peer: to,
            });
        }
    }
    events.sort_by(|a, b| a.start.total_cmp(&b.start).then(a.device.cmp(&b.device)));
    Timeline {
        events,
        makespan: wall,
        busy,
        collectives: Vec::new(),
    }
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
        add_to_timeline(
            &mut s.timeline,
            schedule,
            exchanges,
            Some(cluster.topology()),
        );
        s.makespan_secs = s.timeline.makespan;
        s.bubble_fraction = s.timeline.bubble_fraction();
        s.steady_bubble_fraction = s.timeline.steady_bubble_fraction();
    }
}

impl crate::train::replica::Replica {
    /// The step's report; `memory`: each device's counters read elsewhere (over MPI), else
    /// this process reads them.
    pub(super) fn report(
        &self,
        schedule: &Schedule,
        step: u64,
        outcomes: Vec<StageOutcome>,
        wall: f64,
        loss: f32,
        memory: Option<Vec<wgpipe_tensor::memory::MemoryStats>>,
    ) -> Result<StepReport> {
        ReportFrame::of(self, schedule).report(
            schedule,
            step,
            outcomes,
            wall,
            loss,
            memory,
            self.sim.as_ref(),
        )
    }
}

/// What a step's report needs of a replica besides the step's records: each device's handle
/// (its name and memory counters), the layers of its chunks and their parameter count. Taken
/// once before a run that lends the stages to long-lived device threads (steps back to back),
/// so that each step's report is made while the stages are away.
pub(crate) struct ReportFrame {
    devices: Vec<DeviceFrame>,
}

struct DeviceFrame {
    device: wgpipe_tensor::Device,
    chunks: Vec<usize>,
    layers: Vec<Range<usize>>,
    num_params: usize,
}

impl ReportFrame {
    pub(crate) fn of(replica: &crate::train::replica::Replica, schedule: &Schedule) -> Self {
        let stages = replica.stages();
        let devices = replica
            .device_stages(schedule)
            .into_iter()
            .enumerate()
            .map(|(d, first)| {
                let chunks = schedule.stages_of(d);
                DeviceFrame {
                    device: first.device.clone(),
                    layers: chunks
                        .iter()
                        .map(|&c| {
                            let s = &stages[c];
                            s.first_layer..s.first_layer + s.layers.len()
                        })
                        .collect(),
                    num_params: chunks.iter().map(|&c| stages[c].num_params()).sum(),
                    chunks,
                }
            })
            .collect();
        ReportFrame { devices }
    }

    /// The report of a step whose devices gave `outcomes`, on the replica's simulated cluster
    /// `sim` (if any).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn report(
        &self,
        schedule: &Schedule,
        step: u64,
        outcomes: Vec<StageOutcome>,
        wall: f64,
        loss: f32,
        memory: Option<Vec<wgpipe_tensor::memory::MemoryStats>>,
        sim: Option<&SimCluster>,
    ) -> Result<StepReport> {
        let messages: Vec<u64> = outcomes.iter().map(|o| o.messages_sent).collect();
        let records: Vec<Vec<ActionRecord>> = outcomes.into_iter().map(|o| o.records).collect();
        let timeline = wall_timeline(schedule, &records, wall);
        let stages = self
            .devices
            .iter()
            .zip(&records)
            .enumerate()
            .map(|(d, (frame, recs))| StageReport {
                stage: d,
                device: frame.device.name().to_string(),
                layers: frame.layers.clone(),
                num_params: frame.num_params,
                chunks: frame.chunks.clone(),
                busy_secs: timeline.busy[d],
                flops: recs.iter().map(|r| r.flops).sum(),
                bytes_sent: recs.iter().map(|r| r.bytes).sum(),
                messages_sent: messages[d],
                memory: memory
                    .as_ref()
                    .and_then(|m| m.get(d).cloned())
                    .unwrap_or_else(|| frame.device.memory_stats()),
            })
            .collect();
        let simulated = match sim {
            Some(cluster) => {
                let cost = |device: usize, action: Action| {
                    records[device]
                        .iter()
                        .find(|r| r.action == action)
                        .map(|r| ActionCost {
                            flops: r.flops,
                            bytes: r.bytes,
                        })
                        .unwrap_or_default()
                };
                let t = simulate_on(schedule, cluster.specs(), cluster.topology(), cost)?;
                Some(SimReport {
                    makespan_secs: t.makespan,
                    bubble_fraction: t.bubble_fraction(),
                    steady_bubble_fraction: t.steady_bubble_fraction(),
                    timeline: t,
                })
            }
            None => None,
        };
        Ok(StepReport {
            step,
            loss,
            num_micro_batches: schedule.num_micro_batches,
            wall_secs: wall,
            wall_bubble_fraction: timeline.bubble_fraction(),
            wall_timeline: timeline,
            stages,
            simulated,
            skipped: None,
            loss_scale: None,
        })
    }
}
