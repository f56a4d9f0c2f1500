//! A training loop as one call: [`Pipeline::train_steps`] runs N steps (learning rate from a
//! schedule, forward and backward, clipping, optimizer step) and reports each as it ends. Where
//! it can, it runs them back to back (see `train/back_to_back/`); elsewhere it runs them one
//! at a time through `train_step`, `clip_grad_norm` and `optimizer_step`. Both give the same
//! parameters and optimizer state, bit for bit, and say which ran ([`StepsReport::path`]).

use std::ops::ControlFlow;
use std::time::Instant;

use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result};
use crate::train::report::StepReport;
use crate::LossFn;

use super::Pipeline;

/// How [`Pipeline::train_steps`] runs.
#[derive(Default)]
pub struct StepsOptions<'a> {
    /// How many steps.
    pub steps: u64,
    /// Clip the gradients' global norm to this after every step ([`Pipeline::clip_grad_norm`]).
    pub clip: Option<f32>,
    /// The learning rate of each step from the optimizer steps done before it (those of the
    /// first stage's optimizer, as a plain loop reads them), set on every optimizer before the
    /// step; `None` leaves the rates alone.
    pub lr: Option<&'a dyn Fn(u64) -> f32>,
    /// Run one step at a time even where back to back is possible (to compare, or to keep the
    /// memory of the undo copies).
    pub step_at_a_time: bool,
}

/// Which loop [`Pipeline::train_steps`] ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepsPath {
    /// Steps back to back: a device starts the next step as soon as it has applied its own
    /// update; each update is validated afterwards and redone when it was wrong.
    BackToBack,
    /// One step at a time, for the reason given (back to back needs one process, one replica,
    /// in-process links, no simulated cluster, no tied parameters and no action time limit).
    StepAtATime(String),
}

/// When a step ran on each device: the start of its first compute action and the end of its
/// last, in seconds on the run's clock (one clock for the whole call).
#[derive(Debug, Clone, PartialEq)]
pub struct StepSpan {
    /// The step's key ([`StepReport::step`]).
    pub step: u64,
    pub starts: Vec<f64>,
    pub ends: Vec<f64>,
}

/// What [`Pipeline::train_steps`] did.
#[derive(Debug, Clone)]
pub struct StepsReport {
    pub path: StepsPath,
    /// Steps done (trained and updated, or skipped): all that were asked for unless stopped.
    pub steps: u64,
    /// Steps whose optimistic update failed its validation (clipping needed, an overflow,
    /// non-finite values, a failed update) and was rolled back and redone one at a time.
    /// Always 0 one step at a time.
    pub rollbacks: u64,
    /// The per-step callback asked to stop.
    pub stopped: bool,
    /// Each device's compute seconds over the steps done (work rolled back not counted).
    pub busy_secs: Vec<f64>,
    /// Each step done, in order. One step at a time, a step's clock starts inside
    /// `train_step`, so its span is placed from the call's time (microseconds early).
    pub spans: Vec<StepSpan>,
}

impl StepsReport {
    /// Seconds from the first compute action of the first step to the end of the last action
    /// of the last step.
    pub fn wall_secs(&self) -> f64 {
        let start = self
            .spans
            .iter()
            .flat_map(|s| &s.starts)
            .fold(f64::INFINITY, |a, &b| a.min(b));
        let end = self
            .spans
            .iter()
            .flat_map(|s| &s.ends)
            .fold(0.0f64, |a, &b| a.max(b));
        if start.is_finite() {
            (end - start).max(0.0)
        } else {
            0.0
        }
    }

    /// The measured bubble over the whole run: 1 − Σ busy / (K × wall).
    pub fn bubble_fraction(&self) -> f64 {
        let total = self.busy_secs.len() as f64 * self.wall_secs();
        if total <= 0.0 {
            return 0.0;
        }
        (total - self.busy_secs.iter().sum::<f64>()) / total
    }

    /// Steps that some device began before another had ended the step before: what only
    /// steps back to back can do.
    pub fn overlapped_steps(&self) -> usize {
        self.spans
            .windows(2)
            .filter(|w| {
                let first = w[1].starts.iter().fold(f64::INFINITY, |a, &b| a.min(b));
                let last = w[0].ends.iter().fold(0.0f64, |a, &b| a.max(b));
                first < last
            })
            .count()
    }
}

/// What a step was doing when [`Pipeline::train_steps`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    /// Getting its mini-batch.
    Batch,
    /// Forward and backward (`train_step`).
    Train,
    /// `clip_grad_norm`.
    Clip,
    /// `optimizer_step`.
    Update,
}

/// A failed [`Pipeline::train_steps`]: which step of the run (0-based), in which phase, and
/// the error. The model is as the step-at-a-time loop leaves it after that error: every step
/// before it done, this one's gradients put back (or, a failed clip or update, kept).
#[derive(Debug, Clone, PartialEq)]
pub struct StepsError {
    pub index: u64,
    pub phase: StepPhase,
    /// Boxed: a `Result<_, StepsError>` stays small.
    pub error: Box<PipelineError>,
}

impl std::fmt::Display for StepsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.context(0), self.error)
    }
}

impl std::error::Error for StepsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.error.as_ref())
    }
}

impl StepsError {
    /// What failed, naming the step as `first + index` (e.g. a resumed run's step number).
    pub fn context(&self, first: u64) -> String {
        let step = first + self.index;
        match self.phase {
            StepPhase::Batch => format!("the mini-batch of step {step}"),
            StepPhase::Train => format!("training step {step}"),
            StepPhase::Clip => format!("clipping the gradients of step {step}"),
            StepPhase::Update => format!("optimizer step {step}"),
        }
    }
}

/// `phase` of step `index` failed with `error`.
pub(super) fn failed(index: u64, phase: StepPhase) -> impl FnOnce(PipelineError) -> StepsError {
    move |error| StepsError {
        index,
        phase,
        error: Box::new(error),
    }
}

/// The per-step callback.
pub(super) type OnStep<'a> = dyn FnMut(&StepReport) -> ControlFlow<()> + 'a;
/// The mini-batch of each step of the run.
pub(super) type Batches<'a> = dyn FnMut(u64) -> Result<(Tensor, Tensor)> + 'a;

/// A run of [`Pipeline::train_steps`] under way.
pub(super) struct Run {
    /// Every step's records and spans are on this clock.
    pub clock: Instant,
    pub report: StepsReport,
    /// The index (in the run) of the next step to do.
    pub next: u64,
    /// Mini-batches asked for ahead by steps dropped before they ended, in step order: kept,
    /// so that each step's batch is asked for once.
    prefetched: std::collections::VecDeque<(u64, Result<(Tensor, Tensor)>)>,
}

impl Run {
    /// The mini-batch of step `index`.
    pub fn batch(&mut self, index: u64, batches: &mut Batches<'_>) -> Result<(Tensor, Tensor)> {
        match self.prefetched.front() {
            Some((i, _)) if *i == index => self.prefetched.pop_front().expect("looked at").1,
            _ => batches(index),
        }
    }

    /// Keeps step `index`'s mini-batch for when it runs again.
    pub fn keep_batch(&mut self, index: u64, batch: Result<(Tensor, Tensor)>) {
        self.prefetched.push_back((index, batch));
    }

    /// Step done: its figures kept (its time zero at `offset` on the run's clock), the
    /// callback told.
    pub fn done(&mut self, report: &StepReport, offset: f64, on_step: &mut OnStep<'_>) {
        let k = report.stages.len();
        if self.report.busy_secs.len() < k {
            self.report.busy_secs.resize(k, 0.0);
        }
        let mut starts = vec![f64::INFINITY; k];
        let mut ends = vec![0.0f64; k];
        for e in &report.wall_timeline.events {
            if e.kind.is_compute() && e.device < k {
                starts[e.device] = starts[e.device].min(offset + e.start);
                ends[e.device] = ends[e.device].max(offset + e.end);
            }
        }
        for (b, s) in self.report.busy_secs.iter_mut().zip(&report.stages) {
            *b += s.busy_secs;
        }
        self.report.spans.push(StepSpan {
            step: report.step,
            starts,
            ends,
        });
        self.report.steps += 1;
        self.next += 1;
        if on_step(report).is_break() {
            self.report.stopped = true;
        }
    }
}

impl Pipeline {
    /// Trains `opts.steps` steps: before each, the learning rate from `opts.lr`; then
    /// `train_step` on `batch(i)` (i = 0, 1, ... in the run), `clip_grad_norm` when
    /// `opts.clip` is set, and `optimizer_step`. A step skipped for non-finite values (under
    /// [`crate::NonFinite::SkipStep`], or an overflow under loss scaling) updates nothing (with
    /// loss scaling the scale backs off). `on_step` gets each step's report once its update is
    /// done and may stop the run (`ControlFlow::Break`): the steps before it stay done.
    ///
    /// Where it can, the steps run **back to back**: a device starts the next step as soon as
    /// it has applied its own stages' update, without waiting for the other devices, and the
    /// global checks (non-finite values, loss-scale overflow, the clip norm) are made after
    /// the update, from what every device reports. A step that fails them is rolled back on
    /// every device (and the next step, begun on the wrong parameters, dropped), then finished
    /// one at a time through `clip_grad_norm` and `optimizer_step`, and the run goes on back to
    /// back. The result is the step-at-a-time loop's, bit for bit (parameters, optimizer state,
    /// loss scale, reports' losses). Its costs: each device keeps a copy of its parameters,
    /// gradients and optimizer state until its update is validated, during the next step
    /// (`optimizer_step` keeps one only during the update); `batch(i + 1)` is asked for while
    /// step i runs; the reports' memory peaks are not reset between steps.
    ///
    /// Back to back needs what lets each device update alone and one thread validate: one
    /// process, one replica, in-process links (`Transport::Channels` or `Loopback`), real
    /// devices (no simulated cluster, whose per-step timelines it would not change), no tied
    /// parameters and no action time limit. Elsewhere, and when `opts.step_at_a_time` is set,
    /// the same loop runs one step at a time; [`StepsReport::path`] says which ran and why.
    pub fn train_steps(
        &mut self,
        opts: &StepsOptions<'_>,
        mut batch: impl FnMut(u64) -> Result<(Tensor, Tensor)>,
        loss_fn: &LossFn,
        mut on_step: impl FnMut(&StepReport) -> ControlFlow<()>,
    ) -> std::result::Result<StepsReport, StepsError> {
        let why_not = self.why_not_back_to_back(opts);
        let mut run = Run {
            clock: Instant::now(),
            report: StepsReport {
                path: why_not
                    .clone()
                    .map_or(StepsPath::BackToBack, StepsPath::StepAtATime),
                steps: 0,
                rollbacks: 0,
                stopped: false,
                busy_secs: Vec::new(),
                spans: Vec::new(),
            },
            next: 0,
            prefetched: Default::default(),
        };
        self.settle().map_err(failed(0, StepPhase::Train))?;
        while run.next < opts.steps && !run.report.stopped {
            // Back to back starts from clean gradients; gradients left by an earlier
            // train_step (or an overflow not yet stepped over) go through one plain step.
            if why_not.is_none() && self.gradients_clear() {
                self.run_back_to_back(&mut run, opts, &mut batch, loss_fn, &mut on_step)?;
            } else {
                self.step_at_a_time(&mut run, opts, &mut batch, loss_fn, &mut on_step)?;
            }
        }
        Ok(run.report)
    }

    /// Why steps cannot run back to back here (`None`: they can).
    fn why_not_back_to_back(&self, opts: &StepsOptions<'_>) -> Option<String> {
        let why = if opts.step_at_a_time {
            "asked for (StepsOptions::step_at_a_time)"
        } else if self.transport.crosses_processes() {
            "the devices are spread over processes"
        } else if self.replicas.len() != 1 {
            "data-parallel replicas"
        } else if self.action_timeout.is_some() {
            "an action time limit is set"
        } else if self.sim_cluster().is_some() {
            "a simulated cluster"
        } else if self
            .named_parameters()
            .iter()
            .any(|(_, p)| p.tie_group().is_some())
        {
            "tied parameters"
        } else if self.replicas[0].optimizers.len() != self.num_stages() {
            "no optimizer set"
        } else {
            return None;
        };
        Some(why.to_string())
    }

    /// No gradient accumulated, nothing carried for the next optimizer step.
    fn gradients_clear(&self) -> bool {
        !self.overflowed
            && self.grads_scale.get().is_none()
            && self
                .named_parameters()
                .iter()
                .all(|(_, p)| p.grad().is_none())
    }

    /// The learning rate of the next optimizer step on every optimizer, from `lr`.
    pub(super) fn set_lr_from(&mut self, lr: Option<&dyn Fn(u64) -> f32>) {
        if let (Some(lr), Some(done)) = (lr, self.optimizers().first().map(|o| o.steps())) {
            self.set_lr(lr(done));
        }
    }

    /// One step of the plain loop.
    fn step_at_a_time(
        &mut self,
        run: &mut Run,
        opts: &StepsOptions<'_>,
        batches: &mut Batches<'_>,
        loss_fn: &LossFn,
        on_step: &mut OnStep<'_>,
    ) -> std::result::Result<(), StepsError> {
        let i = run.next;
        let (x, y) = run.batch(i, batches).map_err(failed(i, StepPhase::Batch))?;
        self.set_lr_from(opts.lr);
        let offset = run.clock.elapsed().as_secs_f64();
        let report = self
            .train_step(&x, &y, loss_fn)
            .map_err(failed(i, StepPhase::Train))?;
        self.plain_update(i, report.skipped.is_some(), opts.clip)?;
        run.done(&report, offset, on_step);
        Ok(())
    }

    /// The plain loop's end of step `i` once `train_step` returned: clip and optimizer step;
    /// a step skipped for non-finite values updates nothing (with loss scaling
    /// `optimizer_step` skips it and backs the scale off), its gradients dropped.
    pub(super) fn plain_update(
        &mut self,
        i: u64,
        skipped: bool,
        clip: Option<f32>,
    ) -> std::result::Result<(), StepsError> {
        if skipped && self.scaler.is_none() {
            self.zero_grad();
            return Ok(());
        }
        if let (Some(max_norm), false) = (clip, skipped) {
            self.clip_grad_norm(max_norm)
                .map_err(failed(i, StepPhase::Clip))?;
        }
        self.optimizer_step().map_err(failed(i, StepPhase::Update))
    }
}
