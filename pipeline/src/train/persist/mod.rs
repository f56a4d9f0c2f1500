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
//!
//! Here: the options, errors and the checkpoint's tensors (which name each is saved under, the
//! optimizers' state merged and split); in `save.rs` writing, in `load.rs` reading back.

mod load;
mod save;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::exec::stage::named_tensors;
use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::Param;
use wgpipe_tensor::Tensor;

use crate::exec::Stage;

pub(crate) use save::{strip_path, write_checked};

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
