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
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use wgpipe_tensor::{DType, Error, Result, Tensor};

use crate::param::Param;
use crate::var::Var;

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
}

struct NodeInput {
    id: usize,
    shape: Vec<usize>,
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

    /// The value of `param`; on a recording tape and when the param is trainable, backward adds
    /// its gradient to the param (`Param::accumulate_grad`).
    pub fn param(&self, param: &Param) -> Var {
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
    /// dtype. Exactly [`Tape::param`] when the param already has `dtype`.
    pub fn param_in(&self, param: &Param, dtype: DType) -> Result<Var> {
        let v = self.param(param);
        if v.value().dtype() == dtype {
            return Ok(v);
        }
        v.cast_to(param.value_in(dtype)?)
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
                        shape: v.shape().to_vec(),
                        data: v.data,
                    })
                })
                .collect(),
            backward,
            carry,
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
        run_nodes(nodes, &mut grads, &mut params, Part::Full, &mut Vec::new())?;
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

/// The weight part of a split backward (zero-bubble pipelines' "W"): the nodes with
/// parameter-side inputs, each with its output gradient when that was computed by the input part.
pub struct WeightGrads {
    /// In reverse recording order (the order the walk visits them); the output gradients are
    /// empty when the input part did not compute them.
    deferred: Vec<(Node, Vec<Option<Tensor>>)>,
    /// Gradients of parameter-only vars left by the input part (by var id).
    carried: Vec<(usize, Tensor)>,
    params: Vec<(usize, Param)>,
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
        run_nodes(
            nodes,
            &mut grads,
            &mut params,
            Part::Weight,
            &mut Vec::new(),
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

/// The leaves' gradients (contiguous) after a walk.
fn leaf_grads(tape: u64, leaves: Vec<usize>, grads: &mut [Option<Tensor>]) -> Result<Grads> {
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

/// Which inputs a walk computes gradients for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
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
fn run_nodes(
    mut nodes: Vec<Node>,
    grads: &mut Vec<Option<Tensor>>,
    params: &mut Vec<(usize, Param)>,
    part: Part,
    deferred: &mut Vec<(Node, Vec<Option<Tensor>>)>,
) -> Result<()> {
    while let Some(mut node) = nodes.pop() {
        flush_params(params, grads, Some(node.outputs.start))?;
        let has_weight_side = node.inputs.iter().flatten().any(|i| !i.data);
        if part == Part::Input && !node.data_output {
            deferred.push((node, Vec::new()));
            continue;
        }
        let g: Vec<Option<Tensor>> = node
            .outputs
            .clone()
            .map(|id| grads.get_mut(id).and_then(Option::take))
            .collect();
        if g.iter().all(Option::is_none) {
            continue; // no gradient reaches this node: drop it unrun
        }
        let wants: Vec<bool> = node
            .inputs
            .iter()
            .map(|i| i.as_ref().is_some_and(|i| part.wants(i)))
            .collect();
        // The weight part skips nodes it has nothing to ask of; the other walks always call
        // the backward, which may have effects of its own (`checkpoint` accumulates the
        // gradients of its segment's parameters, even when its input wants none).
        let carried = take_carry(&node, &wants, grads);
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
            deferred.push((node, g));
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
