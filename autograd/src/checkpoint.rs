//! Re-materialization: run a segment without keeping its activations, re-run it in backward.

use wgpipe_tensor::Result;

use crate::tape::{BackwardFn, Tape};
use crate::var::Var;

/// Runs `f(x)` keeping only `x`'s value and the result: on a recording tape, `f` runs on a
/// [`Tape::no_grad`] tape (its activations are freed at once) and one node is recorded whose
/// backward re-runs `f` on a fresh [`Tape::recompute`] tape from a leaf holding `x`'s value and
/// back-propagates through it: parameters used by `f` (via `x.tape().param(..)`) get their
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
        if out.shape() != y_shape.as_slice() {
            return Err(crate::tape::invalid(
                "checkpoint",
                format!(
                    "the recomputed segment gave shape {:?}, the first run {y_shape:?}",
                    out.shape()
                ),
            ));
        }
        let mut grads = re.backward_with(&out, g)?;
        Ok(vec![if wants[0] { grads.take(&xl) } else { None }])
    });
    // `force`: the segment may hold trainable parameters even when `x` wants no gradient.
    tape.record("checkpoint", &[x], y, true, backward, None)
}
