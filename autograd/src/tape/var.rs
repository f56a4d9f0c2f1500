//! `Var`: a tensor recorded on a tape. Its op methods (in `ops/`) mirror the tensor ops and
//! record their backward on the tape.

use wgpipe_tensor::{Device, Result, Tensor};

use super::{BackwardFn, CarrySlot, MultiBackwardFn, Tape};
use crate::param::Param;

/// A value on a [`Tape`]. Cloning is cheap (the value's storage is shared).
#[derive(Clone)]
pub struct Var {
    pub(crate) id: usize,
    pub(crate) value: Tensor,
    pub(crate) tape: Tape,
    /// True when a gradient flows to this var in backward (leaf, trainable param, or the result
    /// of an op on such a var, on a recording tape).
    pub(crate) requires_grad: bool,
    /// True when the value depends on data (a leaf, a constant, or an op on one), false when it
    /// is computed from parameters alone. A split backward computes the gradients of data vars
    /// in its input part and those of parameter-only vars in its weight part.
    pub(crate) data: bool,
}

impl Var {
    pub fn value(&self) -> &Tensor {
        &self.value
    }
    pub fn shape(&self) -> &[usize] {
        self.value.shape()
    }
    pub fn rank(&self) -> usize {
        self.value.rank()
    }
    pub fn numel(&self) -> usize {
        self.value.numel()
    }
    pub fn device(&self) -> &Device {
        self.value.device()
    }
    pub fn tape(&self) -> &Tape {
        &self.tape
    }
    /// Parameter `p` on this var's tape in this var's dtype: how a layer reads its weights.
    /// Under autocast the stream between layers is half, so the weights come as the param's
    /// cached half copy of its f32 master ([`Tape::param_in`]) and the layer computes in
    /// half; in an f32 run they are the param itself. The gradient accumulates in the param's
    /// own dtype either way.
    pub fn param(&self, p: &Param) -> Result<Var> {
        self.tape.param_in(p, self.value.dtype())
    }
    pub fn id(&self) -> usize {
        self.id
    }
    /// True when backward will compute a gradient for this var.
    pub fn requires_grad(&self) -> bool {
        self.requires_grad
    }
    /// The same value as a constant on the same tape: no gradient flows through it.
    pub fn detach(&self) -> Var {
        self.tape.constant(self.value.clone())
    }
    /// True when the value depends on data (a leaf, a constant, or an op on one), false when it
    /// is computed from parameters alone.
    pub fn is_data(&self) -> bool {
        self.data
    }

    /// The same var, counted as depending on data from here on: for ops whose data enters as a
    /// plain tensor rather than a var (an embedding's ids), so that a split backward
    /// ([`crate::Tape::backward_split`]) runs the ops after it in its input part. Gradients are
    /// the same either way; only the split between the two parts changes.
    pub fn depending_on_data(mut self) -> Var {
        self.data = true;
        self
    }

    /// The single value of a one-element var (e.g. a loss).
    pub fn to_scalar(&self) -> Result<f32> {
        self.value.to_scalar()
    }

    /// A custom op: `value` computed from `inputs` (all on one tape) with its `backward`, which
    /// gets the output gradient and which inputs want a gradient, and returns one gradient (or
    /// `None`) per input, shaped like that input. Every built-in op records through this.
    pub fn from_op(
        op: &'static str,
        inputs: &[&Var],
        value: Tensor,
        backward: impl FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Result<Var> {
        let tape = tape_of(op, inputs)?;
        tape.record(
            op,
            inputs,
            value,
            false,
            Box::new(backward) as BackwardFn,
            None,
        )
    }

    /// [`Var::from_op`] for an op with several results, one var per value in `values` (all
    /// recorded as one node): its `backward` gets each output's gradient (`None` for those no
    /// gradient reached; it runs when at least one did) and returns one gradient per input.
    pub fn from_op_multi(
        op: &'static str,
        inputs: &[&Var],
        values: Vec<Tensor>,
        backward: impl FnMut(&[Option<Tensor>], &[bool]) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Result<Vec<Var>> {
        let tape = tape_of(op, inputs)?;
        let backward = Box::new(backward) as MultiBackwardFn;
        tape.record_many(op, inputs, values, false, backward, None)
    }

    /// [`Var::from_op`] for an op whose backward adds its gradient for input `carried` to the
    /// gradient that input already has, in the same pass: when the backward runs, `slot` holds
    /// that gradient (or `None`), taken out of the tape's running sum, and the backward returns
    /// the total for that input. The tape would otherwise add the two in a pass of its own.
    pub(crate) fn from_op_carrying(
        op: &'static str,
        inputs: &[&Var],
        value: Tensor,
        carried: usize,
        slot: CarrySlot,
        backward: impl FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + 'static,
    ) -> Result<Var> {
        let tape = tape_of(op, inputs)?;
        let backward = Box::new(backward) as BackwardFn;
        tape.record(op, inputs, value, false, backward, Some((carried, slot)))
    }
}

/// The tape an op's inputs are on (its first input's): an op needs at least one input var.
fn tape_of(op: &'static str, inputs: &[&Var]) -> Result<Tape> {
    inputs
        .first()
        .map(|v| v.tape.clone())
        .ok_or_else(|| super::invalid(op, "an op needs at least one input var".to_string()))
}

impl std::fmt::Debug for Var {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Var(id={}, shape={:?}, requires_grad={})",
            self.id,
            self.shape(),
            self.requires_grad
        )
    }
}
