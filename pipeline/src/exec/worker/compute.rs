//! The compute actions of one (stage, micro-batch): its forward (recorded, or keeping only its
//! input when a recompute follows), the recompute, and the backward, full or split in an input
//! and a weight part.

use std::rc::Rc;

use wgpipe_autograd::{ForwardCtx, Rerun, Tape, Var};
use wgpipe_tensor::Tensor;

use super::{internal, NonFiniteAt, Recorded, Stash, Worker};
use crate::error::StageCause;

impl Worker<'_, '_> {
    pub(super) fn forward(&mut self, s: usize, m: usize) -> Result<(), StageCause> {
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
        let tape = if checkpointed || io.forward_only {
            Tape::no_grad()
        } else {
            Tape::new()
        };
        let input_finite = if s == 0 {
            self.check(&x, s, m, || format!("the input of micro-batch {m}"))?
        } else {
            self.finite_in.remove(&(s, m, false)).unwrap_or(true)
        };
        let (popped, popped_finite) = self.take_skips_in(stage, m)?;
        let input_finite = input_finite && popped_finite;
        let ctx = if io.forward_only {
            // Which micro-batch it is, as in training (a layer may log or check it).
            ForwardCtx {
                micro_batch: io.first_micro_batch + m as u64,
                kv_position: io.kv_position,
                ..ForwardCtx::eval()
            }
        } else {
            ForwardCtx::train(io.seed, io.step, io.first_micro_batch + m as u64)
        }
        .with_compute(io.compute);
        let recorded = self.record(s, tape, &x, &popped, ctx)?;
        let output = &recorded.output;
        // A skip leaves at once (sent right after this forward); its recompute is not sent
        // again. Its finiteness is that of what the stage received: a non-finite skip is
        // caught where it is popped, as the stage's output is at the next stage.
        for ((id, _), v) in stage.skips.outgoing.iter().zip(&recorded.skips_out) {
            self.skips_out
                .insert((*id, m, false), (v.value().clone(), input_finite));
        }
        if self.is_last(s) && io.forward_only {
            // The caller's thread keeps what it needs of the output (a loss, logits); no
            // backward follows.
            self.loss_gradient(m, output.value().clone())?;
            return Ok(());
        }
        if self.is_last(s) {
            // The loss runs on the caller's thread; its gradient comes back as the seed of
            // this micro-batch's backward, as a next stage's gradient would.
            let (grad, finite) = self.loss_gradient(m, output.value().clone())?;
            if !finite && input_finite {
                self.out.non_finite.get_or_insert(NonFiniteAt {
                    stage: s,
                    micro_batch: m,
                    what: format!("the loss of micro-batch {m}"),
                });
            }
            self.finite_in.insert((s, m, true), input_finite && finite);
            self.grads_in.insert((s, m), grad);
        } else {
            let finite = input_finite
                && self.check(output.value(), s, m, || match stage.layers.last() {
                    Some(l) => format!(
                        "the output of layer {} ({}) for micro-batch {m}",
                        stage.first_layer + stage.layers.len() - 1,
                        l.name()
                    ),
                    None => format!("the output of stage {s} for micro-batch {m}"),
                })?;
            self.finite_out.insert((s, m, false), finite);
            self.to_send.insert((s, m, false), output.value().clone());
        }
        if io.forward_only {
            return Ok(());
        }
        let kept = if checkpointed {
            Stash::Input { x, skips: popped }
        } else {
            Stash::Recorded(Box::new(recorded))
        };
        self.stash.insert((s, m), kept);
        Ok(())
    }

    pub(super) fn recompute(&mut self, s: usize, m: usize) -> Result<(), StageCause> {
        let io = self.io;
        let (x, popped) = match self.stash.remove(&(s, m)) {
            Some(Stash::Input { x, skips }) => (x, skips),
            _ => {
                return Err(internal(format!(
                    "no stashed input to recompute stage {s} micro-batch {m}"
                )))
            }
        };
        let ctx = ForwardCtx {
            recompute: true,
            ..ForwardCtx::train(io.seed, io.step, io.first_micro_batch + m as u64)
                .with_compute(io.compute)
        };
        // Both signals, as `autograd::checkpoint` gives: `ctx.recompute` and a recompute tape,
        // so a layer may check either to skip side effects.
        let recorded = self.record(s, Tape::recompute(), &x, &popped, ctx)?;
        self.stash
            .insert((s, m), Stash::Recorded(Box::new(recorded)));
        Ok(())
    }

    /// Runs stage `s` forward on `tape` from `x` and the skips it popped, and keeps what its
    /// backward needs: a forward's record, or a recompute's.
    fn record(
        &mut self,
        s: usize,
        tape: Tape,
        x: &Tensor,
        popped: &[Tensor],
        ctx: ForwardCtx,
    ) -> Result<Recorded, StageCause> {
        let input = input_var(&tape, x, s);
        let skips_in: Vec<Var> = popped.iter().map(|t| tape.leaf(t.clone())).collect();
        let mut reruns = Vec::new();
        let (output, skips_out) = self.stage(s)?.run_with_skips(
            &input,
            &skips_in,
            ctx,
            &mut self.pos.layer,
            &mut reruns,
        )?;
        Ok(Recorded {
            tape,
            input,
            output,
            skips_in,
            skips_out,
            reruns,
        })
    }

    /// A full backward, or the input part of a split one (`split`), whose weight part is kept.
    pub(super) fn backward(&mut self, s: usize, m: usize, split: bool) -> Result<(), StageCause> {
        let Recorded {
            tape,
            input,
            output,
            skips_in,
            skips_out,
            reruns,
        } = match self.stash.remove(&(s, m)) {
            Some(Stash::Recorded(recorded)) => *recorded,
            _ => {
                return Err(internal(format!(
                    "stage {s} micro-batch {m} has no recorded forward to back-propagate"
                )))
            }
        };
        let seed = self
            .grads_in
            .remove(&(s, m))
            .ok_or_else(|| internal(format!("no gradient for stage {s} micro-batch {m}")))?;
        let mut seed_finite = self.finite_in.remove(&(s, m, true)).unwrap_or(true);
        let stage = self.stage(s)?;
        // The gradients of the skips stashed here seed the backward beside the output's.
        let mut skip_seeds = Vec::with_capacity(skips_out.len());
        for (id, name) in &stage.skips.outgoing {
            let (g, finite) = self.skips_in.remove(&(*id, m, true)).ok_or_else(|| {
                internal(format!(
                    "no gradient of skip '{name}' for stage {s} micro-batch {m}"
                ))
            })?;
            seed_finite &= finite;
            skip_seeds.push(g);
        }
        let roots: Vec<(&Var, &Tensor)> = std::iter::once((&output, &seed))
            .chain(skips_out.iter().zip(&skip_seeds))
            .collect();
        // Each checkpointed run of layers runs again when the backward reaches it, here where
        // the stage's layers are at hand (its tape node cannot hold them): one run's record
        // alive at a time.
        let mut reruns = reruns;
        let at = &mut self.pos.layer;
        let mut supply = |r: &Rc<Rerun>| -> wgpipe_tensor::Result<()> {
            let i = reruns.iter().position(|p| p.is(r)).ok_or_else(|| {
                wgpipe_tensor::Error::Invalid {
                    op: "checkpoint",
                    msg: format!("stage {s}: a checkpointed run of layers was re-run twice"),
                }
            })?;
            stage.rerun(reruns.swap_remove(i), at)
        };
        let mut grads = if split {
            let (grads, weights) = tape.backward_split_roots_rerunning(&roots, &mut supply)?;
            self.stash.insert((s, m), Stash::Weights(weights));
            grads
        } else {
            tape.backward_roots_rerunning(&roots, &mut supply)?
        };
        for ((id, _), v) in stage.skips.incoming.iter().zip(&skips_in) {
            // A popped skip the stage did not use gets a zero gradient.
            let g = match grads.take(v) {
                Some(g) => g,
                None => Tensor::zeros(v.shape(), self.device)?.to_dtype(v.value().dtype())?,
            };
            self.skips_out.insert((*id, m, true), (g, seed_finite));
        }
        if s > 0 {
            let g = grads
                .get(&input)
                .cloned()
                .ok_or_else(|| internal(format!("no gradient reached the input of stage {s}")))?;
            let finite = seed_finite
                && self.check(&g, s, m, || {
                    format!("the gradient of the input of stage {s} for micro-batch {m}")
                })?;
            self.finite_out.insert((s, m, true), finite);
            self.to_send.insert((s, m, true), g);
        }
        Ok(())
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
