//! The reverse walk over a tape's nodes, shared by the full backward and both parts of a split
//! one: run each node's backward once, sum the gradients per var, hand parameter gradients to
//! their params as soon as they are final.

use std::collections::HashMap;
use std::rc::Rc;

use smallvec::SmallVec;

use wgpipe_tensor::{Error, Result, Tensor};

use super::grads::Grads;
use super::{invalid, CarrySlot, Node, NodeInput, Rerun};
use crate::param::Param;

/// The leaves' gradients (contiguous) after a walk.
pub(super) fn leaf_grads(
    tape: u64,
    leaves: Vec<usize>,
    grads: &mut [Option<Tensor>],
) -> Result<Grads> {
    let mut map = HashMap::new();
    for id in leaves {
        if let Some(g) = grads.get_mut(id).and_then(Option::take) {
            map.insert(id, g.contiguous()?);
        }
    }
    Ok(Grads { tape, grads: map })
}

/// Accumulates into their params the gradients of the param vars (`params`, in increasing id
/// order) whose id is above `below` (all when `None`), last first, and removes them from `params`.
/// Nodes are recorded after their inputs, so once the walk reaches a node whose output id is
/// below a param var's id, every consumer of that var has run and its gradient is final.
pub(super) fn flush_params(
    params: &mut Vec<(usize, Param)>,
    grads: &mut [Option<Tensor>],
    below: Option<usize>,
) -> Result<()> {
    while let Some((id, p)) = params.last() {
        if below.is_some_and(|b| *id < b) {
            break;
        }
        if let Some(g) = grads.get_mut(*id).and_then(Option::take) {
            p.accumulate_grad(&g)?;
        }
        params.pop();
    }
    Ok(())
}

/// Hands a checkpointed segment its re-run when the walk reaches it (see
/// [`crate::checkpoint_rerun_later`]).
pub type Supply<'a> = &'a mut dyn FnMut(&Rc<Rerun>) -> Result<()>;

/// Which inputs a walk computes gradients for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// All of them (plain backward).
    Full,
    /// Only inputs that depend on data; nodes with parameter-side inputs go to `deferred`.
    Input,
    /// Only parameter-side inputs (the deferred nodes of an input part).
    Weight,
}

impl Part {
    fn wants(self, input: &NodeInput) -> bool {
        match self {
            Part::Full => true,
            Part::Input => input.data,
            Part::Weight => !input.data,
        }
    }
}

/// Walks `nodes` in reverse, dropping each closure (and so its saved tensors) as soon as it ran,
/// and each intermediate gradient as soon as its node consumed it; param gradients are handed to
/// their params as soon as they are final (see [`flush_params`]). In the input part, a node whose
/// output is parameter-only is not run (its gradient comes in the weight part), and a node with
/// parameter-side inputs is kept in `deferred` with its output gradient.
pub(super) fn run_nodes(
    mut nodes: Vec<Node>,
    grads: &mut Vec<Option<Tensor>>,
    params: &mut Vec<(usize, Param)>,
    part: Part,
    deferred: &mut Vec<(Node, Vec<Option<Tensor>>)>,
    supply: Supply<'_>,
) -> Result<()> {
    while let Some(mut node) = nodes.pop() {
        flush_params(params, grads, Some(node.outputs.start))?;
        let has_weight_side = node.inputs.iter().flatten().any(|i| !i.data);
        if part == Part::Input && !node.data_output {
            deferred.push((node, Vec::new()));
            continue;
        }
        // Inline for the usual one output and few inputs (the backward still returns a Vec).
        let g: SmallVec<[Option<Tensor>; 2]> = node
            .outputs
            .clone()
            .map(|id| grads.get_mut(id).and_then(Option::take))
            .collect();
        if g.iter().all(Option::is_none) {
            continue; // no gradient reaches this node: drop it unrun
        }
        let wants: SmallVec<[bool; 4]> = node
            .inputs
            .iter()
            .map(|i| i.as_ref().is_some_and(|i| part.wants(i)))
            .collect();
        // The weight part skips nodes it has nothing to ask of; the other walks always call
        // the backward, which may have effects of its own (`checkpoint` accumulates the
        // gradients of its segment's parameters, even when its input wants none).
        let carried = take_carry(&node, &wants, grads);
        if let Some(rerun) = node.rerun.as_ref().filter(|r| !r.is_supplied()) {
            // A segment re-run only now: one segment's record alive at a time.
            supply(rerun)?;
        }
        let mut input_grads = if part != Part::Weight || wants.iter().any(|w| *w) {
            (node.backward)(&g, &wants)?
        } else {
            vec![None; wants.len()]
        };
        if let Some((k, left)) = carried.and_then(|(k, slot)| slot.take().map(|t| (k, t))) {
            // The backward did not fold the carried gradient in: add it back as the walk would.
            input_grads[k] = Some(match input_grads[k].take() {
                Some(gi) => left.add(&gi)?,
                None => left,
            });
        }
        if input_grads.len() != node.inputs.len() {
            return Err(invalid(
                node.op,
                format!(
                    "backward gave {} gradients for {} inputs",
                    input_grads.len(),
                    node.inputs.len()
                ),
            ));
        }
        for ((slot, gi), want) in node.inputs.iter().zip(input_grads).zip(&wants) {
            let (Some(input), Some(gi), true) = (slot, gi, *want) else {
                continue;
            };
            if gi.shape() != input.shape.as_slice() {
                return Err(Error::Shape {
                    op: node.op,
                    msg: format!(
                        "backward gave a gradient of shape {:?} for an input of shape {:?}",
                        gi.shape(),
                        input.shape
                    ),
                });
            }
            if grads.len() <= input.id {
                grads.resize(input.id + 1, None);
            }
            // Written into the running sum's memory when no other tensor holds it.
            grads[input.id] = Some(match grads[input.id].take() {
                Some(mut acc) => {
                    acc.add_assign(&gi)?;
                    acc
                }
                None => gi,
            });
        }
        if part == Part::Input && has_weight_side {
            deferred.push((node, g.into_vec()));
        }
    }
    Ok(())
}

/// For a carrying node whose carried input wants a gradient: moves the gradient that input has
/// so far into the node's slot (the backward adds its own to it) and returns the slot.
fn take_carry(
    node: &Node,
    wants: &[bool],
    grads: &mut [Option<Tensor>],
) -> Option<(usize, CarrySlot)> {
    let (k, slot) = node.carry.as_ref()?;
    let input = node.inputs.get(*k)?.as_ref()?;
    if !wants[*k] {
        return None;
    }
    *slot.borrow_mut() = grads.get_mut(input.id).and_then(Option::take);
    Some((*k, slot.clone()))
}
