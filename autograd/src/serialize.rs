//! Save and load tensors, parameters and whole training checkpoints in the
//! [safetensors](https://github.com/huggingface/safetensors) format, with hierarchical names
//! (`blocks.3.attn.q.weight`), so weights move to and from PyTorch and Hugging Face tools.
//!
//! - Saving is atomic: the file is written to a temporary file of a unique name in the same
//!   folder (`.<name>.<pid>-<n>.wgpipe-tmp`, created exclusively), synced to disk, then renamed
//!   over `path`. A crash leaves the old file or the new one, never half of one; concurrent
//!   saves to one path each publish a whole file; temporaries left by a process that died are
//!   removed by the next save to that path.
//! - Tensors are saved as little-endian F32. Loading accepts F32, F16 and BF16 (widened to f32).
//! - Loading into a model ([`load_into`]) checks every name, shape and dtype first and reports
//!   every mismatch at once; on error no parameter has changed.
//! - A training state ([`save_training_state`]; "checkpoint" in the API means re-materialization
//!   only) holds parameters and buffers under their names, the
//!   optimizer's state under `optim.`, and the step in the metadata (`wgpipe.step`), so that
//!   save → load → continue trains bit-identically to an uninterrupted run.
//!
//! Every error is a [`wgpipe_tensor::Error::Invalid`] whose message names the file and the
//! problem (I/O errors and the safetensors parser's errors included).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, TensorInfo, View};
use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Device, Error, Result, Tag, Tensor};

use crate::optim::Optimizer;
use crate::param::Param;

/// Prefix of optimizer-state tensors in a checkpoint.
pub const OPTIM_PREFIX: &str = "optim.";
/// Metadata key of the step in a checkpoint.
pub const STEP_KEY: &str = "wgpipe.step";
/// Metadata key marking a checkpoint, with its format version.
pub const FORMAT_KEY: &str = "wgpipe.format";
const FORMAT_VALUE: &str = "checkpoint/1";
/// Per-parameter optimizer slots that are counters, not parameter-shaped.
const COUNTER_SLOTS: [&str; 1] = ["step"];

fn err(op: &'static str, path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op,
        msg: format!("{}: {msg}", path.display()),
    }
}

// ---------------------------------------------------------------------------------------------
// Saving
// ---------------------------------------------------------------------------------------------

struct F32Bytes {
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &F32Bytes {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `tensors` (read back from their devices) and string `metadata` to `path` as
/// safetensors, atomically (a unique temporary file, fsync, rename). Names must be unique.
pub fn save_tensors(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: &[(String, String)],
) -> Result<()> {
    save_tensors_checked(path, tensors, metadata, false)
}

/// [`save_tensors`]; with `require_finite`, a tensor holding NaN or infinity is refused (naming
/// it) and nothing is written. The check runs on the values read back for writing (no second
/// read-back).
pub fn save_tensors_checked(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: &[(String, String)],
    require_finite: bool,
) -> Result<()> {
    let path = path.as_ref();
    let op = "save_tensors";
    let mut seen = HashSet::new();
    for (name, _) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(err(op, path, format!("the name '{name}' is given twice")));
        }
    }
    let mut meta = HashMap::new();
    for (k, v) in metadata {
        if meta.insert(k.clone(), v.clone()).is_some() {
            return Err(err(
                op,
                path,
                format!("the metadata key '{k}' is given twice"),
            ));
        }
    }
    let mut data = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let values = t.to_vec()?;
        if require_finite {
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(err(
                    op,
                    path,
                    format!("not saved: tensor '{name}' holds {v} (a non-finite value)"),
                ));
            }
        }
        let mut bytes = Vec::with_capacity(values.len() * 4);
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        data.push((
            name.as_str(),
            F32Bytes {
                shape: t.shape().to_vec(),
                bytes,
            },
        ));
    }
    let meta = (!meta.is_empty()).then_some(meta);

    clean_stale_temporaries(path);
    let tmp = create_temporary(path).map_err(|e| err(op, path, e))?;
    let written = write_synced(&tmp, data.iter().map(|(n, d)| (*n, d)), meta);
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(err(
            op,
            path,
            format!("cannot write {}: {e}", tmp.display()),
        ));
    }
    if let Err(e) = fs::rename(&tmp, path) {
        let _ = fs::remove_file(&tmp);
        return Err(err(
            op,
            path,
            format!("cannot rename {} over it: {e}", tmp.display()),
        ));
    }
    sync_dir(path);
    Ok(())
}

/// Suffix of the temporary files of a save.
const TMP_SUFFIX: &str = ".wgpipe-tmp";

/// `.<file name>.` — what the temporaries of saves to `path` start with.
fn tmp_prefix(path: &Path) -> Option<String> {
    Some(format!(".{}.", path.file_name()?.to_str()?))
}

/// Creates (exclusively: never an existing file) an empty temporary file of a name no other
/// save uses, `.<name>.<pid>-<n>.wgpipe-tmp`, beside `path`.
fn create_temporary(path: &Path) -> std::result::Result<PathBuf, String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let prefix = tmp_prefix(path).ok_or("not a file path (it has no UTF-8 file name)")?;
    let pid = std::process::id();
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!("{prefix}{pid}-{n}{TMP_SUFFIX}"));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(_) => return Ok(tmp),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot write {}: {e}", tmp.display())),
        }
    }
}

/// Removes the temporaries of saves to `path` whose process is gone (best effort). Those of
/// this process are another thread's save in flight and are kept; so are those of a live
/// process. Where liveness cannot be checked (no `/proc`), a temporary older than a day counts
/// as stale.
fn clean_stale_temporaries(path: &Path) {
    let Some(prefix) = tmp_prefix(path) else {
        return;
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    let proc_fs = Path::new("/proc/self").exists();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name
            .strip_prefix(prefix.as_str())
            .and_then(|r| r.strip_suffix(TMP_SUFFIX))
        else {
            continue;
        };
        let Some(pid) = rest
            .split_once('-')
            .and_then(|(pid, n)| n.parse::<u64>().ok().and(pid.parse::<u32>().ok()))
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let stale = if proc_fs {
            !Path::new("/proc").join(pid.to_string()).exists()
        } else {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 24 * 3600)
        };
        if stale {
            let _ = fs::remove_file(e.path());
        }
    }
}

fn write_synced<'a>(
    tmp: &Path,
    data: impl Iterator<Item = (&'a str, &'a F32Bytes)>,
    meta: Option<HashMap<String, String>>,
) -> std::result::Result<(), String> {
    // Streams the tensors to the file (no second copy of the model in memory), then syncs.
    safetensors::serialize_to_file(data, meta, tmp).map_err(|e| e.to_string())?;
    fs::OpenOptions::new()
        .write(true)
        .open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| e.to_string())
}

/// Makes the rename durable (best effort: not every platform can sync a folder).
fn sync_dir(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

/// A parsed file: its bytes and header, validated by the safetensors parser.
struct Parsed {
    path: PathBuf,
    bytes: Vec<u8>,
    header_len: usize,
    meta: Metadata,
}

fn parse(op: &'static str, path: &Path) -> Result<Parsed> {
    let bytes = fs::read(path).map_err(|e| err(op, path, format!("cannot read the file: {e}")))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        err(
            op,
            path,
            format!("not a valid safetensors file (truncated or corrupted?): {e}"),
        )
    })?;
    Ok(Parsed {
        path: path.to_path_buf(),
        bytes,
        header_len,
        meta,
    })
}

impl Parsed {
    /// Tensor names in file order.
    fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }
    fn info(&self, name: &str) -> &TensorInfo {
        self.meta.info(name).expect("name comes from the header")
    }
    fn metadata(&self) -> Vec<(String, String)> {
        let mut m: Vec<(String, String)> = self
            .meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        m.sort();
        m
    }
    /// The values of tensor `name`, widened to f32.
    fn values(&self, op: &'static str, name: &str) -> Result<Vec<f32>> {
        let info = self.info(name);
        // Offsets were validated against the file length by `read_metadata`.
        let start = 8 + self.header_len;
        let raw = &self.bytes[start + info.data_offsets.0..start + info.data_offsets.1];
        match info.dtype {
            Dtype::F32 => Ok(raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()),
            Dtype::F16 => Ok(raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            Dtype::BF16 => Ok(raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect()),
            d => Err(err(op, &self.path, unsupported_dtype(name, d))),
        }
    }
}

fn loadable(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

fn unsupported_dtype(name: &str, d: Dtype) -> String {
    format!("tensor '{name}' has dtype {d:?} in the file; only F32, F16 and BF16 can be loaded")
}

/// A file's tensors and metadata.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// In file order.
    pub tensors: Vec<(String, Tensor)>,
    /// Sorted by key.
    pub metadata: Vec<(String, String)>,
}

/// A parsed safetensors file whose tensors are read one by one, for callers that check a
/// whole file against a model before loading anything (a pipeline's checkpoint loader).
pub struct TensorFile(Parsed);

impl TensorFile {
    /// Reads and parses the file. An error here means the file cannot be used at all (missing,
    /// unreadable, truncated, not safetensors), whatever model it is meant for.
    pub fn open(path: impl AsRef<Path>) -> Result<TensorFile> {
        Ok(TensorFile(parse("open", path.as_ref())?))
    }
    /// Tensor names in file order.
    pub fn names(&self) -> Vec<String> {
        self.0.names()
    }
    /// The shape of tensor `name`, if the file has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.0.meta.info(name).map(|i| i.shape.as_slice())
    }
    /// The dtype of tensor `name` in the file (e.g. `F32`), if the file has it.
    pub fn dtype(&self, name: &str) -> Option<String> {
        self.0.meta.info(name).map(|i| format!("{:?}", i.dtype))
    }
    /// True when tensor `name` has a dtype that loads (F32, F16, BF16).
    pub fn is_loadable(&self, name: &str) -> bool {
        self.0.meta.info(name).is_some_and(|i| loadable(i.dtype))
    }
    /// The values of tensor `name`, widened to f32 (an error for a name the file lacks or an
    /// unloadable dtype).
    pub fn values(&self, name: &str) -> Result<Vec<f32>> {
        if self.0.meta.info(name).is_none() {
            return Err(err("values", &self.0.path, format!("no tensor '{name}'")));
        }
        self.0.values("values", name)
    }
    /// The string metadata, sorted by key.
    pub fn metadata(&self) -> Vec<(String, String)> {
        self.0.metadata()
    }
}

/// Reads every tensor of a safetensors file onto `device` (F32; F16 and BF16 widened to f32).
pub fn load_tensors(path: impl AsRef<Path>, device: &Device) -> Result<Vec<(String, Tensor)>> {
    Ok(load_file(path, device)?.tensors)
}

/// [`load_tensors`] plus the file's string metadata.
pub fn load_file(path: impl AsRef<Path>, device: &Device) -> Result<Loaded> {
    let op = "load_tensors";
    let f = parse(op, path.as_ref())?;
    let mut tensors = Vec::new();
    for name in f.names() {
        let values = f.values(op, &name)?;
        let t = Tensor::from_vec(values, &f.info(&name).shape, device)?;
        tensors.push((name, t));
    }
    Ok(Loaded {
        tensors,
        metadata: f.metadata(),
    })
}

/// Only the metadata of a safetensors file (reads the whole file to validate it).
pub fn load_metadata(path: impl AsRef<Path>) -> Result<Vec<(String, String)>> {
    Ok(parse("load_metadata", path.as_ref())?.metadata())
}

// ---------------------------------------------------------------------------------------------
// Loading into a model
// ---------------------------------------------------------------------------------------------

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

type Plan<'a> = Vec<(&'a str, &'a Param)>;

/// Checks the file's tensors `file_names` against `params`; returns what to load.
fn plan_load<'a>(
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
fn build_values(op: &'static str, f: &Parsed, plan: &Plan<'_>) -> Result<Vec<Tensor>> {
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

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

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
