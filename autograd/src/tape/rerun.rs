//! A checkpointed segment whose re-run its caller supplies (see
//! [`crate::checkpoint_rerun_later`]): the walk asks for it when it reaches the segment's node.

use std::cell::RefCell;

use wgpipe_tensor::Tensor;

use super::var::Var;
use super::Tape;

/// A segment recorded by [`crate::checkpoint_rerun_later`]: what its re-run needs (the input's value)
/// and the slot the re-run's tape goes in before the backward reaches the segment.
pub struct Rerun {
    input: Tensor,
    input_wants_grad: bool,
    slot: RefCell<Option<(Tape, Var, Var)>>,
}

impl Rerun {
    pub(crate) fn new(input: Tensor, input_wants_grad: bool) -> Rerun {
        Rerun {
            input,
            input_wants_grad,
            slot: RefCell::new(None),
        }
    }

    /// The re-run, taken by the segment's backward.
    pub(crate) fn take(&self) -> Option<(Tape, Var, Var)> {
        self.slot.borrow_mut().take()
    }

    /// The segment's input value, to re-run it from.
    pub fn input(&self) -> &Tensor {
        &self.input
    }

    /// Whether the segment's input wants a gradient: the re-run starts from a leaf then, from
    /// a constant otherwise (so its backward does not compute an input gradient nobody uses).
    pub fn input_wants_grad(&self) -> bool {
        self.input_wants_grad
    }

    /// Hands over the re-run: `tape` (a [`Tape::recompute`] tape), the var on it holding
    /// [`Rerun::input`] (a leaf or a constant, as [`Rerun::input_wants_grad`] says), and the
    /// segment's output recorded from it.
    pub fn supply(&self, tape: Tape, leaf: Var, output: Var) {
        *self.slot.borrow_mut() = Some((tape, leaf, output));
    }

    /// Whether the re-run was supplied and not yet used by the backward.
    pub fn is_supplied(&self) -> bool {
        self.slot.borrow().is_some()
    }
}
