//! Back-propagation entry points: check the outputs and their seeds, take the recorded nodes out
//! of the tape, and hand them to the reverse walk (`walk.rs`), whole or split in an input and a
//! weight part.

use wgpipe_tensor::{Error, Result, Tensor};

use super::grads::{Grads, WeightGrads};
use super::var::Var;
use super::walk::{flush_params, leaf_grads, run_nodes, Part, Supply};
use super::{invalid, Node, Tape};
use crate::param::Param;

impl Tape {
    /// Back-propagates from a scalar (one-element) output, seeded with 1.
    pub fn backward(&self, output: &Var) -> Result<Grads> {
        if output.value().numel() != 1 {
            return Err(invalid(
                "backward",
                format!(
                    "the output has shape {:?} ({} elements), not a scalar: use backward_with(output, grad_output)",
                    output.shape(),
                    output.value().numel()
                ),
            ));
        }
        let seed = Tensor::ones(output.shape(), output.value().device())?
            .to_dtype(output.value().dtype())?;
        self.backward_with(output, &seed)
    }

    /// Back-propagates from `output` seeded with `grad_output` (same shape and device), e.g. the
    /// gradient a pipeline stage receives from the next stage. Parameter gradients accumulate
    /// into the params; the gradients of leaves come back in `Grads`. Each node's saved tensors
    /// are freed as soon as its backward ran. A tape runs backward once.
    pub fn backward_with(&self, output: &Var, grad_output: &Tensor) -> Result<Grads> {
        self.backward_roots(&[(output, grad_output)])
    }

    /// [`Tape::backward_with`] from several outputs at once, each seeded with its gradient (a
    /// pipeline stage's output and the skips it stashed); seeds of one var add up.
    pub fn backward_roots(&self, roots: &[(&Var, &Tensor)]) -> Result<Grads> {
        self.backward_roots_rerunning(roots, &mut |_| Ok(()))
    }

    /// [`Tape::backward_roots`] where segments recorded by [`crate::checkpoint_rerun_later`]
    /// get their re-run from `supply` when the walk reaches them (one segment's record alive
    /// at a time), unless one was supplied before.
    pub fn backward_roots_rerunning(
        &self,
        roots: &[(&Var, &Tensor)],
        supply: Supply<'_>,
    ) -> Result<Grads> {
        let Taken {
            nodes,
            leaves,
            mut params,
            tape_id,
            mut grads,
        } = self.take_for_backward(roots)?;
        // Parameter gradients go into their params during the walk, each as soon as it is final
        // (so they are not all held at once), in reverse creation order (the order a
        // checkpointed segment's recompute would accumulate them in, so both give bit-identical
        // sums).
        run_nodes(
            nodes,
            &mut grads,
            &mut params,
            Part::Full,
            &mut Vec::new(),
            supply,
        )?;
        flush_params(&mut params, &mut grads, None)?;
        leaf_grads(tape_id, leaves, &mut grads)
    }

    /// The input part of a split backward (zero-bubble pipelines' "B" or "I"): back-propagates
    /// from `output` through every var that depends on data and returns the leaves' gradients,
    /// as [`Tape::backward_with`] does, without computing any parameter gradient. What the weight
    /// part needs (the nodes that have parameter-side inputs, with their output gradients) is
    /// kept in the returned [`WeightGrads`]; everything else is freed now. Running it later
    /// accumulates exactly the parameter gradients the full backward would have, bit for bit
    /// (each var's gradient is summed over the same nodes in the same order).
    pub fn backward_split(
        &self,
        output: &Var,
        grad_output: &Tensor,
    ) -> Result<(Grads, WeightGrads)> {
        self.backward_split_roots(&[(output, grad_output)])
    }

    /// [`Tape::backward_split`] from several seeded outputs (see [`Tape::backward_roots`]).
    pub fn backward_split_roots(&self, roots: &[(&Var, &Tensor)]) -> Result<(Grads, WeightGrads)> {
        self.backward_split_roots_rerunning(roots, &mut |_| Ok(()))
    }

    /// [`Tape::backward_split_roots`] with re-runs supplied as in
    /// [`Tape::backward_roots_rerunning`] (checkpointed segments run in the input part).
    pub fn backward_split_roots_rerunning(
        &self,
        roots: &[(&Var, &Tensor)],
        supply: Supply<'_>,
    ) -> Result<(Grads, WeightGrads)> {
        let Taken {
            nodes,
            leaves,
            params,
            tape_id,
            mut grads,
        } = self.take_for_backward(roots)?;
        let mut deferred = Vec::new();
        run_nodes(
            nodes,
            &mut grads,
            &mut Vec::new(),
            Part::Input,
            &mut deferred,
            supply,
        )?;
        let leaves = leaf_grads(tape_id, leaves, &mut grads)?;
        // What is left are gradients of parameter-only vars the input part could not pass on:
        // the seed itself when the output depends on parameters alone (a stage whose input
        // enters only as an index, such as an embedding lookup).
        let carried: Vec<(usize, Tensor)> = grads
            .into_iter()
            .enumerate()
            .filter_map(|(id, g)| g.map(|g| (id, g)))
            .collect();
        Ok((
            leaves,
            WeightGrads {
                deferred,
                carried,
                params,
            },
        ))
    }

    /// Checks a backward call and takes the recorded nodes out (the tape is done afterwards).
    fn take_for_backward(&self, roots: &[(&Var, &Tensor)]) -> Result<Taken> {
        for (output, grad_output) in roots {
            self.check_root(output, grad_output)?;
        }
        let mut i = self.inner.borrow_mut();
        i.done = true;
        let top = roots.iter().map(|(v, _)| v.id).max().unwrap_or(0);
        let mut grads: Vec<Option<Tensor>> = vec![None; top + 1];
        for (output, grad_output) in roots {
            if output.requires_grad {
                let slot = &mut grads[output.id];
                *slot = Some(match slot.take() {
                    Some(g) => g.add(grad_output)?,
                    None => (*grad_output).clone(),
                });
            }
        }
        Ok(Taken {
            nodes: std::mem::take(&mut i.nodes),
            leaves: std::mem::take(&mut i.leaves),
            params: std::mem::take(&mut i.params),
            tape_id: i.id,
            grads,
        })
    }

    /// Checks one output of a backward call and its seed.
    fn check_root(&self, output: &Var, grad_output: &Tensor) -> Result<()> {
        if !output.tape.same(self) {
            return Err(invalid(
                "backward",
                "the output var was recorded on another tape".to_string(),
            ));
        }
        {
            let i = self.inner.borrow();
            if !i.recording {
                return Err(invalid(
                    "backward",
                    "the tape does not record (Tape::no_grad): there is nothing to back-propagate"
                        .to_string(),
                ));
            }
            if i.done {
                return Err(invalid(
                    "backward",
                    "backward already ran on this tape (its saved tensors are freed); record a new tape"
                        .to_string(),
                ));
            }
        }
        if grad_output.shape() != output.shape() {
            return Err(Error::Shape {
                op: "backward",
                msg: format!(
                    "grad_output has shape {:?} but the output has shape {:?}",
                    grad_output.shape(),
                    output.shape()
                ),
            });
        }
        if grad_output.device() != output.value().device() {
            return Err(Error::DeviceMismatch {
                op: "backward",
                a: output.value().device().name().to_string(),
                b: grad_output.device().name().to_string(),
            });
        }
        Ok(())
    }
}

/// What a backward takes out of the tape.
struct Taken {
    nodes: Vec<Node>,
    leaves: Vec<usize>,
    params: Vec<(usize, Param)>,
    tape_id: u64,
    grads: Vec<Option<Tensor>>,
}
