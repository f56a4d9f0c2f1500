//! Evaluation: the forward of every micro-batch through every stage, recording nothing.

use std::panic::{catch_unwind, AssertUnwindSafe};

use wgpipe_autograd::{ForwardCtx, SkipRouter, Tape};
use wgpipe_tensor::Tensor;

use crate::error::{NonFinite, PipelineError, Result, StageCause};
use crate::exec::comm::ReplicaRun;
use crate::exec::threads::{self};
use crate::microbatch::split_batch;
use crate::train::pipeline::run_held;
use crate::train::replica::{ReplicaStep, Saved, StepCtx};
use crate::train::workers::{LossUse, StuckStep};
use crate::{HeadFn, LossFn};

use super::Pipeline;

impl Pipeline {
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
            for s in self.stages() {
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
                        // A tape that does not record re-runs nothing.
                        &mut Vec::new(),
                    )?
                    .value()
                    .clone())
                };
                h = match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => return Err(s.error(mb, "Forward (eval)", StageCause::Tensor(e))),
                    Err(p) => {
                        return Err(s.error(
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
}

impl Pipeline {
    /// The mean loss of `(inputs, targets)` through a forward-only schedule (the training
    /// schedule's forwards alone, see [`crate::schedule::Schedule::forward_only`]) on the
    /// stages' own devices: over MPI each rank runs its stages and no rank holds the whole
    /// model. Layers run in eval mode (no dropout), nothing is recorded, no gradient or buffer
    /// changes. Like a training step's loss: each micro-batch's mean loss weighted by its share
    /// of the batch, summed in micro-batch order, so the result is the same bits in one
    /// process and across ranks. With R replicas (which hold the same parameters) the loss is
    /// replica 0's on the whole batch (over MPI the other replicas' ranks run it too, in
    /// step), so it does not depend on R either. Every rank of the job must call it at the
    /// same point; all return the same value or the same error.
    pub fn evaluate(&mut self, inputs: &Tensor, targets: &Tensor, loss_fn: &LossFn) -> Result<f32> {
        let (loss, _) = self.forward_round(inputs, targets, LossUse::Evaluate(loss_fn), None)?;
        Ok(loss)
    }

    /// `head` of the last stage's output of every micro-batch of `inputs` (the logits of the
    /// last position, for generation), concatenated along axis 0, on the CPU of every process:
    /// a forward-only round as in [`Pipeline::evaluate`], then the process that holds the last
    /// stage hands what `head` kept to the other processes of its replica. Each replica runs
    /// the whole batch (each of its ranks needs every row's result). Every rank must call it
    /// at the same point.
    pub fn predict(&mut self, inputs: &Tensor, head: &HeadFn) -> Result<Tensor> {
        self.predict_round(inputs, head, None)
    }

    /// [`Pipeline::predict`] decoding with a KV cache: `inputs` hold the tokens at positions
    /// `position..` of each row, and each stage's attention layers keep the keys and values of
    /// its own layers per micro-batch (so over MPI each rank holds its stages' cache). Position
    /// 0 starts the cache (the prompt, any length); each later call gives one token per row at
    /// the position the cache has reached. Rows must stay in the same micro-batches (the same
    /// number of rows) from call to call. A layer that keeps no cache refuses the call.
    pub fn predict_cached(
        &mut self,
        inputs: &Tensor,
        position: usize,
        head: &HeadFn,
    ) -> Result<Tensor> {
        self.predict_round(inputs, head, Some(position))
    }

    fn predict_round(
        &mut self,
        inputs: &Tensor,
        head: &HeadFn,
        kv_position: Option<usize>,
    ) -> Result<Tensor> {
        let (_, kept) = self.forward_round(inputs, inputs, LossUse::Collect(head), kv_position)?;
        let kept = match kept {
            Some(parts) => {
                let refs: Vec<&Tensor> = parts.iter().collect();
                Some(Tensor::concat(&refs, 0)?)
            }
            None => None,
        };
        let schedule = self.schedule.forward_only();
        // A fresh round: its messages never meet the agreement's.
        self.round += 1;
        self.comm.share_output(self.round, &schedule, kept)
    }

    /// One forward-only round through the step machinery: the agreed loss, and under
    /// [`LossUse::Collect`] what the last stage kept of each micro-batch when this process
    /// holds it. Every replica holds the same parameters, so the first one held here runs the
    /// whole batch (over MPI each replica's ranks do, as all of them need a prediction) and
    /// the loss is replica 0's alone: the same bits whatever R.
    fn forward_round(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        use_: LossUse<'_>,
        kv_position: Option<usize>,
    ) -> Result<(f32, Option<Vec<Tensor>>)> {
        self.settle()?;
        self.round += 1;
        let schedule = self.schedule.forward_only();
        let ctx = StepCtx {
            schedule: &schedule,
            transport: &self.transport,
            seed: self.seed,
            step: self.step,
            round: self.round,
            // The loss is reported as it is, finite or not.
            non_finite: NonFinite::Ignore,
            precision: self.precision,
            action_timeout: self.action_timeout,
            loss_seed: 1.0,
            // No gradient is made: nothing to reduce.
            grads_final: None,
            forward_only: true,
            kv_position,
            clock: std::time::Instant::now(),
            replicas_running: 1,
        };
        let whole = [(inputs.clone(), targets.clone(), 1.0)];
        let step = run_held(&mut self.replicas[..1], &ctx, &whole, use_).pop();
        let (outcome, losses) = match step {
            Some(Ok(ReplicaStep::Done {
                outcome, losses, ..
            })) => (outcome, losses),
            Some(Ok(ReplicaStep::TimedOut(error, handles))) => {
                // Its threads still hold stages: they come back through `settle`; a
                // forward-only round changed nothing that needs putting back.
                self.replicas[0].stuck = Some(StuckStep {
                    handles,
                    saved: Saved::take(&self.replicas[0]),
                    what: error.to_string(),
                });
                self.comm.fail_round(self.round, &error);
                return Err(error);
            }
            Some(Err(e)) => (Err(e), Vec::new()),
            None => (
                Err(PipelineError::Config(
                    "no replica ran the forward round".into(),
                )),
                Vec::new(),
            ),
        };
        let (losses, kept) = match use_ {
            // Only the process holding the last stage kept anything.
            LossUse::Collect(_) => (Vec::new(), (!losses.is_empty()).then_some(losses)),
            _ if self.replicas[0].index == 0 => (losses, None),
            _ => (Vec::new(), None),
        };
        let run = ReplicaRun {
            outcome,
            losses,
            weight: 1.0,
            stages: &self.replicas[0].stages,
        };
        let agreed = self.comm.agree(self.round, &schedule, vec![run])?;
        Ok((agreed.loss, kept))
    }
}
