//! `Pipeline`: a sequence of modules cut into stages on devices, trained GPipe-style.
//!
//! `train_step` splits the mini-batch into micro-batches, runs one worker thread per stage over
//! the schedule, accumulates gradients, and leaves them for `optimizer_step`. After a step the
//! gradients equal those of plain training on the whole mini-batch (up to summation order),
//! whatever K, M, schedule and checkpoint mode.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{layer_param_name, Module, Param};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result, StageCause};
use crate::exec::transport::Transport;
use crate::exec::Stage;
use crate::microbatch::split_batch;
use crate::schedule::Schedule;
use crate::sim::SimCluster;
use crate::train::builder::PipelineBuilder;
use crate::train::report::StepReport;
use crate::train::scaler::{GradScaler, ScalerState};
use crate::LossFn;

use super::workers::{first_error, LossSide, Ran, StuckStep};

pub struct Pipeline {
    pub(crate) stages: Vec<Stage>,
    pub(crate) schedule: Schedule,
    pub(crate) seed: u64,
    pub(crate) step: u64,
    pub(crate) sim: Option<SimCluster>,
    pub(crate) optimizers: Vec<Box<dyn Optimizer>>,
    pub(crate) non_finite: NonFinite,
    pub(crate) action_timeout: Option<Duration>,
    pub(crate) transport: Transport,
    /// `train_step` calls so far, failed ones included: what keeps one call's messages apart
    /// from another's (the step counter does not advance on a failed step).
    pub(crate) round: u64,
    /// A timed-out step whose threads still hold stages (see [`Pipeline::settle`]).
    pub(crate) stuck: Option<StuckStep>,
    /// Data parallelism: the other replicas (1..R), each a whole pipeline on its own devices
    /// whose parameters stay bit-identical to this one's (see [`crate::train::replicas`]). The
    /// accessors (parameters, stages, devices, reports of K) describe replica 0.
    pub(crate) replicas: Vec<Pipeline>,
    /// The dtype the layers compute in (see [`wgpipe_autograd::ForwardCtx::compute`]).
    pub(crate) precision: DType,
    /// Dynamic loss scaling (replica 0 keeps it for every replica).
    pub(crate) scaler: Option<GradScaler>,
    /// The seed of this step's backward when loss scaling is on (set on every replica before
    /// its step): the step then runs under `NonFinite::SkipStep`, whatever the policy.
    pub(crate) loss_scale: Option<f32>,
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

    /// R: the number of data-parallel replicas (1 without data parallelism).
    pub fn num_replicas(&self) -> usize {
        1 + self.replicas.len()
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
        if self.stages.iter().any(|s| !s.is_held()) {
            self.check_settled()?;
            crate::exec::absent::restore(&mut self.stages, make_layers())?;
        }
        #[cfg(feature = "mpi")]
        if let Transport::Mpi(comm) = &self.transport {
            self.round += 1;
            return crate::exec::comm::mpi::gather_stages(
                comm,
                self.round,
                &self.schedule,
                &self.stages,
                &mut self.optimizers,
            );
        }
        Ok(())
    }

    /// This process's rank in a job spread over processes (0 in one process): the one that
    /// prints and writes files is rank 0.
    pub fn rank(&self) -> usize {
        match &self.transport {
            #[cfg(feature = "mpi")]
            Transport::Mpi(comm) => comm.rank(),
            _ => 0,
        }
    }

    /// The other data-parallel replicas (1..R), e.g. to check that they stay identical.
    pub fn replicas(&self) -> &[Pipeline] {
        &self.replicas
    }

    /// S: the number of (virtual) stages the model is cut into.
    pub fn num_stages(&self) -> usize {
        self.stages.len()
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
        &self.stages
    }
    /// Layers per (virtual) stage, in model order.
    pub fn balance(&self) -> Vec<usize> {
        self.stages.iter().map(|s| s.layers.len()).collect()
    }
    /// The device of each (virtual) stage, in model order.
    pub fn devices(&self) -> Vec<Device> {
        self.stages.iter().map(|s| s.device.clone()).collect()
    }
    /// Steps taken so far (the RNG key of the next step).
    pub fn step_count(&self) -> u64 {
        self.step
    }
    /// Sets the step counter (e.g. after loading a checkpoint), so that the RNG streams keyed
    /// by step (dropout) continue exactly where the saved run left off.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
        for r in &mut self.replicas {
            r.set_step(step);
        }
    }
    pub fn sim_cluster(&self) -> Option<&SimCluster> {
        self.sim.as_ref()
    }

    /// Every parameter, named `<global layer index>.<name inside the layer>`.
    pub fn named_parameters(&self) -> Vec<(String, Param)> {
        self.stages.iter().flat_map(stage_params).collect()
    }

    /// Every buffer (e.g. batch-norm running statistics), named like the parameters.
    pub fn named_buffers(&self) -> Vec<(String, Param)> {
        self.stages
            .iter()
            .flat_map(|s| {
                s.layers.iter().enumerate().flat_map(move |(i, l)| {
                    l.buffers()
                        .into_iter()
                        .map(move |(n, p)| (layer_param_name(s.first_layer + i, &n), p))
                })
            })
            .collect()
    }

    /// The layers back, in order (e.g. to run them plain or rebuild the pipeline). Over MPI,
    /// the layers of stages other ranks hold are placeholders (see [`Pipeline::gather_stages`]).
    pub fn into_layers(self) -> Vec<Box<dyn Module>> {
        self.stages.into_iter().flat_map(|s| s.layers).collect()
    }

    /// Train or eval mode for every layer.
    pub fn set_train(&mut self, train: bool) {
        for s in &mut self.stages {
            for l in &mut s.layers {
                l.set_train(train);
            }
        }
        for r in &mut self.replicas {
            r.set_train(train);
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
    /// the shard-weighted average over the replicas, the same on every replica (see
    /// [`crate::train::replicas`]); a failure on any replica leaves every replica as before.
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
        self.set_loss_scale(scale);
        let mut report = if self.replicas.is_empty() {
            self.train_step_one(inputs, targets, loss_fn)
        } else {
            crate::train::replicas::train_step(self, inputs, targets, loss_fn)
        }?;
        if let Some(scale) = scale {
            if report.skipped.is_some() {
                self.overflowed = true;
            } else {
                self.grads_scale.set(Some(scale));
            }
            report.loss_scale = Some(scale);
        }
        Ok(report)
    }

    /// The seed of the next step's backward on this pipeline and its replicas.
    fn set_loss_scale(&mut self, scale: Option<f32>) {
        self.loss_scale = scale;
        for r in &mut self.replicas {
            r.set_loss_scale(scale);
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

    /// The policy a step runs under: loss scaling needs to find overflows and skip.
    pub(super) fn step_policy(&self) -> NonFinite {
        if self.loss_scale.is_some() {
            NonFinite::SkipStep
        } else {
            self.non_finite
        }
    }

    /// [`Pipeline::train_step`] of this replica alone.
    pub(crate) fn train_step_one(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: &LossFn,
    ) -> Result<StepReport> {
        self.settle()?;
        self.round += 1;
        // Over MPI with replicas, this rank's replica trains on its share of the mini-batch.
        #[cfg(feature = "mpi")]
        let (inputs, targets, weight) = match &self.transport {
            Transport::Mpi(comm) => {
                crate::exec::comm::mpi::shard(comm, self.schedule.num_devices(), inputs, targets)?
            }
            _ => (inputs.clone(), targets.clone(), 1.0),
        };
        #[cfg(feature = "mpi")]
        let (inputs, targets) = (&inputs, &targets);
        let m = self.schedule.num_micro_batches;
        let xs = split_batch("inputs", inputs, m)?;
        let ys = split_batch("targets", targets, m)?;
        if inputs.shape()[0] != targets.shape()[0] {
            return Err(PipelineError::Config(format!(
                "inputs {:?} and targets {:?} differ in the number of samples (axis 0)",
                inputs.shape(),
                targets.shape()
            )));
        }
        let n = inputs.shape()[0] as f32;
        let scales: Vec<f32> = xs.iter().map(|x| x.shape()[0] as f32 / n).collect();

        let saved = Saved::take(self);
        for s in &self.stages {
            s.device.memory().reset_peak();
        }

        let clock = Instant::now();
        let loss = LossSide {
            targets: &ys,
            scales: &scales,
            loss_fn,
            device: self.stages[self.stages.len() - 1].device.clone(),
            non_finite: self.step_policy(),
            seed: self.loss_scale.unwrap_or(1.0),
        };
        let ran = self.run_workers(xs, &loss, clock);
        let wall = clock.elapsed().as_secs_f64();
        let (results, losses) = match ran {
            Ran::Done { results, losses } => (results, losses),
            Ran::TimedOut { error, stuck } => {
                #[cfg(feature = "mpi")]
                if let Transport::Mpi(comm) = &self.transport {
                    crate::exec::comm::mpi::fail_round(comm, self.round, &error);
                }
                self.stuck = Some(StuckStep {
                    handles: stuck,
                    saved,
                    what: error.to_string(),
                });
                return Err(error);
            }
        };

        let local = first_error(&self.stages, &self.device_stages(), results);
        // Across processes every rank learns every rank's outcome, so all go on or all fail.
        #[cfg(feature = "mpi")]
        let (local, agreed) = match &self.transport {
            Transport::Mpi(comm) => {
                let mine = self
                    .schedule
                    .stages_of(comm.rank() % self.schedule.num_devices())[0];
                match crate::exec::comm::mpi::agree(
                    comm,
                    self.round,
                    &self.schedule,
                    local,
                    &losses,
                    weight,
                    self.stages[mine].device.memory_stats(),
                ) {
                    Ok(a) => (Ok(a.outcomes), Some((a.loss, a.weights, a.memory))),
                    Err(e) => (Err(e), None),
                }
            }
            _ => (local, None),
        };
        let outcomes = match local {
            Ok(o) => o,
            Err(e) => {
                saved.restore(&self.stages);
                return Err(e);
            }
        };
        // Under `NonFinite::SkipStep`: the earliest micro-batch (then stage) where non-finite
        // values appeared.
        let skipped = outcomes
            .iter()
            .filter_map(|o| o.non_finite.clone())
            .min_by_key(|at| (at.micro_batch, at.stage));
        let mut tied = Vec::new();
        if skipped.is_some() {
            saved.restore(&self.stages);
        } else {
            // Tied copies' gradients are summed before anything else sees them (the replica
            // average, the optimizer), and before deferred updates, so a failure changes nothing.
            tied = match crate::exec::tied::exchange(&self.stages, &self.schedule, clock) {
                Ok(t) => t,
                Err(e) => {
                    saved.restore(&self.stages);
                    return Err(e);
                }
            };
            // Over MPI, the groups with copies on other ranks' stages.
            #[cfg(feature = "mpi")]
            if let Transport::Mpi(comm) = &self.transport {
                match crate::exec::comm::mpi_tied::exchange_tied(
                    comm,
                    self.round,
                    &self.schedule,
                    &self.stages,
                    clock,
                ) {
                    Ok(t) => tied.extend(t),
                    Err(e) => {
                        saved.restore(&self.stages);
                        return Err(e);
                    }
                }
            }
            #[cfg(feature = "mpi")]
            if let (Transport::Mpi(comm), Some((_, weights, _))) = (&self.transport, &agreed) {
                let k = self.schedule.num_devices();
                let mine: Vec<&Stage> = self
                    .stages
                    .iter()
                    .filter(|s| {
                        self.transport
                            .runs_device(self.schedule.placement[s.index], k)
                    })
                    .collect();
                if let Err(e) =
                    crate::exec::comm::mpi::all_reduce(comm, self.round, k, &mine, weights)
                {
                    saved.restore(&self.stages);
                    return Err(e);
                }
            }
            for s in &self.stages {
                for l in &s.layers {
                    l.finish_step()?;
                }
            }
        }
        let mut loss = 0.0f32;
        for t in &losses {
            loss += t.to_scalar()?;
        }
        // Over MPI each device's memory is counted by the rank that holds it.
        #[allow(unused_mut)]
        let mut memory = None;
        #[cfg(feature = "mpi")]
        if let Some((total, _, m)) = agreed {
            loss = total;
            memory = Some(m);
        }
        let mut report = self.report(outcomes, wall, loss, memory)?;
        crate::train::report::add_to_report(&mut report, &self.schedule, &tied, self.sim.as_ref());
        report.skipped = skipped;
        self.step += 1;
        Ok(report)
    }

    /// What a step does with NaN or infinite values (see [`NonFinite`]).
    pub fn set_non_finite(&mut self, policy: NonFinite) {
        self.non_finite = policy;
        for r in &mut self.replicas {
            r.set_non_finite(policy);
        }
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
        for r in &mut self.replicas {
            r.set_action_timeout(limit);
        }
    }

    /// After a step that timed out: if its stuck threads have finished, takes their stages
    /// back and puts the gradients and buffers back as they were before that step (its late
    /// results are discarded); if not, an error naming what is still running. Nothing to do
    /// otherwise.
    pub fn settle(&mut self) -> Result<()> {
        for r in &mut self.replicas {
            r.settle()?;
        }
        let Some(stuck) = self.stuck.take() else {
            return Ok(());
        };
        if !stuck.handles.iter().all(|h| h.is_finished()) {
            let what = stuck.what.clone();
            self.stuck = Some(stuck);
            return Err(PipelineError::Stuck(what));
        }
        for h in stuck.handles {
            // A panic after the step was given up is one more discarded result.
            if let Ok((stages, _, _)) = h.join() {
                self.stages.extend(stages);
            }
        }
        self.stages.sort_by_key(|s| s.index);
        stuck.saved.restore(&self.stages);
        Ok(())
    }

    /// An error if a timed-out step still holds stages (for the methods that cannot settle).
    pub(crate) fn check_settled(&self) -> Result<()> {
        for r in &self.replicas {
            r.check_settled()?;
        }
        match &self.stuck {
            Some(s) => Err(PipelineError::Stuck(s.what.clone())),
            None => Ok(()),
        }
    }

    /// Sets one optimizer per stage from `factory` (replacing any earlier ones and their state).
    pub fn set_optimizer(&mut self, factory: impl Fn() -> Box<dyn Optimizer>) {
        self.set_optimizer_from(&factory);
    }

    /// [`Pipeline::set_optimizer`] for every replica (not generic, so it can recurse).
    fn set_optimizer_from(&mut self, factory: &dyn Fn() -> Box<dyn Optimizer>) {
        self.optimizers = self.stages.iter().map(|_| factory()).collect();
        for r in &mut self.replicas {
            r.set_optimizer_from(factory);
        }
    }

    /// The per-stage optimizers of replica 0 (e.g. to set a learning rate, or to save or load
    /// their state; with replicas, [`Pipeline::set_lr`] reaches all of them).
    pub fn optimizers_mut(&mut self) -> &mut [Box<dyn Optimizer>] {
        &mut self.optimizers
    }

    /// The per-stage optimizers.
    pub fn optimizers(&self) -> &[Box<dyn Optimizer>] {
        &self.optimizers
    }

    pub fn set_lr(&mut self, lr: f32) {
        for o in &mut self.optimizers {
            o.set_lr(lr);
        }
        for r in &mut self.replicas {
            r.set_lr(lr);
        }
    }

    pub fn zero_grad(&self) {
        self.grads_scale.set(None);
        for (_, p) in self.named_parameters() {
            p.zero_grad();
        }
        for r in &self.replicas {
            r.zero_grad();
        }
    }
}

pub(super) fn stage_params(s: &Stage) -> Vec<(String, Param)> {
    s.layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            l.parameters()
                .into_iter()
                .map(move |(n, p)| (layer_param_name(s.first_layer + i, &n), p))
        })
        .collect()
}

pub(super) fn stage_error(
    s: &Stage,
    micro_batch: usize,
    action: &str,
    cause: StageCause,
) -> PipelineError {
    PipelineError::Stage {
        stage: s.index,
        device: s.device.name().to_string(),
        micro_batch,
        action: action.to_string(),
        cause: Box::new(cause),
    }
}

/// What a step puts back when it fails, is skipped or times out: the parameters' gradients and
/// the buffers as before the step.
pub(crate) struct Saved {
    params: Vec<(String, Param)>,
    grads: Vec<Option<Tensor>>,
    buffers: Vec<(String, Param)>,
    values: Vec<Tensor>,
}

impl Saved {
    pub(crate) fn take(pipe: &Pipeline) -> Saved {
        let params = pipe.named_parameters();
        let grads = params.iter().map(|(_, p)| p.grad()).collect();
        let buffers = pipe.named_buffers();
        let values = buffers.iter().map(|(_, b)| b.value()).collect();
        Saved {
            params,
            grads,
            buffers,
            values,
        }
    }

    /// Puts the gradients back, and drops what the micro-batches that ran recorded for later
    /// (batch-norm statistics): the Module trait has no "discard" hook, so apply them
    /// (finish_step consumes them) and put every buffer back. Errors here are secondary to the
    /// step's own.
    pub(crate) fn restore(self, stages: &[Stage]) {
        for ((_, p), g) in self.params.iter().zip(self.grads) {
            p.set_grad(g);
        }
        for s in stages {
            for l in &s.layers {
                let _ = catch_unwind(AssertUnwindSafe(|| l.finish_step()));
            }
        }
        for ((_, b), v) in self.buffers.iter().zip(self.values) {
            b.set_value(v);
        }
    }
}
