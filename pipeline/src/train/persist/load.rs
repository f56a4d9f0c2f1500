//! Loading a checkpoint ([`Pipeline::load`]): every replica's tensors checked against the file
//! and every new value built on its device first (`prepare_replica`), then put in place
//! (`apply_replica`), so that a load that fails anywhere changes nothing.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use wgpipe_autograd::serialize::{OPTIM_PREFIX, STEP_KEY};
use wgpipe_tensor::memory::with_tag;
use wgpipe_tensor::{Device, Tag, Tensor};

use super::{
    first_names, optim_param, persist_entries, split_optimizer_state, tied_aliases, Entry,
    LoadOptions, OtherSetting, PResult, PersistError, Restored, COUNTER_SLOTS, SCALER_KEY,
    SETTING_PREFIX,
};
use crate::exec::Stage;
use crate::train::pipeline::Pipeline;
use crate::train::replica::Replica;
use crate::train::scaler::ScalerState;
use crate::train::shards::{from_pipeline, to_pipeline, Source};

impl Pipeline {
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

/// Tensors by name: an optimizer's state, or a stage's share of it.
type NamedTensors = Vec<(String, Tensor)>;

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
    let read = read_metadata(f, path, opts, settings)?;

    // 1. Names, shapes and dtypes of every tensor, model side and optimizer side.
    let entries = persist_entries(&replica.stages);
    let aliases = tied_aliases(&entries);
    let mut problems: Vec<(String, String)> = Vec::new();
    check_held(f, &entries, &mut problems);
    // Over MPI, the tensors of stages other ranks hold: checked against the file, not loaded
    // (each rank loads its own stages from the same file).
    let elsewhere = check_absent(f, &replica.stages, &mut problems);
    let optim_names = optimizer_names(f, &entries, &aliases, &elsewhere, &mut problems);
    let optim_devices = optimizer_devices(f, &entries, &optim_names, &mut problems);
    mismatch(path, &problems)?;

    // 2. Every value read (and checked) and built on its device before anything changes.
    let (values, state) = place_values(f, path, opts, &entries, &optim_names, &optim_devices)?;
    let optimizer_state = stage_states(replica, &entries, state, path)?;
    Ok(Prepared {
        entries,
        values,
        optimizer_state,
        read,
    })
}

/// The checkpoint's step, loss scaler state and extra metadata, and the settings that change
/// the arithmetic and differ from `settings` (refused unless `opts` allows them).
fn read_metadata(
    f: &Source,
    path: &Path,
    opts: &LoadOptions,
    settings: &[(&'static str, String)],
) -> PResult<ReplicaLoad> {
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
    Ok((step, scaler, metadata, other_settings))
}

/// The name, shape and dtype in the file of every tensor saved from this replica's stages.
fn check_held(f: &Source, entries: &[Entry], problems: &mut Vec<(String, String)>) {
    for e in entries.iter().filter(|e| e.saved()) {
        let want = e.param.shape();
        match f.shape(&e.name) {
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
}

/// The names and shapes in the file of the tensors of stages other ranks hold; those tensors'
/// shapes by name.
fn check_absent<'a>(
    f: &Source,
    stages: &'a [Stage],
    problems: &mut Vec<(String, String)>,
) -> HashMap<&'a str, &'a [usize]> {
    let firsts = first_names(stages);
    let absent: Vec<(&str, &[usize], bool)> = stages
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
        match f.shape(name) {
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
    elsewhere
}

/// The optimizer tensors of the file this replica loads, as (name in the file, key for the
/// optimizer); a model tensor in the file that the pipeline lacks is a problem.
fn optimizer_names(
    f: &Source,
    entries: &[Entry],
    aliases: &HashMap<&str, &str>,
    elsewhere: &HashMap<&str, &[usize]>,
    problems: &mut Vec<(String, String)>,
) -> Vec<(String, String)> {
    let by_name: HashMap<&str, &Entry> = entries
        .iter()
        .filter(|e| e.saved())
        .map(|e| (e.name.as_str(), e))
        .collect();
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
    optim_names
}

/// The device of each optimizer tensor, its shape and dtype in the file checked against its
/// parameter.
fn optimizer_devices(
    f: &Source,
    entries: &[Entry],
    optim_names: &[(String, String)],
    problems: &mut Vec<(String, String)>,
) -> Vec<Device> {
    let by_own: HashMap<&str, &Entry> = entries.iter().map(|e| (e.own.as_str(), e)).collect();
    // Device of each optimizer tensor: its parameter's (the `@` counters: the CPU).
    let mut optim_devices = Vec::with_capacity(optim_names.len());
    for (full, key) in optim_names {
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
        let got = f.shape(full).unwrap_or_default();
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
    optim_devices
}

/// The first of `problems` as the load's error, naming how many others there are.
fn mismatch(path: &Path, problems: &[(String, String)]) -> PResult<()> {
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
    Ok(())
}

/// Every value read (and checked) and built on its device: the model's tensors in the order
/// of `entries`, and the optimizer's state.
fn place_values(
    f: &Source,
    path: &Path,
    opts: &LoadOptions,
    entries: &[Entry],
    optim_names: &[(String, String)],
    optim_devices: &[Device],
) -> PResult<(Vec<Tensor>, NamedTensors)> {
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
    for e in entries {
        values.push(place(&e.name, &e.param.device(), Tag::Parameters)?);
    }
    let mut state = Vec::with_capacity(optim_names.len());
    for ((full, key), dev) in optim_names.iter().zip(optim_devices) {
        state.push((key.clone(), place(full, dev, Tag::OptimizerState)?));
    }
    Ok((values, state))
}

/// Each stage's share of the optimizer state, when the replica has an optimizer per stage.
fn stage_states(
    replica: &Replica,
    entries: &[Entry],
    state: NamedTensors,
    path: &Path,
) -> PResult<Option<Vec<NamedTensors>>> {
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
    Ok(optimizer_state)
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
