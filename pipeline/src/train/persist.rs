//! Saving a whole pipeline to disk and loading it back: every stage's parameters and buffers,
//! every stage's optimizer state and the step, in one safetensors file. (Not to be confused
//! with re-materialization, which the schedules call `checkpoint`.) The same tensors can also be
//! one file per device plus an index: see [`crate::train::shards`].
//!
//! The file: parameters and buffers under their global names
//! ([`wgpipe_autograd::layer_param_name`]: `"{layer}.{name}"`), the optimizers' state under
//! `optim.` (per-parameter entries are keyed by the global parameter name, so they are disjoint
//! across stages; the shared counters `@steps` and `@lr` are equal on every stage and stored
//! once), and the step in the metadata. A file written by a pipeline of any K loads into a
//! pipeline of any other K over the same layers.
//!
//! - [`Pipeline::save`] writes atomically (a unique temporary file created exclusively, fsync,
//!   rename; see [`wgpipe_autograd::serialize`]): concurrent saves to one path each publish a
//!   whole file, and temporaries left by a dead process are cleaned up.
//! - [`Pipeline::load`] checks every tensor of every stage (names, shapes, dtypes, and with
//!   [`LoadOptions::require_finite`] finiteness), builds every new value on its device, and only
//!   then changes anything; an optimizer that refuses its state rolls back the stages already
//!   loaded. On any error the pipeline is as before.
//! - Optimizer state is persisted through [`Optimizer::state`] / [`Optimizer::load_state`] only:
//!   the persistence code splits and merges the stages' states itself, so no optimizer has to
//!   pretend to be something it is not.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::exec::stage::named_tensors;
use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::serialize::{save_tensors_checked, FORMAT_KEY, OPTIM_PREFIX, STEP_KEY};
use wgpipe_autograd::Param;
use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Device, Tag, Tensor};

use crate::exec::Stage;
use crate::train::pipeline::Pipeline;
use crate::train::replica::Replica;
use crate::train::scaler::ScalerState;
use crate::train::shards::{from_pipeline, to_pipeline, Source};

/// The loss scaler's state in the metadata (see [`crate::train::scaler::encode_state`]).
const SCALER_KEY: &str = "wgpipe.loss_scaler";

/// The format written in the metadata under [`FORMAT_KEY`].
pub const FORMAT: &str = "checkpoint/1";
/// Per-parameter optimizer slots that are counters (shape `[2]`), not parameter-shaped.
const COUNTER_SLOTS: [&str; 1] = ["step"];

/// How [`Pipeline::save`] writes.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Extra string metadata (keys must not start with `wgpipe.`), e.g. the model's description.
    pub metadata: Vec<(String, String)>,
    /// Refuse to write a checkpoint any of whose tensors holds NaN or infinity.
    pub require_finite: bool,
}

/// How [`Pipeline::load`] checks.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Refuse a checkpoint any of whose tensors holds NaN or infinity (on by default: a NaN
    /// parameter would only show as NaN losses later, and the check is one pass over values
    /// that are read anyway).
    pub require_finite: bool,
    /// Resume although the checkpoint was written under other settings that change the
    /// arithmetic (see [`Restored::other_settings`]); refused by default, naming them.
    pub allow_other_settings: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            require_finite: true,
            allow_other_settings: false,
        }
    }
}

/// The metadata prefix of the settings that change a run's arithmetic (see
/// [`Pipeline::arithmetic_settings`]).
const SETTING_PREFIX: &str = "wgpipe.setting.";

/// A setting that differs between a checkpoint and the pipeline loading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherSetting {
    pub name: String,
    pub saved: String,
    pub now: String,
}

impl std::fmt::Display for OtherSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} (saved with {})", self.name, self.now, self.saved)
    }
}

/// What [`Pipeline::load`] found besides the tensors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The step saved (now the pipeline's step).
    pub step: u64,
    /// The extra metadata given at save time, sorted by key.
    pub metadata: Vec<(String, String)>,
    /// The settings that change the arithmetic and differ from the checkpoint's (empty unless
    /// [`LoadOptions::allow_other_settings`]): the run continues in other arithmetic.
    pub other_settings: Vec<OtherSetting>,
}

/// Why a save or a load failed. A load error leaves the pipeline as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PersistError {
    /// The file cannot be used at all: missing, unreadable, truncated, not safetensors, or not
    /// a wgpipe checkpoint. Nothing about the pipeline is wrong.
    #[error("{}: cannot be read as a checkpoint: {why}", path.display())]
    Unreadable { path: PathBuf, why: String },
    /// A whole checkpoint, but not of this pipeline: `tensor` is the first tensor that differs
    /// (in file order or the pipeline's order), `why` says how (and how many others differ).
    #[error("{}: does not match this pipeline: {tensor}: {why}", path.display())]
    Mismatch {
        path: PathBuf,
        tensor: String,
        why: String,
    },
    /// With `require_finite`: tensor `tensor` holds `value`.
    #[error("{}: tensor '{tensor}' holds {value}, not a finite number", path.display())]
    NonFinite {
        path: PathBuf,
        tensor: String,
        value: f32,
    },
    /// Writing failed (nothing was published), or the values could not be read back or placed
    /// on their devices (e.g. out of memory).
    #[error("{}: {why}", path.display())]
    Io { path: PathBuf, why: String },
    /// The checkpoint of this model, written under settings that change the arithmetic
    /// (refused unless [`LoadOptions::allow_other_settings`]).
    #[error("{}: written under other settings that change the arithmetic: {} (allow_other_settings resumes anyway)", path.display(), list_settings(.settings))]
    OtherSettings {
        path: PathBuf,
        settings: Vec<OtherSetting>,
    },
}

/// `settings` in one line.
pub fn list_settings(settings: &[OtherSetting]) -> String {
    settings
        .iter()
        .map(|o| o.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl PersistError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            PersistError::Unreadable { path, .. }
            | PersistError::Mismatch { path, .. }
            | PersistError::NonFinite { path, .. }
            | PersistError::Io { path, .. }
            | PersistError::OtherSettings { path, .. } => path,
        }
    }
}

pub(crate) type PResult<T> = std::result::Result<T, PersistError>;

/// The optimizers' state of all stages as one list keyed like a checkpoint file (without the
/// `optim.` prefix): per-parameter entries from every stage, the shared `@` counters once.
pub fn merged_optimizer_state(optimizers: &[Box<dyn Optimizer>]) -> Vec<(String, Tensor)> {
    let mut all = Vec::new();
    for (i, o) in optimizers.iter().enumerate() {
        for (k, t) in o.state() {
            if !k.starts_with('@') || i == 0 {
                all.push((k, t));
            }
        }
    }
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// The inverse of [`merged_optimizer_state`]: each stage's share of a merged state, given the
/// stage that owns each parameter. Shared `@` entries go to every stage. `Err` names the first
/// entry that belongs to no parameter.
pub fn split_optimizer_state(
    state: Vec<(String, Tensor)>,
    owner: &HashMap<String, usize>,
    num_stages: usize,
) -> std::result::Result<Vec<Vec<(String, Tensor)>>, String> {
    let mut per: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); num_stages];
    for (k, t) in state {
        if k.starts_with('@') {
            for p in per.iter_mut() {
                p.push((k.clone(), t.clone()));
            }
            continue;
        }
        let pname = k.rsplit_once('.').map_or(k.as_str(), |(p, _)| p);
        match owner.get(pname) {
            Some(&s) => per[s].push((k, t)),
            None => return Err(k),
        }
    }
    Ok(per)
}

/// One tensor of the model side of a checkpoint.
pub(crate) struct Entry {
    /// Its name in the file: its own, or for a tied copy after its group's first, the first's
    /// (the copies are identical by construction, so they are saved once).
    pub(crate) name: String,
    /// Its own global name (what its stage's optimizer keys its state by).
    pub(crate) own: String,
    pub(crate) param: Param,
    pub(crate) stage: usize,
}

impl Entry {
    /// Whether it is saved under its own name (not a later tied copy).
    pub(crate) fn saved(&self) -> bool {
        self.name == self.own
    }
}

/// Parameters and buffers of `stages` (a parameter shared inside a stage once) and the stage of
/// each; a tied copy after the first of its group (in stage order, held here or not) carries
/// the first's name.
pub(crate) fn persist_entries(stages: &[Stage]) -> Vec<Entry> {
    let firsts = first_names(stages);
    let mut out: Vec<Entry> = Vec::new();
    for st in stages.iter().filter(|s| s.is_held()) {
        for t in named_tensors(st.first_layer, &st.layers) {
            if out.iter().any(|e| e.param.same(&t.param)) {
                continue;
            }
            let name = match t.param.tie_group() {
                Some(g) => firsts[&g].clone(),
                None => t.name.clone(),
            };
            out.push(Entry {
                name,
                own: t.name,
                param: t.param,
                stage: st.index,
            });
        }
    }
    out
}

/// Each tie group's first copy's name, in stage order over every stage (held here or not).
fn first_names(stages: &[Stage]) -> HashMap<String, String> {
    let mut firsts = HashMap::new();
    for st in stages {
        let tensors: Vec<(String, Option<String>)> = match &st.absent {
            Some(a) => a
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.tie.clone()))
                .collect(),
            None => named_tensors(st.first_layer, &st.layers)
                .into_iter()
                .map(|t| (t.name, t.param.tie_group()))
                .collect(),
        };
        for (name, tie) in tensors {
            if let Some(g) = tie {
                firsts.entry(g).or_insert(name);
            }
        }
    }
    firsts
}

/// The own names of later tied copies, each with its group's first name.
pub(crate) fn tied_aliases(entries: &[Entry]) -> HashMap<&str, &str> {
    entries
        .iter()
        .filter(|e| !e.saved())
        .map(|e| (e.own.as_str(), e.name.as_str()))
        .collect()
}

/// The parameter a per-parameter optimizer key (`{parameter}.{slot}`) belongs to.
pub(crate) fn optim_param(key: &str) -> &str {
    key.rsplit_once('.').map_or(key, |(p, _)| p)
}

impl Pipeline {
    /// The settings that change the arithmetic of a step (its bits), recorded in every
    /// checkpoint: the dtype the layers compute in, loss scaling, R replicas and M micro-batches
    /// (the split of the mini-batch, the dropout keys), the schedule (the order gradients are
    /// accumulated in). K and the balance are not among them: a checkpoint reshards.
    pub fn arithmetic_settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("precision", self.precision().name().to_string()),
            (
                "loss_scaling",
                if self.loss_scaler().is_some() {
                    "on"
                } else {
                    "off"
                }
                .to_string(),
            ),
            ("replicas", self.num_replicas().to_string()),
            ("micro_batches", self.num_micro_batches().to_string()),
            ("schedule", self.schedule().name.clone()),
        ]
    }

    /// Saves parameters, buffers, every stage's optimizer state and the pipeline's step to
    /// `path`, atomically (see the [module](crate::train::persist) doc). Creates missing folders.
    pub fn save(&self, path: impl AsRef<Path>, opts: &SaveOptions) -> PResult<()> {
        let path = path.as_ref();
        let io = |why: String| PersistError::Io {
            path: path.to_path_buf(),
            why,
        };
        self.check_settled().map_err(|e| io(e.to_string()))?;
        if let Some(s) = self.stages().iter().find(|s| !s.is_held()) {
            let rank = s.absent.as_ref().map_or(0, |a| a.rank);
            return Err(io(format!(
                "stage {} is held by rank {rank}, not by this one: call gather_stages first, \
                 then save from one rank",
                s.index
            )));
        }
        let meta = self.checkpoint_metadata(path, opts)?;
        let entries = persist_entries(self.stages());
        let aliases = tied_aliases(&entries);
        let mut tensors: Vec<(String, Tensor)> = entries
            .iter()
            .filter(|e| e.saved())
            .map(|e| (e.name.clone(), e.param.value()))
            .collect();
        // A later tied copy's optimizer state equals the first's (same gradients, same
        // updates): saved once too.
        for (k, t) in merged_optimizer_state(self.optimizers()) {
            if !aliases.contains_key(optim_param(&k)) {
                tensors.push((format!("{OPTIM_PREFIX}{k}"), t));
            }
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| io(format!("cannot create the folder {}: {e}", dir.display())))?;
        }
        write_checked(path, &tensors, &meta, opts.require_finite)
    }

    /// The metadata of a checkpoint of this pipeline (format, step, arithmetic settings, loss
    /// scaler, and the caller's `opts.metadata`); `path` is what an error names.
    pub(crate) fn checkpoint_metadata(
        &self,
        path: &Path,
        opts: &SaveOptions,
    ) -> PResult<Vec<(String, String)>> {
        let mut meta = vec![
            (FORMAT_KEY.to_string(), FORMAT.to_string()),
            (STEP_KEY.to_string(), self.step_count().to_string()),
        ];
        for (name, value) in self.arithmetic_settings() {
            meta.push((format!("{SETTING_PREFIX}{name}"), value));
        }
        if let Some(s) = self.loss_scaler() {
            meta.push((
                SCALER_KEY.to_string(),
                crate::train::scaler::encode_state(&s),
            ));
        }
        for (k, v) in &opts.metadata {
            if k.starts_with("wgpipe.") {
                return Err(PersistError::Io {
                    path: path.to_path_buf(),
                    why: format!(
                        "the metadata key '{k}' is reserved (keys starting with 'wgpipe.')"
                    ),
                });
            }
            meta.push((k.clone(), v.clone()));
        }
        Ok(meta)
    }

    /// Loads a checkpoint written by [`Pipeline::save`], or the sharded one in a folder (or
    /// named by its index) written by [`Pipeline::save_sharded`] or
    /// [`split`](crate::train::shards::split), by a pipeline of any K over the same layers
    /// (each process reads only the shards that hold its stages): parameters, buffers, every stage's optimizer state (when optimizers are set)
    /// and the step (which keys the dropout RNG, so training continues bit-exactly). Every
    /// tensor is checked and every new value built before anything changes; on error the
    /// pipeline is as before. Gradients are cleared (they belonged to the old weights). Over
    /// MPI every rank must call it at the same point: the ranks agree before anything changes,
    /// so that all load or none does.
    pub fn load(&mut self, path: impl AsRef<Path>, opts: &LoadOptions) -> PResult<Restored> {
        let path = path.as_ref();
        // A timed-out step still holding stages: what is loaded would miss them.
        let settled = self.settle().map_err(|e| PersistError::Io {
            path: path.to_path_buf(),
            why: e.to_string(),
        });
        // Each held replica reads the same checkpoint (the same structure, so only the first
        // can refuse it), which also gives each its own optimizer state on its own devices;
        // every replica's values are built before any replica changes.
        let settings = self.arithmetic_settings();
        let prepared: PResult<Vec<Prepared>> =
            settled
                .and_then(|()| Source::open(path))
                .and_then(|source| {
                    self.replicas
                        .iter()
                        .map(|r| prepare_replica(r, &source, path, opts, &settings))
                        .collect()
                });
        // Over MPI every rank loads, or none does: one that cannot (a shard it does not see, a
        // value it cannot place) fails the load on every rank before anything changes.
        self.round += 1;
        let agreed = self.comm.agree_ok(
            self.round,
            self.num_devices(),
            prepared.as_ref().map(|_| ()).map_err(to_pipeline),
        );
        let prepared = prepared?;
        agreed.map_err(|e| PersistError::Io {
            path: path.to_path_buf(),
            why: format!("not loaded: {}", from_pipeline(e)),
        })?;
        let mut read = None;
        for (r, p) in self.replicas.iter_mut().zip(prepared) {
            read = Some(apply_replica(r, p, path)?);
        }
        let (step, scaler, metadata, other_settings) =
            read.expect("a pipeline holds at least one replica");
        self.set_step(step);
        if let (Some(state), Some(s)) = (scaler, &mut self.scaler) {
            s.state = state;
        }
        Ok(Restored {
            step,
            metadata,
            other_settings,
        })
    }
}

/// A checkpoint as read into one replica: the step, the scaler's state, the extra metadata it
/// holds and the settings that differ.
type ReplicaLoad = (
    u64,
    Option<ScalerState>,
    Vec<(String, String)>,
    Vec<OtherSetting>,
);

/// A checkpoint read and checked for one replica, every new value built on its device: what
/// [`apply_replica`] puts in place.
struct Prepared {
    entries: Vec<Entry>,
    values: Vec<Tensor>,
    /// Each stage's share of the optimizer state (`None`: the replica has no optimizers).
    optimizer_state: Option<Vec<Vec<(String, Tensor)>>>,
    read: ReplicaLoad,
}

/// The first half of [`Pipeline::load`] for one replica: every tensor checked, read and built
/// on its device; nothing changes.
fn prepare_replica(
    replica: &Replica,
    f: &Source,
    path: &Path,
    opts: &LoadOptions,
    settings: &[(&'static str, String)],
) -> PResult<Prepared> {
    let unreadable = |why: String| PersistError::Unreadable {
        path: path.to_path_buf(),
        why,
    };
    let mut metadata = f.metadata();
    let step = match metadata.iter().find(|(k, _)| k == STEP_KEY) {
        None => {
            return Err(unreadable(format!(
                "a safetensors file, but not a wgpipe checkpoint (no '{STEP_KEY}' in its metadata)"
            )))
        }
        Some((_, v)) => v
            .parse::<u64>()
            .map_err(|_| unreadable(format!("'{STEP_KEY}' is '{v}', not a step number")))?,
    };
    // A checkpoint of a run with loss scaling resumes at its scale (a pipeline without
    // scaling ignores it; a file without it leaves the scaler as built).
    let scaler = match metadata.iter().find(|(k, _)| k == SCALER_KEY) {
        Some((_, v)) => Some(crate::train::scaler::decode_state(v).ok_or_else(|| {
            unreadable(format!(
                "'{SCALER_KEY}' is '{v}', not 'scale good_steps skipped_steps'"
            ))
        })?),
        None => None,
    };
    // A checkpoint from before settings were recorded has none to compare.
    let other_settings: Vec<OtherSetting> = settings
        .iter()
        .filter_map(|(name, now)| {
            let key = format!("{SETTING_PREFIX}{name}");
            let (_, saved) = metadata.iter().find(|(k, _)| *k == key)?;
            (saved != now).then(|| OtherSetting {
                name: name.to_string(),
                saved: saved.clone(),
                now: now.clone(),
            })
        })
        .collect();
    if !other_settings.is_empty() && !opts.allow_other_settings {
        return Err(PersistError::OtherSettings {
            path: path.to_path_buf(),
            settings: other_settings,
        });
    }
    metadata.retain(|(k, _)| !k.starts_with("wgpipe."));

    // 1. Names, shapes and dtypes of every tensor, model side and optimizer side.
    let entries = persist_entries(&replica.stages);
    let aliases = tied_aliases(&entries);
    let by_name: HashMap<&str, &Entry> = entries
        .iter()
        .filter(|e| e.saved())
        .map(|e| (e.name.as_str(), e))
        .collect();
    let by_own: HashMap<&str, &Entry> = entries.iter().map(|e| (e.own.as_str(), e)).collect();
    let mut problems: Vec<(String, String)> = Vec::new();
    let shape_of = |name: &str| f.shape(name);
    for e in entries.iter().filter(|e| e.saved()) {
        let want = e.param.shape();
        match shape_of(&e.name) {
            None => problems.push((
                e.name.clone(),
                "missing: in the pipeline, not in the file".into(),
            )),
            Some(got) if got != want => problems.push((
                e.name.clone(),
                format!("shape mismatch: {got:?} in the file vs {want:?} in the pipeline"),
            )),
            Some(_) if !f.is_loadable(&e.name) => problems.push((
                e.name.clone(),
                format!(
                    "dtype {} in the file (only F32, F16 and BF16 load)",
                    f.dtype(&e.name).unwrap_or_default()
                ),
            )),
            Some(_) => {}
        }
    }
    // Over MPI, the tensors of stages other ranks hold: checked against the file, not loaded
    // (each rank loads its own stages from the same file).
    let firsts = first_names(&replica.stages);
    let absent: Vec<(&str, &[usize], bool)> = replica
        .stages
        .iter()
        .filter_map(|s| s.absent.as_ref())
        .flat_map(|a| &a.tensors)
        .map(|t| {
            let later_copy = t.tie.as_ref().is_some_and(|g| firsts[g] != t.name);
            (t.name.as_str(), t.shape.as_slice(), later_copy)
        })
        .collect();
    let elsewhere: HashMap<&str, &[usize]> = absent.iter().map(|&(n, s, _)| (n, s)).collect();
    for &(name, want, later_copy) in &absent {
        if later_copy {
            // Saved once, under its group's first name.
            continue;
        }
        match shape_of(name) {
            None => problems.push((
                name.to_string(),
                "missing: in the pipeline (held by another rank), not in the file".into(),
            )),
            Some(got) if got != want => problems.push((
                name.to_string(),
                format!("shape mismatch: {got:?} in the file vs {want:?} in the pipeline"),
            )),
            Some(_) => {}
        }
    }
    let names = f.names();
    // (name in the file, key for the optimizer): a tied group's saved state also goes to its
    // later copies, under their own names.
    let mut optim_names = Vec::new();
    for n in &names {
        if let Some(key) = n.strip_prefix(OPTIM_PREFIX) {
            let pname = optim_param(key);
            if aliases.contains_key(pname) {
                // A checkpoint written before copies were saved once: the first's state serves.
                continue;
            }
            if !elsewhere.contains_key(pname) {
                optim_names.push((n.clone(), key.to_string()));
            }
            let slot = &key[pname.len()..];
            for (alias, _) in aliases.iter().filter(|(_, first)| **first == pname) {
                optim_names.push((n.clone(), format!("{alias}{slot}")));
            }
        } else if elsewhere.contains_key(n.as_str()) || aliases.contains_key(n.as_str()) {
            continue;
        } else if !by_name.contains_key(n.as_str()) {
            problems.push((
                n.clone(),
                "unexpected: in the file, not in the pipeline".into(),
            ));
        }
    }
    // Device of each optimizer tensor: its parameter's (the `@` counters: the CPU).
    let mut optim_devices = Vec::with_capacity(optim_names.len());
    for (full, key) in &optim_names {
        if key.starts_with('@') {
            optim_devices.push(Device::cpu());
            continue;
        }
        let (pname, slot) = key.rsplit_once('.').unwrap_or((key.as_str(), ""));
        let Some(e) = by_own.get(pname) else {
            problems.push((
                full.clone(),
                format!("optimizer state of parameter '{pname}', which the pipeline does not have"),
            ));
            optim_devices.push(Device::cpu());
            continue;
        };
        let got = shape_of(full).unwrap_or_default();
        let want = e.param.shape();
        if !COUNTER_SLOTS.contains(&slot) && got != want {
            problems.push((
                full.clone(),
                format!("shape mismatch: {got:?} in the file vs {want:?} for parameter '{pname}' in the pipeline"),
            ));
        } else if !f.is_loadable(full) {
            problems.push((
                full.clone(),
                format!("dtype {} in the file", f.dtype(full).unwrap_or_default()),
            ));
        }
        optim_devices.push(e.param.device());
    }
    if let Some((tensor, why)) = problems.first().cloned() {
        let more = problems.len() - 1;
        let why = if more == 0 {
            why
        } else {
            let others: Vec<String> = problems[1..]
                .iter()
                .take(5)
                .map(|(n, w)| format!("{n} ({})", w.split(':').next().unwrap_or(w)))
                .collect();
            format!(
                "{why}; and {more} more tensor(s) differ: {}{}",
                others.join(", "),
                if more > 5 { ", ..." } else { "" }
            )
        };
        return Err(PersistError::Mismatch {
            path: path.to_path_buf(),
            tensor,
            why,
        });
    }

    // 2. Every value read (and checked) and built on its device before anything changes.
    let read = |name: &str| -> PResult<Vec<f32>> {
        let v = f.values(name)?;
        if opts.require_finite {
            if let Some(x) = v.iter().find(|x| !x.is_finite()) {
                return Err(PersistError::NonFinite {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    value: *x,
                });
            }
        }
        Ok(v)
    };
    let place = |name: &str, device: &Device, tag: Tag| -> PResult<Tensor> {
        let v = read(name)?;
        let shape = f.shape(name).unwrap_or_default();
        with_tag(tag, || Tensor::from_vec(v, &shape, device)).map_err(|e| PersistError::Io {
            path: path.to_path_buf(),
            why: format!("placing '{name}' on {}: {e}", device.name()),
        })
    };
    let mut values = Vec::with_capacity(entries.len());
    for e in &entries {
        values.push(place(&e.name, &e.param.device(), Tag::Parameters)?);
    }
    let mut state = Vec::with_capacity(optim_names.len());
    for ((full, key), dev) in optim_names.iter().zip(&optim_devices) {
        state.push((key.clone(), place(full, dev, Tag::OptimizerState)?));
    }

    let optimizer_state =
        if replica.optimizers.len() == replica.stages.len() && !replica.optimizers.is_empty() {
            let owner: HashMap<String, usize> =
                entries.iter().map(|e| (e.own.clone(), e.stage)).collect();
            let per = split_optimizer_state(state, &owner, replica.stages.len()).map_err(|k| {
                PersistError::Mismatch {
                    path: path.to_path_buf(),
                    tensor: format!("{OPTIM_PREFIX}{k}"),
                    why: "optimizer state of no parameter of the pipeline".into(),
                }
            })?;
            Some(per)
        } else {
            None
        };
    Ok(Prepared {
        entries,
        values,
        optimizer_state,
        read: (step, scaler, metadata, other_settings),
    })
}

/// The second half of [`Pipeline::load`] for one replica: the optimizers take their state
/// (each checks its own; rolled back together if one refuses), then the parameters and buffers
/// their values; gradients cleared.
fn apply_replica(replica: &mut Replica, p: Prepared, path: &Path) -> PResult<ReplicaLoad> {
    let Prepared {
        entries,
        values,
        optimizer_state,
        read,
    } = p;
    if let Some(per) = optimizer_state {
        let mut kept: BTreeMap<usize, Vec<(String, Tensor)>> = BTreeMap::new();
        for (i, s) in per.into_iter().enumerate() {
            let before = replica.optimizers[i].state();
            if let Err(e) = replica.optimizers[i].load_state(s) {
                for (j, st) in kept {
                    let _ = replica.optimizers[j].load_state(st);
                }
                return Err(PersistError::Mismatch {
                    path: path.to_path_buf(),
                    tensor: format!("{OPTIM_PREFIX}* of stage {i}"),
                    why: format!("the optimizer refuses its state: {e}"),
                });
            }
            kept.insert(i, before);
        }
    }

    for (e, v) in entries.iter().zip(values) {
        e.param.set_value(v);
    }
    for (_, p) in replica.named_parameters() {
        p.zero_grad();
    }
    Ok(read)
}

/// Writes `tensors` and `meta` to `path` atomically; with `require_finite`, a non-finite value
/// is refused as [`PersistError::NonFinite`] naming the tensor, and nothing is written.
pub(crate) fn write_checked(
    path: &Path,
    tensors: &[(String, Tensor)],
    meta: &[(String, String)],
    require_finite: bool,
) -> PResult<()> {
    save_tensors_checked(path, tensors, meta, require_finite).map_err(|e| {
        let msg = e.to_string();
        match msg.split_once("not saved: tensor '") {
            Some((_, rest)) if require_finite => {
                let tensor = rest.split('\'').next().unwrap_or_default().to_string();
                let value = rest
                    .split("holds ")
                    .nth(1)
                    .and_then(|v| v.split(' ').next())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f32::NAN);
                PersistError::NonFinite {
                    path: path.to_path_buf(),
                    tensor,
                    value,
                }
            }
            _ => PersistError::Io {
                path: path.to_path_buf(),
                why: strip_path(&msg, path),
            },
        }
    })
}

/// An error message of the serializer without its leading `op: path: ` (the persist error
/// shows the path once).
pub(crate) fn strip_path(msg: &str, path: &Path) -> String {
    let p = format!("{}: ", path.display());
    match msg.find(&p) {
        Some(i) => msg[i + p.len()..].to_string(),
        None => msg.to_string(),
    }
}
