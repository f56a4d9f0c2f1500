//! Training checkpoints: parameters, buffers, the optimizer's state (under `optim.`) and the
//! step in one file, saved and loaded so that training continues bit-identically.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Device, Error, Result, Tag, Tensor};

use super::load_into::{build_values, plan_load};
use super::read::parse;
use super::write::save_tensors;
use super::{err, COUNTER_SLOTS, FORMAT_KEY, FORMAT_VALUE, OPTIM_PREFIX, STEP_KEY};
use crate::optim::Optimizer;
use crate::param::Param;

/// What [`load_training_state`] found besides the tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingStateInfo {
    /// The step saved with the checkpoint.
    pub step: u64,
    /// The extra metadata given to [`save_training_state`], sorted by key.
    pub metadata: Vec<(String, String)>,
}

/// Saves a training checkpoint: `params` and `buffers` under their names, the optimizer's state
/// under `optim.`, `step` and `metadata` (keys must not start with `wgpipe.`) in the metadata.
pub fn save_training_state(
    path: impl AsRef<Path>,
    params: &[(String, Param)],
    buffers: &[(String, Param)],
    optimizer: &dyn Optimizer,
    step: u64,
    metadata: &[(String, String)],
) -> Result<()> {
    let path = path.as_ref();
    let op = "save_training_state";
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut seen: HashMap<&str, &Param> = HashMap::new();
    for (name, p) in params.iter().chain(buffers) {
        if name.starts_with(OPTIM_PREFIX) {
            return Err(err(
                op,
                path,
                format!("the name '{name}' starts with '{OPTIM_PREFIX}', which is reserved for the optimizer's state"),
            ));
        }
        if let Some(prev) = seen.insert(name, p) {
            if prev.same(p) {
                continue;
            }
            return Err(err(
                op,
                path,
                format!("two different parameters or buffers are both named '{name}'"),
            ));
        }
        tensors.push((name.clone(), p.value()));
    }
    for (key, t) in optimizer.state() {
        tensors.push((format!("{OPTIM_PREFIX}{key}"), t));
    }
    let mut meta = vec![
        (FORMAT_KEY.to_string(), FORMAT_VALUE.to_string()),
        (STEP_KEY.to_string(), step.to_string()),
    ];
    for (k, v) in metadata {
        if k.starts_with("wgpipe.") {
            return Err(err(
                op,
                path,
                format!("the metadata key '{k}' is reserved (keys starting with 'wgpipe.')"),
            ));
        }
        meta.push((k.clone(), v.clone()));
    }
    save_tensors(path, &tensors, &meta)
}

/// Loads a checkpoint written by [`save_training_state`]: parameters and buffers (strictly: names,
/// shapes and dtypes must match), the optimizer's state (each tensor onto the device of the
/// parameter it belongs to) and the step. Everything is checked before anything changes.
/// Gradients are cleared: they belonged to the weights before the load.
pub fn load_training_state(
    path: impl AsRef<Path>,
    params: &[(String, Param)],
    buffers: &[(String, Param)],
    optimizer: &mut dyn Optimizer,
) -> Result<TrainingStateInfo> {
    let path = path.as_ref();
    let op = "load_training_state";
    let f = parse(op, path)?;
    let mut metadata = f.metadata();
    let step = match metadata.iter().find(|(k, _)| k == STEP_KEY) {
        None => {
            return Err(err(
                op,
                path,
                format!("not a wgpipe checkpoint: no '{STEP_KEY}' in its metadata"),
            ))
        }
        Some((_, v)) => v.parse::<u64>().map_err(|_| {
            err(
                op,
                path,
                format!("'{STEP_KEY}' is '{v}', not a step number"),
            )
        })?,
    };
    metadata.retain(|(k, _)| !k.starts_with("wgpipe."));

    let all: Vec<(String, Param)> = params.iter().chain(buffers).cloned().collect();
    let names = f.names();
    let (model_names, optim_names): (Vec<String>, Vec<String>) = names
        .into_iter()
        .partition(|n| !n.starts_with(OPTIM_PREFIX));
    let (plan, _) = plan_load(op, &f, &model_names, &all, true)?;

    // The optimizer's state, each tensor on its parameter's device, with its shape.
    let model: BTreeMap<&str, (Device, Vec<usize>)> = all
        .iter()
        .map(|(n, p)| (n.as_str(), (p.device(), p.shape())))
        .collect();
    let mut state = Vec::with_capacity(optim_names.len());
    for full in &optim_names {
        let key = &full[OPTIM_PREFIX.len()..];
        let device = if key.starts_with('@') {
            Device::cpu()
        } else {
            let (pname, slot) = key.rsplit_once('.').unwrap_or((key, ""));
            match model.get(pname) {
                Some((d, shape)) => {
                    let in_file = &f.info(full).shape;
                    if !COUNTER_SLOTS.contains(&slot) && in_file != shape {
                        return Err(err(
                            op,
                            path,
                            format!("shape mismatch: optimizer state {full} is {in_file:?} in the file vs {shape:?} for parameter '{pname}' in the model"),
                        ));
                    }
                    d.clone()
                }
                None => {
                    return Err(err(
                        op,
                        path,
                        format!("optimizer state '{full}' belongs to parameter '{pname}', which the model does not have"),
                    ))
                }
            }
        };
        let values = f.values(op, full)?;
        let t = with_tag(Tag::OptimizerState, || {
            Tensor::from_vec(values, &f.info(full).shape, &device)
        })?;
        state.push((key.to_string(), t));
    }
    // Build the parameter values, then let the optimizer check its state, then commit.
    let values = build_values(op, &f, &plan)?;
    optimizer.load_state(state).map_err(|e| {
        let why = match e {
            Error::Invalid { op, msg } => format!("{op}: {msg}"),
            other => other.to_string(),
        };
        err(
            op,
            path,
            format!("the optimizer state does not load: {why}"),
        )
    })?;
    for ((_, p), v) in plan.into_iter().zip(values) {
        p.set_value(v);
    }
    for (_, p) in &all {
        p.zero_grad();
    }
    Ok(TrainingStateInfo { step, metadata })
}
