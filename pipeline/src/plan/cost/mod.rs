//! The planner's cost model: what a candidate configuration would do on the simulated cluster,
//! without running its arithmetic.
//!
//! Time: the candidate's schedule is replayed by the simulator itself (`timeline::simulate`),
//! each action costing the FLOPs and bytes the profile predicts for its stage and micro-batch
//! size, so the two use the same timing rules by construction; what can differ is only the
//! profile's prediction of each action's FLOPs.
//!
//! Memory: each device's action list is walked in order, adding and freeing what the executor
//! holds (received inputs, tapes or checkpointed inputs, output gradients, messages not yet
//! taken by their receiver), with each action's transient peak on top, plus parameters,
//! gradients and optimizer state. Threads run in real time, not simulated time, so a sent
//! message is counted on its sender until the sender has provably heard back from the receiver
//! after the receiver took it: the result is an upper bound of the measured peak.
//!
//! Skips: a candidate's skip links and the transfers of its schedule are those the builder
//! derives from its stage ranges, so the simulator costs each skip transfer by its profiled
//! bytes. A received skip is held by its consumer from its receive until the backward that
//! returns its gradient; the producer keeps its stash with its tape (or makes it again when it
//! re-materializes) and holds the sent message until it is surely taken; a skip inside one
//! stage is held with that stage's tape.

mod facts;
mod memory;
mod stage;
mod synth;
mod time;

use crate::microbatch::micro_batch_sizes;
use crate::partition::stage_ranges;
use crate::schedule::ScheduleKind;
use crate::schedule::{Action, CheckpointMode, Schedule, SkipLink};
use crate::sim::timeline::DeviceSpec;
use crate::sim::topology::Topology;
use crate::skips::{skip_links, SkipRoute};

use super::profile::Profile;

/// One point of the search space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The cluster device of each pipeline device, in pipeline order: R x K entries, replica
    /// r's device d at rK + d (the layout of `PipelineBuilder::replicas`).
    pub order: Vec<usize>,
    /// R, data-parallel replicas of the K-device pipeline, each on its share of the batch.
    pub replicas: usize,
    pub kind: ScheduleKind,
    /// Virtual stages per device.
    pub chunks: usize,
    pub micro_batches: usize,
    /// Layers per virtual stage.
    pub balance: Vec<usize>,
    /// Re-materialization of each (virtual) stage (K x chunks entries, in model order: a
    /// device's chunks may differ; every replica runs the same schedule).
    pub remat: Vec<CheckpointMode>,
    /// Layers re-materialized inside their stages whatever the stage's mode (global indices,
    /// ascending; `PipelineBuilder::checkpoint_layers`): the planner checkpoints layers where
    /// that recomputes less than a whole stage's mode would to fit.
    pub checkpoint_layers: Vec<usize>,
}

impl Candidate {
    /// K, the devices of one replica's pipeline.
    pub fn pipeline_devices(&self) -> usize {
        self.order.len() / self.replicas.max(1)
    }

    /// Replica `r`'s pipeline alone: its K devices as a candidate of one replica.
    pub fn replica(&self, r: usize) -> Candidate {
        let k = self.pipeline_devices();
        Candidate {
            order: self.order[r * k..(r + 1) * k].to_vec(),
            replicas: 1,
            ..self.clone()
        }
    }

    /// The same structure: devices, replicas, schedule kind, chunks and M (any balance).
    pub fn same_structure(&self, other: &Candidate) -> bool {
        self.order == other.order
            && self.replicas == other.replicas
            && self.kind == other.kind
            && self.chunks == other.chunks
            && self.micro_batches == other.micro_batches
    }
}

/// What the cost model predicts for a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub step_secs: f64,
    pub bubble_fraction: f64,
    /// Per device (R x K, as the candidate's order): the peak bytes of a training step (what
    /// its report's memory shows).
    pub step_peak_bytes: Vec<u64>,
    /// Per device: the peak including the optimizer step.
    pub peak_bytes: Vec<u64>,
    /// Per device: parameters, gradients and optimizer state.
    pub static_bytes: Vec<u64>,
}

/// The sums and peaks of one stage's layers at one micro-batch size.
#[derive(Debug, Clone, Copy, Default)]
struct StageAt {
    forward: f64,
    backward: f64,
    backward_input: f64,
    backward_weight: f64,
    accumulate: f64,
    /// The part of `accumulate` in the input part of a split backward (layers re-materialized
    /// inside the stage run their whole backward there).
    accumulate_input: f64,
    loss: f64,
    input: f64,
    output: f64,
    stash: f64,
    forward_peak: f64,
    no_grad_peak: f64,
    backward_peak: f64,
    backward_input_peak: f64,
    keep: f64,
    backward_weight_peak: f64,
    loss_peak: f64,
    loss_kept: f64,
    /// Left by each forward until the step ends.
    residue: f64,
    /// Skips this stage stashes for later stages.
    skip_out: f64,
}

/// A profile on a cluster, for one mini-batch size.
#[derive(Clone, Copy)]
pub struct CostModel<'a> {
    pub profile: &'a Profile,
    pub specs: &'a [DeviceSpec],
    /// The links between the cluster's devices (indexed as `specs`): each transfer and each
    /// all-reduce is priced on the links it crosses.
    pub links: &'a Topology,
    pub batch: usize,
}

/// A candidate's per-stage costs at its micro-batch sizes, and its per-device constants (of
/// one replica, at that replica's share of the batch).
#[derive(Clone)]
pub struct CandidateCosts {
    sizes: Vec<usize>,
    /// The samples these costs are for (one replica's share).
    batch: usize,
    /// Bytes of each skip link (by id) at the first micro-batch size and at the other one.
    skip_bytes: Vec<[f64; 2]>,
    stages: Vec<[StageAt; 2]>,
    static_bytes: Vec<u64>,
    optimizer_extra: Vec<f64>,
    largest_param: Vec<f64>,
    /// Parameter bytes of each pipeline device: what its all-reduce across replicas carries.
    param_bytes: Vec<u64>,
}

impl CandidateCosts {
    /// Seconds that re-materializing `stage` under `mode` adds to a step: its forward run again
    /// for each micro-batch the mode recomputes.
    pub fn recompute_secs(&self, stage: usize, mode: CheckpointMode) -> f64 {
        let m = self.sizes.len();
        (0..m)
            .filter(|&mb| mode.recomputes(mb, m))
            .map(|mb| self.at(stage, mb).forward)
            .sum()
    }
    /// Recomputed FLOPs (seconds on a timed profile) of a step's forwards of layers `layers`,
    /// re-materialized inside their stages: each runs again for every micro-batch.
    pub fn layer_recompute(&self, model: &CostModel, layers: &[usize]) -> f64 {
        self.sizes
            .iter()
            .map(|&b| {
                layers
                    .iter()
                    .map(|&l| model.profile.layers[l].forward_flops.at(b))
                    .sum::<f64>()
            })
            .sum()
    }

    /// Stage `s`'s costs again, after `c.checkpoint_layers` changed.
    pub fn restage(&mut self, model: &CostModel, c: &Candidate, s: usize) {
        self.stages[s] = model.stage_entry(&c.balance, &c.checkpoint_layers, &self.sizes, s);
    }

    /// Parameters, gradients and optimizer state of each pipeline device.
    pub fn static_bytes(&self) -> &[u64] {
        &self.static_bytes
    }
    /// The samples these costs are for (one replica's share).
    pub fn batch(&self) -> usize {
        self.batch
    }
    fn size_index(&self, micro_batch: usize) -> usize {
        usize::from(self.sizes[micro_batch] != self.sizes[0])
    }
    fn at(&self, stage: usize, micro_batch: usize) -> &StageAt {
        &self.stages[stage][self.size_index(micro_batch)]
    }
    /// Bytes of the skip a skip transfer `a` carries (0 for other actions).
    fn skip_of(&self, a: &Action) -> f64 {
        a.skip.map_or(0.0, |p| {
            self.skip_bytes[p.id][self.size_index(a.micro_batch)]
        })
    }
}

impl CostModel<'_> {
    /// Predicts time and memory of `c` run with `schedule` (its schedule, recomputes as its
    /// `remat` says; validated here) and `facts` of that schedule.
    pub fn predict(
        &self,
        c: &Candidate,
        schedule: &Schedule,
        facts: &ScheduleFacts,
    ) -> crate::Result<Prediction> {
        schedule.validate()?;
        let costs = self.replica_costs(c, &schedule.placement)?;
        let (step_secs, bubble_fraction) = self.step_time(c, &costs, schedule, facts)?;
        let k = c.pipeline_devices();
        let (step_peak_bytes, peak_bytes) = costs
            .iter()
            .flat_map(|rc| (0..k).map(move |d| self.device_memory(rc, schedule, facts, d)))
            .unzip();
        Ok(Prediction {
            step_secs,
            bubble_fraction,
            step_peak_bytes,
            peak_bytes,
            static_bytes: costs
                .iter()
                .flat_map(|rc| rc.static_bytes.clone())
                .collect(),
        })
    }

    /// Each replica's share of the mini-batch, as the pipeline splits it.
    pub fn shards(&self, replicas: usize) -> crate::Result<Vec<usize>> {
        micro_batch_sizes(self.batch, replicas)
            .map_err(|e| crate::PipelineError::Config(format!("{replicas} replicas: {e}")))
    }

    /// The costs of each of `c`'s replicas (of one replica's pipeline at that replica's share
    /// of the batch; replicas with equal shares share them).
    pub fn replica_costs(
        &self,
        c: &Candidate,
        placement: &[usize],
    ) -> crate::Result<Vec<CandidateCosts>> {
        let one = c.replica(0);
        let mut out: Vec<CandidateCosts> = Vec::with_capacity(c.replicas);
        for (r, shard) in self.shards(c.replicas)?.into_iter().enumerate() {
            let same = (r > 0 && out[r - 1].batch == shard).then(|| out[r - 1].clone());
            let costs = match same {
                Some(costs) => costs,
                None => CostModel {
                    batch: shard,
                    ..*self
                }
                .costs(&one, placement)?,
            };
            out.push(costs);
        }
        Ok(out)
    }

    /// The costs of `c`'s stages placed by `placement` (stage -> pipeline device).
    pub fn costs(&self, c: &Candidate, placement: &[usize]) -> crate::Result<CandidateCosts> {
        let sizes = micro_batch_sizes(self.batch, c.micro_batches)
            .map_err(|e| crate::PipelineError::Config(e.to_string()))?;
        let k = c.order.len();
        let mut static_bytes = vec![0u64; k];
        let mut optimizer_extra = vec![0f64; k];
        let mut largest_param = vec![0f64; k];
        let mut param_bytes = vec![0u64; k];
        for (s, r) in stage_ranges(&c.balance).into_iter().enumerate() {
            let d = placement[s];
            for l in &self.profile.layers[r] {
                static_bytes[d] += l.param_bytes + l.grad_bytes + l.optimizer_state_bytes;
                param_bytes[d] += l.param_bytes;
                optimizer_extra[d] += l.optimizer_step_bytes as f64;
                largest_param[d] = largest_param[d].max(l.param_bytes as f64);
            }
        }
        let small = *sizes.last().expect("at least one micro-batch");
        let skip_bytes = self
            .skip_links(&c.balance)
            .iter()
            .map(|l| {
                let b = self.skip_bytes_between(&c.balance, l.from, l.to);
                [b(sizes[0]), b(small)]
            })
            .collect();
        Ok(CandidateCosts {
            stages: self.stage_table(&c.balance, &c.checkpoint_layers, &sizes),
            skip_bytes,
            sizes,
            batch: self.batch,
            static_bytes,
            optimizer_extra,
            largest_param,
            param_bytes,
        })
    }

    /// The skip links of a balance, numbered as the builder numbers them.
    pub fn skip_links(&self, balance: &[usize]) -> Vec<SkipLink> {
        if self.profile.skips.is_empty() {
            return Vec::new();
        }
        skip_links(
            self.profile.skips.iter().map(|s| &s.edge),
            &stage_ranges(balance),
            SkipRoute::Direct,
        )
        .0
    }

    /// The bytes of the skips from stage `from` to stage `to` (both ends in one stage when
    /// equal), as a function of the micro-batch size.
    fn skip_bytes_between(
        &self,
        balance: &[usize],
        from: usize,
        to: usize,
    ) -> impl Fn(usize) -> f64 + '_ {
        let ranges = stage_ranges(balance);
        let chosen: Vec<usize> = self
            .profile
            .skips
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                ranges[from].contains(&s.edge.producer) && ranges[to].contains(&s.edge.consumer)
            })
            .map(|(i, _)| i)
            .collect();
        move |b| {
            chosen
                .iter()
                .map(|&i| self.profile.skips[i].bytes.at(b))
                .sum()
        }
    }
}

pub use facts::{with_remat, ScheduleFacts};
