//! Saving a pipeline to one checkpoint file ([`Pipeline::save`]): its tensors, the
//! optimizers' state and the metadata (step, arithmetic settings, loss scaler), written
//! atomically.

use std::path::Path;

use wgpipe_autograd::serialize::{save_tensors_checked, FORMAT_KEY, OPTIM_PREFIX, STEP_KEY};
use wgpipe_tensor::Tensor;

use super::{
    merged_optimizer_state, optim_param, persist_entries, tied_aliases, PResult, PersistError,
    SaveOptions, FORMAT, SCALER_KEY, SETTING_PREFIX,
};
use crate::train::pipeline::Pipeline;

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
