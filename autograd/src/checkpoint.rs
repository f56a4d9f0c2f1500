//! Re-materialization: run a segment without keeping its activations, re-run it in backward.

use std::rc::Rc;

use wgpipe_tensor::{Result, Tensor};

pub use crate::tape::Rerun;
use crate::tape::{BackwardFn, Tape};
use crate::var::Var;

/// Runs `f(x)` keeping only `x`'s value and the result: on a recording tape, `f` runs on a
/// [`Tape::no_grad`] tape (its activations are freed at once) and one node is recorded whose
/// backward re-runs `f` on a fresh [`Tape::recompute`] tape from a leaf holding `x`'s value and
/// back-propagates through it: parameters used by `f` (via `x.param(..)`) get their
/// gradients, and `x`'s gradient flows on.
///
/// `f` must compute the same thing twice: randomness must come from the [`ForwardCtx`]
/// (`Var::dropout` is keyed by it), never from state that changes between the calls.
/// On a tape that does not record, this is just `f(x)`.
///
/// [`ForwardCtx`]: crate::module::ForwardCtx
pub fn checkpoint(x: &Var, f: impl Fn(&Var) -> Result<Var> + 'static) -> Result<Var> {
    let tape = x.tape().clone();
    if !tape.is_recording() {
        return f(x);
    }
    let y = {
        let inner = Tape::no_grad();
        let xin = inner.constant(x.value().clone());
        f(&xin)?.value().clone()
    };
    let x_value = x.value().clone();
    let y_shape = y.shape().to_vec();
    let backward: BackwardFn = Box::new(move |g, wants| {
        let re = Tape::recompute();
        let xl = re.leaf(x_value.clone());
        let out = f(&xl)?;
        through_rerun(&re, &xl, &out, &y_shape, g, wants[0])
    });
    // `force`: the segment may hold trainable parameters even when `x` wants no gradient.
    tape.record("checkpoint", &[x], y, true, backward, None)
}

/// The backward of a checkpointed segment through its re-run `out` (recorded on `re` from
/// `input`): the output gradient `g` back-propagated there (the segment's parameters get their
/// gradients), and `input`'s gradient when `wants` it.
fn through_rerun(
    re: &Tape,
    input: &Var,
    out: &Var,
    first_shape: &[usize],
    g: &Tensor,
    wants: bool,
) -> Result<Vec<Option<Tensor>>> {
    if out.shape() != first_shape {
        return Err(crate::tape::invalid(
            "checkpoint",
            format!(
                "the re-run segment gave shape {:?}, the first run {first_shape:?}",
                out.shape()
            ),
        ));
    }
    let mut grads = re.backward_with(out, g)?;
    Ok(vec![if wants { grads.take(input) } else { None }])
}

/// [`checkpoint`] for a segment that the caller runs itself: `y` is the value the segment gave
/// for `x` (computed without recording), and the recorded node's backward back-propagates
/// through the re-run the caller hands to the returned [`Rerun`]: before the backward, or when
/// the backward reaches the node, from the supplier given to
/// [`Tape::backward_roots_rerunning`] (a pipeline stage re-runs its checkpointed layers so, as
/// torch's checkpoint does, one run's record alive at a time; it holds the layers, which the
/// node cannot keep itself). Parameters of the segment get their
/// gradients in that backward, as with [`checkpoint`], bit for bit like a plain run.
///
/// On a tape that does not record, the result is `y` as a constant and nothing is kept.
pub fn checkpoint_rerun_later(x: &Var, y: Tensor) -> Result<(Var, Option<Rc<Rerun>>)> {
    let tape = x.tape().clone();
    if !tape.is_recording() {
        return Ok((tape.constant(y), None));
    }
    let rerun = Rc::new(Rerun::new(x.value().clone(), x.requires_grad()));
    let y_shape = y.shape().to_vec();
    let held = rerun.clone();
    let backward: BackwardFn = Box::new(move |g, wants| {
        let Some((re, leaf, out)) = held.take() else {
            return Err(crate::tape::invalid(
                "checkpoint",
                "the backward reached a checkpointed segment whose re-run was not supplied"
                    .to_string(),
            ));
        };
        through_rerun(&re, &leaf, &out, &y_shape, g, wants[0])
    });
    let var = tape.record("checkpoint", &[x], y, true, backward, None)?;
    tape.attach_rerun(rerun.clone());
    Ok((var, Some(rerun)))
}
