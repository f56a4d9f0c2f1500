//! `Pipeline`: a sequence of modules cut into stages on devices, trained GPipe-style, as a
//! group of data-parallel [`Replica`]s (one without data parallelism) and what they share: the
//! schedule, the optimizers' settings, the loss scaler, the step counter and the step
//! communicator.
//!
//! `train_step` splits the mini-batch into one shard per replica and each shard into
//! micro-batches, runs every replica's devices over the schedule, agrees on the outcome through
//! the step communicator, reduces the gradients across replicas, and leaves them for
//! `optimizer_step`. After a step the gradients equal those of plain training on the whole
//! mini-batch (up to summation order), whatever R, K, M, schedule and checkpoint mode. The
//! replicas may all be in this process or one per group of MPI ranks: the path through this
//! code is the same (see [`crate::exec::comm`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{ModelFactory, Module, Param};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result};
use crate::exec::comm::{at_replica, ReplicaRun, StepComm};
use crate::exec::transport::Transport;
use crate::exec::Stage;
use crate::microbatch::split_batch;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;
use crate::sim::{SimCluster, Topology};
use crate::train::builder::PipelineBuilder;
use crate::train::replica::{Replica, ReplicaStep, Saved, StepCtx};
use crate::train::replicas::{copy_buffers, merge_reports};
use crate::train::report::StepReport;
use crate::train::scaler::{GradScaler, ScalerState};
use crate::train::workers::{LossUse, StuckStep};
use crate::LossFn;

pub struct Pipeline {
    /// The replicas this process runs: all R in one process, one per process over MPI. The
    /// accessors (parameters, stages, devices, reports of K) describe the first.
    pub(crate) replicas: Vec<Replica>,
    pub(crate) schedule: Schedule,
    /// What the replicas and processes of a step agree on.
    pub(crate) comm: Box<dyn StepComm>,
    pub(crate) transport: Transport,
    pub(crate) seed: u64,
    pub(crate) step: u64,
    pub(crate) non_finite: NonFinite,
    pub(crate) action_timeout: Option<Duration>,
    /// `train_step` (and agreement) calls so far, failed ones included: what keeps one call's
    /// messages apart from another's (the step counter does not advance on a failed step).
    pub(crate) round: u64,
    /// The dtype the layers compute in (see [`wgpipe_autograd::ForwardCtx::compute`]).
    pub(crate) precision: DType,
    /// Dynamic loss scaling.
    pub(crate) scaler: Option<GradScaler>,
    /// The factor the accumulated gradients carry since the last optimizer step (`None`: no
    /// scaled gradients; 1 once [`Pipeline::clip_grad_norm`] has unscaled them).
    /// A cell so that `clip_grad_norm` and `zero_grad` keep taking `&self`.
    pub(crate) grads_scale: std::cell::Cell<Option<f32>>,
    /// A step since the last optimizer step overflowed: that optimizer step is skipped.
    pub(crate) overflowed: bool,
}

impl Pipeline {
    /// Starts a builder over `layers` (see [`PipelineBuilder`]).
    pub fn builder(layers: Vec<Box<dyn Module>>) -> PipelineBuilder {
        PipelineBuilder::new(layers)
    }

    /// Starts a builder over the model `factory` builds, layer range by layer range: each
    /// layer is built alone once to be described (names, shapes, tie groups, skips, costs) and
    /// dropped, and [`PipelineBuilder::build`] materializes only the stages this process holds
    /// (over MPI, one rank's; in one process, all of them). The factory's rule (each layer's
    /// values from the seed and its index only) makes every layout start from the same
    /// parameters, bit for bit. `Balance::ByTime` and the planner run the layers, so they need
    /// [`Pipeline::builder`].
    pub fn builder_from(factory: Arc<dyn ModelFactory>) -> Result<PipelineBuilder> {
        PipelineBuilder::from_factory(factory)
    }

    /// The first replica held here (what the accessors describe).
    fn first(&self) -> &Replica {
        &self.replicas[0]
    }

    /// R: the number of data-parallel replicas of the job (1 without data parallelism).
    pub fn num_replicas(&self) -> usize {
        self.comm
            .replicas(self.schedule.num_devices(), self.replicas.len())
            .0
    }

    /// The replicas this process runs, e.g. to check that they stay identical (all R in one
    /// process; this rank's one over MPI).
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// Over MPI, where each rank holds and trains only its device's stages: every rank gets
    /// every stage's current parameters, buffers and optimizer state from the rank that trains
    /// it, so that each holds the whole trained model (to evaluate, sample, or save it to one
    /// file). `make_layers` builds the whole model again (as it was given to the builder; its
    /// values do not matter): the layers of the stages this rank does not hold come from it.
    /// Every rank must call it at the same point. Nothing to do in one process.
    pub fn gather_stages(
        &mut self,
        make_layers: impl FnOnce() -> Vec<Box<dyn Module>>,
    ) -> Result<()> {
        self.check_settled()?;
        let first = &mut self.replicas[0];
        if first.stages.iter().any(|s| !s.is_held()) {
            crate::exec::absent::restore(&mut first.stages, make_layers())?;
        }
        self.round += 1;
        self.comm.gather_stages(
            self.round,
            &self.schedule,
            &first.stages,
            &mut first.optimizers,
        )
    }

    /// This process's rank in a job spread over processes (0 in one process): the one that
    /// prints and writes files is rank 0.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// S: the number of (virtual) stages the model is cut into.
    pub fn num_stages(&self) -> usize {
        self.first().stages.len()
    }
    /// K: the number of devices the stages are placed on (S / chunks per device).
    pub fn num_devices(&self) -> usize {
        self.schedule.num_devices()
    }
    pub fn num_micro_batches(&self) -> usize {
        self.schedule.num_micro_batches
    }
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
    pub fn stages(&self) -> &[Stage] {
        self.first().stages()
    }
    /// Layers per (virtual) stage, in model order.
    pub fn balance(&self) -> Vec<usize> {
        self.stages().iter().map(|s| s.layers.len()).collect()
    }
    /// The device of each (virtual) stage, in model order.
    pub fn devices(&self) -> Vec<Device> {
        self.first().devices()
    }
    /// Steps taken so far (the RNG key of the next step).
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// Sets the step counter (e.g. after loading a checkpoint), so that the RNG streams keyed
    /// by step (dropout) continue exactly where the saved run left off.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }
    pub fn sim_cluster(&self) -> Option<&SimCluster> {
        self.first().sim.as_ref()
    }

    /// Every parameter, named `<global layer index>.<name inside the layer>`.
    pub fn named_parameters(&self) -> Vec<(String, Param)> {
        self.first().named_parameters()
    }

    /// Every buffer (e.g. batch-norm running statistics), named like the parameters.
    pub fn named_buffers(&self) -> Vec<(String, Param)> {
        self.first().named_buffers()
    }

    /// The layers back, in order (e.g. to run them plain or rebuild the pipeline). Over MPI,
    /// the layers of stages other ranks hold are placeholders (see [`Pipeline::gather_stages`]).
    pub fn into_layers(mut self) -> Vec<Box<dyn Module>> {
        let first = self.replicas.swap_remove(0);
        first.stages.into_iter().flat_map(|s| s.layers).collect()
    }

    /// Train or eval mode for every layer.
    pub fn set_train(&mut self, train: bool) {
        for r in &mut self.replicas {
            for s in &mut r.stages {
                for l in &mut s.layers {
                    l.set_train(train);
                }
            }
        }
    }

    /// Runs forward and backward of every micro-batch of `(inputs, targets)` (split along axis
    /// 0), accumulating gradients into the parameters. The loss of each micro-batch is its mean
    /// loss times its share of the mini-batch, so the reported loss and the gradients are those
    /// of the mean loss over the whole mini-batch. On error every stage is stopped, every thread
    /// joined, and the gradients are put back as they were before the call. With an action
    /// time limit ([`Pipeline::set_action_timeout`]), an action that runs past it makes the step
    /// return an error at once; its thread is left to finish (see [`Pipeline::settle`]).
    ///
    /// With R replicas the mini-batch is split into R shards (sizes differing by at most one),
    /// each replica runs the step above on its shard, and every parameter's gradient becomes
    /// the shard-weighted average over the replicas, the same on every replica; a failure (or a
    /// skip) on any replica leaves every replica as before.
    pub fn train_step(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &LossFn,
    ) -> Result<StepReport> {
        let scale = self.scaler.as_ref().map(|s| s.state.scale);
        if let (Some(scale), Some(carried)) = (scale, self.grads_scale.get()) {
            if carried != scale {
                return Err(PipelineError::Config(format!(
                    "train_step: the gradients accumulated so far carry a loss scale of {carried} \
                     (clip_grad_norm unscales them), this step's would carry {scale}: call \
                     optimizer_step (or zero_grad) before the next train_step"
                )));
            }
        }
        let mut report = self.step_replicas(inputs, targets, loss_fn, scale)?;
        self.note_scaled_step(&mut report, scale);
        Ok(report)
    }

    /// What a step trained with the loss scale `scale` (`None`: no loss scaling) leaves for
    /// the optimizer step: an overflow makes it skip, else the gradients carry the scale.
    pub(super) fn note_scaled_step(&mut self, report: &mut StepReport, scale: Option<f32>) {
        if let Some(scale) = scale {
            if report.skipped.is_some() {
                self.overflowed = true;
            } else {
                self.grads_scale.set(Some(scale));
            }
            report.loss_scale = Some(scale);
        }
    }

    /// The dtype the layers compute in (set by [`PipelineBuilder::precision`]).
    pub fn precision(&self) -> DType {
        self.precision
    }

    /// The loss scaler's state (`None` without loss scaling).
    pub fn loss_scaler(&self) -> Option<ScalerState> {
        self.scaler.as_ref().map(|s| s.state)
    }

    /// [`Pipeline::train_step`] once the loss scale is known: every held replica's part, the
    /// agreement, then (unless a replica failed or skipped) the tied-weight exchange, the
    /// gradient reduction and the buffers; all or nothing across replicas and processes.
    fn step_replicas(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &LossFn,
        loss_scale: Option<f32>,
    ) -> Result<StepReport> {
        self.settle()?;
        self.round += 1;
        let held = self.replicas.len();
        let (r, first) = self.comm.replicas(self.schedule.num_devices(), held);
        let shards = shard_batch(inputs, targets, r)?;
        let weights: Vec<f32> = shards.iter().map(|s| s.2).collect();
        let saved: Vec<Saved> = self.replicas.iter().map(Saved::take).collect();
        // The step's clock: every replica's records, and the reduction's, are on it.
        let clock = Instant::now();
        let grads_final = match self.replicas.as_slice() {
            [one] => {
                self.comm
                    .begin_round(self.round, &self.schedule, &one.stages, &weights, clock)
            }
            _ => None,
        };
        let ctx = StepCtx {
            schedule: &self.schedule,
            transport: &self.transport,
            seed: self.seed,
            step: self.step,
            round: self.round,
            // Loss scaling needs to find overflows and skip, whatever the policy.
            non_finite: if loss_scale.is_some() {
                NonFinite::SkipStep
            } else {
                self.non_finite
            },
            precision: self.precision,
            action_timeout: self.action_timeout,
            loss_seed: loss_scale.unwrap_or(1.0),
            grads_final,
            clock,
            forward_only: false,
            kv_position: None,
            replicas_running: held,
        };
        let steps = run_held(
            &mut self.replicas,
            &ctx,
            &shards[first..first + held],
            LossUse::Train(loss_fn),
        );

        // A replica that timed out keeps its stuck threads; the others are put back.
        let mut runs = Vec::with_capacity(held);
        let mut timed_out = None;
        for (i, (step, saved)) in steps.into_iter().zip(saved).enumerate() {
            match step {
                Ok(ReplicaStep::TimedOut(error, handles)) if timed_out.is_none() => {
                    self.replicas[i].stuck = Some(StuckStep {
                        handles,
                        saved,
                        what: error.to_string(),
                    });
                    timed_out = Some(at_replica(error, i, held));
                }
                step => runs.push((i, step, saved)),
            }
        }
        if let Some(error) = timed_out {
            self.comm.fail_round(self.round, &error);
            for (i, _, saved) in runs {
                saved.restore(&self.replicas[i].stages);
            }
            return Err(error);
        }
        let mut saved = Vec::with_capacity(held);
        let mut walls = Vec::with_capacity(held);
        let mut agreeing = Vec::with_capacity(held);
        for (i, step, s) in runs {
            saved.push(s);
            let (outcome, losses, wall) = match step {
                Ok(ReplicaStep::Done {
                    outcome,
                    losses,
                    wall,
                }) => (outcome, losses, wall),
                Ok(ReplicaStep::TimedOut(error, _)) | Err(error) => (Err(error), Vec::new(), 0.0),
            };
            walls.push(wall);
            agreeing.push(ReplicaRun {
                outcome,
                losses,
                weight: weights[first + i],
                stages: &self.replicas[i].stages,
            });
        }
        let restore_all = |replicas: &[Replica], saved: Vec<Saved>| {
            for (rep, s) in replicas.iter().zip(saved) {
                s.restore(&rep.stages);
            }
        };
        let agreed = match self.comm.agree(self.round, &self.schedule, agreeing) {
            Ok(a) => a,
            Err(e) => {
                restore_all(&self.replicas, saved);
                return Err(e);
            }
        };
        let mut tied = vec![Vec::new(); held];
        let mut reduced = (0.0, 0.0);
        let mut buckets = Vec::new();
        if agreed.skipped.is_some() {
            restore_all(&self.replicas, saved);
        } else {
            match self.reduce(&weights, clock) {
                Ok((t, span, b)) => (tied, reduced, buckets) = (t, span, b),
                Err(e) => {
                    restore_all(&self.replicas, saved);
                    return Err(e);
                }
            }
        }
        let mut reports = Vec::with_capacity(held);
        for (i, outcomes) in agreed.outcomes.into_iter().enumerate() {
            let rep = &self.replicas[i];
            let mut report = rep.report(
                &self.schedule,
                self.step,
                outcomes,
                walls[i],
                agreed.loss,
                agreed.memory.clone(),
            )?;
            crate::train::report::add_to_report(
                &mut report,
                &self.schedule,
                &tied[i],
                rep.sim.as_ref(),
            );
            reports.push(report);
        }
        let mut report = if held == 1 {
            let mut one = reports.pop().expect("one replica");
            // The buckets this process reduced with the other processes' replicas.
            one.wall_timeline.collectives.extend(buckets);
            one
        } else {
            // The links among all the replicas' devices: each replica's cluster is its part
            // of the whole, nodes and all.
            let parts: Option<Vec<(&Topology, usize)>> = self
                .replicas
                .iter()
                .map(|rep| rep.sim.as_ref().map(|c| (c.topology(), c.len())))
                .collect();
            let links = parts.map(|p| Topology::concat(&p));
            merge_reports(
                links.as_ref(),
                self.schedule.num_devices(),
                reports,
                agreed.loss,
                reduced,
            )
        };
        report.skipped = agreed.skipped;
        self.step += 1;
        Ok(report)
    }

    /// After a step every replica and process finished well: tied copies' gradients summed
    /// (before anything else sees them: the reduction, the optimizer, deferred updates), the
    /// gradients reduced across replicas, the layers' deferred updates applied, and the
    /// buffers of held replicas made replica 0's. Each held replica's tied exchanges, and when
    /// the reduction ran on the step's clock.
    fn reduce(&self, weights: &[f32], clock: Instant) -> Result<Reduced> {
        let held = self.replicas.len();
        let mut tied = Vec::with_capacity(held);
        for (i, rep) in self.replicas.iter().enumerate() {
            let exchanged = crate::exec::tied::exchange(&rep.stages, &self.schedule, clock)
                .and_then(|mut t| {
                    let across =
                        self.comm
                            .exchange_tied(self.round, &self.schedule, &rep.stages, clock)?;
                    t.extend(across);
                    Ok(t)
                });
            tied.push(exchanged.map_err(|e| at_replica(e, i, held))?);
        }
        let start = clock.elapsed().as_secs_f64();
        let stages: Vec<&[Stage]> = self.replicas.iter().map(|r| r.stages()).collect();
        let buckets = self
            .comm
            .reduce_gradients(self.round, &self.schedule, &stages, weights)?;
        for rep in &self.replicas {
            for s in &rep.stages {
                for l in &s.layers {
                    l.finish_step()?;
                }
            }
        }
        for rep in &self.replicas[1..] {
            copy_buffers(self.first(), rep)?;
        }
        Ok((tied, (start, clock.elapsed().as_secs_f64()), buckets))
    }

    /// What a step does with NaN or infinite values (see [`NonFinite`]).
    pub fn set_non_finite(&mut self, policy: NonFinite) {
        self.non_finite = policy;
    }

    /// A time limit for each compute action of a step (None: no limit, the default). An action
    /// that runs longer makes `train_step` stop every stage and return an error naming the
    /// stage and action within a few milliseconds of the limit. The stuck thread cannot be
    /// interrupted: it is left to finish, its results are discarded, and until it has, its
    /// stages are away from the pipeline: `train_step`, `optimizer_step`, `forward` and
    /// `clip_grad_norm` return an error saying so (they retry on their own once it is done;
    /// [`Pipeline::settle`] does so explicitly).
    pub fn set_action_timeout(&mut self, limit: Option<Duration>) {
        self.action_timeout = limit;
    }

    /// After a step that timed out: if its stuck threads have finished, takes their stages
    /// back and puts the gradients and buffers back as they were before that step (its late
    /// results are discarded); if not, an error naming what is still running. Nothing to do
    /// otherwise.
    pub fn settle(&mut self) -> Result<()> {
        for r in &mut self.replicas {
            r.settle()?;
        }
        Ok(())
    }

    /// An error if a timed-out step still holds stages (for the methods that cannot settle).
    pub(crate) fn check_settled(&self) -> Result<()> {
        for r in &self.replicas {
            r.check_settled()?;
        }
        Ok(())
    }

    /// Sets one optimizer per stage from `factory` (replacing any earlier ones and their state).
    pub fn set_optimizer(&mut self, factory: impl Fn() -> Box<dyn Optimizer>) {
        for r in &mut self.replicas {
            r.optimizers = r.stages.iter().map(|_| factory()).collect();
        }
    }

    /// The per-stage optimizers of the first replica (e.g. to set a learning rate, or to save
    /// or load their state; with replicas, [`Pipeline::set_lr`] reaches all of them).
    pub fn optimizers_mut(&mut self) -> &mut [Box<dyn Optimizer>] {
        &mut self.replicas[0].optimizers
    }

    /// The per-stage optimizers.
    pub fn optimizers(&self) -> &[Box<dyn Optimizer>] {
        self.first().optimizers()
    }

    pub fn set_lr(&mut self, lr: f32) {
        for r in &mut self.replicas {
            for o in &mut r.optimizers {
                o.set_lr(lr);
            }
        }
    }

    pub fn zero_grad(&self) {
        self.grads_scale.set(None);
        for r in &self.replicas {
            for (_, p) in r.named_parameters() {
                p.zero_grad();
            }
        }
    }
}

/// What [`Pipeline::reduce`] did: each held replica's tied exchanges, and when the gradient
/// reduction ran (start and end on the step's clock), and the buckets reduced with other
/// processes (each as it ran).
type Reduced = (
    Vec<Vec<TiedExchange>>,
    (f64, f64),
    Vec<crate::sim::timeline::Collective>,
);

/// The mini-batch `(inputs, targets)` as R shards (sizes differing by at most one), each with
/// its share of the samples: the one check that inputs and targets agree and that every
/// replica gets a sample.
pub(super) fn shard_batch(
    inputs: &Tensor,
    targets: &Tensor,
    r: usize,
) -> Result<Vec<(Tensor, Tensor, f32)>> {
    let n = inputs.shape().first().copied().unwrap_or(0);
    if targets.shape().first() != Some(&n) {
        return Err(PipelineError::Config(format!(
            "inputs {:?} and targets {:?} differ in the number of samples (axis 0)",
            inputs.shape(),
            targets.shape()
        )));
    }
    if r == 1 {
        return Ok(vec![(inputs.clone(), targets.clone(), 1.0)]);
    }
    if n < r {
        return Err(PipelineError::Config(format!(
            "a mini-batch of inputs {:?} and targets {:?} cannot be shared by {r} replicas (each needs at least one sample)",
            inputs.shape(),
            targets.shape()
        )));
    }
    let xs = split_batch("inputs", inputs, r)?;
    let ys = split_batch("targets", targets, r)?;
    Ok(xs
        .into_iter()
        .zip(ys)
        .map(|(x, y)| {
            let w = x.shape()[0] as f32 / n as f32;
            (x, y, w)
        })
        .collect())
}

/// Every held replica's part of a step: on this thread for one, on a thread each for several.
pub(crate) fn run_held(
    replicas: &mut [Replica],
    ctx: &StepCtx<'_>,
    shards: &[(Tensor, Tensor, f32)],
    loss_fn: LossUse<'_>,
) -> Vec<Result<ReplicaStep>> {
    if let [only] = replicas {
        return vec![only.run_with(ctx, &shards[0].0, &shards[0].1, loss_fn)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = replicas
            .iter_mut()
            .zip(shards)
            .map(|(rep, (x, y, _))| scope.spawn(move || rep.run_with(ctx, x, y, loss_fn)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|payload| {
                    Err(PipelineError::Config(format!(
                        "its step panicked: {}",
                        crate::exec::threads::panic_message(payload)
                    )))
                })
            })
            .collect()
    })
}
