//! The tape: a record of the ops run on [`Var`]s, walked in reverse by `backward`.
//!
//! A `Tape` is a cheap, `Rc`-shared handle and lives on one thread (a pipeline stage records one
//! tape per micro-batch on its own thread). Each recorded op becomes a node holding a `FnOnce`
//! closure that owns exactly the tensors its backward needs; backward calls each closure once and
//! drops it right away, so saved activations are freed while the walk goes on (the device's
//! memory accounting shows it). Ops whose inputs need no gradient, and every op on a
//! [`Tape::no_grad`] tape, record nothing and keep nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use wgpipe_tensor::{Error, Result, Tensor};

use crate::param::Param;
use crate::var::Var;

/// The backward of one node: given the gradient of its output and which inputs want a gradient,
/// the gradient of each input (`None` where none is wanted or it is zero). Gradients must have the
/// shapes of the inputs.
pub type BackwardFn = Box<dyn FnOnce(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>>>;

static NEXT_TAPE: AtomicU64 = AtomicU64::new(1);

/// A tape handle. Clones share the tape.
#[derive(Clone)]
pub struct Tape {
    inner: Rc<RefCell<TapeInner>>,
}

struct Node {
    op: &'static str,
    output: usize,
    /// For each input: its var id and shape when it wants a gradient, else `None`.
    inputs: Vec<Option<(usize, Vec<usize>)>>,
    backward: BackwardFn,
}

struct TapeInner {
    id: u64,
    recording: bool,
    recompute: bool,
    done: bool,
    next_var: usize,
    nodes: Vec<Node>,
    leaves: Vec<usize>,
    params: Vec<(usize, Param)>,
}

impl Default for Tape {
    fn default() -> Self {
        Tape::new()
    }
}

impl Tape {
    fn make(recording: bool, recompute: bool) -> Tape {
        Tape {
            inner: Rc::new(RefCell::new(TapeInner {
                id: NEXT_TAPE.fetch_add(1, Ordering::Relaxed),
                recording,
                recompute,
                done: false,
                next_var: 0,
                nodes: Vec::new(),
                leaves: Vec::new(),
                params: Vec::new(),
            })),
        }
    }

    /// A recording tape.
    pub fn new() -> Tape {
        Tape::make(true, false)
    }

    /// A tape that records nothing and keeps nothing (inference, or the first forward of a
    /// checkpointed segment). `backward` on it is an error.
    pub fn no_grad() -> Tape {
        Tape::make(false, false)
    }

    /// The recording tape a checkpointed segment re-runs on in backward: [`Tape::is_recompute`]
    /// is true on it, so layers with side effects (batch-norm statistics) can skip them.
    pub fn recompute() -> Tape {
        Tape::make(true, true)
    }

    /// True when ops on this tape are recorded (false for `no_grad`, and after `backward`).
    pub fn is_recording(&self) -> bool {
        let i = self.inner.borrow();
        i.recording && !i.done
    }

    /// True on the tape a checkpointed segment is re-run on during backward.
    pub fn is_recompute(&self) -> bool {
        self.inner.borrow().recompute
    }

    /// Number of recorded nodes not yet run by backward.
    pub fn len(&self) -> usize {
        self.inner.borrow().nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when both handles are the same tape.
    pub fn same(&self, other: &Tape) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    /// A unique id of this tape in the process.
    pub fn id(&self) -> u64 {
        self.inner.borrow().id
    }

    fn new_var(&self, value: Tensor, requires_grad: bool) -> Var {
        let id = {
            let mut i = self.inner.borrow_mut();
            i.next_var += 1;
            i.next_var - 1
        };
        Var {
            id,
            value,
            tape: self.clone(),
            requires_grad,
        }
    }

    /// A value that gets no gradient.
    pub fn constant(&self, value: Tensor) -> Var {
        self.new_var(value, false)
    }

    /// An input whose gradient is wanted: `Grads::get` gives it after backward.
    pub fn leaf(&self, value: Tensor) -> Var {
        let rec = self.is_recording();
        let v = self.new_var(value, rec);
        if rec {
            self.inner.borrow_mut().leaves.push(v.id);
        }
        v
    }

    /// The value of `param`; on a recording tape and when the param is trainable, backward adds
    /// its gradient to the param (`Param::accumulate_grad`).
    pub fn param(&self, param: &Param) -> Var {
        let rec = self.is_recording() && param.is_trainable();
        let v = self.new_var(param.value(), rec);
        if rec {
            self.inner.borrow_mut().params.push((v.id, param.clone()));
        }
        v
    }

    /// Records the result `value` of op `op` on `inputs` (all on this tape) with its backward.
    /// Nothing is recorded, and `backward` is dropped at once, when the tape does not record or
    /// no input wants a gradient (unless `force`, used by `checkpoint` whose segment may hold
    /// parameters even when its input wants no gradient).
    pub(crate) fn record(
        &self,
        op: &'static str,
        inputs: &[&Var],
        value: Tensor,
        force: bool,
        backward: BackwardFn,
    ) -> Result<Var> {
        if let Some(other) = inputs.iter().find(|v| !v.tape.same(self)) {
            return Err(invalid(
                op,
                format!(
                    "an input var (shape {:?}) was recorded on another tape (id {}, this one is {}); use tape.constant(var.value().clone()) or record both on one tape",
                    other.shape(),
                    other.tape.id(),
                    self.id()
                ),
            ));
        }
        let wants = inputs.iter().any(|v| v.requires_grad);
        if !self.is_recording() || !(wants || force) {
            return Ok(self.new_var(value, false));
        }
        let out = self.new_var(value, true);
        let node = Node {
            op,
            output: out.id,
            inputs: inputs
                .iter()
                .map(|v| v.requires_grad.then(|| (v.id, v.shape().to_vec())))
                .collect(),
            backward,
        };
        self.inner.borrow_mut().nodes.push(node);
        Ok(out)
    }

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
        let seed = Tensor::ones(output.shape(), output.value().device())?;
        self.backward_with(output, &seed)
    }

    /// Back-propagates from `output` seeded with `grad_output` (same shape and device), e.g. the
    /// gradient a pipeline stage receives from the next stage. Parameter gradients accumulate
    /// into the params; the gradients of leaves come back in `Grads`. Each node's saved tensors
    /// are freed as soon as its backward ran. A tape runs backward once.
    pub fn backward_with(&self, output: &Var, grad_output: &Tensor) -> Result<Grads> {
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
        let (nodes, leaves, mut params, tape_id) = {
            let mut i = self.inner.borrow_mut();
            i.done = true;
            (
                std::mem::take(&mut i.nodes),
                std::mem::take(&mut i.leaves),
                std::mem::take(&mut i.params),
                i.id,
            )
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; output.id + 1];
        if output.requires_grad {
            grads[output.id] = Some(grad_output.clone());
        }
        // Parameter gradients go into their params during the walk, each as soon as it is final
        // (so they are not all held at once), in reverse creation order (the order a
        // checkpointed segment's recompute would accumulate them in, so both give bit-identical
        // sums).
        run_nodes(nodes, &mut grads, &mut params)?;
        flush_params(&mut params, &mut grads, None)?;
        let mut map = HashMap::new();
        for id in leaves {
            if let Some(g) = grads.get_mut(id).and_then(Option::take) {
                map.insert(id, g.contiguous()?);
            }
        }
        Ok(Grads {
            tape: tape_id,
            grads: map,
        })
    }
}

/// Accumulates into their params the gradients of the param vars (`params`, in increasing id
/// order) whose id is above `below` (all when `None`), last first, and removes them from `params`.
/// Nodes are recorded after their inputs, so once the walk reaches a node whose output id is
/// below a param var's id, every consumer of that var has run and its gradient is final.
fn flush_params(
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

/// Walks `nodes` in reverse, dropping each closure (and so its saved tensors) as soon as it ran,
/// and each intermediate gradient as soon as its node consumed it; param gradients are handed to
/// their params as soon as they are final (see [`flush_params`]).
fn run_nodes(
    mut nodes: Vec<Node>,
    grads: &mut Vec<Option<Tensor>>,
    params: &mut Vec<(usize, Param)>,
) -> Result<()> {
    while let Some(node) = nodes.pop() {
        flush_params(params, grads, Some(node.output))?;
        let Node {
            op,
            output,
            inputs,
            backward,
        } = node;
        let g = match grads.get_mut(output).and_then(Option::take) {
            Some(g) => g,
            None => continue, // no gradient reaches this node: drop it unrun
        };
        let wants: Vec<bool> = inputs.iter().map(Option::is_some).collect();
        let input_grads = backward(&g, &wants)?;
        drop(g);
        if input_grads.len() != inputs.len() {
            return Err(invalid(
                op,
                format!(
                    "backward gave {} gradients for {} inputs",
                    input_grads.len(),
                    inputs.len()
                ),
            ));
        }
        for (slot, gi) in inputs.into_iter().zip(input_grads) {
            let (Some((id, shape)), Some(gi)) = (slot, gi) else {
                continue;
            };
            if gi.shape() != shape.as_slice() {
                return Err(Error::Shape {
                    op,
                    msg: format!(
                        "backward gave a gradient of shape {:?} for an input of shape {shape:?}",
                        gi.shape()
                    ),
                });
            }
            if grads.len() <= id {
                grads.resize(id + 1, None);
            }
            grads[id] = Some(match grads[id].take() {
                Some(acc) => acc.add(&gi)?,
                None => gi,
            });
        }
    }
    Ok(())
}

pub(crate) fn invalid(op: &'static str, msg: String) -> Error {
    Error::Invalid { op, msg }
}

/// The gradients of a tape's leaves after backward.
pub struct Grads {
    tape: u64,
    grads: HashMap<usize, Tensor>,
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

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.inner.borrow();
        write!(
            f,
            "Tape(id={}, recording={}, nodes={}, done={})",
            i.id,
            i.recording,
            i.nodes.len(),
            i.done
        )
    }
}
