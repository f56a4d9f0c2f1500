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

use crate::microbatch::micro_batch_sizes;
use crate::partition::stage_ranges;
use crate::schedule::ScheduleKind;
use crate::schedule::{Action, ActionKind, CheckpointMode, Schedule, SkipLink};
use crate::sim::collectives::{add_to_timeline, holder_devices, replicated_timeline, TiedExchange};
use crate::sim::timeline::{simulate_valid, ActionCost, DeviceSpec, LinkSpec, Timeline};
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
    /// Re-materialization of each pipeline device's stages (K entries: every replica runs
    /// the same schedule).
    pub remat: Vec<CheckpointMode>,
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
    pub link: LinkSpec,
    pub batch: usize,
}

/// Facts of a schedule the cost model needs: which forwards are checkpointed, when each sent
/// message is surely off its sender, and which backward of a stage comes first. Removing
/// recomputes does not change the release points (they compare positions of transfers within
/// one device's list) nor the first backwards, so the facts of a uniform mode serve every mix.
pub struct ScheduleFacts {
    micro_batches: usize,
    /// By `stage * M + micro_batch`.
    checkpointed: Vec<bool>,
    /// Per device, per index of a send: the index after which the message is gone from the
    /// sender (the list's length: the end of the step).
    release: Vec<Vec<usize>>,
    /// The first backward (full or weight part) of each stage: it stores the parameter
    /// gradients, later ones add to them.
    first_backward: Vec<Option<Action>>,
}

/// Where a transfer of `link`'s `from` stage, direction and micro-batch sits: by
/// `(from * 2 + grad) * M + micro_batch` for the chain, after those by
/// `(skip id * 2 + grad) * M + micro_batch` for skips.
fn transfer_slot(a: &Action, stages: usize, m: usize) -> Option<usize> {
    a.link(stages).map(|l| {
        let grad = usize::from(l.grad);
        match l.skip {
            None => (l.from * 2 + grad) * m + a.micro_batch,
            Some(id) => (stages + id) * 2 * m + grad * m + a.micro_batch,
        }
    })
}

fn is_send(kind: ActionKind) -> bool {
    use ActionKind::*;
    matches!(kind, SendActivation | SendGrad | SendSkip | SendSkipGrad)
}

fn is_recv(kind: ActionKind) -> bool {
    use ActionKind::*;
    matches!(kind, RecvActivation | RecvGrad | RecvSkip | RecvSkipGrad)
}

impl ScheduleFacts {
    pub fn of(schedule: &Schedule) -> ScheduleFacts {
        let stages = schedule.num_stages();
        let m = schedule.num_micro_batches;
        let none = (usize::MAX, usize::MAX);
        let skips = schedule
            .actions()
            .filter_map(|(_, a)| a.skip.map(|p| p.id + 1))
            .max()
            .unwrap_or(0);
        let mut sends = vec![none; (stages + skips) * 2 * m];
        let mut recvs = vec![none; (stages + skips) * 2 * m];
        let mut checkpointed = vec![false; stages * m];
        let mut first_backward = vec![None; stages];
        for (d, list) in schedule.devices.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                match a.kind {
                    k if is_send(k) => {
                        if let Some(slot) = transfer_slot(a, stages, m) {
                            sends[slot] = (d, i);
                        }
                    }
                    k if is_recv(k) => {
                        if let Some(slot) = transfer_slot(a, stages, m) {
                            recvs[slot] = (d, i);
                        }
                    }
                    ActionKind::Recompute => checkpointed[a.stage * m + a.micro_batch] = true,
                    ActionKind::Backward | ActionKind::BackwardWeight => {
                        first_backward[a.stage].get_or_insert(*a);
                    }
                    _ => {}
                }
            }
        }
        let release = schedule
            .devices
            .iter()
            .enumerate()
            .map(|(d, list)| {
                list.iter()
                    .enumerate()
                    .map(|(i, a)| {
                        let Some(slot) = transfer_slot(a, stages, m) else {
                            return list.len();
                        };
                        if !is_send(a.kind) {
                            return list.len();
                        }
                        let (p, r) = recvs[slot];
                        if p == usize::MAX {
                            return list.len();
                        }
                        if p == d {
                            return r;
                        }
                        // The first later receive on d of something p sent after it took the
                        // message: p's list is sequential, so p had taken it by then.
                        (i + 1..list.len())
                            .find(|&j| {
                                let b = &list[j];
                                is_recv(b.kind)
                                    && transfer_slot(b, stages, m)
                                        .is_some_and(|x| sends[x].0 == p && sends[x].1 > r)
                            })
                            .unwrap_or(list.len())
                    })
                    .collect()
            })
            .collect();
        ScheduleFacts {
            micro_batches: m,
            checkpointed,
            release,
            first_backward,
        }
    }

    fn is_first_backward(&self, a: &Action) -> bool {
        self.first_backward[a.stage] == Some(*a)
    }
}

/// `schedule` with each device's recomputes kept only where its mode asks for them (the
/// schedule must have been generated with [`CheckpointMode::Always`]).
pub fn with_remat(schedule: &Schedule, remat: &[CheckpointMode]) -> Schedule {
    let m = schedule.num_micro_batches;
    let mut s = schedule.clone();
    for (d, list) in s.devices.iter_mut().enumerate() {
        list.retain(|a| a.kind != ActionKind::Recompute || remat[d].recomputes(a.micro_batch, m));
    }
    s
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
    /// Parameters, gradients and optimizer state of each pipeline device.
    pub fn static_bytes(&self) -> &[u64] {
        &self.static_bytes
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
            stages: self.stage_table(&c.balance, &sizes),
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

    /// Step time and bubble: the simulator's replay of `schedule` (assumed valid) with each
    /// action's predicted FLOPs and bytes, on every replica (`costs`: one per replica), then
    /// each device's ring all-reduce across the replicas as the simulated cluster models it.
    pub fn step_time(
        &self,
        c: &Candidate,
        costs: &[CandidateCosts],
        schedule: &Schedule,
        facts: &ScheduleFacts,
    ) -> crate::Result<(f64, f64)> {
        // The tied exchanges start when their holders' last work ends: that needs the events.
        let ties = !self.profile.ties.is_empty();
        if c.replicas <= 1 {
            let mut t = self.replay(c, &costs[0], schedule, facts, ties)?;
            self.add_tied_exchanges(c, schedule, &mut t);
            return Ok((t.makespan, t.bubble_fraction()));
        }
        let timelines = (0..c.replicas)
            .map(|r| {
                let mut t = self.replay(&c.replica(r), &costs[r], schedule, facts, true)?;
                self.add_tied_exchanges(c, schedule, &mut t);
                Ok(t)
            })
            .collect::<crate::Result<Vec<Timeline>>>()?;
        let parts: Vec<&Timeline> = timelines.iter().collect();
        let t = replicated_timeline(
            &parts,
            c.pipeline_devices(),
            &costs[0].param_bytes,
            &self.link,
        );
        Ok((t.makespan, t.bubble_fraction()))
    }

    /// Adds to one replica's timeline the exchanges of the tie groups that `c`'s balance puts
    /// on more than one device, by the rule the pipeline's own step report uses.
    fn add_tied_exchanges(&self, c: &Candidate, schedule: &Schedule, t: &mut Timeline) {
        let ranges = stage_ranges(&c.balance);
        let stage_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        let exchanges: Vec<TiedExchange> = self
            .profile
            .ties
            .iter()
            .filter_map(|tie| {
                let stages = tie.layers.iter().map(|&l| stage_of(l));
                let devices =
                    holder_devices(stages.collect::<Option<Vec<_>>>()?, &schedule.placement);
                (devices.len() > 1).then_some(TiedExchange {
                    devices,
                    bytes: tie.bytes,
                    start: 0.0,
                    end: 0.0,
                })
            })
            .collect();
        add_to_timeline(t, schedule, &exchanges, Some(&self.link));
    }

    /// One replica's simulated step (`c` of one replica); its events kept when `record`.
    fn replay(
        &self,
        c: &Candidate,
        costs: &CandidateCosts,
        schedule: &Schedule,
        facts: &ScheduleFacts,
        record: bool,
    ) -> crate::Result<Timeline> {
        let last = c.balance.len() - 1;
        let specs: Vec<DeviceSpec> = c.order.iter().map(|&d| self.specs[d]).collect();
        let timeline = simulate_valid(schedule, &specs, &self.link, record, |_, a: Action| {
            let st = costs.at(a.stage, a.micro_batch);
            let first = || facts.is_first_backward(&a);
            let flops = match a.kind {
                ActionKind::Forward => st.forward + if a.stage == last { st.loss } else { 0.0 },
                ActionKind::Recompute => st.forward,
                ActionKind::Backward if first() => st.backward - st.accumulate,
                ActionKind::Backward => st.backward,
                ActionKind::BackwardInput => st.backward_input,
                ActionKind::BackwardWeight if first() => st.backward_weight - st.accumulate,
                ActionKind::BackwardWeight => st.backward_weight,
                _ => 0.0,
            };
            let bytes = match a.kind {
                ActionKind::SendActivation => st.output,
                ActionKind::SendGrad => st.input,
                ActionKind::SendSkip | ActionKind::SendSkipGrad => costs.skip_of(&a),
                _ => 0.0,
            };
            ActionCost {
                flops: flops.max(0.0),
                bytes: bytes as u64,
            }
        })?;
        Ok(timeline)
    }

    /// (step peak, peak with the optimizer step) of pipeline device `d`. A device's walk reads
    /// its own list only (and positions of transfers in its peers'), so the device's
    /// re-materialization alone decides it.
    pub fn device_memory(
        &self,
        costs: &CandidateCosts,
        schedule: &Schedule,
        facts: &ScheduleFacts,
        d: usize,
    ) -> (u64, u64) {
        let last = costs.stages.len() - 1;
        let walk = walk_memory(schedule, facts, d, last, costs, costs.largest_param[d]);
        let step = costs.static_bytes[d] as f64 + walk;
        let with_optimizer = step.max(costs.static_bytes[d] as f64 + costs.optimizer_extra[d]);
        (step.ceil() as u64, with_optimizer.ceil() as u64)
    }

    /// A lower bound of the step: for each device, its compute, plus the forwards of the
    /// stages before its first one (its first input cannot come earlier) and, for one stage
    /// per device and whole backwards (the device's last action is then its stage's last
    /// backward), the backwards of those stages after it.
    /// With replicas, the slowest replica's (the all-reduce comes after).
    pub fn compute_bound(
        &self,
        c: &Candidate,
        costs: &[CandidateCosts],
        placement: &[usize],
    ) -> f64 {
        (0..c.replicas)
            .map(|r| self.replica_bound(&c.replica(r), &costs[r], placement))
            .fold(0.0, f64::max)
    }

    fn replica_bound(&self, c: &Candidate, costs: &CandidateCosts, placement: &[usize]) -> f64 {
        let last = c.balance.len() - 1;
        let k = c.order.len();
        let rate = |s: usize| self.specs[c.order[placement[s]]].flops_per_sec;
        let small = costs.sizes.len() - 1;
        let mut busy = vec![0f64; k];
        for (s, &d) in placement.iter().enumerate() {
            for m in 0..costs.sizes.len() {
                let x = costs.at(s, m);
                let loss = if s == last { x.loss } else { 0.0 };
                busy[d] += (x.forward + x.backward - x.accumulate + loss) / rate(s);
            }
        }
        let tail = c.chunks == 1 && c.kind.def().backward_tail;
        // The smallest micro-batch's forwards and backwards of the stages so far.
        let (mut fwd, mut bwd) = (0.0, 0.0);
        let mut bound = 0.0f64;
        let mut seen = vec![false; k];
        for (s, &d) in placement.iter().enumerate() {
            if !seen[d] {
                seen[d] = true;
                bound = bound.max(fwd + busy[d] + if tail { bwd } else { 0.0 });
            }
            let x = costs.at(s, small);
            fwd += x.forward / rate(s);
            bwd += (x.backward - x.accumulate).max(0.0) / rate(s);
        }
        bound
    }

    /// `[stage][0 or 1]`: the stage at the first micro-batch size and at the other one.
    fn stage_table(&self, balance: &[usize], sizes: &[usize]) -> Vec<[StageAt; 2]> {
        let small = *sizes.last().expect("at least one micro-batch");
        let ranges = stage_ranges(balance);
        let last = ranges.len() - 1;
        ranges
            .into_iter()
            .enumerate()
            .map(|(s, r)| {
                let local = self.skip_bytes_between(balance, s, s);
                let out = |b: usize| {
                    (s + 1..balance.len())
                        .map(|t| self.skip_bytes_between(balance, s, t)(b))
                        .sum::<f64>()
                };
                let one = |b: usize| {
                    let mut st = self.stage_at(r.clone(), s == 0, s == last, b);
                    with_local_skips(&mut st, local(b));
                    st.skip_out = out(b);
                    st
                };
                [one(sizes[0]), one(small)]
            })
            .collect()
    }

    fn stage_at(&self, r: std::ops::Range<usize>, first: bool, last: bool, b: usize) -> StageAt {
        let p = self.profile;
        let mut st = StageAt {
            input: p.input_bytes_of(r.start, b) as f64,
            ..StageAt::default()
        };
        let mut prefix = 0.0;
        let mut in_bytes = 0.0;
        // Per layer: the peak of its input part, and what it keeps for the weight part.
        let mut input_parts = Vec::with_capacity(r.len());
        for (i, l) in p.layers[r.clone()]
            .iter()
            .enumerate()
            .map(|(j, l)| (r.start + j, l))
        {
            let out = l.output_bytes.bytes(b) as f64;
            st.forward += l.forward_flops.at(b);
            st.residue += l.forward_residue_bytes.at(b);
            st.backward += if first && i <= p.first_trainable {
                l.backward_flops_from_data.at(b)
            } else {
                l.backward_flops.at(b)
            };
            st.backward_input += if first && i <= p.first_trainable {
                l.backward_input_flops_from_data.at(b)
            } else {
                l.backward_input_flops.at(b)
            };
            st.backward_weight += l.backward_weight_flops.at(b);
            st.accumulate += l.accumulate_flops;
            prefix += l.stash_bytes.at(b);
            st.forward_peak = st.forward_peak.max(prefix + l.forward_extra_bytes.at(b));
            st.no_grad_peak = st.no_grad_peak.max(in_bytes + l.no_grad_peak_bytes.at(b));
            st.backward_peak = st
                .backward_peak
                .max(prefix + out + l.backward_extra_bytes.at(b));
            // A layer's weight part may need its input, which inside a stage is the output of
            // the layer before (not in that layer's own measured keep); the stage's input is
            // held until the weight part anyway.
            let keep = l.weight_keep_bytes.at(b)
                + if i > r.start && l.param_bytes > 0 {
                    in_bytes
                } else {
                    0.0
                };
            st.keep += keep;
            input_parts.push((prefix + out + l.backward_input_extra_bytes.at(b), keep));
            st.backward_weight_peak += l.backward_weight_extra_bytes.at(b);
            in_bytes = out;
            st.output = out;
        }
        st.stash = prefix;
        // The input parts run from the last layer back; what the later layers kept is alive.
        let mut kept_after = 0.0;
        for &(peak, keep) in input_parts.iter().rev() {
            st.backward_input_peak = st.backward_input_peak.max(peak + kept_after);
            kept_after += keep;
        }
        if last {
            st.loss = p.loss.flops.at(b);
            st.loss_peak = p.loss.peak_bytes.at(b);
            st.loss_kept = p.loss.kept_bytes.at(b);
        }
        st
    }
}

/// A skip inside a stage is held from its producer's forward to its consumer's backward, with
/// its gradient during the backward: charged to the whole stage's tape (an upper bound).
fn with_local_skips(st: &mut StageAt, bytes: f64) {
    if bytes == 0.0 {
        return;
    }
    st.stash += bytes;
    st.forward_peak += bytes;
    st.no_grad_peak += bytes;
    st.backward_peak += 2.0 * bytes;
    st.backward_input_peak += 2.0 * bytes;
    st.keep += bytes;
}

/// A non-finite check of a tensor makes a temporary of its size, then sums it to a scalar.
const CHECK_SCALAR: f64 = 4.0;

/// What one (stage, micro-batch) holds on its device.
#[derive(Default, Clone, Copy)]
struct Held {
    input: f64,
    stash: f64,
    seed: f64,
    keep: f64,
    /// Skips received from earlier stages (held until the backward that returns their
    /// gradients is complete).
    skips_in: f64,
    /// Gradients of this stage's stashed skips, received from later stages.
    skip_grads: f64,
}

/// The largest bytes above parameters, gradients and state device `d` holds during a step.
fn walk_memory(
    schedule: &Schedule,
    facts: &ScheduleFacts,
    d: usize,
    last: usize,
    costs: &CandidateCosts,
    param_check: f64,
) -> f64 {
    let list = &schedule.devices[d];
    let mut held = 0.0f64;
    let mut peak = 0.0f64;
    let m_count = facts.micro_batches;
    let mut items = vec![Held::default(); schedule.num_stages() * m_count];
    // Bytes of messages by the index after which they leave the sender.
    let mut leaving = vec![0.0f64; list.len() + 1];
    // Bytes made by the last compute action that its send hands on (0 when a tape holds them).
    let mut outgoing = 0.0;
    for (i, a) in list.iter().enumerate() {
        let (s, m) = (a.stage, a.micro_batch);
        let st = costs.at(s, m);
        let it = &mut items[s * m_count + m];
        match a.kind {
            ActionKind::RecvActivation => {
                it.input = st.input;
                held += st.input;
            }
            ActionKind::RecvGrad => {
                it.seed = st.output;
                held += st.output;
            }
            ActionKind::RecvSkip => {
                let b = costs.skip_of(a);
                it.skips_in += b;
                held += b;
            }
            ActionKind::RecvSkipGrad => {
                let b = costs.skip_of(a);
                it.skip_grads += b;
                held += b;
            }
            ActionKind::Forward => {
                if s == 0 {
                    it.input = st.input;
                    held += st.input;
                    // The non-finite check of the input.
                    peak = peak.max(held + st.input + CHECK_SCALAR);
                }
                // The stashed skips as messages, until their receivers surely took them.
                held += st.skip_out;
                if facts.checkpointed[s * m_count + m] {
                    peak = peak.max(held + st.no_grad_peak);
                    outgoing = if s == last { 0.0 } else { st.output };
                    held += st.output;
                    if s == last {
                        // Until the loss is done with it.
                        peak = peak.max(held + st.loss_peak);
                        held -= st.output;
                    }
                } else {
                    peak = peak.max(held + st.forward_peak + st.skip_out);
                    // The stashed skips are roots of the tape until the backward.
                    it.stash = st.stash + st.skip_out;
                    held += it.stash;
                    outgoing = 0.0;
                    if s == last {
                        peak = peak.max(held + st.loss_peak);
                    }
                }
                held += st.residue;
                // The non-finite check of the output.
                peak = peak.max(held + st.output + CHECK_SCALAR);
                if s == last {
                    it.seed = st.output;
                    held += st.output + st.loss_kept;
                }
            }
            ActionKind::Recompute => {
                // It makes the stashed skips again, as roots of its tape (not sent again).
                peak = peak.max(held + st.forward_peak + st.skip_out);
                it.stash = st.stash + st.skip_out;
                held += it.stash;
            }
            ActionKind::Backward | ActionKind::BackwardInput => {
                let rest = held - it.stash - it.seed;
                // The popped skips' gradients (sent back) and their non-finite checks.
                let grads = it.skips_in;
                let (top, after) = if a.kind == ActionKind::Backward {
                    (st.backward_peak, it.input + it.skips_in)
                } else {
                    (st.backward_input_peak, 0.0)
                };
                let skip_top = if grads > 0.0 {
                    2.0 * grads + CHECK_SCALAR
                } else {
                    0.0
                };
                peak = peak.max(rest + top + skip_top);
                held = rest - after - it.skip_grads + grads;
                it.skip_grads = 0.0;
                if a.kind == ActionKind::Backward {
                    it.skips_in = 0.0;
                }
                if a.kind == ActionKind::BackwardInput {
                    it.keep = st.keep;
                    held += st.keep;
                } else {
                    it.input = 0.0;
                }
                it.stash = 0.0;
                it.seed = 0.0;
                outgoing = if s > 0 { st.input } else { 0.0 };
                if s > 0 {
                    // The check of the input gradient runs while the output and its gradient
                    // are still referenced: the input (in `rest`), output, seed, the input
                    // gradient and the check's temporary.
                    peak =
                        peak.max(rest + 2.0 * st.output + 2.0 * st.input + skip_top + CHECK_SCALAR);
                }
                held += outgoing;
            }
            ActionKind::BackwardWeight => {
                peak = peak.max(held + st.backward_weight_peak);
                held -= it.keep + it.input + it.skips_in;
                it.keep = 0.0;
                it.input = 0.0;
                it.skips_in = 0.0;
            }
            ActionKind::SendActivation | ActionKind::SendGrad => {
                if outgoing > 0.0 {
                    leaving[facts.release[d][i]] += outgoing;
                }
                outgoing = 0.0;
            }
            ActionKind::SendSkip | ActionKind::SendSkipGrad => {
                leaving[facts.release[d][i]] += costs.skip_of(a);
            }
            // Tied exchanges are events of the timeline, never actions.
            ActionKind::ExchangeTied => {}
        }
        peak = peak.max(held);
        held -= leaving[i];
    }
    // The end-of-step check of each parameter gradient (a temporary of its size).
    peak.max(held + param_check + CHECK_SCALAR)
}
