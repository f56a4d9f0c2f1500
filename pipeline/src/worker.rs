//! One stage's worker: walks the stage's action list for one training step.
//!
//! Activations go forward and gradients go back through channels; a receive polls an abort flag
//! so that a failure anywhere stops every stage within milliseconds instead of hanging.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use wgpipe_autograd::{ForwardCtx, Module, Tape, Var};
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{Device, Tensor};

use crate::error::StageCause;
use crate::schedule::{Action, CheckpointMode};

/// The loss of one micro-batch: `(output of the last stage, targets) -> scalar mean loss`.
pub type LossFn = dyn Fn(&Var, &Tensor) -> wgpipe_tensor::Result<Var> + Sync;

/// A tensor in flight between two stages.
pub(crate) struct Msg {
    pub micro_batch: usize,
    pub tensor: Tensor,
}

/// The channels of one stage (None at the ends of the pipeline).
#[derive(Default)]
pub(crate) struct StageLinks {
    pub act_in: Option<Receiver<Msg>>,
    pub act_out: Option<Sender<Msg>>,
    pub grad_in: Option<Receiver<Msg>>,
    pub grad_out: Option<Sender<Msg>>,
}

/// A stage: its layers (indices `first_layer..`) on its device.
pub struct Stage {
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
    pub num_micro_batches: usize,
    pub checkpoint: CheckpointMode,
    pub seed: u64,
    pub step: u64,
    /// Micro-batch inputs (first stage only).
    pub inputs: &'a [Tensor],
    /// Micro-batch targets and loss scales (last stage only).
    pub targets: &'a [Tensor],
    pub scales: &'a [f32],
    pub loss_fn: &'a LossFn,
    pub abort: &'a AtomicBool,
    pub clock: Instant,
}

/// What a micro-batch keeps between its forward and its backward.
enum Stash {
    /// Checkpointed: only the stage input; the forward is re-run before backward.
    Input(Tensor),
    /// Recorded: the tape, its input var and the var to back-propagate from (the stage output,
    /// or the scaled loss on the last stage).
    Recorded { tape: Tape, input: Var, output: Var },
}

/// The worker's result: records of every action and the (scaled) loss of each micro-batch.
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
    fn is_first(&self, links: &StageLinks) -> bool {
        links.act_in.is_none()
    }
    fn is_last(&self, links: &StageLinks) -> bool {
        links.act_out.is_none()
    }

    /// Runs the stage's layers on `x`, each with its global layer index in the context.
    pub(crate) fn run_layers(&self, x: &Var, ctx: ForwardCtx) -> wgpipe_tensor::Result<Var> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, &ctx.at_layer((self.first_layer + i) as u64))?;
        }
        Ok(h)
    }

    /// Walks `io.actions`. `pos` tells, after an error or a panic, where it happened.
    pub(crate) fn run_step(
        &self,
        links: &StageLinks,
        io: &StepInputs<'_>,
        pos: &mut Position,
    ) -> Result<StageOutcome, StageCause> {
        let mut out = StageOutcome::default();
        let mut received: HashMap<usize, Tensor> = HashMap::new();
        let mut grads_in: HashMap<usize, Tensor> = HashMap::new();
        let mut to_send: HashMap<usize, Tensor> = HashMap::new();
        let mut stash: HashMap<usize, Stash> = HashMap::new();
        let last = self.is_last(links);
        for &action in io.actions {
            if io.abort.load(Ordering::SeqCst) {
                return Err(StageCause::Disconnected(
                    "stopped because another stage failed".into(),
                ));
            }
            let m = action.micro_batch();
            *pos = Position {
                micro_batch: m,
                action: Some(action),
            };
            // Memory accounting: forward values (inputs, saved tensors, messages) are activations;
            // everything the backward pass makes (received and sent gradients, the transient
            // per-micro-batch parameter gradients before they are accumulated) is gradients.
            let _tag = TagGuard::new(match action {
                Action::Backward(_) | Action::RecvGrad(_) | Action::SendGrad(_) => Tag::Gradients,
                _ => Tag::Activations,
            });
            let mut start = io.clock.elapsed().as_secs_f64();
            let flops0 = self.device.flops();
            let mut bytes = 0u64;
            match action {
                Action::RecvActivation(_) => {
                    let msg = recv(links.act_in.as_ref(), io.abort, "activation", self.index)?;
                    start = io.clock.elapsed().as_secs_f64(); // time the copy, not the wait
                                                              // The hand-off copy (host staging between different devices) runs here, on
                                                              // the receiver, so the sender's compute does not wait for it.
                    received.insert(msg.micro_batch, msg.tensor.to_device(&self.device)?);
                }
                Action::RecvGrad(_) => {
                    let msg = recv(links.grad_in.as_ref(), io.abort, "gradient", self.index)?;
                    start = io.clock.elapsed().as_secs_f64();
                    grads_in.insert(msg.micro_batch, msg.tensor.to_device(&self.device)?);
                }
                Action::Forward(_) => {
                    let x = if self.is_first(links) {
                        io.inputs[m].to_device(&self.device)?
                    } else {
                        take(&mut received, m, "activation")?
                    };
                    let checkpointed = io.checkpoint.recomputes(m, io.num_micro_batches);
                    let ctx = ForwardCtx::train(io.seed, io.step, m as u64);
                    let tape = if checkpointed {
                        Tape::no_grad()
                    } else {
                        Tape::new()
                    };
                    let input = self.input_var(&tape, &x, links);
                    let mut output = self.run_layers(&input, ctx)?;
                    if last {
                        output = self.scaled_loss(&output, io, m)?;
                        out.losses.push(output.value().clone());
                    } else {
                        to_send.insert(m, output.value().clone());
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
                    stash.insert(m, kept);
                }
                Action::Recompute(_) => {
                    let x = match stash.remove(&m) {
                        Some(Stash::Input(x)) => x,
                        _ => {
                            return Err(internal(format!(
                                "no stashed input to recompute micro-batch {m}"
                            )))
                        }
                    };
                    let ctx = ForwardCtx {
                        recompute: true,
                        ..ForwardCtx::train(io.seed, io.step, m as u64)
                    };
                    // Both signals, as `autograd::checkpoint` gives: `ctx.recompute` and a
                    // recompute tape, so a layer may check either to skip side effects.
                    let tape = Tape::recompute();
                    let input = self.input_var(&tape, &x, links);
                    let mut output = self.run_layers(&input, ctx)?;
                    if last {
                        output = self.scaled_loss(&output, io, m)?;
                    }
                    stash.insert(
                        m,
                        Stash::Recorded {
                            tape,
                            input,
                            output,
                        },
                    );
                }
                Action::Backward(_) => {
                    let (tape, input, output) = match stash.remove(&m) {
                        Some(Stash::Recorded {
                            tape,
                            input,
                            output,
                        }) => (tape, input, output),
                        _ => {
                            return Err(internal(format!(
                                "micro-batch {m} has no recorded forward to back-propagate"
                            )))
                        }
                    };
                    let grads = if last {
                        tape.backward(&output)?
                    } else {
                        let g = take(&mut grads_in, m, "gradient")?;
                        tape.backward_with(&output, &g)?
                    };
                    if !self.is_first(links) {
                        let g = grads.get(&input).cloned().ok_or_else(|| {
                            internal(format!(
                                "no gradient reached the input of stage {}",
                                self.index
                            ))
                        })?;
                        to_send.insert(m, g);
                    }
                }
                Action::SendActivation(_) | Action::SendGrad(_) => {
                    let t = take(&mut to_send, m, "outgoing tensor")?;
                    bytes = (t.numel() * std::mem::size_of::<f32>()) as u64;
                    let link = match action {
                        Action::SendActivation(_) => links.act_out.as_ref(),
                        _ => links.grad_out.as_ref(),
                    };
                    send(
                        link,
                        Msg {
                            micro_batch: m,
                            tensor: t,
                        },
                        self.index,
                    )?;
                }
            }
            if action.is_compute() {
                // GPU work is asynchronous: wait for it so the recorded interval is real.
                self.device.synchronize()?;
            }
            out.records.push(ActionRecord {
                action,
                start,
                end: io.clock.elapsed().as_secs_f64(),
                flops: (self.device.flops() - flops0) as f64,
                bytes,
            });
        }
        Ok(out)
    }

    /// Stage 0's input needs no gradient; later stages' inputs do (it is sent back).
    fn input_var(&self, tape: &Tape, x: &Tensor, links: &StageLinks) -> Var {
        if self.is_first(links) {
            tape.constant(x.clone())
        } else {
            tape.leaf(x.clone())
        }
    }

    /// The micro-batch's mean loss scaled by its share of the mini-batch, so that the
    /// accumulated gradient is that of the mean loss over the whole mini-batch.
    fn scaled_loss(
        &self,
        output: &Var,
        io: &StepInputs<'_>,
        m: usize,
    ) -> wgpipe_tensor::Result<Var> {
        let target = io.targets[m].to_device(&self.device)?;
        (io.loss_fn)(output, &target)?.mul_scalar(io.scales[m])
    }
}

fn internal(msg: String) -> StageCause {
    StageCause::Disconnected(format!("internal schedule error: {msg}"))
}

fn take(map: &mut HashMap<usize, Tensor>, m: usize, what: &str) -> Result<Tensor, StageCause> {
    map.remove(&m)
        .ok_or_else(|| internal(format!("no {what} for micro-batch {m}")))
}

fn recv(
    rx: Option<&Receiver<Msg>>,
    abort: &AtomicBool,
    what: &str,
    stage: usize,
) -> Result<Msg, StageCause> {
    let rx = rx.ok_or_else(|| internal(format!("stage {stage} has no {what} input")))?;
    loop {
        match rx.recv_timeout(POLL) {
            Ok(m) => return Ok(m),
            Err(RecvTimeoutError::Timeout) => {
                if abort.load(Ordering::SeqCst) {
                    return Err(StageCause::Disconnected(
                        "stopped because another stage failed".into(),
                    ));
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(StageCause::Disconnected(format!(
                    "the neighbour sending the {what} stopped"
                )))
            }
        }
    }
}

fn send(tx: Option<&Sender<Msg>>, msg: Msg, stage: usize) -> Result<(), StageCause> {
    let tx = tx.ok_or_else(|| internal(format!("stage {stage} has no output link")))?;
    tx.send(msg)
        .map_err(|_| StageCause::Disconnected("the receiving neighbour stopped".into()))
}

impl From<wgpipe_tensor::Error> for StageCause {
    fn from(e: wgpipe_tensor::Error) -> Self {
        StageCause::Tensor(e)
    }
}
