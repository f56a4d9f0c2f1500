//! Steps back to back (issue 33), after the zero-bubble paper's post-update validation
//! ("bypassing optimizer synchronizations"): one long-lived thread per device runs step after
//! step. When a device has done its last action of step s it applies its own stages' update at
//! once, as if the step were valid (no overflow or non-finite value, clip factor exactly 1,
//! gradients unscaled by 1 / loss scale as `optimizer_step` does), keeps what undoes it, and
//! begins step s+1, whose loss scale is the one a good step s leaves. The caller's thread
//! serves the loss of both steps, gathers every device's report of step s and validates it with
//! the step-at-a-time path's own arithmetic (the agreement of `train_step`, the clip norm of
//! `clip_grad_norm` over the stages in order). A device applies step s+1's update only once
//! step s is validated, so at most one update per device is ever unconfirmed.
//!
//! A step that fails validation ends the segment: step s+1 is stopped, every device's update
//! of s and s+1's partial gradients and batch-norm statistics are undone, and step s is
//! finished by the step-at-a-time code (`clip_grad_norm` + `optimizer_step`, or the skip);
//! the next segment resumes back to back from s+1. Dropout is keyed by the step's counter, so a
//! step run again draws the same masks.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use wgpipe_tensor::{Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result};
use crate::exec::comm::ReplicaRun;
use crate::exec::runner::{owns_the_cpu, root_cause, start_device};
use crate::exec::threads::{self, spawn_stage};
use crate::exec::transport::wire_links;
use crate::exec::worker::{LossRequest, StageOutcome, StepInputs};
use crate::train::optim_step::clip_norm;
use crate::train::pipeline::shard_batch;
use crate::train::replica::micro_batches;
use crate::train::report::{ReportFrame, StepReport};
use crate::train::scaler::GradScaler;
use crate::train::steps::{failed, Batches, OnStep, Run, StepPhase, StepsError, StepsOptions};
use crate::train::workers::{LossSide, LossUse};
use crate::LossFn;

use super::Pipeline;

mod device;
use device::{device_loop, After, Ctl, Finished, Lent, Update, Work};

/// How often the caller's thread looks at devices' reports between loss requests.
const POLL: Duration = Duration::from_millis(1);

/// A step launched on the devices and not validated yet.
struct InFlight {
    index: u64,
    /// Its RNG key (the step counter it runs under).
    key: u64,
    round: u64,
    /// Its mini-batch, kept for a run again when it is dropped before it ends.
    batch: (Tensor, Tensor),
    targets: Vec<Tensor>,
    scales: Vec<f32>,
    /// The loss scale its backward is seeded with.
    seed: Option<f32>,
    abort: Arc<AtomicBool>,
    /// The scaled loss of each micro-batch, in the order the last stage ran them.
    losses: Vec<Tensor>,
    results: Vec<Option<Result<After>>>,
}

/// How the validation of a step came out.
enum Verdict {
    Valid(StepReport, f64),
    /// Its update must be redone one step at a time: from its gradients, or (skipped) as a
    /// skip from before it.
    Redo(StepReport, f64),
    Failed(PipelineError),
}

/// How a segment ended (once every device gave its stages back and what was not validated
/// was undone).
enum End {
    /// Every step launched was validated (the run is over, or it was stopped), or the next
    /// step could not be launched (the error).
    Kept(Option<StepsError>),
    /// Step `index` needs its update redone one step at a time.
    Redo {
        index: u64,
        report: Box<StepReport>,
        offset: f64,
        seed: Option<f32>,
    },
    Failed(StepsError),
}

/// What the caller's thread needs through a segment.
struct Segment<'a> {
    ctls: Vec<Sender<Ctl>>,
    loss_tx: Sender<LossRequest>,
    frame: ReportFrame,
    last_device: Device,
    non_finite: NonFinite,
    opts: &'a StepsOptions<'a>,
    /// The scaler as it will be once every step launched is valid.
    ahead: Option<GradScaler>,
    /// Optimizer steps done when the segment began (`None`: no optimizer reports any).
    done: Option<u64>,
    first: u64,
    inflight: VecDeque<InFlight>,
    /// A step that could not be launched: the error, returned once every step before it is
    /// done, and its mini-batch (or the failure to get it), kept for a later segment when a
    /// step before it is redone.
    launch_error: Option<StepsError>,
    unlaunched: Option<(u64, Result<(Tensor, Tensor)>)>,
}

impl Pipeline {
    /// Runs steps back to back from `run.next` until the run ends or a step needs its update
    /// redone (which it then does, one step at a time).
    pub(super) fn run_back_to_back(
        &mut self,
        run: &mut Run,
        opts: &StepsOptions<'_>,
        batches: &mut Batches<'_>,
        loss_fn: &LossFn,
        on_step: &mut OnStep<'_>,
    ) -> std::result::Result<(), StepsError> {
        let k = self.schedule.num_devices();
        let rep = &mut self.replicas[0];
        let frame = ReportFrame::of(rep, &self.schedule);
        let last_device = rep.stages[rep.stages.len() - 1].device.clone();
        let done = rep.optimizers.first().map(|o| o.steps());
        let mut by_device: Vec<Lent> = (0..k)
            .map(|_| Lent {
                stages: Vec::new(),
                optimizers: Vec::new(),
                pending: None,
                next: None,
            })
            .collect();
        let stages = std::mem::take(&mut rep.stages);
        let optimizers = std::mem::take(&mut rep.optimizers);
        for (s, o) in stages.into_iter().zip(optimizers) {
            let lent = &mut by_device[self.schedule.placement[s.index]];
            lent.stages.push(s);
            lent.optimizers.push(o);
        }
        let (loss_tx, loss_rx) = channel::<LossRequest>();
        let (events_tx, events) = channel::<Finished>();
        let mut seg = Segment {
            ctls: Vec::with_capacity(k),
            loss_tx,
            frame,
            last_device,
            // Loss scaling needs to find overflows and skip, whatever the policy.
            non_finite: if self.scaler.is_some() {
                NonFinite::SkipStep
            } else {
                self.non_finite
            },
            opts,
            ahead: self.scaler.clone(),
            done,
            first: run.next,
            inflight: VecDeque::new(),
            launch_error: None,
            unlaunched: None,
        };
        let (back, end) = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(k);
            let mut unstarted = Vec::new();
            for (d, lent) in by_device.into_iter().enumerate() {
                let (ctl_tx, ctl_rx) = channel();
                let events = events_tx.clone();
                let spawned = start_device(lent, |take| {
                    spawn_stage(scope, d, move || {
                        let lent = take.recv().ok()?;
                        Some(threads::run_stage_work(
                            owns_the_cpu(k == 1, &lent.stages),
                            move || device_loop(d, lent, ctl_rx, events),
                        ))
                    })
                });
                match spawned {
                    Ok(h) => handles.push(h),
                    Err((lent, e)) => {
                        unstarted.push((lent, format!("could not start device {d}'s thread: {e}")));
                    }
                }
                seg.ctls.push(ctl_tx);
            }
            drop(events_tx);
            let end = if let Some((_, why)) = unstarted.first() {
                End::Failed(failed(run.next, StepPhase::Train)(PipelineError::Config(
                    why.clone(),
                )))
            } else {
                self.drive(
                    &mut seg, run, batches, loss_fn, on_step, &loss_rx, &events, &handles,
                )
            };
            // Whatever is still in flight stops; closing the channels sends every device home.
            for f in &seg.inflight {
                f.abort.store(true, Ordering::SeqCst);
            }
            seg.ctls.clear();
            let mut back: Vec<Option<Lent>> = unstarted.into_iter().map(|(l, _)| Some(l)).collect();
            back.extend(handles.into_iter().map(|h| h.join().ok().flatten()));
            (back, end)
        });
        // A step dropped before it ended runs again with the same mini-batch (each batch is
        // asked for once).
        for f in &seg.inflight {
            run.keep_batch(f.index, Ok(f.batch.clone()));
        }
        if let Some((index, batch)) = seg.unlaunched.take() {
            run.keep_batch(index, batch);
        }
        let keep_trained = match &end {
            End::Redo { index, report, .. } if report.skipped.is_none() => Some(*index),
            _ => None,
        };
        let rep = &mut self.replicas[0];
        let mut lost = false;
        let mut undo_error = None;
        let mut pairs = Vec::new();
        for lent in back {
            let Some(mut lent) = lent else {
                lost = true;
                continue;
            };
            if let Err(e) = lent.undo(keep_trained) {
                undo_error.get_or_insert(e);
            }
            pairs.extend(lent.stages.into_iter().zip(lent.optimizers));
        }
        pairs.sort_by_key(|(s, _)| s.index);
        for (s, o) in pairs {
            rep.stages.push(s);
            rep.optimizers.push(o);
        }
        if lost {
            return Err(failed(run.next, StepPhase::Train)(PipelineError::Config(
                "a device's thread ended without giving its stages back: the pipeline lost them"
                    .into(),
            )));
        }
        if let Some(e) = undo_error {
            return Err(failed(run.next, StepPhase::Update)(e));
        }
        match end {
            End::Kept(None) => Ok(()),
            End::Kept(Some(e)) | End::Failed(e) => Err(e),
            End::Redo {
                index,
                mut report,
                offset,
                seed,
            } => {
                // As after `train_step`: the step counter moves on, then the plain loop's end
                // of the step.
                self.step += 1;
                self.set_lr_from(opts.lr);
                self.note_scaled_step(&mut report, seed);
                self.plain_update(index, report.skipped.is_some(), opts.clip)?;
                run.report.rollbacks += 1;
                run.done(&report, offset, on_step);
                Ok(())
            }
        }
    }

    /// The caller's thread through a segment: launches steps (two ahead of the oldest
    /// unvalidated one at most), serves their losses, validates each in order, commits it or
    /// ends the segment.
    #[allow(clippy::too_many_arguments)]
    fn drive(
        &mut self,
        seg: &mut Segment<'_>,
        run: &mut Run,
        batches: &mut Batches<'_>,
        loss_fn: &LossFn,
        on_step: &mut OnStep<'_>,
        loss_rx: &Receiver<LossRequest>,
        events: &Receiver<Finished>,
        handles: &[std::thread::ScopedJoinHandle<'_, Option<Lent>>],
    ) -> End {
        self.launch(seg, run, batches);
        self.launch(seg, run, batches);
        loop {
            if seg.inflight.is_empty() {
                return End::Kept(seg.launch_error.take());
            }
            // Losses first: the last device waits for them.
            if let Ok(req) = loss_rx.recv_timeout(POLL) {
                serve_loss(seg, req, loss_fn);
                continue;
            }
            while let Ok(f) = events.try_recv() {
                if let Some(s) = seg.inflight.iter_mut().find(|s| s.index == f.index) {
                    s.results[f.device] = Some(f.result);
                }
            }
            if seg.inflight[0].results.iter().any(Option::is_none) {
                // A device's thread ends only when told to, or when it lost its stages.
                if handles.iter().any(|h| h.is_finished()) {
                    return End::Failed(failed(seg.inflight[0].index, StepPhase::Train)(
                        PipelineError::Config(
                            "a device's thread ended in the middle of the run".into(),
                        ),
                    ));
                }
                continue;
            }
            let f = seg.inflight.pop_front().expect("not empty");
            let (index, seed) = (f.index, f.seed);
            match self.validate(seg, f) {
                Verdict::Valid(report, offset) => {
                    for c in &seg.ctls {
                        let _ = c.send(Ctl::Commit);
                    }
                    self.step += 1;
                    if let Some(s) = &mut self.scaler {
                        s.stepped();
                    }
                    run.done(&report, offset, on_step);
                    if run.report.stopped {
                        return End::Kept(None);
                    }
                    self.launch(seg, run, batches);
                }
                Verdict::Redo(report, offset) => {
                    return End::Redo {
                        index,
                        report: Box::new(report),
                        offset,
                        seed,
                    }
                }
                Verdict::Failed(e) => return End::Failed(failed(index, StepPhase::Train)(e)),
            }
        }
    }

    /// Sends the next step (after those in flight) to every device, unless the run has no
    /// more steps or one could not be launched.
    fn launch(&mut self, seg: &mut Segment<'_>, run: &mut Run, batches: &mut Batches<'_>) {
        let index = run.next + seg.inflight.len() as u64;
        if index >= seg.opts.steps || seg.launch_error.is_some() {
            return;
        }
        let batch = match run.batch(index, batches) {
            Ok(b) => b,
            Err(e) => {
                seg.unlaunched = Some((index, Err(e.clone())));
                seg.launch_error = Some(failed(index, StepPhase::Batch)(e));
                return;
            }
        };
        let split = shard_batch(&batch.0, &batch.1, 1)
            .and_then(|_| micro_batches(&batch.0, &batch.1, self.schedule.num_micro_batches));
        let (xs, targets, scales) = match split {
            Ok(s) => s,
            Err(e) => {
                seg.unlaunched = Some((index, Ok(batch)));
                seg.launch_error = Some(failed(index, StepPhase::Train)(e));
                return;
            }
        };
        self.round += 1;
        let abort = Arc::new(AtomicBool::new(false));
        let links = wire_links(&self.transport, &self.schedule, self.round, &abort);
        let seed = seg.ahead.as_ref().map(|s| s.state.scale);
        if let Some(s) = &mut seg.ahead {
            s.stepped();
        }
        let ahead = index - seg.first;
        let update = Update {
            lr: seg.opts.lr.zip(seg.done).map(|(lr, done)| lr(done + ahead)),
            scale: seed,
            clip: seg.opts.clip.is_some(),
        };
        let key = self.step + seg.inflight.len() as u64;
        let inputs = Arc::new(xs);
        for (d, (links, ctl)) in links.into_iter().zip(&seg.ctls).enumerate() {
            let io = StepInputs {
                actions: self.schedule.devices[d].clone(),
                num_stages: self.schedule.num_stages(),
                seed: self.seed,
                step: key,
                first_micro_batch: 0,
                inputs: inputs.clone(),
                abort: abort.clone(),
                clock: run.clock,
                non_finite: seg.non_finite,
                compute: self.precision,
                forward_only: false,
                kv_position: None,
                loss: seg.loss_tx.clone(),
                running: Arc::new(Mutex::new(None)),
                grads_final: None,
            };
            let _ = ctl.send(Ctl::Work(Box::new(Work {
                index,
                io,
                links,
                update,
            })));
        }
        seg.inflight.push_back(InFlight {
            index,
            key,
            round: self.round,
            batch,
            targets,
            scales,
            seed,
            abort,
            losses: Vec::new(),
            results: (0..seg.ctls.len()).map(|_| None).collect(),
        });
    }

    /// A step every device reported on, validated as the step-at-a-time path decides: the
    /// agreement of `train_step` (failures, then non-finite values), the layers' deferred
    /// updates, each device's update, then the clip norm.
    fn validate(&self, seg: &Segment<'_>, f: InFlight) -> Verdict {
        let mut errors = Vec::new();
        let mut outcomes = Vec::new();
        let mut rest = Vec::new();
        for r in f.results.into_iter().flatten() {
            match r {
                Ok(a) => {
                    outcomes.push(a.outcome);
                    rest.push((a.finish, a.parts, a.updated));
                }
                Err(e) => errors.push(e),
            }
        }
        let outcome = match root_cause(errors) {
            Some(e) => Err(e),
            None => Ok(outcomes),
        };
        let run = ReplicaRun {
            outcome,
            losses: f.losses,
            weight: 1.0,
            // Only a communicator across processes reads them; this path runs in one.
            stages: &[],
        };
        let mut agreed = match self.comm.agree(f.round, &self.schedule, vec![run]) {
            Ok(a) => a,
            Err(e) => return Verdict::Failed(e),
        };
        let mut outcomes = agreed.outcomes.pop().unwrap_or_default();
        let offset = on_step_clock(&mut outcomes);
        let wall = outcomes
            .iter()
            .flat_map(|o| &o.records)
            .fold(0.0f64, |a, r| a.max(r.end));
        let mut report = match seg.frame.report(
            &self.schedule,
            f.key,
            outcomes,
            wall,
            agreed.loss,
            None,
            None,
        ) {
            Ok(r) => r,
            Err(e) => return Verdict::Failed(e),
        };
        report.skipped = agreed.skipped;
        report.loss_scale = f.seed;
        if report.skipped.is_some() {
            return Verdict::Redo(report, offset);
        }
        let mut parts = Vec::new();
        let mut updated = true;
        for (finish, p, u) in rest {
            if let Err(e) = finish {
                return Verdict::Failed(e);
            }
            parts.extend(p);
            updated &= u;
        }
        let clipped = seg.opts.clip.is_some_and(|max_norm| {
            parts.sort_by_key(|(stage, _)| *stage);
            let parts: Vec<f64> = parts.iter().map(|(_, p)| *p).collect();
            let unscale = f.seed.map_or(1.0, |g| 1.0 / g);
            // Exactly 1 is what the step-at-a-time path leaves unclipped.
            clip_norm(&parts, unscale, max_norm).map_or(true, |(_, factor)| factor != 1.0)
        });
        if !updated || clipped {
            return Verdict::Redo(report, offset);
        }
        Verdict::Valid(report, offset)
    }
}

/// Answers a loss request of a step in flight (one that is not is left unanswered: its
/// device stops).
fn serve_loss(seg: &mut Segment<'_>, req: LossRequest, loss_fn: &LossFn) {
    let Some(f) = seg.inflight.iter_mut().find(|f| f.key == req.step) else {
        return;
    };
    let side = LossSide {
        targets: &f.targets,
        scales: &f.scales,
        loss_fn: LossUse::Train(loss_fn),
        collected: Default::default(),
        device: seg.last_device.clone(),
        non_finite: seg.non_finite,
        seed: f.seed.unwrap_or(1.0),
    };
    let answer = side.gradient(&req, &mut f.losses);
    if answer.is_err() {
        f.abort.store(true, Ordering::SeqCst);
    }
    let _ = req.reply.send(answer);
}

/// Moves a step's records from the run's clock to its own (zero at its first action), as a
/// step's report has them; where that zero is on the run's clock.
fn on_step_clock(outcomes: &mut [StageOutcome]) -> f64 {
    let zero = outcomes
        .iter()
        .flat_map(|o| &o.records)
        .fold(f64::INFINITY, |a, r| a.min(r.start));
    if !zero.is_finite() {
        return 0.0;
    }
    for r in outcomes.iter_mut().flat_map(|o| o.records.iter_mut()) {
        r.start -= zero;
        r.end -= zero;
    }
    zero
}
