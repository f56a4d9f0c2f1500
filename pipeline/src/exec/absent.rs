//! Stages a rank does not hold. Over MPI each rank keeps only the layers (and so the parameters,
//! gradients and optimizer state) of the stages it trains; at build the others' layers are
//! dropped and replaced by placeholders that keep what the rank still needs to know of them:
//! how many layers and their names (reports, error messages), the names, shapes and tie groups
//! of their parameters and buffers (checkpoints, tied gradients, parameter counts) and the rank
//! that holds them. [`restore`] puts real layers back (see `Pipeline::gather_stages`).

use crate::exec::stage::named_tensors;
use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Skips, Var};
use wgpipe_tensor::memory::{with_tag, Tag};

use crate::error::{PipelineError, Result};
use crate::exec::Stage;

/// What a rank knows of a stage another rank holds.
#[derive(Debug, Clone)]
pub(crate) struct AbsentStage {
    /// The rank that holds (and trains) the stage.
    pub rank: usize,
    pub tensors: Vec<AbsentTensor>,
}

/// A parameter or buffer of a stage held elsewhere.
#[derive(Debug, Clone)]
pub(crate) struct AbsentTensor {
    /// Its global name (`<layer>.<name in the layer>`), as checkpoints key it.
    pub name: String,
    pub shape: Vec<usize>,
    pub buffer: bool,
    pub tie: Option<String>,
}

impl AbsentStage {
    /// Elements of the stage's parameters (buffers not counted).
    pub fn num_params(&self) -> usize {
        self.tensors
            .iter()
            .filter(|t| !t.buffer)
            .map(|t| t.shape.iter().product::<usize>())
            .sum()
    }
}

/// Stands for a layer of a stage held by another rank: it has no parameters, and running it is
/// an error that says where the layer is.
struct AbsentLayer {
    index: usize,
    name: String,
    rank: usize,
    skips: Skips,
}

impl AbsentLayer {
    /// What running it is: an error saying where the layer is.
    fn not_here(&self) -> wgpipe_tensor::Error {
        wgpipe_tensor::Error::Invalid {
            op: "forward",
            msg: format!(
                "layer {} ({}) is held by rank {}, not by this one: Pipeline::evaluate and \
                 Pipeline::predict run the forward across the ranks; gather_stages puts every \
                 stage on every rank",
                self.index, self.name, self.rank
            ),
        }
    }
}

impl Module for AbsentLayer {
    fn name(&self) -> String {
        format!("{} (held by rank {})", self.name, self.rank)
    }
    fn forward(&self, _x: &Var, _ctx: &ForwardCtx) -> wgpipe_tensor::Result<Var> {
        Err(self.not_here())
    }
    fn forward_skips(
        &self,
        _x: &Var,
        _popped: &[Var],
        _ctx: &ForwardCtx,
    ) -> wgpipe_tensor::Result<(Var, Vec<Var>)> {
        Err(self.not_here())
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn to_device(&mut self, _device: &wgpipe_tensor::Device) -> wgpipe_tensor::Result<()> {
        Ok(())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        // Costs are taken before the layers are dropped; nothing asks an absent layer.
        CostHint::pass_through(input_shape)
    }
    fn skips(&self) -> Skips {
        self.skips.clone()
    }
}

/// The stage of `layers` (starting at global layer `first_layer`) as held by `rank`: the layers
/// are dropped (and their memory freed) and placeholders put in their place.
pub(crate) fn absent_layers(
    layers: Vec<Box<dyn Module>>,
    first_layer: usize,
    rank: usize,
) -> (Vec<Box<dyn Module>>, AbsentStage) {
    let mut tensors = Vec::new();
    let mut placeholders: Vec<Box<dyn Module>> = Vec::with_capacity(layers.len());
    for t in named_tensors(first_layer, &layers) {
        tensors.push(AbsentTensor {
            name: t.name,
            shape: t.param.shape(),
            buffer: t.buffer,
            tie: t.param.tie_group(),
        });
    }
    for (i, l) in layers.into_iter().enumerate() {
        let index = first_layer + i;
        placeholders.push(Box::new(AbsentLayer {
            index,
            name: l.name(),
            rank,
            skips: l.skips(),
        }));
    }
    (placeholders, AbsentStage { rank, tensors })
}

/// Puts the layers of `model` (the whole model, built again as the pipeline's was) in place of
/// every absent stage's placeholders, each on its stage's device. Names and shapes must be the
/// absent ones; nothing changes on error. The values are the new layers' own (what the caller
/// gathers next replaces them).
pub(crate) fn restore(stages: &mut [Stage], model: Vec<Box<dyn Module>>) -> Result<()> {
    if stages.iter().all(|s| s.absent.is_none()) {
        return Ok(());
    }
    let total: usize = stages.iter().map(|s| s.layers.len()).sum();
    if model.len() != total {
        return Err(PipelineError::Config(format!(
            "gather_stages: the model given has {} layers, the pipeline {total}",
            model.len()
        )));
    }
    let mut model = model.into_iter();
    let mut replaced = Vec::new();
    for s in stages.iter() {
        let layers: Vec<Box<dyn Module>> = model.by_ref().take(s.layers.len()).collect();
        let Some(absent) = &s.absent else { continue };
        let mut layers = layers;
        for (i, l) in layers.iter_mut().enumerate() {
            with_tag(Tag::Parameters, || l.to_device(&s.device)).map_err(|e| {
                PipelineError::Config(format!(
                    "gather_stages: placing layer {} on stage {} (device {}): {e}",
                    s.first_layer + i,
                    s.index,
                    s.device
                ))
            })?;
        }
        let got: Vec<_> = named_tensors(s.first_layer, &layers)
            .into_iter()
            .map(|t| (t.name, t.param.shape(), t.buffer))
            .collect();
        let want: Vec<_> = absent
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.buffer))
            .collect();
        if got != want {
            let diff = got
                .iter()
                .zip(&want)
                .find(|(g, w)| g != w)
                .map(|(g, w)| format!("{} {:?} where the pipeline has {} {:?}", g.0, g.1, w.0, w.1))
                .unwrap_or_else(|| format!("{} tensors where it has {}", got.len(), want.len()));
            return Err(PipelineError::Config(format!(
                "gather_stages: the model given differs from the pipeline's at stage {}: {diff}",
                s.index
            )));
        }
        replaced.push((s.index, layers));
    }
    for (index, layers) in replaced {
        stages[index].layers = layers;
        stages[index].absent = None;
    }
    Ok(())
}
