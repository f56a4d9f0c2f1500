//! Loading a file into a model's parameters: every name, shape and dtype is matched against the
//! parameters first and every mismatch reported at once; only then does any parameter change.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use safetensors::tensor::Dtype;
use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Result, Tag, Tensor};

use super::err;
use super::read::{loadable, parse, unsupported_dtype, Parsed};
use crate::param::Param;

/// What [`load_into`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters given a value from the file, in the order of the parameter list.
    pub loaded: Vec<String>,
    /// Parameters of the model the file has no tensor for (kept as they were).
    pub missing: Vec<String>,
    /// Tensors of the file the model has no parameter for (ignored).
    pub unexpected: Vec<String>,
    /// Parameters loaded from F16/BF16 tensors, with the file's dtype.
    pub converted: Vec<(String, String)>,
}

/// Loads the tensors of the file at `path` into `params`, each onto its parameter's device.
///
/// Shapes must match and dtypes must be loadable, always; with `strict`, the names must match
/// exactly too (no missing, no unexpected tensor). Every problem is checked before anything is
/// changed and all are reported in one error, e.g. `missing (in the model, not in the file):
/// head.bias; shape mismatch: blocks.0.w is [3, 4] in the file vs [4, 3] in the model`.
pub fn load_into(
    path: impl AsRef<Path>,
    params: &[(String, Param)],
    strict: bool,
) -> Result<LoadReport> {
    let op = "load_into";
    let f = parse(op, path.as_ref())?;
    let names = f.names();
    let (plan, report) = plan_load(op, &f, &names, params, strict)?;
    let values = build_values(op, &f, &plan)?;
    for ((_, p), v) in plan.into_iter().zip(values) {
        p.set_value(v);
    }
    Ok(report)
}

pub(super) type Plan<'a> = Vec<(&'a str, &'a Param)>;

/// Checks the file's tensors `file_names` against `params`; returns what to load.
pub(super) fn plan_load<'a>(
    op: &'static str,
    f: &Parsed,
    file_names: &[String],
    params: &'a [(String, Param)],
    strict: bool,
) -> Result<(Plan<'a>, LoadReport)> {
    let in_file: HashSet<&str> = file_names.iter().map(String::as_str).collect();
    let mut model: HashMap<&str, &Param> = HashMap::new();
    let mut report = LoadReport::default();
    let mut shapes = Vec::new();
    let mut dtypes = Vec::new();
    let mut plan = Vec::new();
    for (name, p) in params {
        if let Some(prev) = model.insert(name, p) {
            if !prev.same(p) {
                return Err(err(
                    op,
                    &f.path,
                    format!("two different parameters of the model are both named '{name}'"),
                ));
            }
            continue;
        }
        if !in_file.contains(name.as_str()) {
            report.missing.push(name.clone());
            continue;
        }
        let info = f.info(name);
        let shape = p.shape();
        if info.shape != shape {
            shapes.push(format!(
                "{name} is {:?} in the file vs {:?} in the model",
                info.shape, shape
            ));
        }
        if !loadable(info.dtype) {
            dtypes.push(unsupported_dtype(name, info.dtype));
        } else if info.dtype != Dtype::F32 {
            report
                .converted
                .push((name.clone(), format!("{:?}", info.dtype)));
        }
        report.loaded.push(name.clone());
        plan.push((name.as_str(), p));
    }
    report.unexpected = file_names
        .iter()
        .filter(|n| !model.contains_key(n.as_str()))
        .cloned()
        .collect();

    let mut problems = Vec::new();
    if strict && !report.missing.is_empty() {
        problems.push(format!(
            "{} missing (in the model, not in the file): {}",
            report.missing.len(),
            report.missing.join(", ")
        ));
    }
    if strict && !report.unexpected.is_empty() {
        problems.push(format!(
            "{} unexpected (in the file, not in the model): {}",
            report.unexpected.len(),
            report.unexpected.join(", ")
        ));
    }
    if !shapes.is_empty() {
        problems.push(format!("shape mismatch: {}", shapes.join(", ")));
    }
    if !dtypes.is_empty() {
        problems.push(format!("dtype: {}", dtypes.join("; ")));
    }
    if !problems.is_empty() {
        return Err(err(
            op,
            &f.path,
            format!("does not match the model: {}", problems.join("; ")),
        ));
    }
    Ok((plan, report))
}

/// The new values of a plan, each on its parameter's device. Built before any is set, so that a
/// failure (e.g. out of memory) changes nothing.
pub(super) fn build_values(op: &'static str, f: &Parsed, plan: &Plan<'_>) -> Result<Vec<Tensor>> {
    plan.iter()
        .map(|(name, p)| {
            let v = f.values(op, name)?;
            let dev = p.device();
            with_tag(Tag::Parameters, || {
                Tensor::from_vec(v, &f.info(name).shape, &dev)
            })
        })
        .collect()
}
