//! Layers known by their description alone, for a pipeline built from a [`ModelFactory`]
//! (`Pipeline::builder_from`): what partitioning, the settings every rank compares, the
//! reports and the checkpoint layout need of a layer (its name, its parameters' and buffers'
//! names, shapes, tie groups and trainability, its skips, its cost) without its values. The
//! factory builds each layer once, alone, to describe it, and drops it; at build the
//! pipeline materializes only the stages this process holds ([`materialize`]), so a process's
//! memory holds its own layers plus, for a moment, the largest one.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use wgpipe_autograd::{CostHint, ForwardCtx, ModelFactory, Module, Param, Skips, Var};
use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result};
use crate::exec::stage::named_tensors;

/// A layer's cost on an input shape, and the bytes of each skip it stashes.
type Measured = (CostHint, Vec<usize>);

/// A layer of a model built from a factory, before (or instead of) its materialization.
struct DescribedLayer {
    index: usize,
    name: String,
    /// Shaped like the layer's, valued by one broadcast element (see [`shape_only`]).
    params: Vec<(String, Param)>,
    buffers: Vec<(String, Param)>,
    skips: Skips,
    factory: Arc<dyn ModelFactory>,
    /// Cost and stash bytes by input shape, each measured once from a transient build.
    costs: Mutex<HashMap<Vec<usize>, Measured>>,
}

impl DescribedLayer {
    fn not_built(&self) -> wgpipe_tensor::Error {
        wgpipe_tensor::Error::Invalid {
            op: "forward",
            msg: format!(
                "layer {} ({}) is only described: the pipeline materializes the layers of the \
                 stages this process holds at build",
                self.index, self.name
            ),
        }
    }

    /// The cost and stash bytes of the layer on `input_shape`, from the layer itself (built
    /// for the question and dropped; the answer is kept).
    fn measured(&self, input_shape: &[usize]) -> Measured {
        let mut costs = self.costs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = costs.get(input_shape) {
            return c.clone();
        }
        let built = self
            .factory
            .describe_range(self.index..self.index + 1)
            .ok()
            .and_then(|mut v| v.pop());
        // `describe` built this layer once already; a factory that fails now reports nothing.
        let answer = match built {
            Some(l) => (l.cost(input_shape), l.stash_bytes(input_shape)),
            None => (
                CostHint::pass_through(input_shape),
                vec![0; self.skips.stashes.len()],
            ),
        };
        costs.insert(input_shape.to_vec(), answer.clone());
        answer
    }
}

impl Module for DescribedLayer {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn forward(&self, _x: &Var, _ctx: &ForwardCtx) -> wgpipe_tensor::Result<Var> {
        Err(self.not_built())
    }
    fn forward_skips(
        &self,
        _x: &Var,
        _popped: &[Var],
        _ctx: &ForwardCtx,
    ) -> wgpipe_tensor::Result<(Var, Vec<Var>)> {
        Err(self.not_built())
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.params.clone()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        self.buffers.clone()
    }
    fn to_device(&mut self, _device: &wgpipe_tensor::Device) -> wgpipe_tensor::Result<()> {
        Ok(())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        self.measured(input_shape).0
    }
    fn skips(&self) -> Skips {
        self.skips.clone()
    }
    fn stash_bytes(&self, input_shape: &[usize]) -> Vec<usize> {
        self.measured(input_shape).1
    }
}

/// A parameter with `p`'s name, shape, tie group and trainability whose value holds one
/// element, broadcast to the shape (stride 0): its shape and element count are right for
/// whatever counts parameters, and it takes no storage.
fn shape_only(p: &Param) -> Result<Param> {
    let shape = p.shape();
    let one = Tensor::zeros(&vec![1; shape.len()], p.value().device())?;
    let q = Param::new(p.name(), one.broadcast_to(&shape)?);
    if let Some(group) = p.tie_group() {
        q.set_tie_group(group);
    }
    q.set_trainable(p.is_trainable());
    Ok(q)
}

/// Every layer of `factory`'s model as a description: each built alone, described and
/// dropped before the next.
pub(crate) fn describe(factory: &Arc<dyn ModelFactory>) -> Result<Vec<Box<dyn Module>>> {
    let n = factory.num_layers();
    let mut out: Vec<Box<dyn Module>> = Vec::with_capacity(n);
    for index in 0..n {
        let mut built = factory.describe_range(index..index + 1).map_err(|e| {
            PipelineError::Config(format!("building layer {index} of {n} to describe it: {e}"))
        })?;
        let layer = match (built.pop(), built.is_empty()) {
            (Some(l), true) => l,
            _ => {
                return Err(PipelineError::Config(format!(
                    "the model factory gave {} layers for layer {index} alone",
                    built.len() + 1
                )))
            }
        };
        let params = layer
            .parameters()
            .iter()
            .map(|(n, p)| Ok((n.clone(), shape_only(p)?)))
            .collect::<Result<_>>()?;
        let buffers = layer
            .buffers()
            .iter()
            .map(|(n, p)| Ok((n.clone(), shape_only(p)?)))
            .collect::<Result<_>>()?;
        out.push(Box::new(DescribedLayer {
            index,
            name: layer.name(),
            params,
            buffers,
            skips: layer.skips(),
            factory: factory.clone(),
            costs: Mutex::new(HashMap::new()),
        }));
    }
    Ok(out)
}

/// The layers `range` of `factory`'s model, built, checked against their descriptions
/// (`described`, the same range): a factory whose layers differ by range or by call would
/// give ranks that disagree on the model.
pub(crate) fn materialize(
    factory: &dyn ModelFactory,
    range: Range<usize>,
    described: &[Box<dyn Module>],
) -> Result<Vec<Box<dyn Module>>> {
    let start = range.start;
    let layers = factory.build_range(range.clone()).map_err(|e| {
        PipelineError::Config(format!("building layers {range:?} of the model: {e}"))
    })?;
    let key = |layers: &[Box<dyn Module>]| -> Vec<(String, Vec<usize>, bool, Option<String>)> {
        named_tensors(start, layers)
            .into_iter()
            .map(|t| (t.name, t.param.shape(), t.buffer, t.param.tie_group()))
            .collect()
    };
    let names =
        |layers: &[Box<dyn Module>]| -> Vec<String> { layers.iter().map(|l| l.name()).collect() };
    if names(&layers) != names(described) || key(&layers) != key(described) {
        return Err(PipelineError::Config(format!(
            "the model factory's layers {range:?} differ from their descriptions \
             (built {:?}, described {:?}): each layer must be the same whatever range it is \
             built in",
            names(&layers),
            names(described)
        )));
    }
    Ok(layers)
}
