//! One replica: a whole pipeline of K devices (its stages, their optimizers, its part of the
//! simulated cluster) and its share of a step: its micro-batches through its devices. A
//! [`Pipeline`](crate::train::Pipeline) is a group of replicas that train on shards of each
//! mini-batch and stay bit-identical.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::Param;
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result};
use crate::exec::runner::first_error;
use crate::exec::transport::Transport;
use crate::exec::worker::StageOutcome;
use crate::exec::Stage;
use crate::microbatch::split_batch;
use crate::schedule::Schedule;
use crate::sim::SimCluster;

use super::workers::{DeviceResult, LossSide, LossUse, Ran, StuckStep};

/// One data-parallel replica: its stages on its K devices and one optimizer per stage.
pub struct Replica {
    /// Its index among the job's replicas (its shard of every mini-batch).
    pub(crate) index: usize,
    pub(crate) stages: Vec<Stage>,
    pub(crate) optimizers: Vec<Box<dyn Optimizer>>,
    /// Its devices' part of the simulated cluster.
    pub(crate) sim: Option<SimCluster>,
    /// A timed-out step whose threads still hold stages (see [`crate::train::Pipeline::settle`]).
    pub(crate) stuck: Option<StuckStep>,
}

/// What every replica's part of one step shares: the schedule, the transport and the step's
/// keys and policies.
pub(crate) struct StepCtx<'a> {
    pub schedule: &'a Schedule,
    pub transport: &'a Transport,
    pub seed: u64,
    pub step: u64,
    /// Which `train_step` call this is (messages of one call never mix with another's).
    pub round: u64,
    pub non_finite: NonFinite,
    pub precision: DType,
    pub action_timeout: Option<Duration>,
    /// What the backward is seeded with (the loss scale; 1 without loss scaling).
    pub loss_seed: f32,
    /// The hook for gradients that became final (see
    /// [`crate::exec::comm::StepComm::begin_round`]; only where one replica is held).
    pub grads_final: Option<std::sync::Arc<dyn crate::exec::comm::GradsFinal>>,
    /// When the step began: its records and the reduction's are on this clock.
    pub clock: Instant,
    /// A forward-only round (`schedule` is then forwards only; see
    /// [`Schedule::forward_only`]).
    pub forward_only: bool,
    /// Decoding with a KV cache at this position (forward-only rounds of generation).
    pub kv_position: Option<usize>,
    /// How many replicas run their part of this step side by side in this process, each on
    /// device threads of its own.
    pub replicas_running: usize,
}

/// How a replica's part of a step ended.
pub(crate) enum ReplicaStep {
    /// Every device finished: their outcomes (or the root-cause error), the scaled loss of each
    /// micro-batch, and the replica's wall time.
    Done {
        outcome: Result<Vec<StageOutcome>>,
        losses: Vec<Tensor>,
        wall: f64,
    },
    /// An action ran past its time limit: the error, and the threads still running.
    TimedOut(PipelineError, Vec<JoinHandle<DeviceResult>>),
}

impl Replica {
    /// Its index among the job's replicas.
    pub fn index(&self) -> usize {
        self.index
    }
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }
    /// The per-stage optimizers.
    pub fn optimizers(&self) -> &[Box<dyn Optimizer>] {
        &self.optimizers
    }
    /// The device of each (virtual) stage, in model order.
    pub fn devices(&self) -> Vec<Device> {
        self.stages.iter().map(|s| s.device.clone()).collect()
    }
    /// Every parameter, named `<global layer index>.<name inside the layer>`.
    pub fn named_parameters(&self) -> Vec<(String, Param)> {
        self.stages
            .iter()
            .flat_map(Stage::named_parameters)
            .collect()
    }
    /// Every buffer (e.g. batch-norm running statistics), named like the parameters.
    pub fn named_buffers(&self) -> Vec<(String, Param)> {
        self.stages.iter().flat_map(Stage::named_buffers).collect()
    }

    /// The first stage of each device (whose device handle and memory counters stand for it).
    pub(crate) fn device_stages(&self, schedule: &Schedule) -> Vec<&Stage> {
        (0..schedule.num_devices())
            .map(|d| &self.stages[schedule.stages_of(d)[0]])
            .collect()
    }

    /// This replica's part of a step: its shard `(inputs, targets)` split into micro-batches,
    /// run by one thread per device; each micro-batch's loss is its mean loss times its part of
    /// the shard (the replicas' shares weigh their gradients in the reduction). `loss_fn` says
    /// what the last stage's outputs are for: a training step's loss and gradient, or a
    /// forward-only round's loss or kept outputs (then returned as `losses`, one per
    /// micro-batch in micro-batch order).
    pub(crate) fn run_with(
        &mut self,
        ctx: &StepCtx<'_>,
        inputs: &Tensor,
        targets: &Tensor,
        loss_fn: LossUse<'_>,
    ) -> Result<ReplicaStep> {
        let (xs, ys, scales) = micro_batches(inputs, targets, ctx.schedule.num_micro_batches)?;
        for s in &self.stages {
            s.device.memory().reset_peak();
        }
        let clock = ctx.clock;
        let loss = LossSide {
            targets: &ys,
            scales: &scales,
            loss_fn,
            device: self.stages[self.stages.len() - 1].device.clone(),
            non_finite: ctx.non_finite,
            seed: ctx.loss_seed,
            collected: Default::default(),
        };
        let ran = self.run_workers(ctx, xs, &loss, clock);
        let wall = clock.elapsed().as_secs_f64();
        Ok(match ran {
            Ran::Done {
                results,
                mut losses,
            } => ReplicaStep::Done {
                outcome: {
                    if let LossUse::Collect(_) = loss.loss_fn {
                        // Only the process that holds the last stage collected anything.
                        losses = loss.collected.take().into_iter().flatten().collect();
                    }
                    first_error(&self.stages, &self.device_stages(ctx.schedule), results)
                },
                losses,
                wall,
            },
            Ran::TimedOut { error, stuck } => ReplicaStep::TimedOut(error, stuck),
        })
    }

    /// After a step that timed out: if its stuck threads have finished, takes their stages
    /// back and puts the gradients and buffers back as they were before that step; if not,
    /// an error naming what is still running. Nothing to do otherwise.
    pub(crate) fn settle(&mut self) -> Result<()> {
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

    /// An error if a timed-out step still holds stages.
    pub(crate) fn check_settled(&self) -> Result<()> {
        match &self.stuck {
            Some(s) => Err(PipelineError::Stuck(s.what.clone())),
            None => Ok(()),
        }
    }
}

/// A shard `(inputs, targets)` as M micro-batches, with each one's share of the shard (what
/// its mean loss is multiplied by).
pub(crate) fn micro_batches(
    inputs: &Tensor,
    targets: &Tensor,
    m: usize,
) -> Result<(Vec<Tensor>, Vec<Tensor>, Vec<f32>)> {
    let xs = split_batch("inputs", inputs, m)?;
    let ys = split_batch("targets", targets, m)?;
    let n = inputs.shape()[0] as f32;
    let scales = xs.iter().map(|x| x.shape()[0] as f32 / n).collect();
    Ok((xs, ys, scales))
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
    pub(crate) fn take(replica: &Replica) -> Saved {
        Saved::of(&replica.stages)
    }

    /// The gradients and buffers of `stages` (a replica's, or one device's).
    pub(crate) fn of(stages: &[Stage]) -> Saved {
        let params: Vec<(String, Param)> =
            stages.iter().flat_map(Stage::named_parameters).collect();
        let grads = params.iter().map(|(_, p)| p.grad()).collect();
        let buffers: Vec<(String, Param)> = stages.iter().flat_map(Stage::named_buffers).collect();
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
