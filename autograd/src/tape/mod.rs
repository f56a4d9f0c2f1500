//! The tape: a record of the ops run on [`Var`]s, walked in reverse by `backward`.
//!
//! A `Tape` is a cheap, `Rc`-shared handle and lives on one thread (a pipeline stage records one
//! tape per micro-batch on its own thread). Each recorded op becomes a node holding a `FnOnce`
//! closure that owns exactly the tensors its backward needs; backward calls each closure once and
//! drops it right away, so saved activations are freed while the walk goes on (the device's
//! memory accounting shows it). Ops whose inputs need no gradient, and every op on a
//! [`Tape::no_grad`] tape, record nothing and keep nothing.

mod backward;
mod grads;
mod rerun;
pub mod var;
mod walk;

use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use wgpipe_tensor::{DType, Dims, Error, Result, Tensor};

pub use grads::{Grads, WeightGrads};
pub use rerun::Rerun;
pub use walk::Supply;

use crate::param::Param;
use var::Var;

/// The backward of one node: given the gradient of its output and which inputs want a gradient,
/// the gradient of each input (`None` where none is wanted or it is zero). Gradients must have the
/// shapes of the inputs. A split backward ([`Tape::backward_split`]) calls it twice, once for the
/// inputs that carry data and once for those computed from parameters alone, so it is `FnMut`;
/// each input's gradient must not depend on which other inputs were asked for.
pub type BackwardFn = Box<dyn FnMut(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>>>;

/// The backward of a node with several outputs ([`Var::from_op_multi`]): as [`BackwardFn`], given
/// each output's gradient, `None` for the outputs no gradient reached (at least one did).
pub type MultiBackwardFn =
    Box<dyn FnMut(&[Option<Tensor>], &[bool]) -> Result<Vec<Option<Tensor>>>>;

/// Where a node that folds the gradient sum into its own backward (see
/// [`Var::from_op_carrying`]) finds the gradient its input already has when the backward runs.
pub(crate) type CarrySlot = Rc<RefCell<Option<Tensor>>>;

static NEXT_TAPE: AtomicU64 = AtomicU64::new(1);

/// A tape handle. Clones share the tape.
#[derive(Clone)]
pub struct Tape {
    inner: Rc<RefCell<TapeInner>>,
}

struct Node {
    op: &'static str,
    /// The ids of the output vars (consecutive: one for most ops).
    outputs: Range<usize>,
    /// Whether the outputs depend on data (see [`Var::is_data`]).
    data_output: bool,
    /// For each input that wants a gradient: its var id, shape and whether it depends on data.
    inputs: Vec<Option<NodeInput>>,
    /// A single-output op's [`BackwardFn`] is wrapped into this form when recorded.
    backward: MultiBackwardFn,
    /// `(input index, slot)`: before the backward runs, the gradient accumulated so far for that
    /// input moves into the slot; the backward returns the sum (see [`Var::from_op_carrying`]).
    carry: Option<(usize, CarrySlot)>,
    /// A segment checkpointed by [`crate::checkpoint_rerun_later`]: the walk asks the caller's
    /// supplier for its re-run just before this node's backward, where it is needed.
    rerun: Option<Rc<Rerun>>,
}

struct NodeInput {
    id: usize,
    shape: Dims,
    data: bool,
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

    fn new_var(&self, value: Tensor, requires_grad: bool, data: bool) -> Var {
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
            data,
        }
    }

    /// A value that gets no gradient.
    pub fn constant(&self, value: Tensor) -> Var {
        self.new_var(value, false, true)
    }

    /// An input whose gradient is wanted: `Grads::get` gives it after backward.
    pub fn leaf(&self, value: Tensor) -> Var {
        let rec = self.is_recording();
        let v = self.new_var(value, rec, true);
        if rec {
            self.inner.borrow_mut().leaves.push(v.id);
        }
        v
    }

    /// The value of `param` as stored (an f32 master weight stays f32 under autocast); on a
    /// recording tape and when the param is trainable, backward adds its gradient to the param
    /// (`Param::accumulate_grad`). For code outside a layer (a loss over parameters, a test): a
    /// layer reads its weights with [`Var::param`], which gives them in its input's dtype.
    pub fn stored_param(&self, param: &Param) -> Var {
        let rec = self.is_recording() && param.is_trainable();
        let v = self.new_var(param.value(), rec, false);
        if rec {
            self.inner.borrow_mut().params.push((v.id, param.clone()));
        }
        v
    }

    /// The value of `param` in `dtype` (autocast's compute copy of an f32 master weight): the
    /// param's var cast to `dtype`, the cast being the param's cached copy
    /// ([`Param::value_in`]), so the gradient is cast back and accumulates in the param's own
    /// dtype. Exactly [`Tape::stored_param`] when the param already has `dtype`.
    pub fn param_in(&self, param: &Param, dtype: DType) -> Result<Var> {
        let v = self.stored_param(param);
        if v.value().dtype() == dtype {
            return Ok(v);
        }
        v.cast_to(param.value_in(dtype)?)
    }

    /// Marks the node recorded last as a segment whose re-run the caller supplies during the
    /// backward (see [`crate::checkpoint_rerun_later`]).
    pub(crate) fn attach_rerun(&self, rerun: Rc<Rerun>) {
        if let Some(node) = self.inner.borrow_mut().nodes.last_mut() {
            node.rerun = Some(rerun);
        }
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
        mut backward: BackwardFn,
        carry: Option<(usize, CarrySlot)>,
    ) -> Result<Var> {
        // The walk runs a single-output node only when its output has a gradient.
        let backward = Box::new(move |g: &[Option<Tensor>], w: &[bool]| match g {
            [Some(g)] => backward(g, w),
            _ => Err(invalid(op, "no output gradient".to_string())),
        }) as MultiBackwardFn;
        let mut out = self.record_many(op, inputs, vec![value], force, backward, carry)?;
        Ok(out.pop().expect("one value, one var"))
    }

    /// [`Tape::record`] for an op with one var per value in `values` (the node's outputs); its
    /// backward gets each output's gradient.
    pub(crate) fn record_many(
        &self,
        op: &'static str,
        inputs: &[&Var],
        values: Vec<Tensor>,
        force: bool,
        backward: MultiBackwardFn,
        carry: Option<(usize, CarrySlot)>,
    ) -> Result<Vec<Var>> {
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
        let data = inputs.iter().any(|v| v.data);
        if !self.is_recording() || !(wants || force) {
            return Ok(values
                .into_iter()
                .map(|v| self.new_var(v, false, data))
                .collect());
        }
        let out: Vec<Var> = values
            .into_iter()
            .map(|v| self.new_var(v, true, data))
            .collect();
        let first = out.first().map_or(self.inner.borrow().next_var, |v| v.id);
        let node = Node {
            op,
            outputs: first..first + out.len(),
            data_output: data,
            inputs: inputs
                .iter()
                .map(|v| {
                    v.requires_grad.then(|| NodeInput {
                        id: v.id,
                        shape: Dims::from_slice(v.shape()),
                        data: v.data,
                    })
                })
                .collect(),
            backward,
            carry,
            rerun: None,
        };
        self.inner.borrow_mut().nodes.push(node);
        Ok(out)
    }
}

pub(crate) fn invalid(op: &'static str, msg: String) -> Error {
    Error::Invalid { op, msg }
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
