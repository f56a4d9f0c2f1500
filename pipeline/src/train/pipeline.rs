//! `Pipeline`: a sequence of modules cut into stages on devices, trained GPipe-style.
//!
//! `train_step` splits the mini-batch into micro-batches, runs one worker thread per stage over
//! the schedule, accumulates gradients, and leaves them for `optimizer_step`. After a step the
//! gradients equal those of plain training on the whole mini-batch (up to summation order),
//! whatever K, M, schedule and checkpoint mode.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{layer_param_name, ForwardCtx, Module, Param, SkipRouter, Tape};
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result, StageCause};
use crate::exec::threads::{self, lock, spawn_stage};
use crate::exec::transport::{wire_links, Transport};
use crate::exec::worker::{
    run_device, ActionRecord, LossRequest, Position, Running, StageOutcome, StepInputs,
};
use crate::exec::Stage;
use crate::microbatch::split_batch;
use crate::schedule::{Action, Schedule};
use crate::sim::timeline::{simulate, ActionCost};
use crate::sim::SimCluster;
use crate::train::builder::PipelineBuilder;
use crate::train::report::{wall_timeline, SimReport, StageReport, StepReport};
use crate::train::scaler::{GradScaler, ScalerState};
use crate::LossFn;

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
    fn step_policy(&self) -> NonFinite {
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
                match crate::exec::comm::mpi::exchange_tied(
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

    /// Starts one thread per device, each owning its stages for the step, wires the links the
    /// schedule names, serves the last stage's loss requests on this thread, and collects each
    /// device's stages and outcome, watching the action time limit.
    fn run_workers(&mut self, xs: Vec<Tensor>, loss: &LossSide<'_>, clock: Instant) -> Ran {
        let schedule = &self.schedule;
        let k = schedule.num_devices();
        let mut by_device: Vec<Vec<Stage>> = (0..k).map(|_| Vec::new()).collect();
        for stage in std::mem::take(&mut self.stages) {
            by_device[schedule.placement[stage.index]].push(stage);
        }
        let device_names: Vec<String> = by_device
            .iter()
            .map(|stages| {
                stages
                    .first()
                    .map_or_else(String::new, |s| s.device.name().to_string())
            })
            .collect();
        let abort = Arc::new(AtomicBool::new(false));
        let links = wire_links(&self.transport, schedule, self.round, &abort);
        let inputs = Arc::new(xs);
        let (loss_tx, loss_rx) = channel::<LossRequest>();
        let running: Vec<Running> = (0..k).map(|_| Arc::new(Mutex::new(None))).collect();
        let mut handles: Vec<Option<JoinHandle<DeviceResult>>> = Vec::with_capacity(k);
        let mut results: Vec<Option<DeviceResult>> = (0..k).map(|_| None).collect();
        for (device, (stages, links)) in by_device.into_iter().zip(links).enumerate() {
            // Under a transport that spreads devices over processes, the others' devices run
            // nothing here.
            let actions = if self.transport.runs_device(device, k) {
                schedule.devices[device].clone()
            } else {
                Vec::new()
            };
            let io = StepInputs {
                actions,
                num_stages: schedule.num_stages(),
                seed: self.seed,
                step: self.step,
                inputs: inputs.clone(),
                abort: abort.clone(),
                clock,
                non_finite: self.step_policy(),
                compute: self.precision,
                loss: loss_tx.clone(),
                running: running[device].clone(),
            };
            // The stages reach the thread through a channel, so that a thread that cannot be
            // started does not take them with it.
            let (give, take) = channel::<Vec<Stage>>();
            let spawned = threads::spawn_named(device, move || -> DeviceResult {
                let stages = take.recv().unwrap_or_default();
                let mut pos = Position::default();
                let r = {
                    let refs: Vec<&Stage> = stages.iter().collect();
                    // Device threads run side by side: their kernels share the CPU's threads.
                    catch_unwind(AssertUnwindSafe(|| {
                        wgpipe_tensor::share_cpu_threads(|| {
                            run_device(&refs, &links, &io, &mut pos)
                        })
                    }))
                };
                let r = match r {
                    Ok(r) => r,
                    Err(payload) => Err(StageCause::Panic(threads::panic_message(payload))),
                };
                if let Err(cause) = &r {
                    io.abort.store(true, Ordering::SeqCst);
                    if let Some(tell) = &links.abort_peers {
                        tell(&cause.to_string());
                    }
                }
                // Dropping the links closes this device's channels, which also wakes any
                // neighbour blocked on them.
                drop(links);
                (stages, pos, r)
            });
            match spawned {
                Ok(h) => {
                    let _ = give.send(stages);
                    handles.push(Some(h));
                }
                Err(e) => {
                    abort.store(true, Ordering::SeqCst);
                    let cause = StageCause::Disconnected(format!(
                        "could not start the device's thread: {e}"
                    ));
                    results[device] = Some((stages, Position::default(), Err(cause)));
                    handles.push(None);
                }
            }
        }
        drop(loss_tx);
        let mut losses = Vec::new();
        let mut timed_out: Option<(PipelineError, Instant)> = None;
        loop {
            match loss_rx.recv_timeout(POLL) {
                Ok(req) => {
                    let answer = loss.gradient(&req, &mut losses);
                    if answer.is_err() {
                        abort.store(true, Ordering::SeqCst);
                    }
                    let _ = req.reply.send(answer);
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {}
            }
            for (d, h) in handles.iter_mut().enumerate() {
                if h.as_ref().is_some_and(|h| h.is_finished()) {
                    let joined = h.take().map(JoinHandle::join);
                    results[d] = Some(match joined {
                        Some(Ok(r)) => r,
                        _ => (Vec::new(), Position::default(), Err(lost_stages())),
                    });
                }
            }
            if handles.iter().all(Option::is_none) {
                break;
            }
            if let (None, Some(limit)) = (&timed_out, self.action_timeout) {
                let late = running.iter().enumerate().find_map(|(d, slot)| {
                    let (action, since) = (*lock(slot))?;
                    (since.elapsed() > limit).then_some((d, action, since))
                });
                if let Some((d, action, since)) = late {
                    abort.store(true, Ordering::SeqCst);
                    let error = PipelineError::Stage {
                        stage: action.stage,
                        device: device_names[d].clone(),
                        micro_batch: action.micro_batch,
                        action: describe(action),
                        cause: Box::new(StageCause::TimedOut(format!(
                            "still running after {:.2?}, past the limit of {limit:.2?}; its \
                             thread is left to finish and its results will be discarded",
                            since.elapsed()
                        ))),
                    };
                    timed_out = Some((error, Instant::now()));
                }
            }
            // After a timeout, the other devices stop within a poll; what still runs an action
            // that began before the abort is stuck.
            if let Some((_, at)) = &timed_out {
                let waiting = handles.iter().enumerate().any(|(d, h)| {
                    h.is_some() && lock(&running[d]).is_none_or(|(_, since)| since > *at)
                });
                if !waiting {
                    break;
                }
            }
        }
        if let Some((error, _)) = timed_out {
            // Give back what finished, keep the handles of what is stuck.
            for (stages, _, _) in results.into_iter().flatten() {
                self.stages.extend(stages);
            }
            self.stages.sort_by_key(|s| s.index);
            let stuck = handles.into_iter().flatten().collect();
            return Ran::TimedOut { error, stuck };
        }
        let mut out = Vec::with_capacity(k);
        for (stages, pos, r) in results.into_iter().flatten() {
            self.stages.extend(stages);
            out.push((pos, r));
        }
        self.stages.sort_by_key(|s| s.index);
        Ran::Done {
            results: out,
            losses,
        }
    }

    /// The first stage of each device (whose device handle and memory counters stand for it).
    fn device_stages(&self) -> Vec<&Stage> {
        (0..self.schedule.num_devices())
            .map(|d| {
                let first = self.schedule.stages_of(d)[0];
                &self.stages[first]
            })
            .collect()
    }

    /// The step's report; `memory`: each device's counters read elsewhere (over MPI), else
    /// this process reads them.
    fn report(
        &self,
        outcomes: Vec<StageOutcome>,
        wall: f64,
        loss: f32,
        memory: Option<Vec<wgpipe_tensor::memory::MemoryStats>>,
    ) -> Result<StepReport> {
        let messages: Vec<u64> = outcomes.iter().map(|o| o.messages_sent).collect();
        let records: Vec<Vec<ActionRecord>> = outcomes.into_iter().map(|o| o.records).collect();
        let timeline = wall_timeline(&self.schedule, &records, wall);
        let stages = self
            .device_stages()
            .into_iter()
            .zip(&records)
            .enumerate()
            .map(|(d, (first, recs))| {
                let chunks = self.schedule.stages_of(d);
                StageReport {
                    stage: d,
                    device: first.device.name().to_string(),
                    layers: chunks
                        .iter()
                        .map(|&c| {
                            let s = &self.stages[c];
                            s.first_layer..s.first_layer + s.layers.len()
                        })
                        .collect(),
                    num_params: chunks.iter().map(|&c| self.stages[c].num_params()).sum(),
                    chunks,
                    busy_secs: timeline.busy[d],
                    flops: recs.iter().map(|r| r.flops).sum(),
                    bytes_sent: recs.iter().map(|r| r.bytes).sum(),
                    messages_sent: messages[d],
                    memory: memory
                        .as_ref()
                        .and_then(|m| m.get(d).cloned())
                        .unwrap_or_else(|| first.device.memory_stats()),
                }
            })
            .collect();
        let simulated = match &self.sim {
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
                let t = simulate(&self.schedule, cluster.specs(), &cluster.link(), cost)?;
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
            step: self.step,
            loss,
            num_micro_batches: self.schedule.num_micro_batches,
            wall_secs: wall,
            wall_bubble_fraction: timeline.bubble_fraction(),
            wall_timeline: timeline,
            stages,
            simulated,
            skipped: None,
            loss_scale: None,
        })
    }

    /// Evaluation forward: micro-batch by micro-batch through every stage, recording nothing.
    /// Returns the outputs concatenated along axis 0, on the last stage's device.
    pub fn forward(&self, inputs: &Tensor) -> Result<Tensor> {
        self.check_settled()?;
        let xs = split_batch("inputs", inputs, self.schedule.num_micro_batches)?;
        let mut outs = Vec::with_capacity(xs.len());
        for (mb, x) in xs.into_iter().enumerate() {
            let mut h = x;
            // Skips in flight between stages, by name (moved to each consumer's device).
            let mut skips = SkipRouter::new();
            for s in &self.stages {
                let run = || -> wgpipe_tensor::Result<Tensor> {
                    let tape = Tape::no_grad();
                    let v = tape.constant(h.to_device(&s.device)?);
                    for (_, name) in &s.skips.incoming {
                        if let Some(t) = skips.take(name) {
                            let t = tape.constant(t.value().to_device(&s.device)?);
                            skips.insert(name.clone(), t);
                        }
                    }
                    Ok(s.run_layers(
                        &v,
                        &mut skips,
                        ForwardCtx::eval().with_compute(self.precision),
                        &mut None,
                    )?
                    .value()
                    .clone())
                };
                h = match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        return Err(stage_error(s, mb, "Forward (eval)", StageCause::Tensor(e)))
                    }
                    Err(p) => {
                        return Err(stage_error(
                            s,
                            mb,
                            "Forward (eval)",
                            StageCause::Panic(threads::panic_message(p)),
                        ))
                    }
                };
            }
            outs.push(h);
        }
        let refs: Vec<&Tensor> = outs.iter().collect();
        Ok(Tensor::concat(&refs, 0)?)
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

    /// Scales all gradients so that their global L2 norm (over every stage) is at most
    /// `max_norm`; returns the norm before clipping. All or nothing: every stage's scaled
    /// gradients are computed before any is stored. A non-finite norm (a NaN or infinite
    /// gradient) is an `Err` naming the first stage whose gradients hold one; nothing changes.
    pub fn clip_grad_norm(&self, max_norm: f32) -> Result<f32> {
        self.check_settled()?;
        if max_norm.is_nan() || max_norm < 0.0 {
            return Err(PipelineError::Config(format!(
                "clip_grad_norm: max_norm must be >= 0, got {max_norm}"
            )));
        }
        // A tied parameter counts once, as in plain training (its copies hold one gradient).
        let counted = crate::exec::tied::without_later_copies(&self.stages);
        let mut parts = Vec::with_capacity(self.stages.len());
        for (s, params) in self.stages.iter().zip(&counted) {
            parts.push(
                wgpipe_autograd::optim::grad_norm_sq(params)
                    .map_err(|e| stage_error(s, 0, "clip_grad_norm", StageCause::Tensor(e)))?,
            );
        }
        // Over MPI each rank has its own stages' gradients: every rank takes each stage's part
        // from the rank that trains it, so that all sum the same parts in the same order.
        #[cfg(feature = "mpi")]
        if let Transport::Mpi(comm) = &self.transport {
            parts = crate::exec::comm::mpi::stage_parts(comm, self.round, &self.schedule, &parts)?;
        }
        let mut sq = 0.0f64;
        for (s, &part) in self.stages.iter().zip(&parts) {
            if !part.is_finite() {
                return Err(stage_error(
                    s,
                    0,
                    "clip_grad_norm",
                    StageCause::Tensor(wgpipe_tensor::Error::Invalid {
                        op: "clip_grad_norm",
                        msg: format!(
                            "the squared norm of this stage's gradients is {part}: a gradient holds NaN or infinity (no gradient was clipped)"
                        ),
                    }),
                ));
            }
            sq += part;
        }
        // Gradients of a loss-scaled step are unscaled here, in the same pass as the clipping.
        let unscale = self.grads_scale.get().map_or(1.0, |g| 1.0 / g);
        let norm = (sq.sqrt() * unscale as f64) as f32;
        let factor = wgpipe_autograd::optim::clip_factor(norm, max_norm) * unscale;
        if factor != 1.0 {
            self.scale_grads_everywhere(factor, "clip_grad_norm")?;
        }
        if self.grads_scale.get().is_some() {
            self.grads_scale.set(Some(1.0));
        }
        Ok(norm)
    }

    /// Multiplies every gradient by `factor`, all or nothing: every stage's scaled gradients
    /// are computed before any is stored; the replicas (which hold the same gradients) get
    /// replica 0's.
    fn scale_grads_everywhere(&self, factor: f32, what: &str) -> Result<()> {
        let mut scaled = Vec::new();
        for s in &self.stages {
            scaled.push(
                wgpipe_autograd::optim::scaled_grads(&stage_params(s), factor)
                    .map_err(|e| stage_error(s, 0, what, StageCause::Tensor(e)))?,
            );
        }
        for (p, g) in scaled.into_iter().flatten() {
            p.set_grad(Some(g));
        }
        for r in &self.replicas {
            for ((_, src), (_, dst)) in self.named_parameters().iter().zip(r.named_parameters()) {
                if let Some(g) = src.grad() {
                    dst.set_grad(Some(g.to_device(dst.value().device())?));
                }
            }
        }
        Ok(())
    }

    /// Applies each stage's optimizer to its parameters on its own device (stages in parallel,
    /// on threads named `wgpipe-stage-N`), then clears the gradients.
    ///
    /// All or nothing across stages: before the step every stage's parameter values, gradients
    /// and optimizer state ([`Optimizer::state`]) are kept; when any stage fails (an error, out
    /// of memory, or a panic of its optimizer) every stage is rolled back (values set back,
    /// `load_state` of the kept state), so parameters, optimizer state and step counters are as
    /// before and the gradients are kept: a retry applies the step once. The `Err` names the
    /// failing stage (the lowest one when several fail). Over MPI the ranks agree on the
    /// outcome: a failure on any rank makes every rank roll back and return that rank's error
    /// (every rank must call it the same number of times). The cost: the old values and state stay
    /// alive until every stage has finished (about one extra copy of parameters and optimizer
    /// state at the peak of the step).
    pub fn optimizer_step(&mut self) -> Result<()> {
        self.settle()?;
        if std::iter::once(&*self)
            .chain(&self.replicas)
            .any(|p| p.optimizers.len() != p.stages.len())
        {
            return Err(PipelineError::Config(
                "no optimizer set: call set_optimizer (or the builder's optimizer) first".into(),
            ));
        }
        if self.scaler.is_some() {
            // Every stage, replica and rank learned of the overflow with the step's outcome,
            // so all skip here alike, with no further message: parameters and optimizer state
            // stay as they are, the gradients are dropped, the scale backs off.
            if std::mem::take(&mut self.overflowed) {
                if let Some(s) = &mut self.scaler {
                    s.overflowed();
                }
                self.zero_grad();
                return Ok(());
            }
            if let Some(g) = self.grads_scale.get().filter(|&g| g != 1.0) {
                self.scale_grads_everywhere(1.0 / g, "optimizer step (unscaling)")?;
                self.grads_scale.set(Some(1.0));
            }
        }
        // Over MPI, a round of its own for the ranks' agreement on the outcome.
        #[cfg(feature = "mpi")]
        let round = {
            self.round += 1;
            self.round
        };
        // Every replica's stages are one all-or-nothing step, so that replicas stay identical.
        let mut pairs: Vec<(&Stage, &mut Box<dyn Optimizer>)> = self
            .stages
            .iter()
            .zip(self.optimizers.iter_mut())
            .chain(
                self.replicas
                    .iter_mut()
                    .flat_map(|r| r.stages.iter().zip(r.optimizers.iter_mut())),
            )
            .collect();
        let kept: Vec<StageKeep> = pairs
            .iter()
            .map(|(s, o)| StageKeep::take(s, o.as_ref()))
            .collect();
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            let spawned: Vec<_> = pairs
                .iter_mut()
                .map(|(s, o)| {
                    let params = stage_params(s);
                    let h = spawn_stage(scope, s.index, move || {
                        let step = || wgpipe_tensor::share_cpu_threads(|| o.step(&params));
                        match catch_unwind(AssertUnwindSafe(step)) {
                            Ok(r) => r.map_err(StageCause::Tensor),
                            Err(p) => Err(StageCause::Panic(threads::panic_message(p))),
                        }
                    });
                    (*s, h)
                })
                .collect();
            spawned
                .into_iter()
                .map(|(s, h)| {
                    let r = match h {
                        Ok(h) => h
                            .join()
                            .unwrap_or_else(|p| Err(StageCause::Panic(threads::panic_message(p)))),
                        Err(e) => Err(StageCause::Tensor(wgpipe_tensor::Error::Invalid {
                            op: "optimizer_step",
                            msg: format!("cannot start the stage's thread: {e}"),
                        })),
                    };
                    r.map_err(|c| stage_error(s, 0, "optimizer step", c))
                })
                .collect()
        });
        let failed = results.into_iter().find_map(|r| r.err());
        // Across processes: all ranks step, or none does (each rank rolls back its own
        // stages), with the failing rank's error on every rank.
        #[cfg(feature = "mpi")]
        let failed = match &self.transport {
            Transport::Mpi(comm) => {
                let local = failed.map_or(Ok(()), Err);
                crate::exec::comm::mpi::agree_ok(comm, round, self.schedule.num_devices(), local)
                    .err()
            }
            _ => failed,
        };
        if let Some(e) = failed {
            let mut rollback_errors = Vec::new();
            for ((s, o), keep) in pairs.iter_mut().zip(kept) {
                if let Err(re) = keep.restore(o.as_mut()) {
                    rollback_errors.push(format!("stage {}: {re}", s.index));
                }
            }
            if !rollback_errors.is_empty() {
                return Err(PipelineError::Config(format!(
                    "{e}; and rolling the other stages back failed: {} (the optimizer's load_state does not take back its own state())",
                    rollback_errors.join("; ")
                )));
            }
            return Err(e);
        }
        drop(kept);
        drop(pairs);
        self.zero_grad();
        if let Some(s) = &mut self.scaler {
            s.stepped();
        }
        Ok(())
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

fn stage_params(s: &Stage) -> Vec<(String, Param)> {
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

/// What a stage needs to undo an optimizer step: parameter values, gradients and the
/// optimizer's state, as they were before it.
struct StageKeep {
    params: Vec<(Param, Tensor, Option<Tensor>)>,
    optimizer: Vec<(String, Tensor)>,
}

impl StageKeep {
    fn take(s: &Stage, o: &dyn Optimizer) -> StageKeep {
        StageKeep {
            params: stage_params(s)
                .into_iter()
                .map(|(_, p)| {
                    let (v, g) = (p.value(), p.grad());
                    (p, v, g)
                })
                .collect(),
            optimizer: o.state(),
        }
    }

    fn restore(self, o: &mut dyn Optimizer) -> wgpipe_tensor::Result<()> {
        for (p, v, g) in self.params {
            p.set_value(v);
            p.set_grad(g);
        }
        o.load_state(self.optimizer)
    }
}

fn stage_error(s: &Stage, micro_batch: usize, action: &str, cause: StageCause) -> PipelineError {
    PipelineError::Stage {
        stage: s.index,
        device: s.device.name().to_string(),
        micro_batch,
        action: action.to_string(),
        cause: Box::new(cause),
    }
}

/// The root cause among the devices' results (`devices[d]` is device d's first stage): a
/// device's own failure wins over the "stopped because another stage failed" of the others. The
/// error names the virtual stage of the failing action (the device's first stage before any).
fn first_error(
    stages: &[Stage],
    devices: &[&Stage],
    results: Vec<(Position, std::result::Result<StageOutcome, StageCause>)>,
) -> Result<Vec<StageOutcome>> {
    let mut errors = Vec::new();
    let mut ok = Vec::new();
    for (first, (pos, r)) in devices.iter().zip(results) {
        match r {
            Ok(o) => ok.push(o),
            Err(cause) => {
                let (stage, mut action) = match pos.action {
                    Some(a) => (a.stage, describe(a)),
                    None => (first.index, "start".to_string()),
                };
                if let Some(index) = pos.layer {
                    let layer = stages
                        .iter()
                        .find(|s| (s.first_layer..s.first_layer + s.layers.len()).contains(&index))
                        .map(|s| s.layers[index - s.first_layer].name())
                        .unwrap_or_default();
                    action = format!("{action} in layer {index} ({layer})");
                }
                errors.push(PipelineError::Stage {
                    stage,
                    device: first.device.name().to_string(),
                    micro_batch: pos.micro_batch,
                    action,
                    cause: Box::new(cause),
                });
            }
        }
    }
    let root = errors
        .iter()
        .position(|e| !matches!(e.cause(), Some(StageCause::Disconnected(_))))
        .unwrap_or(0);
    match errors.into_iter().nth(root) {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}

/// An action as error messages name it: `Forward (2F3)`.
fn describe(a: Action) -> String {
    format!("{:?} ({a})", a.kind)
}

/// How often the caller's thread looks at loss requests, finished devices and the time limit.
const POLL: Duration = Duration::from_millis(2);

/// What a device's thread gives back: its stages, where it was, and its outcome.
type DeviceResult = (
    Vec<Stage>,
    Position,
    std::result::Result<StageOutcome, StageCause>,
);

/// How the device threads of a step ended.
enum Ran {
    /// Every device finished (well or not): positions and outcomes, and the scaled loss of
    /// each micro-batch in the order the last stage ran them.
    Done {
        results: Vec<(Position, std::result::Result<StageOutcome, StageCause>)>,
        losses: Vec<Tensor>,
    },
    /// An action ran past the time limit: the error, and the threads still running.
    TimedOut {
        error: PipelineError,
        stuck: Vec<JoinHandle<DeviceResult>>,
    },
}

/// A step that timed out while some of its threads still run.
pub(crate) struct StuckStep {
    handles: Vec<JoinHandle<DeviceResult>>,
    saved: Saved,
    /// The timeout error, repeated by every call refused until the threads are done.
    what: String,
}

fn lost_stages() -> StageCause {
    StageCause::Panic("the device's thread ended without giving its stages back".into())
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

/// The loss side of a step, on the caller's thread: the targets, each micro-batch's share of
/// the mini-batch, the loss function and the device of the last stage.
struct LossSide<'a> {
    targets: &'a [Tensor],
    scales: &'a [f32],
    loss_fn: &'a LossFn,
    device: Device,
    non_finite: NonFinite,
    /// What the backward is seeded with (the loss scale; 1 without loss scaling).
    seed: f32,
}

impl LossSide<'_> {
    /// The gradient of micro-batch `req.micro_batch`'s scaled loss with respect to the last
    /// stage's output, and whether the loss is finite; the loss goes to `losses`. Under
    /// [`NonFinite::Error`] a non-finite loss is an error; a panic of the loss function is one.
    fn gradient(
        &self,
        req: &LossRequest,
        losses: &mut Vec<Tensor>,
    ) -> std::result::Result<(Tensor, bool), StageCause> {
        let m = req.micro_batch;
        let run = || -> std::result::Result<(Tensor, bool), StageCause> {
            let tape = Tape::new();
            let output = tape.leaf(req.output.clone());
            let loss = {
                let _tag = TagGuard::new(Tag::Activations);
                let target = self.targets[m].to_device(&self.device)?;
                (self.loss_fn)(&output, &target)?.mul_scalar(self.scales[m])?
            };
            losses.push(loss.value().clone());
            let finite =
                self.non_finite == NonFinite::Ignore || loss.value().to_scalar()?.is_finite();
            if !finite && self.non_finite == NonFinite::Error {
                return Err(StageCause::NonFinite(format!(
                    "the loss of micro-batch {m} holds NaN or infinity"
                )));
            }
            let _tag = TagGuard::new(Tag::Gradients);
            // Seeding with the loss scale: a power of two scales every gradient exactly.
            let grads = if self.seed == 1.0 {
                tape.backward(&loss)?
            } else {
                tape.backward(&loss.mul_scalar(self.seed)?)?
            };
            let g = grads.get(&output).cloned().ok_or_else(|| {
                StageCause::Disconnected(format!(
                    "the loss of micro-batch {m} does not depend on the last stage's output"
                ))
            })?;
            Ok((g, finite))
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(r) => r,
            Err(p) => Err(StageCause::Panic(threads::panic_message(p))),
        }
    }
}
