//! A virtual stage: a contiguous run of the model's layers on one device, and how it runs them
//! (with the skips that enter and leave it).

use std::ops::Range;
use std::rc::Rc;

use wgpipe_autograd::{
    checkpoint_rerun_later, layer_param_name, ForwardCtx, Module, Param, Rerun, SkipRouter, Tape,
    Var,
};
use wgpipe_tensor::Device;

use crate::error::{PipelineError, StageCause};
use crate::skips::StageSkips;

/// A virtual stage: its layers (global indices `first_layer..`) on its device.
pub struct Stage {
    /// The virtual stage index (model order).
    pub index: usize,
    pub device: Device,
    pub first_layer: usize,
    pub layers: Vec<Box<dyn Module>>,
    /// The skips that enter and leave this stage (those inside it stay inside).
    pub skips: StageSkips,
    /// Over MPI, a stage another rank holds: `layers` are placeholders (see [`crate::exec::absent`]).
    pub(crate) absent: Option<crate::exec::absent::AbsentStage>,
    /// Runs of `layers` (indices into it, ascending, disjoint, none of them with skips)
    /// re-materialized inside every recording forward: each keeps only its input and the
    /// layers run again just before the stage's backward (per-layer re-materialization, set by
    /// `PipelineBuilder::checkpoint_layers`).
    pub(crate) checkpointed: Vec<Range<usize>>,
}

/// A checkpointed run of a stage's layers recorded by a forward: what it needs to run again
/// when the backward reaches it ([`Stage::rerun`]).
pub(crate) struct PendingRerun {
    rerun: Rc<Rerun>,
    layers: Range<usize>,
    ctx: ForwardCtx,
}

impl PendingRerun {
    /// Whether this is the run whose tape node holds `rerun`.
    pub(crate) fn is(&self, rerun: &Rc<Rerun>) -> bool {
        Rc::ptr_eq(&self.rerun, rerun)
    }
}

/// A parameter or buffer of a run of layers under its global name
/// (`<global layer index>.<name inside the layer>`, see [`layer_param_name`]).
pub(crate) struct NamedTensor {
    pub name: String,
    pub param: Param,
    pub buffer: bool,
}

/// The parameters and buffers of `layers` (the first at global index `first_layer`), layer by
/// layer, each layer's parameters before its buffers: the one place global names are made.
pub(crate) fn named_tensors(first_layer: usize, layers: &[Box<dyn Module>]) -> Vec<NamedTensor> {
    let mut out = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let params = l.parameters().into_iter().map(|p| (p, false));
        for ((n, param), buffer) in params.chain(l.buffers().into_iter().map(|b| (b, true))) {
            out.push(NamedTensor {
                name: layer_param_name(first_layer + i, &n),
                param,
                buffer,
            });
        }
    }
    out
}

impl Stage {
    /// The stage's parameters under their global names, in layer order (a tied parameter once
    /// per copy).
    pub fn named_parameters(&self) -> Vec<(String, Param)> {
        self.named(false)
    }

    /// The stage's buffers (e.g. batch-norm running statistics), named like the parameters.
    pub fn named_buffers(&self) -> Vec<(String, Param)> {
        self.named(true)
    }

    fn named(&self, buffers: bool) -> Vec<(String, Param)> {
        named_tensors(self.first_layer, &self.layers)
            .into_iter()
            .filter(|t| t.buffer == buffers)
            .map(|t| (t.name, t.param))
            .collect()
    }

    /// An error of `action` on micro-batch `micro_batch` of this stage.
    pub(crate) fn error(
        &self,
        micro_batch: usize,
        action: &str,
        cause: StageCause,
    ) -> PipelineError {
        PipelineError::Stage {
            stage: self.index,
            device: self.device.name().to_string(),
            micro_batch,
            action: action.to_string(),
            cause: Box::new(cause),
        }
    }

    /// Whether this process holds the stage's layers (false for another rank's stage over MPI).
    pub fn is_held(&self) -> bool {
        self.absent.is_none()
    }

    /// Elements of the stage's parameters, held here or not (a tied parameter counts in every
    /// stage holding a copy).
    pub fn num_params(&self) -> usize {
        match &self.absent {
            Some(a) => a.num_params(),
            None => self
                .layers
                .iter()
                .flat_map(|l| l.parameters())
                .map(|(_, p)| p.value().numel())
                .sum(),
        }
    }

    /// Runs the stage's layers on `x`, each with its global layer index in the context; `at`
    /// holds the index of the layer running (so an error or a panic can say which), and is
    /// cleared after. `skips` holds the skips that entered the stage; the ones that leave it
    /// are left there. On a recording tape each checkpointed run of layers runs without
    /// recording and is pushed on `reruns`, to be run again by [`Stage::rerun`] before the
    /// backward.
    pub(crate) fn run_layers(
        &self,
        x: &Var,
        skips: &mut SkipRouter,
        ctx: ForwardCtx,
        at: &mut Option<usize>,
        reruns: &mut Vec<PendingRerun>,
    ) -> wgpipe_tensor::Result<Var> {
        let mut h = x.clone();
        let mut i = 0;
        while i < self.layers.len() {
            if let Some(run) = self.checkpointed.iter().find(|r| r.start == i) {
                if x.tape().is_recording() {
                    let free = Tape::no_grad();
                    let y =
                        self.run_plain(run.clone(), &free.constant(h.value().clone()), ctx, at)?;
                    let (v, rerun) = checkpoint_rerun_later(&h, y.value().clone())?;
                    reruns.extend(rerun.map(|rerun| PendingRerun {
                        rerun,
                        layers: run.clone(),
                        ctx,
                    }));
                    h = v;
                    i = run.end;
                    continue;
                }
            }
            let index = self.first_layer + i;
            *at = Some(index);
            h = skips.forward(
                self.layers[i].as_ref(),
                index,
                &h,
                &ctx.at_layer(index as u64),
            )?;
            i += 1;
        }
        *at = None;
        Ok(h)
    }

    /// Runs `layers` (indices into the stage's, without skips) on `x`.
    fn run_plain(
        &self,
        layers: Range<usize>,
        x: &Var,
        ctx: ForwardCtx,
        at: &mut Option<usize>,
    ) -> wgpipe_tensor::Result<Var> {
        let mut h = x.clone();
        for i in layers {
            let index = self.first_layer + i;
            *at = Some(index);
            h = self.layers[i].forward(&h, &ctx.at_layer(index as u64))?;
        }
        Ok(h)
    }

    /// Runs a checkpointed run of layers again, recording, from the input it kept, and hands
    /// the record to its tape node (whose backward back-propagates through it).
    pub(crate) fn rerun(
        &self,
        pending: PendingRerun,
        at: &mut Option<usize>,
    ) -> wgpipe_tensor::Result<()> {
        let tape = Tape::recompute();
        let input = pending.rerun.input().clone();
        let leaf = if pending.rerun.input_wants_grad() {
            tape.leaf(input)
        } else {
            tape.constant(input)
        };
        let ctx = ForwardCtx {
            recompute: true,
            ..pending.ctx
        };
        let out = self.run_plain(pending.layers, &leaf, ctx, at)?;
        *at = None;
        pending.rerun.supply(tape, leaf, out);
        Ok(())
    }

    /// Runs the stage on `x` with the skips it pops (`skips_in`, by [`StageSkips::incoming`]);
    /// the output and the skips it sends on (by [`StageSkips::outgoing`]); checkpointed runs of
    /// layers go on `reruns` (see [`Stage::run_layers`]).
    pub(crate) fn run_with_skips(
        &self,
        x: &Var,
        skips_in: &[Var],
        ctx: ForwardCtx,
        at: &mut Option<usize>,
        reruns: &mut Vec<PendingRerun>,
    ) -> wgpipe_tensor::Result<(Var, Vec<Var>)> {
        let mut router = SkipRouter::new();
        for ((_, name), v) in self.skips.incoming.iter().zip(skips_in) {
            router.insert(name.clone(), v.clone());
        }
        let y = self.run_layers(x, &mut router, ctx, at, reruns)?;
        let out = self
            .skips
            .outgoing
            .iter()
            .map(|(_, name)| {
                router
                    .take(name)
                    .ok_or_else(|| wgpipe_tensor::Error::Invalid {
                        op: "skip",
                        msg: format!("stage {} did not stash skip '{name}'", self.index),
                    })
            })
            .collect::<wgpipe_tensor::Result<Vec<Var>>>()?;
        Ok((y, out))
    }
}
