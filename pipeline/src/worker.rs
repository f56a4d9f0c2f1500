//! One device's worker: walks the device's action list for one training step.
//!
//! Activations go forward and gradients go back through the links the schedule names; a
//! receive polls an abort flag so that a failure anywhere stops every device within milliseconds
//! instead of hanging. The worker never knows which schedule it runs: it does what each action
//! says, to the virtual stage (chunk) the action names.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use wgpipe_autograd::{ForwardCtx, Module, Tape, Var, WeightGrads};
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{Device, Tensor};

use crate::error::StageCause;
use crate::schedule::{Action, ActionKind, Link};

/// The loss of one micro-batch: `(output of the last stage, targets) -> scalar mean loss`.
pub type LossFn = dyn Fn(&Var, &Tensor) -> wgpipe_tensor::Result<Var> + Sync;

/// A tensor in flight between two stages.
pub(crate) struct Msg {
    pub micro_batch: usize,
    pub tensor: Tensor,
}

/// The ends of the links a device's actions use: senders of the links it sends on, receivers of
/// those it receives on (a link between two chunks of one device has both ends here).
#[derive(Default)]
pub(crate) struct DeviceLinks {
    pub tx: HashMap<Link, Sender<Msg>>,
    pub rx: HashMap<Link, Receiver<Msg>>,
}

/// A virtual stage: its layers (global indices `first_layer..`) on its device.
pub struct Stage {
    /// The virtual stage index (model order).
    pub index: usize,
    pub device: Device,
    pub first_layer: usize,
    pub layers: Vec<Box<dyn Module>>,
}

/// What the worker measured for one action.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ActionRecord {
    pub action: Action,
    pub start: f64,
    pub end: f64,
    pub flops: f64,
    pub bytes: u64,
}

/// Per-step inputs of a worker.
pub(crate) struct StepInputs<'a> {
    pub actions: &'a [Action],
    /// S, the number of virtual stages (the last one computes the loss).
    pub num_stages: usize,
    pub seed: u64,
    pub step: u64,
    /// Micro-batch inputs (used by stage 0).
    pub inputs: &'a [Tensor],
    /// Micro-batch targets and loss scales (used by the last stage).
    pub targets: &'a [Tensor],
    pub scales: &'a [f32],
    pub loss_fn: &'a LossFn,
    pub abort: &'a AtomicBool,
    pub clock: Instant,
}

/// What a (stage, micro-batch) keeps between its forward and the end of its backward.
enum Stash {
    /// Checkpointed: only the stage input; the forward is re-run before backward.
    Input(Tensor),
    /// Recorded: the tape, its input var and the var to back-propagate from (the stage output,
    /// or the scaled loss on the last stage).
    Recorded { tape: Tape, input: Var, output: Var },
    /// After the input part of a split backward: what the weight part needs.
    Weights(WeightGrads),
}

/// The worker's result: records of every action and the (scaled) loss of each micro-batch that
/// went through the last stage on this device.
#[derive(Default)]
pub(crate) struct StageOutcome {
    pub records: Vec<ActionRecord>,
    pub losses: Vec<Tensor>,
}

/// Where the worker is, readable after a panic.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Position {
    pub micro_batch: usize,
    pub action: Option<Action>,
}

const POLL: Duration = Duration::from_millis(5);

impl Stage {
    /// Runs the stage's layers on `x`, each with its global layer index in the context.
    pub(crate) fn run_layers(&self, x: &Var, ctx: ForwardCtx) -> wgpipe_tensor::Result<Var> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, &ctx.at_layer((self.first_layer + i) as u64))?;
        }
        Ok(h)
    }
}

/// One device's state during a step.
struct Worker<'a> {
    /// The device's stages by virtual index.
    stages: HashMap<usize, &'a Stage>,
    device: &'a Device,
    links: &'a DeviceLinks,
    io: &'a StepInputs<'a>,
    /// (stage, micro-batch) pairs whose forward keeps only the input (a Recompute follows).
    checkpointed: HashSet<(usize, usize)>,
    received: HashMap<(usize, usize), Tensor>,
    grads_in: HashMap<(usize, usize), Tensor>,
    /// Outgoing tensors by (stage, micro-batch, is gradient).
    to_send: HashMap<(usize, usize, bool), Tensor>,
    stash: HashMap<(usize, usize), Stash>,
    /// Messages that arrived before the receive that wants them, by (link, micro-batch).
    early: HashMap<(Link, usize), Tensor>,
    out: StageOutcome,
}

/// Walks `io.actions` on the device holding `stages`. `pos` tells, after an error or a panic,
/// where it happened.
pub(crate) fn run_device(
    stages: &[&Stage],
    links: &DeviceLinks,
    io: &StepInputs<'_>,
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
        out: StageOutcome::default(),
    };
    for &action in io.actions {
        if io.abort.load(Ordering::SeqCst) {
            return Err(StageCause::Disconnected(
                "stopped because another stage failed".into(),
            ));
        }
        *pos = Position {
            micro_batch: action.micro_batch,
            action: Some(action),
        };
        w.run(action)?;
    }
    Ok(w.out)
}

impl<'a> Worker<'a> {
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
        let mut bytes = 0u64;
        let (s, m) = (action.stage, action.micro_batch);
        match action.kind {
            ActionKind::RecvActivation | ActionKind::RecvGrad => {
                let t = self.recv(action)?;
                start = io.clock.elapsed().as_secs_f64(); // time the copy, not the wait
                                                          // The hand-off copy (host staging between different devices) runs here, on the
                                                          // receiver, so the sender's compute does not wait for it.
                let t = t.to_device(self.device)?;
                if action.kind == ActionKind::RecvActivation {
                    self.received.insert((s, m), t);
                } else {
                    self.grads_in.insert((s, m), t);
                }
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
                bytes = (t.numel() * std::mem::size_of::<f32>()) as u64;
                let link = self.link(action)?;
                let tx = self
                    .links
                    .tx
                    .get(&link)
                    .ok_or_else(|| internal(format!("no sender for {link}")))?;
                tx.send(Msg {
                    micro_batch: m,
                    tensor: t,
                })
                .map_err(|_| StageCause::Disconnected("the receiving neighbour stopped".into()))?;
            }
        }
        if action.is_compute() {
            // GPU work is asynchronous: wait for it so the recorded interval is real.
            self.device.synchronize()?;
        }
        self.out.records.push(ActionRecord {
            action,
            start,
            end: io.clock.elapsed().as_secs_f64(),
            flops: (self.device.flops() - flops0) as f64,
            bytes,
        });
        Ok(())
    }

    fn link(&self, action: Action) -> Result<Link, StageCause> {
        action
            .link(self.io.num_stages)
            .ok_or_else(|| internal(format!("{action} has no peer")))
    }

    fn forward(&mut self, s: usize, m: usize) -> Result<(), StageCause> {
        let io = self.io;
        let stage = self.stage(s)?;
        let x = if s == 0 {
            io.inputs[m].to_device(self.device)?
        } else {
            self.received
                .remove(&(s, m))
                .ok_or_else(|| internal(format!("no activation for stage {s} micro-batch {m}")))?
        };
        let checkpointed = self.checkpointed.contains(&(s, m));
        let tape = if checkpointed {
            Tape::no_grad()
        } else {
            Tape::new()
        };
        let input = input_var(&tape, &x, s);
        let mut output = stage.run_layers(&input, ForwardCtx::train(io.seed, io.step, m as u64))?;
        if self.is_last(s) {
            output = self.scaled_loss(&output, m)?;
            self.out.losses.push(output.value().clone());
        } else {
            self.to_send.insert((s, m, false), output.value().clone());
        }
        let kept = if checkpointed {
            Stash::Input(x)
        } else {
            Stash::Recorded {
                tape,
                input,
                output,
            }
        };
        self.stash.insert((s, m), kept);
        Ok(())
    }

    fn recompute(&mut self, s: usize, m: usize) -> Result<(), StageCause> {
        let io = self.io;
        let x = match self.stash.remove(&(s, m)) {
            Some(Stash::Input(x)) => x,
            _ => {
                return Err(internal(format!(
                    "no stashed input to recompute stage {s} micro-batch {m}"
                )))
            }
        };
        let ctx = ForwardCtx {
            recompute: true,
            ..ForwardCtx::train(io.seed, io.step, m as u64)
        };
        // Both signals, as `autograd::checkpoint` gives: `ctx.recompute` and a recompute tape,
        // so a layer may check either to skip side effects.
        let tape = Tape::recompute();
        let input = input_var(&tape, &x, s);
        let mut output = self.stage(s)?.run_layers(&input, ctx)?;
        if self.is_last(s) {
            output = self.scaled_loss(&output, m)?;
        }
        self.stash.insert(
            (s, m),
            Stash::Recorded {
                tape,
                input,
                output,
            },
        );
        Ok(())
    }

    /// A full backward, or the input part of a split one (`split`), whose weight part is kept.
    fn backward(&mut self, s: usize, m: usize, split: bool) -> Result<(), StageCause> {
        let (tape, input, output) = match self.stash.remove(&(s, m)) {
            Some(Stash::Recorded {
                tape,
                input,
                output,
            }) => (tape, input, output),
            _ => {
                return Err(internal(format!(
                    "stage {s} micro-batch {m} has no recorded forward to back-propagate"
                )))
            }
        };
        let seed = if self.is_last(s) {
            Tensor::ones(output.shape(), output.value().device())?
        } else {
            self.grads_in
                .remove(&(s, m))
                .ok_or_else(|| internal(format!("no gradient for stage {s} micro-batch {m}")))?
        };
        let grads = if split {
            let (grads, weights) = tape.backward_split(&output, &seed)?;
            self.stash.insert((s, m), Stash::Weights(weights));
            grads
        } else {
            tape.backward_with(&output, &seed)?
        };
        if s > 0 {
            let g = grads
                .get(&input)
                .cloned()
                .ok_or_else(|| internal(format!("no gradient reached the input of stage {s}")))?;
            self.to_send.insert((s, m, true), g);
        }
        Ok(())
    }

    /// The message `action` waits for: taken from the early arrivals, or read from its link
    /// (keeping messages for other micro-batches), polling the abort flag.
    fn recv(&mut self, action: Action) -> Result<Tensor, StageCause> {
        let link = self.link(action)?;
        let m = action.micro_batch;
        if let Some(t) = self.early.remove(&(link, m)) {
            return Ok(t);
        }
        let rx = self
            .links
            .rx
            .get(&link)
            .ok_or_else(|| internal(format!("no receiver for {link}")))?;
        loop {
            match rx.recv_timeout(POLL) {
                Ok(msg) if msg.micro_batch == m => return Ok(msg.tensor),
                Ok(msg) => {
                    self.early.insert((link, msg.micro_batch), msg.tensor);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.io.abort.load(Ordering::SeqCst) {
                        return Err(StageCause::Disconnected(
                            "stopped because another stage failed".into(),
                        ));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(StageCause::Disconnected(format!(
                        "the neighbour sending on {link} stopped"
                    )))
                }
            }
        }
    }

    /// The micro-batch's mean loss scaled by its share of the mini-batch, so that the
    /// accumulated gradient is that of the mean loss over the whole mini-batch.
    fn scaled_loss(&self, output: &Var, m: usize) -> wgpipe_tensor::Result<Var> {
        let io = self.io;
        let target = io.targets[m].to_device(self.device)?;
        (io.loss_fn)(output, &target)?.mul_scalar(io.scales[m])
    }
}

/// Stage 0's input needs no gradient; later stages' inputs do (it is sent back).
fn input_var(tape: &Tape, x: &Tensor, stage: usize) -> Var {
    if stage == 0 {
        tape.constant(x.clone())
    } else {
        tape.leaf(x.clone())
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
