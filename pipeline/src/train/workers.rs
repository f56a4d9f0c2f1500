//! One replica's step on its devices: a thread per device walks its action list, the caller's
//! thread serves the last stage's loss requests and watches the action time limit, and the
//! devices' results become their outcomes or the root-cause error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wgpipe_autograd::Tape;
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{Device, Tensor};

use crate::error::{NonFinite, PipelineError, StageCause};
use crate::exec::runner::{describe, device_error, owns_the_cpu, run_device_step, start_device};
use crate::exec::threads::{self, lock};
use crate::exec::transport::wire_links;
use crate::exec::worker::{LossRequest, Position, Running, StageOutcome, StepInputs};
use crate::exec::Stage;
use crate::{HeadFn, LossFn};

use super::replica::{Replica, Saved, StepCtx};

impl Replica {
    /// Starts one thread per device, each owning its stages for the step, wires the links the
    /// schedule names, serves the last stage's loss requests on this thread, and collects each
    /// device's stages and outcome, watching the action time limit.
    pub(super) fn run_workers(
        &mut self,
        ctx: &StepCtx<'_>,
        xs: Vec<Tensor>,
        loss: &LossSide<'_>,
        clock: Instant,
    ) -> Ran {
        let schedule = ctx.schedule;
        let k = schedule.num_devices();
        // The only device thread of the step has the CPU's threads to itself.
        let alone = k == 1 && ctx.replicas_running == 1;
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
        let links = wire_links(ctx.transport, schedule, ctx.round, &abort);
        let inputs = Arc::new(xs);
        let (loss_tx, loss_rx) = channel::<LossRequest>();
        let running: Vec<Running> = (0..k).map(|_| Arc::new(Mutex::new(None))).collect();
        let mut handles: Vec<Option<JoinHandle<DeviceResult>>> = Vec::with_capacity(k);
        let mut results: Vec<Option<DeviceResult>> = (0..k).map(|_| None).collect();
        for (device, (stages, links)) in by_device.into_iter().zip(links).enumerate() {
            // Under a transport that spreads devices over processes, the others' devices run
            // nothing here.
            let actions = if ctx.transport.runs_device(device, k) {
                schedule.devices[device].clone()
            } else {
                Vec::new()
            };
            let io = StepInputs {
                actions,
                num_stages: schedule.num_stages(),
                seed: ctx.seed,
                step: ctx.step,
                first_micro_batch: (self.index * schedule.num_micro_batches) as u64,
                inputs: inputs.clone(),
                abort: abort.clone(),
                clock,
                non_finite: ctx.non_finite,
                compute: ctx.precision,
                forward_only: ctx.forward_only,
                kv_position: ctx.kv_position,
                loss: loss_tx.clone(),
                running: running[device].clone(),
                grads_final: ctx.grads_final.clone(),
            };
            let spawned = start_device(stages, |take| {
                threads::spawn_named(device, move || -> DeviceResult {
                    let stages = take.recv().unwrap_or_default();
                    threads::run_stage_work(owns_the_cpu(alone, &stages), move || {
                        let (pos, r) = run_device_step(&stages, &io, links);
                        (stages, pos, r)
                    })
                })
            });
            match spawned {
                Ok(h) => handles.push(Some(h)),
                Err((stages, e)) => {
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
        // When each device's thread was seen to end (within a poll).
        let mut ended: Vec<Option<Instant>> = vec![None; k];
        loop {
            let all_ended = match loss_rx.recv_timeout(POLL) {
                Ok(req) => {
                    let answer = loss.gradient(&req, &mut losses);
                    if answer.is_err() {
                        abort.store(true, Ordering::SeqCst);
                    }
                    let _ = req.reply.send(answer);
                    false
                }
                Err(RecvTimeoutError::Timeout) => false,
                // Every device's work has ended (each held a sender until then) and its thread
                // is on its way out: join them. Polling `is_finished` instead spun this thread
                // through ~70k rounds a step (a disconnected channel answers at once), keeping a
                // core from the device threads that had to wake up and exit: the main job's 400
                // steps took 16.0-18.5 s with the spin, 14.2-14.6 s without (2-core Zen 4).
                Err(RecvTimeoutError::Disconnected) => true,
            };
            for (d, h) in handles.iter_mut().enumerate() {
                if h.as_ref().is_some_and(|h| all_ended || h.is_finished()) {
                    ended[d] = Some(Instant::now());
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
            if let (None, Some(limit)) = (&timed_out, ctx.action_timeout) {
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
        if let Some((late, at)) = timed_out {
            // Give back what finished, keep the handles of what is stuck. A device that had
            // failed before the action ran past the limit holds the error to report: the first
            // in time, with the stuck action said beside it.
            let mut failed = Vec::new();
            for (d, r) in results.into_iter().enumerate() {
                let Some((stages, pos, r)) = r else { continue };
                let first = stages
                    .first()
                    .map(|s| (s.index, s.device.name().to_string()));
                self.stages.extend(stages);
                if let (Err(cause), Some(end)) = (r, ended[d].filter(|&e| e <= at)) {
                    failed.push((end, first, pos, cause));
                }
            }
            self.stages.sort_by_key(|s| s.index);
            // The earliest failure that was its own (not a stop because another failed).
            failed.retain(|f| !matches!(f.3, StageCause::Disconnected(_)));
            failed.sort_by_key(|f| f.0);
            let error = match (failed.into_iter().next(), &late) {
                (
                    Some((_, Some((index, device)), pos, cause)),
                    PipelineError::Stage { stage, action, .. },
                ) => device_error(&self.stages, index, &device, pos, cause).at(&format!(
                    "; the first failure, while stage {stage}'s {action} ran on past the \
                     action time limit (its thread is left to finish)"
                )),
                _ => late,
            };
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
}

/// How often the caller's thread looks at loss requests, finished devices and the time limit.
const POLL: Duration = Duration::from_millis(2);

/// What a device's thread gives back: its stages, where it was, and its outcome.
pub(super) type DeviceResult = (
    Vec<Stage>,
    Position,
    std::result::Result<StageOutcome, StageCause>,
);

/// How the device threads of a step ended.
pub(super) enum Ran {
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
    pub(super) handles: Vec<JoinHandle<DeviceResult>>,
    pub(super) saved: Saved,
    /// The timeout error, repeated by every call refused until the threads are done.
    pub(super) what: String,
}

fn lost_stages() -> StageCause {
    StageCause::Panic("the device's thread ended without giving its stages back".into())
}

/// What the caller's thread does with the last stage's output of a micro-batch.
#[derive(Clone, Copy)]
pub(crate) enum LossUse<'a> {
    /// A training step: the scaled loss, and its gradient for the backward.
    Train(&'a LossFn),
    /// A forward-only round that evaluates: the scaled loss alone.
    Evaluate(&'a LossFn),
    /// A forward-only round that keeps `head(output)` of every micro-batch (generation).
    Collect(&'a HeadFn),
}

/// The loss side of a step, on the caller's thread: the targets, each micro-batch's share of
/// the mini-batch, the loss function and the device of the last stage.
pub(super) struct LossSide<'a> {
    pub(super) targets: &'a [Tensor],
    pub(super) scales: &'a [f32],
    pub(super) loss_fn: LossUse<'a>,
    /// Under [`LossUse::Collect`]: each micro-batch's kept output, by micro-batch.
    pub(super) collected: std::cell::RefCell<Vec<Option<Tensor>>>,
    pub(super) device: Device,
    pub(super) non_finite: NonFinite,
    /// What the backward is seeded with (the loss scale; 1 without loss scaling).
    pub(super) seed: f32,
}

impl LossSide<'_> {
    /// The gradient of micro-batch `req.micro_batch`'s scaled loss with respect to the last
    /// stage's output, and whether the loss is finite; the loss goes to `losses`. Under
    /// [`NonFinite::Error`] a non-finite loss is an error; a panic of the loss function is one.
    pub(super) fn gradient(
        &self,
        req: &LossRequest,
        losses: &mut Vec<Tensor>,
    ) -> std::result::Result<(Tensor, bool), StageCause> {
        let m = req.micro_batch;
        let run = || -> std::result::Result<(Tensor, bool), StageCause> {
            let (loss_fn, train) = match self.loss_fn {
                LossUse::Train(f) => (f, true),
                LossUse::Evaluate(f) => (f, false),
                LossUse::Collect(head) => {
                    let _tag = TagGuard::new(Tag::Activations);
                    let kept = head(&req.output)?;
                    let mut collected = self.collected.borrow_mut();
                    if collected.len() <= m {
                        collected.resize(m + 1, None);
                    }
                    collected[m] = Some(kept);
                    // No backward follows: the answer's tensor is not used.
                    return Ok((req.output.clone(), true));
                }
            };
            let tape = if train { Tape::new() } else { Tape::no_grad() };
            let output = tape.leaf(req.output.clone());
            let loss = {
                let _tag = TagGuard::new(Tag::Activations);
                let target = self.targets[m].to_device(&self.device)?;
                loss_fn(&output, &target)?.mul_scalar(self.scales[m])?
            };
            losses.push(loss.value().clone());
            if !train {
                // Evaluation reports the loss as it is, finite or not; nothing to seed.
                return Ok((req.output.clone(), true));
            }
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
