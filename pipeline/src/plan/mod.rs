//! The planner: chooses K, the device order, the schedule, chunks per device, M, the balance and
//! each stage's re-materialization, by predicting every candidate on the simulated cluster.
//!
//! - [`profile`]: per-layer FLOPs and bytes, measured by a dry run of small micro-batches.
//! - [`cost`]: the cost model: step time by the simulator's own replay of the candidate's
//!   schedule, peak memory per device by walking its action lists.
//! - [`search`]: the search over the space, exact where the space is small.
//!
//! Data parallelism is a dimension of the space: R replicas of a K-device pipeline (R x K at
//! most the cluster's devices), predicted as the simulated cluster runs them (each replica on
//! its share of the batch, then each device's ring all-reduce of its gradients).

pub mod cost;
pub mod dp;
pub mod profile;
pub mod search;

#[cfg(test)]
mod layout_tests;

use std::fmt;

pub use cost::{Candidate, CostModel, Prediction};
pub use profile::{
    profile_layers, profile_layers_timed, Affine, LayerProfile, LossProfile, Profile, ProfileRun,
    SkipProfile, TieProfile,
};

use wgpipe_tensor::Tensor;

use crate::schedule::Schedule;
use crate::schedule::ScheduleKind;
use crate::sim::timeline::{DeviceSpec, LinkSpec};
use crate::sim::topology::Topology;
use crate::LossFn;

/// What the search may choose from.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    /// Schedule kinds to try (default: all).
    pub kinds: Vec<ScheduleKind>,
    /// Chunks per device for interleaved 1F1B and looped BFS (ZB-V and DualPipeV use 2).
    pub chunks: Vec<usize>,
    /// Micro-batch counts to try (default: 1, 2, 3, 4, 6, 8, 12, ..., 64 and K, 2K, 4K).
    pub micro_batches: Option<Vec<usize>>,
    /// At most this many devices in all, replicas included (default: all of the cluster's).
    pub max_devices: Option<usize>,
    /// At most this many data-parallel replicas (default: as many as the devices allow;
    /// `PipelineBuilder::plan` uses 1, `plan_replicated` this).
    pub max_replicas: usize,
    /// At least this many pipeline stages (devices per replica; default 1). With 1, pure data
    /// parallelism (K = 1) competes; the examples ask for 2 so that they show a pipeline.
    pub min_stages: usize,
    /// The fewest samples a micro-batch may hold (batch norm needs a few; default 1).
    pub min_micro_batch: usize,
    /// Every balance is tried when there are at most this many for a (K, chunks).
    pub exhaustive_balances: usize,
    /// How many of the best structures get their balance refined, and for how many passes.
    pub refine: usize,
    pub refine_passes: usize,
    /// Next-best plans to report.
    pub alternatives: usize,
    /// The search stops after this many layouts (R x K, taken in the order of a lower bound of
    /// their step) in a row that did not improve the best plan, even where the bound would let
    /// later ones compete: a heuristic for large clusters, where hundreds of layouts have
    /// bounds within the bubble of the best plan (`usize::MAX`: only the bound stops it).
    pub layout_patience: usize,
    /// Repetitions of each layer's timing when planning on real devices (median).
    pub measure_reps: usize,
    /// Whether a device whose stages need re-materializing to fit may checkpoint single
    /// layers inside them instead of whole stages' micro-batches (default: yes, where it
    /// recomputes less and the step comes out shorter).
    pub layer_remat: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            kinds: ScheduleKind::ALL.to_vec(),
            chunks: vec![2, 4],
            micro_batches: None,
            max_devices: None,
            max_replicas: usize::MAX,
            min_stages: 1,
            min_micro_batch: 1,
            exhaustive_balances: 64,
            refine: 4,
            refine_passes: 8,
            alternatives: 4,
            layout_patience: 24,
            measure_reps: 5,
            layer_remat: true,
        }
    }
}

/// A configuration with its prediction and its schedule (recomputes as chosen per device).
#[derive(Debug, Clone)]
pub struct Planned {
    pub candidate: Candidate,
    pub prediction: Prediction,
    pub schedule: Schedule,
}

/// The search's answer.
#[derive(Debug, Clone)]
pub struct PlanReport {
    pub best: Planned,
    /// The next best plans of other structures (order, replicas, kind, chunks, M), fastest
    /// first.
    pub alternatives: Vec<Planned>,
    /// Candidates predicted in full.
    pub evaluated: usize,
    pub search_secs: f64,
    /// What the predicted times rest on: "simulated times" (FLOPs over the cluster's rates),
    /// or the measured layer times of a plan for real devices.
    pub basis: String,
}

/// Why nothing fits: the device that overflows most in the configuration closest to fitting.
#[derive(Debug, Clone, PartialEq)]
pub struct NoFit {
    /// Cluster index of the device.
    pub device: usize,
    pub needed: u64,
    pub available: u64,
    /// The smallest per-device memory with which that configuration fits (its largest peak).
    pub smallest_memory: u64,
    /// Largest peak over capacity in that configuration (memories this many times larger fit).
    pub scale: f64,
    pub closest: Candidate,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "no configuration fits the devices' memory: in the closest one ({kind:?}, R={r}, K={k}, \
         M={m}, re-materializing every micro-batch where it overflows) device {} needs {} bytes \
         but has {}; with {} bytes on every device it fits (memories {:.2}x as large)",
        .0.device, .0.needed, .0.available, .0.smallest_memory, .0.scale,
        kind = .0.closest.kind, r = .0.closest.replicas, k = .0.closest.pipeline_devices(),
        m = .0.closest.micro_batches
    )]
    NoFit(Box<NoFit>),
    #[error("nothing to plan: {0}")]
    Empty(String),
    /// Profiling the layers or building a candidate failed.
    #[error("planner: {0}")]
    Pipeline(#[from] crate::error::PipelineError),
}

/// The fastest configuration of a profiled model for `batch` samples per step on devices
/// `specs` joined by `link` that fits every device's memory.
pub fn plan(
    profile: &Profile,
    specs: &[DeviceSpec],
    link: LinkSpec,
    batch: usize,
    options: &PlanOptions,
) -> Result<PlanReport, PlanError> {
    plan_on(profile, specs, &Topology::flat(link), batch, options)
}

/// [`plan`] on a cluster of nodes: `links` says which link joins which of `specs`' devices
/// (see [`Topology::nodes`]), and stages and replicas are placed knowing the links they cross.
pub fn plan_on(
    profile: &Profile,
    specs: &[DeviceSpec],
    links: &Topology,
    batch: usize,
    options: &PlanOptions,
) -> Result<PlanReport, PlanError> {
    links
        .check_devices(specs.len())
        .map_err(|e| PlanError::Empty(e.to_string()))?;
    let model = CostModel {
        profile,
        specs,
        links,
        batch,
    };
    search::search(&model, options)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

/// One line per plan: the table of the chosen plan and its alternatives.
fn row(f: &mut fmt::Formatter<'_>, tag: &str, p: &Planned) -> fmt::Result {
    let c = &p.candidate;
    let remat: Vec<String> = c.remat.iter().map(|m| m.to_string()).collect();
    let peaks: Vec<String> = p.prediction.peak_bytes.iter().map(|&b| mib(b)).collect();
    let layers = if c.checkpoint_layers.is_empty() {
        String::new()
    } else {
        format!(" checkpointed layers {:?}", c.checkpoint_layers)
    };
    writeln!(
        f,
        "{tag:<6} {:<14} {:>2} {:>2} {:>2} {:>4} {:>12.6} {:>6.1}%  devices {:?} balance {:?} remat [{}]{layers} peak MiB [{}]",
        format!("{:?}", c.kind),
        c.replicas,
        c.pipeline_devices(),
        c.chunks,
        c.micro_batches,
        p.prediction.step_secs,
        p.prediction.bubble_fraction * 100.0,
        c.order,
        c.balance,
        remat.join(" "),
        peaks.join(" ")
    )
}

impl fmt::Display for PlanReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan: {} candidates predicted in {:.2} s ({})",
            self.evaluated, self.search_secs, self.basis
        )?;
        writeln!(
            f,
            "{:<6} {:<14} {:>2} {:>2} {:>2} {:>4} {:>12} {:>7}",
            "", "schedule", "R", "K", "v", "M", "step s", "bubble"
        )?;
        row(f, "chosen", &self.best)?;
        for (i, p) in self.alternatives.iter().enumerate() {
            row(f, &format!("alt {}", i + 1), p)?;
        }
        Ok(())
    }
}

/// What the planner needs besides the layers and the cluster: a sample to profile on (at least
/// 2 rows of inputs and targets; the first rows are used), the loss, and the mini-batch size the
/// plan is for.
pub struct PlanInputs<'a> {
    pub inputs: &'a Tensor,
    pub targets: &'a Tensor,
    pub loss: &'a LossFn,
    pub batch: usize,
    pub options: PlanOptions,
}
