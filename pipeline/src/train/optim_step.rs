//! Gradient clipping and the optimizer step, all or nothing across stages and replicas: every
//! stage's new values are made before any is kept, and a failure anywhere rolls every stage back.

use std::panic::{catch_unwind, AssertUnwindSafe};

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::Param;
use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result, StageCause};
use crate::exec::threads::{self, spawn_stage};
use crate::exec::Stage;

use super::Pipeline;

impl Pipeline {
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
        let counted = crate::exec::tied::without_later_copies(self.stages());
        let mut parts = Vec::with_capacity(self.stages().len());
        for (s, params) in self.stages().iter().zip(&counted) {
            parts.push(
                wgpipe_autograd::optim::grad_norm_sq(params)
                    .map_err(|e| s.error(0, "clip_grad_norm", StageCause::Tensor(e)))?,
            );
        }
        // Over MPI each rank has its own stages' gradients: every rank takes each stage's part
        // from the rank that trains it, so that all sum the same parts in the same order.
        let parts = self.comm.stage_parts(self.round, &self.schedule, parts)?;
        // Gradients of a loss-scaled step are unscaled here, in the same pass as the clipping.
        let unscale = self.grads_scale.get().map_or(1.0, |g| 1.0 / g);
        let (norm, clip) = clip_norm(&parts, unscale, max_norm).map_err(|i| {
            let part = parts[i];
            self.stages()[i].error(
                0,
                "clip_grad_norm",
                StageCause::Tensor(wgpipe_tensor::Error::Invalid {
                    op: "clip_grad_norm",
                    msg: format!(
                        "the squared norm of this stage's gradients is {part}: a gradient holds NaN or infinity (no gradient was clipped)"
                    ),
                }),
            )
        })?;
        let factor = clip * unscale;
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
        scale_stage_grads(self.stages(), factor, what)?;
        for r in &self.replicas[1..] {
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
        if self
            .replicas
            .iter()
            .any(|r| r.optimizers.len() != r.stages.len())
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
            if let Some(factor) = unscaling(self.grads_scale.get()) {
                self.scale_grads_everywhere(factor, UNSCALING)?;
                self.grads_scale.set(Some(1.0));
            }
        }
        // A round of its own for the agreement on the outcome.
        self.round += 1;
        let round = self.round;
        // Every replica's stages are one all-or-nothing step, so that replicas stay identical.
        let mut pairs: Vec<(&Stage, &mut Box<dyn Optimizer>)> = self
            .replicas
            .iter_mut()
            .flat_map(|r| r.stages.iter().zip(r.optimizers.iter_mut()))
            .collect();
        let kept: Vec<StageKeep> = pairs
            .iter()
            .map(|(s, o)| StageKeep::take(s, o.as_ref()))
            .collect();
        // One stage's step has the CPU's threads to itself.
        let alone = pairs.len() == 1;
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            let spawned: Vec<_> = pairs
                .iter_mut()
                .map(|(s, o)| {
                    let params = s.named_parameters();
                    let alone = alone && s.device.is_cpu();
                    let step = move || step_stage(&params, o.as_mut(), alone);
                    let h = spawn_stage(scope, s.index, step);
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
                    r.map_err(|c| s.error(0, "optimizer step", c))
                })
                .collect()
        });
        let failed = results.into_iter().find_map(|r| r.err());
        // Across processes: all ranks step, or none does (each rank rolls back its own
        // stages), with the failing rank's error on every rank.
        let k = self.schedule.num_devices();
        let failed = self
            .comm
            .agree_ok(round, k, failed.map_or(Ok(()), Err))
            .err();
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
}

/// The arithmetic of [`Pipeline::clip_grad_norm`] once each stage's squared gradient norm
/// (`parts`, in stage order) is known: the norm of the unscaled gradients (`unscale`: 1 / the
/// loss scale they carry, else 1) and the clip factor (1 exactly when no clipping is needed),
/// or the index of the first part that is not finite. Steps back to back validate a step with
/// it, so that they decide as the step-at-a-time path does, bit for bit.
pub(super) fn clip_norm(
    parts: &[f64],
    unscale: f32,
    max_norm: f32,
) -> std::result::Result<(f32, f32), usize> {
    let mut sq = 0.0f64;
    for (i, &part) in parts.iter().enumerate() {
        if !part.is_finite() {
            return Err(i);
        }
        sq += part;
    }
    let norm = (sq.sqrt() * unscale as f64) as f32;
    Ok((norm, wgpipe_autograd::optim::clip_factor(norm, max_norm)))
}

/// Multiplies the gradients of `stages` by `factor`, all or nothing: every new gradient is
/// computed before any is stored.
pub(super) fn scale_stage_grads(stages: &[Stage], factor: f32, what: &str) -> Result<()> {
    let mut scaled = Vec::new();
    for s in stages {
        scaled.push(
            wgpipe_autograd::optim::scaled_grads(&s.named_parameters(), factor)
                .map_err(|e| s.error(0, what, StageCause::Tensor(e)))?,
        );
    }
    for (p, g) in scaled.into_iter().flatten() {
        p.set_grad(Some(g));
    }
    Ok(())
}

/// What the optimizer step multiplies gradients that carry the loss scale `carried` by before
/// it applies them: 1 / scale, or nothing when they carry none (or 1).
pub(super) fn unscaling(carried: Option<f32>) -> Option<f32> {
    carried.filter(|&g| g != 1.0).map(|g| 1.0 / g)
}

/// What an error while unscaling gradients says it was doing.
pub(super) const UNSCALING: &str = "optimizer step (unscaling)";

/// One stage's optimizer step on its parameters `params`, a panic of the optimizer caught;
/// `alone`: the only stage stepping, on a CPU device (see [`threads::run_stage_work`]).
pub(super) fn step_stage(
    params: &[(String, Param)],
    o: &mut dyn Optimizer,
    alone: bool,
) -> std::result::Result<(), StageCause> {
    // Caught where it ran, which knows where it happened.
    threads::run_stage_work(alone, || {
        match catch_unwind(AssertUnwindSafe(|| o.step(params))) {
            Ok(r) => r.map_err(StageCause::Tensor),
            Err(p) => Err(StageCause::Panic(threads::panic_message(p))),
        }
    })
}

/// What a stage needs to undo an optimizer step: parameter values, gradients and the
/// optimizer's state, as they were before it.
pub(super) struct StageKeep {
    params: Vec<(Param, Tensor, Option<Tensor>)>,
    optimizer: Vec<(String, Tensor)>,
}

impl StageKeep {
    pub(super) fn take(s: &Stage, o: &dyn Optimizer) -> StageKeep {
        StageKeep {
            params: s
                .named_parameters()
                .into_iter()
                .map(|(_, p)| {
                    let (v, g) = (p.value(), p.grad());
                    (p, v, g)
                })
                .collect(),
            optimizer: o.state(),
        }
    }

    pub(super) fn restore(self, o: &mut dyn Optimizer) -> wgpipe_tensor::Result<()> {
        for (p, v, g) in self.params {
            p.set_value(v);
            p.set_grad(g);
        }
        o.load_state(self.optimizer)
    }
}
