//! A device's side of steps back to back: its thread runs step after step, applies its own
//! stages' update as soon as its last action is done, and keeps what undoes that update until
//! the caller's thread validates the step (the module above).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, Sender};

use wgpipe_autograd::optim::{grad_norm_sq, Optimizer};

use crate::error::{PipelineError, Result};
use crate::exec::runner::{device_error, run_device_step};
use crate::exec::threads::{self};
use crate::exec::transport::DeviceLinks;
use crate::exec::worker::{StageOutcome, StepInputs};
use crate::exec::Stage;
use crate::train::optim_step::{scale_stage_grads, step_stage, unscaling, StageKeep, UNSCALING};
use crate::train::replica::Saved;

/// One step's work for one device.
pub(super) struct Work {
    /// The step's index in the run.
    pub(super) index: u64,
    pub(super) io: StepInputs,
    pub(super) links: DeviceLinks,
    pub(super) update: Update,
}

/// How a device updates its stages after a step, assuming the step valid.
#[derive(Clone, Copy)]
pub(super) struct Update {
    /// The learning rate of the update.
    pub(super) lr: Option<f32>,
    /// The loss scale the step's gradients carry (`None`: no loss scaling).
    pub(super) scale: Option<f32>,
    /// Whether the clip norm is checked: each stage's squared gradient norm is computed
    /// before the update.
    pub(super) clip: bool,
}

/// What the caller's thread tells a device, in this order for steps 0, 1, 2...: work 0,
/// work 1, verdict 0, work 2, verdict 1, ... The channel closing means stop: a device then
/// gives back its stages with what undoes its unvalidated step.
pub(super) enum Ctl {
    Work(Box<Work>),
    /// The oldest unvalidated step is valid: its undo copies can go.
    Commit,
}

/// A device's report of a step.
pub(super) struct Finished {
    pub(super) device: usize,
    pub(super) index: u64,
    pub(super) result: Result<After>,
}

/// What a device did after a step that ran well on it.
pub(super) struct After {
    pub(super) outcome: StageOutcome,
    /// Its layers' deferred updates (`finish_step`): an error fails the step, as the
    /// step-at-a-time reduction's does.
    pub(super) finish: Result<()>,
    /// Each of its stages' squared gradient norm (stage, part), when clipping.
    pub(super) parts: Vec<(usize, f64)>,
    /// Whether it applied its update. It does not when the step is void here (non-finite
    /// values), or when a norm or an update failed: the step is then finished one step at a
    /// time, which meets (and reports) the same failure.
    pub(super) updated: bool,
}

/// What undoes a device's step that is not validated yet.
pub(super) struct Pending {
    pub(super) index: u64,
    /// Each stage's values, gradients (as the backward left them) and optimizer state before
    /// the update; empty when none was applied.
    pub(super) keeps: Vec<StageKeep>,
    /// The gradients and buffers before the step.
    pub(super) before: Saved,
}

/// A device's stages and optimizers, lent to its thread for a segment and given back with
/// what undoes what was not validated.
pub(super) struct Lent {
    pub(super) stages: Vec<Stage>,
    pub(super) optimizers: Vec<Box<dyn Optimizer>>,
    pub(super) pending: Option<Pending>,
    /// The gradients and buffers when it began the step after the pending one.
    pub(super) next: Option<Saved>,
}

impl Lent {
    /// Undoes what is not validated: the step begun after the pending one, and the pending
    /// one: back to just after its backward when `keep_trained` names it (its update undone,
    /// its gradients kept), else to before it.
    pub(super) fn undo(&mut self, keep_trained: Option<u64>) -> Result<()> {
        if let Some(next) = self.next.take() {
            next.restore(&self.stages);
        }
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let mut errors = Vec::new();
        for ((s, o), keep) in self.stages.iter().zip(&mut self.optimizers).zip(p.keeps) {
            if let Err(e) = keep.restore(o.as_mut()) {
                errors.push(format!("stage {}: {e}", s.index));
            }
        }
        if keep_trained != Some(p.index) {
            p.before.restore(&self.stages);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(PipelineError::Config(format!(
                "rolling back an update made ahead of its validation failed: {} (the optimizer's load_state does not take back its own state())",
                errors.join("; ")
            )))
        }
    }
}

/// A device's thread: step after step until the channel closes.
pub(super) fn device_loop(
    device: usize,
    mut lent: Lent,
    ctl: Receiver<Ctl>,
    events: Sender<Finished>,
) -> Lent {
    loop {
        let work = match ctl.recv() {
            Ok(Ctl::Work(w)) => w,
            Ok(Ctl::Commit) => {
                lent.pending = None;
                continue;
            }
            Err(_) => return lent,
        };
        let Work {
            index,
            io,
            links,
            update,
        } = *work;
        lent.next = Some(Saved::of(&lent.stages));
        let ran = run_step(&lent.stages, &io, links);
        // This step's update goes on top of the previous one's: only once that is valid.
        if lent.pending.is_some() {
            match ctl.recv() {
                Ok(Ctl::Commit) => lent.pending = None,
                _ => return lent,
            }
        }
        let before = lent.next.take().expect("saved when the step began");
        let (result, keeps) = match ran {
            Ok(outcome) => {
                let (after, keeps) =
                    after_step(&lent.stages, &mut lent.optimizers, outcome, update);
                (Ok(after), keeps)
            }
            Err(e) => (Err(e), Vec::new()),
        };
        lent.pending = Some(Pending {
            index,
            keeps,
            before,
        });
        if events
            .send(Finished {
                device,
                index,
                result,
            })
            .is_err()
        {
            return lent;
        }
    }
}

/// One step's actions on the device holding `stages` (see `run_device_step`), a failure named
/// after where it happened.
pub(super) fn run_step(
    stages: &[Stage],
    io: &StepInputs,
    links: DeviceLinks,
) -> Result<StageOutcome> {
    let (pos, r) = run_device_step(stages, io, links);
    r.map_err(|cause| {
        let (index, name) = stages
            .first()
            .map_or((0, ""), |s| (s.index, s.device.name()));
        device_error(stages, index, name, pos, cause)
    })
}

/// After a step ran well on a device: its layers' deferred updates, then its update applied
/// as if the step were valid, with what undoes it.
pub(super) fn after_step(
    stages: &[Stage],
    optimizers: &mut [Box<dyn Optimizer>],
    outcome: StageOutcome,
    update: Update,
) -> (After, Vec<StageKeep>) {
    let finish = finish_layers(stages);
    let mut after = After {
        outcome,
        finish,
        parts: Vec::new(),
        updated: false,
    };
    // Non-finite values here make the step void everywhere: nothing to apply.
    if after.finish.is_err() || after.outcome.non_finite.is_some() {
        return (after, Vec::new());
    }
    if update.clip {
        for s in stages {
            match grad_norm_sq(&s.named_parameters()) {
                Ok(part) => after.parts.push((s.index, part)),
                Err(_) => return (after, Vec::new()),
            }
        }
    }
    let keeps = stages
        .iter()
        .zip(optimizers.iter_mut())
        .map(|(s, o)| {
            if let Some(lr) = update.lr {
                o.set_lr(lr);
            }
            StageKeep::take(s, o.as_ref())
        })
        .collect();
    after.updated = apply_update(stages, optimizers, update.scale);
    (after, keeps)
}

/// The layers' deferred updates (batch-norm statistics), a panic caught.
pub(super) fn finish_layers(stages: &[Stage]) -> Result<()> {
    let finish = || -> Result<()> {
        for s in stages {
            for l in &s.layers {
                l.finish_step()?;
            }
        }
        Ok(())
    };
    catch_unwind(AssertUnwindSafe(finish)).unwrap_or_else(|p| {
        Err(PipelineError::Config(format!(
            "a layer's deferred update panicked: {}",
            threads::panic_message(p)
        )))
    })
}

/// `optimizer_step`'s work on one device's stages: unscale, step each stage, drop the
/// gradients. Whether it all went well (the undo copies cover a failure part way).
pub(super) fn apply_update(
    stages: &[Stage],
    optimizers: &mut [Box<dyn Optimizer>],
    scale: Option<f32>,
) -> bool {
    if let Some(factor) = unscaling(scale) {
        if scale_stage_grads(stages, factor, UNSCALING).is_err() {
            return false;
        }
    }
    // On the device's own loop's thread, wherever that runs (see `run_stage_work`).
    for (s, o) in stages.iter().zip(optimizers.iter_mut()) {
        if step_stage(&s.named_parameters(), o.as_mut(), false).is_err() {
            return false;
        }
    }
    for s in stages {
        for (_, p) in s.named_parameters() {
            p.zero_grad();
        }
    }
    true
}
