//! One device's worker: walks the device's action list for one training step.
//!
//! Activations go forward and gradients go back through the links the schedule names; a
//! receive polls an abort flag so that a failure anywhere stops every device within milliseconds
//! instead of hanging. The worker never knows which schedule it runs: it does what each action
//! says, to the virtual stage (chunk) the action names.

//!
//! Here: the step's inputs and outcome, the worker's state and the walk over the actions; in
//! `compute.rs` the forward, recompute and backward of a (stage, micro-batch), in
//! `messages.rs` what crosses the links (and the loss gradient from the caller's thread), in
//! `finite.rs` the checks for NaN and infinity.

mod compute;
mod finite;
mod messages;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpipe_autograd::{Tape, Var, WeightGrads};
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, StageCause};
use crate::exec::stage::{PendingRerun, Stage};
use crate::exec::threads::lock;
use crate::exec::transport::{DeviceLinks, Msg};
use crate::schedule::{Action, ActionKind, Link};
use crate::sim::wire_bytes;

/// What the worker measured for one action.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActionRecord {
    pub action: Action,
    pub start: f64,
    pub end: f64,
    pub flops: f64,
    pub bytes: u64,
}

/// Per-step inputs of a worker. Owned (the device's thread may outlive a `train_step` that
/// timed out), and without the loss function: the last stage asks the calling thread for the
/// gradient of the loss instead ([`LossRequest`]).
pub(crate) struct StepInputs {
    pub actions: Vec<Action>,
    /// S, the number of virtual stages (the last one's output goes to the loss).
    pub num_stages: usize,
    pub seed: u64,
    pub step: u64,
    /// The key of this replica's micro-batch 0 among the mini-batch's R x M (replica index x
    /// M): the layers see micro-batch m as `first_micro_batch + m`, so that R replicas draw
    /// the dropout masks of one pipeline over R x M micro-batches.
    pub first_micro_batch: u64,
    /// Micro-batch inputs (used by stage 0).
    pub inputs: Arc<Vec<Tensor>>,
    pub abort: Arc<AtomicBool>,
    pub clock: Instant,
    pub non_finite: NonFinite,
    /// The dtype the layers compute in
    /// ([`ForwardCtx::compute`](wgpipe_autograd::ForwardCtx::compute)), for forwards and
    /// recomputes alike, so that a recompute gives the values the forward gave.
    pub compute: DType,
    /// A forward-only round (evaluation, generation): forwards run in eval mode without a
    /// tape, nothing is kept for a backward, and the last stage's output goes to the caller's
    /// thread, whose answer carries no gradient to use.
    pub forward_only: bool,
    /// In a forward-only round, decoding with a KV cache at this position
    /// ([`ForwardCtx::kv_position`](wgpipe_autograd::ForwardCtx::kv_position)).
    pub kv_position: Option<usize>,
    pub loss: Sender<LossRequest>,
    /// The compute action running and since when, for the step's watchdog.
    pub running: Running,
    /// Told when a stage's weight gradients are final (their reduction can start).
    pub grads_final: Option<Arc<dyn crate::exec::comm::GradsFinal>>,
}

/// A device's compute action running now and since when (`None` between actions), shared with
/// the step's watchdog.
pub(crate) type Running = Arc<Mutex<Option<(Action, Instant)>>>;

/// The mark of a compute action running on a device, cleared when dropped: when the action
/// ends, well or with an error, so that the watchdog never takes a failed action for a stuck
/// one.
struct RunningMark<'a>(&'a Running);

impl<'a> RunningMark<'a> {
    fn new(running: &'a Running, action: Action) -> Self {
        *lock(running) = Some((action, Instant::now()));
        RunningMark(running)
    }
}

impl Drop for RunningMark<'_> {
    fn drop(&mut self) {
        *lock(self.0) = None;
    }
}

/// The last stage's output of one micro-batch, sent to the thread that called `train_step`,
/// which computes the scaled loss and answers with its gradient with respect to the output and
/// whether the loss is finite (or with the loss function's error).
pub(crate) struct LossRequest {
    /// The step's RNG key ([`StepInputs::step`]): which step asks, when steps run back to back
    /// and the caller's thread serves two at once.
    pub step: u64,
    pub micro_batch: usize,
    pub output: Tensor,
    pub reply: Sender<Result<(Tensor, bool), StageCause>>,
}

/// What a (stage, micro-batch) keeps between its forward and the end of its backward.
enum Stash {
    /// Checkpointed: only the stage input and the skips it popped; the forward is re-run
    /// before backward.
    Input { x: Tensor, skips: Vec<Tensor> },
    /// Recorded (boxed: several times the size of the other variants).
    Recorded(Box<Recorded>),
    /// After the input part of a split backward: what the weight part needs.
    Weights(WeightGrads),
}

/// A recorded forward: the tape, its input var, the var to back-propagate from (the stage
/// output), and the skips popped (leaves) and stashed here (seeded by their gradients), in the
/// order of the stage's [`StageSkips`].
struct Recorded {
    tape: Tape,
    input: Var,
    output: Var,
    skips_in: Vec<Var>,
    skips_out: Vec<Var>,
    /// The checkpointed runs of layers on the tape, run again before the backward.
    reruns: Vec<PendingRerun>,
}

/// The worker's result: records of every action, and where non-finite values first appeared
/// on this device (under [`NonFinite::SkipStep`]).
#[derive(Default)]
pub(crate) struct StageOutcome {
    pub records: Vec<ActionRecord>,
    pub non_finite: Option<NonFiniteAt>,
    /// Messages this device put on its links (activations, gradients, skips).
    pub messages_sent: u64,
}

/// Where non-finite values first appeared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteAt {
    pub stage: usize,
    pub micro_batch: usize,
    /// What was non-finite ("the loss", "the output of layer 3 (Linear(8, 8))", ...).
    pub what: String,
}

/// Where the worker is, readable after a panic: the action, and the layer when the action was
/// running a layer's forward.
#[derive(Debug, Clone, Default)]
pub(crate) struct Position {
    pub micro_batch: usize,
    pub action: Option<Action>,
    /// The global index of the layer whose forward was running.
    pub layer: Option<usize>,
}

/// One device's state during a step.
struct Worker<'a, 'p> {
    pos: &'p mut Position,
    /// The device's stages by virtual index.
    stages: HashMap<usize, &'a Stage>,
    device: &'a Device,
    links: &'a DeviceLinks,
    io: &'a StepInputs,
    /// (stage, micro-batch) pairs whose forward keeps only the input (a Recompute follows).
    checkpointed: HashSet<(usize, usize)>,
    received: HashMap<(usize, usize), Tensor>,
    grads_in: HashMap<(usize, usize), Tensor>,
    /// Outgoing tensors by (stage, micro-batch, is gradient).
    to_send: HashMap<(usize, usize, bool), Tensor>,
    stash: HashMap<(usize, usize), Stash>,
    /// Messages that arrived before the receive that wants them, by (link, micro-batch).
    early: HashMap<(Link, usize), Msg>,
    /// Whether what each (stage, micro-batch, is gradient) received was finite.
    finite_in: HashMap<(usize, usize, bool), bool>,
    /// Whether each outgoing tensor (same key as `to_send`) is finite.
    finite_out: HashMap<(usize, usize, bool), bool>,
    /// Skips (and skip gradients, `true`) received, by (skip id, micro-batch, is gradient),
    /// with whether they are finite.
    skips_in: HashMap<(usize, usize, bool), (Tensor, bool)>,
    /// Skips (and skip gradients) to send, same key.
    skips_out: HashMap<(usize, usize, bool), (Tensor, bool)>,
    /// A message of this step arrived non-finite: the parameter gradients here may be so
    /// without this device being where it began.
    tainted: bool,
    /// FLOPs of the non-finite checks during the current action: bookkeeping, not the
    /// action's work, so they stay out of its record (and of the simulated cost model).
    check_flops: u64,
    out: StageOutcome,
}

/// Walks `io.actions` on the device holding `stages`. `pos` tells, after an error or a panic,
/// where it happened.
pub(crate) fn run_device(
    stages: &[&Stage],
    links: &DeviceLinks,
    io: &StepInputs,
    pos: &mut Position,
) -> Result<StageOutcome, StageCause> {
    let device = &stages
        .first()
        .ok_or_else(|| internal("a device without stages".into()))?
        .device;
    let checkpointed = io
        .actions
        .iter()
        .filter(|a| a.kind == ActionKind::Recompute)
        .map(|a| (a.stage, a.micro_batch))
        .collect();
    let mut w = Worker {
        pos,
        stages: stages.iter().map(|s| (s.index, *s)).collect(),
        device,
        links,
        io,
        checkpointed,
        received: HashMap::new(),
        grads_in: HashMap::new(),
        to_send: HashMap::new(),
        stash: HashMap::new(),
        early: HashMap::new(),
        finite_in: HashMap::new(),
        finite_out: HashMap::new(),
        skips_in: HashMap::new(),
        skips_out: HashMap::new(),
        tainted: false,
        check_flops: 0,
        out: StageOutcome::default(),
    };
    // Where each stage's weight gradients become final: its last action that adds to them.
    let mut last_grad: HashMap<usize, usize> = HashMap::new();
    for (i, a) in io.actions.iter().enumerate() {
        if matches!(a.kind, ActionKind::Backward | ActionKind::BackwardWeight) {
            last_grad.insert(a.stage, i);
        }
    }
    for (i, &action) in io.actions.iter().enumerate() {
        if io.abort.load(Ordering::SeqCst) {
            return Err(StageCause::Disconnected(
                "stopped because another stage failed".into(),
            ));
        }
        *w.pos = Position {
            micro_batch: action.micro_batch,
            action: Some(action),
            layer: None,
        };
        w.run(action)?;
        if let Some(hook) = &io.grads_final {
            if last_grad.get(&action.stage) == Some(&i) {
                hook.stage_final(w.stage(action.stage)?);
            }
        }
    }
    w.check_param_grads(stages)?;
    Ok(w.out)
}

impl<'a> Worker<'a, '_> {
    fn stage(&self, s: usize) -> Result<&'a Stage, StageCause> {
        self.stages
            .get(&s)
            .copied()
            .ok_or_else(|| internal(format!("stage {s} is not on this device")))
    }

    fn is_last(&self, s: usize) -> bool {
        s + 1 == self.io.num_stages
    }

    fn run(&mut self, action: Action) -> Result<(), StageCause> {
        // Memory accounting: forward values (inputs, saved tensors, messages) are activations;
        // everything the backward pass makes (received and sent gradients, the transient
        // per-micro-batch parameter gradients before they are accumulated) is gradients.
        let _tag = TagGuard::new(if action.kind.is_backward() {
            Tag::Gradients
        } else {
            Tag::Activations
        });
        let io = self.io;
        let mut start = io.clock.elapsed().as_secs_f64();
        let flops0 = self.device.flops();
        self.check_flops = 0;
        let mut bytes = 0u64;
        let (s, m) = (action.stage, action.micro_batch);
        // Marked while it runs, cleared however it ends (an error returns early).
        let mark = action
            .is_compute()
            .then(|| RunningMark::new(&io.running, action));
        match action.kind {
            ActionKind::RecvActivation | ActionKind::RecvGrad => {
                let msg = self.recv(action)?;
                // Time the copy, not the wait. The hand-off copy (host staging between
                // different devices) runs here, on the receiver, so the sender's compute does
                // not wait for it.
                start = io.clock.elapsed().as_secs_f64();
                let t = msg.tensor.to_device(self.device)?;
                let grad = action.kind == ActionKind::RecvGrad;
                self.finite_in.insert((s, m, grad), msg.finite);
                self.tainted |= !msg.finite;
                if grad {
                    self.grads_in.insert((s, m), t);
                } else {
                    self.received.insert((s, m), t);
                }
            }
            ActionKind::RecvSkip | ActionKind::RecvSkipGrad => {
                let msg = self.recv(action)?;
                start = io.clock.elapsed().as_secs_f64();
                let t = msg.tensor.to_device(self.device)?;
                self.tainted |= !msg.finite;
                let id = self.link(action)?.skip.unwrap_or_default();
                let grad = action.kind == ActionKind::RecvSkipGrad;
                self.skips_in.insert((id, m, grad), (t, msg.finite));
            }
            ActionKind::SendSkip | ActionKind::SendSkipGrad => {
                let link = self.link(action)?;
                let key = (link.skip.unwrap_or_default(), m, link.grad);
                let (t, finite) = self
                    .skips_out
                    .remove(&key)
                    .ok_or_else(|| internal(format!("no outgoing skip for {action}")))?;
                bytes = wire_bytes(&t);
                self.send(link, m, t, finite)?;
            }
            ActionKind::ExchangeTied => {
                return Err(internal(format!("{action} is not a schedule action")))
            }
            ActionKind::Forward => self.forward(s, m)?,
            ActionKind::Recompute => self.recompute(s, m)?,
            ActionKind::Backward | ActionKind::BackwardInput => {
                self.backward(s, m, action.kind == ActionKind::BackwardInput)?
            }
            ActionKind::BackwardWeight => match self.stash.remove(&(s, m)) {
                Some(Stash::Weights(w)) => w.run()?,
                _ => {
                    return Err(internal(format!(
                        "stage {s} micro-batch {m} has no input part to finish"
                    )))
                }
            },
            ActionKind::SendActivation | ActionKind::SendGrad => {
                let grad = action.kind == ActionKind::SendGrad;
                let t = self
                    .to_send
                    .remove(&(s, m, grad))
                    .ok_or_else(|| internal(format!("no outgoing tensor for {action}")))?;
                bytes = wire_bytes(&t);
                let finite = self.finite_out.remove(&(s, m, grad)).unwrap_or(true);
                let link = self.link(action)?;
                self.send(link, m, t, finite)?;
            }
        }
        if action.is_compute() {
            // GPU work is asynchronous: wait for it so the recorded interval is real.
            self.device.synchronize()?;
        }
        drop(mark);
        self.out.records.push(ActionRecord {
            action,
            start,
            end: io.clock.elapsed().as_secs_f64(),
            flops: (self.device.flops() - flops0 - self.check_flops) as f64,
            bytes,
        });
        Ok(())
    }
}

fn internal(msg: String) -> StageCause {
    StageCause::Disconnected(format!("internal schedule error: {msg}"))
}

impl From<wgpipe_tensor::Error> for StageCause {
    fn from(e: wgpipe_tensor::Error) -> Self {
        StageCause::Tensor(e)
    }
}
