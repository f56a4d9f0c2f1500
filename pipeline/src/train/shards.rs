//! Sharded checkpoints: a folder with one safetensors file per device of replica 0 (under MPI,
//! written by the rank that trains it, in parallel with the others) and an index written last,
//! `model.safetensors.index.json` in the convention of sharded safetensors checkpoints:
//! `{"metadata": {...}, "weight_map": {tensor: file}}`. The metadata holds what a one-file
//! checkpoint's does (format, step, arithmetic settings, loss scaler, the caller's keys) plus
//! the layout it was saved from (`wgpipe.layout.*`), the number of shards and the save's
//! number.
//!
//! - Tensor names are the global ones of a one-file checkpoint (they do not depend on K), so a
//!   sharded checkpoint loads into a pipeline of any K (R, an arithmetic setting, as for one
//!   file), in one process or under MPI, each rank reading only the shards that hold its
//!   stages' tensors; [`consolidate`] and [`split`] convert between the two forms.
//! - The index is the commit point. Shards are named after the save's number
//!   (`model-save<n>-00001-of-0000K.safetensors`, n one more than the index found in the
//!   folder), so a new save never touches the files of the checkpoint the current index names;
//!   the index is renamed in only after every rank's shards are written (agreed through the
//!   step communicator), and the previous save's shards are removed after it. A save that dies
//!   half-way leaves the previous checkpoint loadable. Under MPI the folder must be one that
//!   every writing rank and rank 0 see (a shared file system, or one host).
//! - Opening one checks the index against the shards' headers (read alone, not the tensors):
//!   a shard missing, truncated, of another save, or not holding what the index says it holds,
//!   is an error naming it.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use wgpipe_autograd::serialize::{write_atomically, TensorFile, OPTIM_PREFIX, STEP_KEY};
use wgpipe_tensor::{Device, Tensor};

use crate::error::PipelineError;
use crate::train::persist::{
    optim_param, persist_entries, strip_path, tied_aliases, write_checked, PResult, PersistError,
    SaveOptions,
};
use crate::train::pipeline::Pipeline;

/// The index's file name in a sharded checkpoint's folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Metadata: the number of the save that wrote the index and its shards.
const SAVE_KEY: &str = "wgpipe.save";
/// Metadata: how many shard files the save wrote.
const SHARDS_KEY: &str = "wgpipe.shards";
/// Metadata of a shard: its number (1-based).
const SHARD_KEY: &str = "wgpipe.shard";
/// Metadata: the layout saved from (devices, replicas, schedule, balance): for people; loading
/// reshards to any layout.
const LAYOUT_PREFIX: &str = "wgpipe.layout.";

/// Whether `path` names a sharded checkpoint: a folder, or an index file (`*.index.json`).
pub fn is_sharded(path: &Path) -> bool {
    path.is_dir()
        || path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.ends_with(".index.json"))
}

/// The file name of shard `i` (0-based) of `n` of save `save`.
fn shard_name(save: u64, i: usize, n: usize) -> String {
    format!("model-save{save}-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Whether `name` is a shard file of some save (what the clean-up after a save may remove).
fn is_shard_name(name: &str) -> bool {
    name.starts_with("model-save") && name.ends_with(".safetensors") && name.contains("-of-")
}

/// The number of the next save into `dir`: one more than its index's (1 for a folder without
/// one). Every rank reads the same index: it changes only after all of them wrote their shards.
fn next_save(dir: &Path) -> u64 {
    let saved = fs::read_to_string(dir.join(INDEX_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["metadata"][SAVE_KEY].as_str()?.parse::<u64>().ok());
    saved.map_or(1, |n| n + 1)
}

/// A shard opened through the one-file checkpoints' reader: its header parsed once (and the
/// file's length checked against it; a shard cut short by a dying save is found here, without
/// reading its tensors); the error says why, without the path (the caller names the shard).
fn open_shard(path: &Path) -> Result<TensorFile, String> {
    TensorFile::open(path).map_err(|e| strip_path(&e.to_string(), path))
}

/// A sharded checkpoint, opened: the index checked against every shard's header; the shards'
/// tensors are read when asked for, each from its offset (a shard's header is parsed once, at
/// open).
pub(crate) struct Sharded {
    /// The index file (what errors about the checkpoint as a whole name).
    index: PathBuf,
    /// The string metadata of the index, sorted by key.
    metadata: Vec<(String, String)>,
    /// Each shard's path, and the shard opened.
    shards: Vec<(PathBuf, TensorFile)>,
    /// Each tensor: its shard, dtype and shape.
    tensors: HashMap<String, (usize, String, Vec<usize>)>,
    /// Tensor names by shard, then in file order.
    order: Vec<String>,
}

impl Sharded {
    /// Opens the sharded checkpoint at `path` (its folder or its index).
    pub(crate) fn open(path: &Path) -> PResult<Sharded> {
        let index = if path.is_dir() {
            path.join(INDEX_FILE)
        } else {
            path.to_path_buf()
        };
        let dir = match index.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let unreadable = |p: &Path, why: String| PersistError::Unreadable {
            path: p.to_path_buf(),
            why,
        };
        let text = fs::read_to_string(&index).map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "no {INDEX_FILE}: the folder holds no finished sharded checkpoint (the index \
                     is written last, after every shard)"
                )
            } else {
                format!("cannot read the index: {e}")
            };
            unreadable(&index, why)
        })?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| unreadable(&index, format!("not a JSON index: {e}")))?;
        let mut metadata: Vec<(String, String)> = v["metadata"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
            .collect();
        metadata.sort();
        let meta = |key: &str| metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        if meta(STEP_KEY).is_none() {
            return Err(unreadable(
                &index,
                format!(
                    "an index, but not of a wgpipe checkpoint (no '{STEP_KEY}' in its metadata)"
                ),
            ));
        }
        let Some(map) = v["weight_map"].as_object() else {
            return Err(unreadable(&index, "an index without a weight_map".into()));
        };
        let mut files: Vec<&str> = Vec::new();
        for (name, file) in map {
            let Some(file) = file.as_str() else {
                return Err(unreadable(
                    &index,
                    format!("tensor '{name}' has no file name"),
                ));
            };
            if Path::new(file).file_name() != Some(file.as_ref()) {
                return Err(unreadable(
                    &index,
                    format!("tensor '{name}' is in '{file}', outside the checkpoint's folder"),
                ));
            }
            if !files.contains(&file) {
                files.push(file);
            }
        }
        files.sort();
        let save = meta(SAVE_KEY).cloned();
        if let Some(n) = meta(SHARDS_KEY).and_then(|n| n.parse::<usize>().ok()) {
            if n != files.len() {
                // Name a shard the index should list and does not.
                let missing = save
                    .as_ref()
                    .and_then(|s| s.parse::<u64>().ok())
                    .and_then(|s| {
                        (0..n)
                            .map(|i| shard_name(s, i, n))
                            .find(|f| !files.contains(&f.as_str()))
                    })
                    .map(|f| format!(" ({f} is not among them)"))
                    .unwrap_or_default();
                return Err(unreadable(
                    &index,
                    format!(
                        "the weight_map names {} shard file(s), the save wrote {n}{missing}",
                        files.len()
                    ),
                ));
            }
        }
        let mut tensors = HashMap::new();
        let mut order = Vec::new();
        let mut shards = Vec::new();
        for (i, file) in files.iter().enumerate() {
            let shard = dir.join(file);
            let h = open_shard(&shard).map_err(|why| {
                let why = if shard.exists() {
                    why
                } else {
                    format!(
                        "shard {} of {}, named in the index, is missing",
                        i + 1,
                        files.len()
                    )
                };
                unreadable(&shard, why)
            })?;
            let shard_save = h
                .metadata()
                .into_iter()
                .find_map(|(k, v)| (k == SAVE_KEY).then_some(v));
            if let (Some(want), Some(got)) = (&save, shard_save) {
                if *want != got {
                    return Err(unreadable(
                        &shard,
                        format!(
                            "written by save {got}, but the index is of save {want} (a shard of \
                             another save put in its place)"
                        ),
                    ));
                }
            }
            for name in h.names() {
                if map.get(&name).and_then(Value::as_str) != Some(*file) {
                    return Err(unreadable(
                        &shard,
                        format!("holds tensor '{name}', which the index does not list in it"),
                    ));
                }
                let dtype = h.dtype(&name).unwrap_or_default();
                let shape = h.shape(&name).unwrap_or_default().to_vec();
                order.push(name.clone());
                tensors.insert(name, (i, dtype, shape));
            }
            shards.push((shard, h));
        }
        if let Some((name, file)) = map.iter().find(|(n, _)| !tensors.contains_key(*n)) {
            let file = file.as_str().unwrap_or_default();
            return Err(unreadable(
                &dir.join(file),
                format!("the index puts tensor '{name}' in this shard, which does not hold it"),
            ));
        }
        Ok(Sharded {
            index,
            metadata,
            shards,
            tensors,
            order,
        })
    }

    /// The values of tensor `name`, read from its offset in its shard; errors name the shard.
    fn values(&self, name: &str) -> PResult<Vec<f32>> {
        let Some((i, _, _)) = self.tensors.get(name) else {
            return Err(PersistError::Unreadable {
                path: self.index.clone(),
                why: format!("no tensor '{name}'"),
            });
        };
        let (path, file) = &self.shards[*i];
        file.values(name).map_err(|e| PersistError::Unreadable {
            path: path.clone(),
            why: strip_path(&e.to_string(), path),
        })
    }
}

/// A checkpoint being loaded: one file, or a sharded folder.
pub(crate) enum Source {
    One(TensorFile, PathBuf),
    Sharded(Sharded),
}

impl Source {
    /// Opens the checkpoint at `path`: a sharded one when [`is_sharded`], else one file.
    pub(crate) fn open(path: &Path) -> PResult<Source> {
        if is_sharded(path) {
            return Ok(Source::Sharded(Sharded::open(path)?));
        }
        let f = TensorFile::open(path).map_err(|e| PersistError::Unreadable {
            path: path.to_path_buf(),
            why: strip_path(&e.to_string(), path),
        })?;
        Ok(Source::One(f, path.to_path_buf()))
    }

    /// The string metadata, sorted by key.
    pub(crate) fn metadata(&self) -> Vec<(String, String)> {
        match self {
            Source::One(f, _) => f.metadata(),
            Source::Sharded(s) => s.metadata.clone(),
        }
    }

    /// Every tensor name (a one-file checkpoint's in file order; a sharded one's by shard).
    pub(crate) fn names(&self) -> Vec<String> {
        match self {
            Source::One(f, _) => f.names(),
            Source::Sharded(s) => s.order.clone(),
        }
    }

    pub(crate) fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Source::One(f, _) => f.shape(name).map(<[usize]>::to_vec),
            Source::Sharded(s) => s.tensors.get(name).map(|(_, _, shape)| shape.clone()),
        }
    }

    pub(crate) fn dtype(&self, name: &str) -> Option<String> {
        match self {
            Source::One(f, _) => f.dtype(name),
            Source::Sharded(s) => s.tensors.get(name).map(|(_, d, _)| d.clone()),
        }
    }

    /// Whether tensor `name` has a dtype that loads (F32, F16, BF16).
    pub(crate) fn is_loadable(&self, name: &str) -> bool {
        match self {
            Source::One(f, _) => f.is_loadable(name),
            Source::Sharded(s) => s
                .tensors
                .get(name)
                .is_some_and(|(_, d, _)| matches!(d.as_str(), "F32" | "F16" | "BF16")),
        }
    }

    /// The values of tensor `name`, widened to f32; errors name the file that holds it.
    pub(crate) fn values(&self, name: &str) -> PResult<Vec<f32>> {
        match self {
            Source::One(f, path) => f.values(name).map_err(|e| PersistError::Unreadable {
                path: path.clone(),
                why: strip_path(&e.to_string(), path),
            }),
            Source::Sharded(s) => s.values(name),
        }
    }
}

/// The metadata of the checkpoint at `path` (one file or sharded), sorted by key: e.g. the
/// model description a caller saved, to say which model a checkpoint holds.
pub fn checkpoint_metadata(path: impl AsRef<Path>) -> PResult<Vec<(String, String)>> {
    Ok(Source::open(path.as_ref())?.metadata())
}

/// Writes the index into `dir` for `files` (shard files there, complete): the
/// weight_map from their headers, `metadata` (strings) plus `total_size`; atomically. The
/// commit point of a sharded save; then removes the shards of other saves (best effort).
fn write_index(dir: &Path, metadata: &[(String, String)], files: &[String]) -> PResult<()> {
    let index = dir.join(INDEX_FILE);
    let mut weight_map = Map::new();
    // Bytes of tensor data, as the convention's `total_size` (shards hold F32).
    let mut total = 0u64;
    for file in files {
        let shard = dir.join(file);
        let h = open_shard(&shard).map_err(|why| PersistError::Io {
            path: shard.clone(),
            why: format!("not indexed (the previous checkpoint stays): {why}"),
        })?;
        for name in h.names() {
            let shape = h.shape(&name).unwrap_or_default();
            total += 4 * shape.iter().product::<usize>() as u64;
            if let Some(other) = weight_map.insert(name.clone(), Value::from(file.as_str())) {
                return Err(PersistError::Io {
                    path: shard,
                    why: format!("tensor '{name}' is in {other} too"),
                });
            }
        }
    }
    let mut meta = Map::new();
    meta.insert("total_size".into(), Value::from(total));
    for (k, v) in metadata {
        meta.insert(k.clone(), Value::from(v.as_str()));
    }
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "metadata": meta,
        "weight_map": weight_map,
    }))
    .expect("a JSON value serializes");
    write_atomically(&index, text.as_bytes()).map_err(|e| PersistError::Io {
        path: index.clone(),
        why: strip_path(&e.to_string(), &index),
    })?;
    // The previous saves' shards are no longer named by any index.
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if is_shard_name(&name) && !files.contains(&name) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// A failure of this process's part of a sharded save or a load, as the step communicator
/// carries it.
pub(crate) fn to_pipeline(e: &PersistError) -> PipelineError {
    PipelineError::Config(e.to_string())
}

/// Another rank's failure as the step communicator gives it back: what that rank said
/// ("rank r failed: ..."), without the stage and micro-batch of a step's failure.
pub(crate) fn from_pipeline(e: PipelineError) -> String {
    match e {
        PipelineError::Stage { cause, .. } => cause.to_string(),
        other => other.to_string(),
    }
}

impl Pipeline {
    /// Saves a sharded checkpoint into the folder `dir` (created if missing): one safetensors
    /// file per device of replica 0, written by the process that trains it (in one process,
    /// all of them), then the index, written by rank 0 once every rank's shards are written
    /// (see the [module](crate::train::shards) doc). Every rank of an MPI job must call it at
    /// the same point; no `gather_stages` is needed. The same result on every rank; on error
    /// the checkpoint the folder held before (if any) is still the one it holds.
    pub fn save_sharded(&mut self, dir: impl AsRef<Path>, opts: &SaveOptions) -> PResult<()> {
        let dir = dir.as_ref();
        let io = |why: String| PersistError::Io {
            path: dir.to_path_buf(),
            why,
        };
        let k = self.num_devices();
        let save = next_save(dir);
        let files: Vec<String> = (0..k).map(|d| shard_name(save, d, k)).collect();
        // What fails here fails in the agreement below too, so that no rank waits for one
        // that gave up.
        let meta = self.sharded_metadata(dir, opts, save);
        let local = self
            .check_settled()
            .map_err(|e| io(e.to_string()))
            .and(meta.clone())
            .and_then(|meta| self.write_shards(dir, &files, &meta, opts.require_finite));
        // Every rank's shards are written before the index names them.
        self.round += 1;
        let agreed = self.comm.agree_ok(
            self.round,
            k,
            local.as_ref().map(|_| ()).map_err(to_pipeline),
        );
        local?;
        agreed.map_err(|e| {
            io(format!(
                "not saved (the previous checkpoint stays): {}",
                from_pipeline(e)
            ))
        })?;
        let committed = if self.rank() == 0 {
            write_index(dir, &meta?, &files)
        } else {
            Ok(())
        };
        // Every rank returns whether the index was written.
        self.round += 1;
        let agreed = self.comm.agree_ok(
            self.round,
            k,
            committed.as_ref().map(|_| ()).map_err(to_pipeline),
        );
        committed?;
        agreed.map_err(|e| {
            io(format!(
                "not saved (the previous checkpoint stays): {}",
                from_pipeline(e)
            ))
        })
    }

    /// The metadata of every shard and of the index of save `save`: a one-file checkpoint's,
    /// the layout saved from, the save's number and its number of shards.
    fn sharded_metadata(
        &self,
        dir: &Path,
        opts: &SaveOptions,
        save: u64,
    ) -> PResult<Vec<(String, String)>> {
        let k = self.num_devices();
        let mut meta = self.checkpoint_metadata(dir, opts)?;
        let balance: Vec<String> = self.balance().iter().map(|b| b.to_string()).collect();
        for (key, value) in [
            ("devices", k.to_string()),
            ("replicas", self.num_replicas().to_string()),
            ("schedule", self.schedule().name.clone()),
            ("balance", balance.join(",")),
        ] {
            meta.push((format!("{LAYOUT_PREFIX}{key}"), value));
        }
        meta.push((SAVE_KEY.into(), save.to_string()));
        meta.push((SHARDS_KEY.into(), k.to_string()));
        Ok(meta)
    }

    /// This process's shards of a sharded save: the devices of replica 0 it runs (none on the
    /// ranks of other replicas, whose values are the same).
    fn write_shards(
        &self,
        dir: &Path,
        files: &[String],
        meta: &[(String, String)],
        require_finite: bool,
    ) -> PResult<()> {
        let k = self.num_devices();
        if self.replicas[0].index != 0 {
            return Ok(());
        }
        let mine: Vec<usize> = (0..k)
            .filter(|&d| self.transport.runs_device(d, k))
            .collect();
        if mine.is_empty() {
            return Ok(());
        }
        fs::create_dir_all(dir).map_err(|e| PersistError::Io {
            path: dir.to_path_buf(),
            why: format!("cannot create the folder: {e}"),
        })?;
        let stages = self.stages();
        let entries = persist_entries(stages);
        let aliases = tied_aliases(&entries);
        let placement = &self.schedule().placement;
        for d in mine {
            let path = dir.join(&files[d]);
            let mut tensors: Vec<(String, Tensor)> = entries
                .iter()
                .filter(|e| e.saved() && placement[e.stage] == d)
                .map(|e| (e.name.clone(), e.param.value()))
                .collect();
            for s in stages.iter().filter(|s| placement[s.index] == d) {
                if !s.is_held() {
                    return Err(PersistError::Io {
                        path,
                        why: format!(
                            "stage {} of device {d} is not held by this process",
                            s.index
                        ),
                    });
                }
                let Some(o) = self.optimizers().get(s.index) else {
                    continue;
                };
                // As in a one-file checkpoint: the shared `@` counters once (stage 0's), a
                // later tied copy's state under its group's first copy.
                for (key, t) in o.state() {
                    let keep = if key.starts_with('@') {
                        s.index == 0
                    } else {
                        !aliases.contains_key(optim_param(&key))
                    };
                    if keep {
                        tensors.push((format!("{OPTIM_PREFIX}{key}"), t));
                    }
                }
            }
            let mut meta = meta.to_vec();
            meta.push((SHARD_KEY.into(), (d + 1).to_string()));
            write_checked(&path, &tensors, &meta, require_finite)?;
        }
        Ok(())
    }
}

/// The metadata of a one-file checkpoint made from a sharded one: the save's own keys dropped.
fn one_file_metadata(metadata: &[(String, String)]) -> Vec<(String, String)> {
    metadata
        .iter()
        .filter(|(k, _)| ![SAVE_KEY, SHARDS_KEY, SHARD_KEY].contains(&k.as_str()))
        .cloned()
        .collect()
}

/// Writes the sharded checkpoint at `sharded` (its folder or index) as one checkpoint file
/// `out` (atomically), which [`Pipeline::load`] reads as it reads the folder.
pub fn consolidate(sharded: impl AsRef<Path>, out: impl AsRef<Path>) -> PResult<()> {
    let (sharded, out) = (sharded.as_ref(), out.as_ref());
    let s = Sharded::open(sharded)?;
    let cpu = Device::cpu();
    let mut tensors = Vec::with_capacity(s.order.len());
    for name in &s.order {
        let shape = &s.tensors[name].2;
        let t = Tensor::from_vec(s.values(name)?, shape, &cpu).map_err(|e| PersistError::Io {
            path: out.to_path_buf(),
            why: format!("tensor '{name}': {e}"),
        })?;
        tensors.push((name.clone(), t));
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|e| PersistError::Io {
            path: out.to_path_buf(),
            why: format!("cannot create the folder {}: {e}", dir.display()),
        })?;
    }
    write_checked(out, &tensors, &one_file_metadata(&s.metadata), false)
}

/// Splits the one-file checkpoint `one_file` into a sharded checkpoint in the folder `dir` of
/// `shards` files (fewer when the model has fewer layers), whole layers in each (a parameter's
/// optimizer state with it), in layer order, balanced by bytes. The shards need not match any
/// pipeline's devices: loading reads each tensor from whichever shard holds it.
pub fn split(one_file: impl AsRef<Path>, dir: impl AsRef<Path>, shards: usize) -> PResult<()> {
    let (one_file, dir) = (one_file.as_ref(), dir.as_ref());
    let src = match Source::open(one_file)? {
        Source::One(f, p) => Source::One(f, p),
        Source::Sharded(_) => {
            return Err(PersistError::Unreadable {
                path: one_file.to_path_buf(),
                why: "a sharded checkpoint already (split takes one checkpoint file)".into(),
            })
        }
    };
    let metadata = src.metadata();
    if !metadata.iter().any(|(k, _)| k == STEP_KEY) {
        return Err(PersistError::Unreadable {
            path: one_file.to_path_buf(),
            why: format!(
                "a safetensors file, but not a wgpipe checkpoint (no '{STEP_KEY}' in its metadata)"
            ),
        });
    }
    if shards == 0 {
        return Err(PersistError::Io {
            path: dir.to_path_buf(),
            why: "split into 0 shards".into(),
        });
    }
    // Each tensor's layer (the first part of its global name; the `@` counters and other
    // names go with the first layer).
    let names = src.names();
    let layer_of = |name: &str| -> usize {
        let n = name.strip_prefix(OPTIM_PREFIX).unwrap_or(name);
        n.split('.')
            .next()
            .and_then(|l| l.parse().ok())
            .unwrap_or(0)
    };
    let mut bytes: BTreeMap<usize, u64> = BTreeMap::new();
    for n in &names {
        let size = src.shape(n).unwrap_or_default().iter().product::<usize>() as u64;
        *bytes.entry(layer_of(n)).or_default() += 4 * size.max(1);
    }
    let n = shards.min(bytes.len().max(1));
    let total: u64 = bytes.values().sum::<u64>().max(1);
    let mut shard_of_layer = HashMap::new();
    let mut before = 0u64;
    for (layer, b) in &bytes {
        // Layers whose first byte falls in the i-th n-th of the model go to shard i.
        let i = ((before * n as u64) / total) as usize;
        shard_of_layer.insert(*layer, i.min(n - 1));
        before += b;
    }
    // Shards left empty by a big layer are dropped (the index names only files with tensors).
    let mut used: Vec<usize> = shard_of_layer.values().copied().collect();
    used.sort();
    used.dedup();
    let n = used.len();
    let save = next_save(dir);
    let files: Vec<String> = (0..n).map(|i| shard_name(save, i, n)).collect();
    let cpu = Device::cpu();
    let mut per: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); n];
    for name in &names {
        let shape = src.shape(name).unwrap_or_default();
        let t =
            Tensor::from_vec(src.values(name)?, &shape, &cpu).map_err(|e| PersistError::Io {
                path: dir.to_path_buf(),
                why: format!("tensor '{name}': {e}"),
            })?;
        let i = used
            .iter()
            .position(|&u| u == shard_of_layer[&layer_of(name)])
            .expect("every layer's shard is used");
        per[i].push((name.clone(), t));
    }
    fs::create_dir_all(dir).map_err(|e| PersistError::Io {
        path: dir.to_path_buf(),
        why: format!("cannot create the folder: {e}"),
    })?;
    let mut meta = one_file_metadata(&metadata);
    meta.push((SAVE_KEY.into(), save.to_string()));
    meta.push((SHARDS_KEY.into(), n.to_string()));
    for (i, tensors) in per.iter().enumerate() {
        let mut m = meta.clone();
        m.push((SHARD_KEY.into(), (i + 1).to_string()));
        write_checked(&dir.join(&files[i]), tensors, &m, false)?;
    }
    write_index(dir, &meta, &files)
}
