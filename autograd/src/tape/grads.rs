//! What a backward gives back: the leaves' gradients ([`Grads`]) and, from the input part of a
//! split backward, the weight part still to run ([`WeightGrads`]).

use std::collections::HashMap;

use wgpipe_tensor::{Result, Tensor};

use super::var::Var;
use super::walk::{flush_params, run_nodes, Part};
use super::Node;
use crate::param::Param;

/// The weight part of a split backward (zero-bubble pipelines' "W"): the nodes with
/// parameter-side inputs, each with its output gradient when that was computed by the input part.
pub struct WeightGrads {
    /// In reverse recording order (the order the walk visits them); the output gradients are
    /// empty when the input part did not compute them.
    pub(super) deferred: Vec<(Node, Vec<Option<Tensor>>)>,
    /// Gradients of parameter-only vars left by the input part (by var id).
    pub(super) carried: Vec<(usize, Tensor)>,
    pub(super) params: Vec<(usize, Param)>,
}

impl WeightGrads {
    /// Computes the parameter gradients and accumulates them into the params, as the full
    /// backward would have.
    pub fn run(self) -> Result<()> {
        let WeightGrads {
            deferred,
            carried,
            mut params,
        } = self;
        let top = deferred
            .first()
            .map_or(0, |(n, _)| n.outputs.end.saturating_sub(1));
        let top = params.last().map_or(top, |(id, _)| top.max(*id));
        let top = carried.iter().map(|(id, _)| *id).fold(top, usize::max);
        let mut grads: Vec<Option<Tensor>> = vec![None; top + 1];
        for (id, g) in carried {
            grads[id] = Some(g);
        }
        let mut nodes = Vec::with_capacity(deferred.len());
        // `run_nodes` pops from the back: give it recording order, with the output gradients
        // the input part computed placed in the slots of their vars.
        for (node, gs) in deferred.into_iter().rev() {
            for (id, g) in node.outputs.clone().zip(gs) {
                grads[id] = g;
            }
            nodes.push(node);
        }
        // Segments re-run later run in the input part (their input depends on data).
        run_nodes(
            nodes,
            &mut grads,
            &mut params,
            Part::Weight,
            &mut Vec::new(),
            &mut |_| Ok(()),
        )?;
        flush_params(&mut params, &mut grads, None)
    }

    /// Number of nodes waiting for the weight part.
    pub fn len(&self) -> usize {
        self.deferred.len()
    }

    pub fn is_empty(&self) -> bool {
        self.deferred.is_empty()
    }
}

/// The gradients of a tape's leaves after backward.
pub struct Grads {
    pub(super) tape: u64,
    pub(super) grads: HashMap<usize, Tensor>,
}

impl Grads {
    /// The gradient of leaf `v` (contiguous, shaped like `v`); `None` when `v` is not a leaf of
    /// this tape or no gradient reached it.
    pub fn get(&self, v: &Var) -> Option<&Tensor> {
        if v.tape.id() != self.tape {
            return None;
        }
        self.grads.get(&v.id)
    }

    /// Takes the gradient of leaf `v` out.
    pub fn take(&mut self, v: &Var) -> Option<Tensor> {
        if v.tape.id() != self.tape {
            return None;
        }
        self.grads.remove(&v.id)
    }

    pub fn len(&self) -> usize {
        self.grads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }
}

impl std::fmt::Debug for Grads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grads({} leaves)", self.grads.len())
    }
}
