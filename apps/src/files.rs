//! `--save` and `--resume`: whole-pipeline checkpoints, one file or a sharded folder, through
//! the pipeline crate's [`persist`](crate::pipeline::train::persist) and
//! [`shards`](crate::pipeline::train::shards) modules, with messages that tell a damaged or
//! foreign file (nothing to do with the flags) from a checkpoint of another model (the flags
//! differ: which tensor, and which model each side describes). `--consolidate` and `--split` are
//! `PipelineArgs::convert_checkpoint`, with the flags.

use std::path::Path;

use crate::autograd::serialize::OPTIM_PREFIX;
use crate::bail;
use crate::error::{AppError, AppResult};
use crate::pipeline::train::persist::list_settings;
use crate::pipeline::{checkpoint_metadata, LoadOptions, PersistError, Pipeline, SaveOptions};

/// Whether `--save path` asks for a sharded checkpoint: a path that ends in a separator
/// (`ckpt/`; an existing folder named without one is refused, as a mistaken file path).
pub fn is_folder_path(path: &Path) -> bool {
    path.as_os_str()
        .to_string_lossy()
        .ends_with(std::path::is_separator)
}

/// `Err` naming `--flag` unless `path` is a readable file.
pub fn check_readable(flag: &str, path: &Path) -> AppResult<()> {
    if !path.exists() {
        bail!("--{flag} {}: file not found", path.display());
    }
    if let Err(e) = std::fs::File::open(path) {
        bail!("--{flag} {}: cannot open it: {e}", path.display());
    }
    if path.is_dir() {
        bail!("--{flag} {}: a folder, not a file", path.display());
    }
    Ok(())
}

/// Saves parameters, buffers, every stage's optimizer state and the step (atomically; refuses
/// to write a checkpoint holding NaN or infinity): one file, or a sharded folder when
/// [`is_folder_path`] (then every rank of an MPI job must call it).
pub fn save_pipeline(
    pipe: &mut Pipeline,
    path: &Path,
    metadata: &[(String, String)],
) -> AppResult<()> {
    let opts = SaveOptions {
        metadata: metadata.to_vec(),
        require_finite: true,
    };
    let saved = if is_folder_path(path) {
        // Each rank its own devices' shards, rank 0 the index.
        pipe.save_sharded(path, &opts)
    } else if crate::output::is_root() {
        // One file per job, from rank 0 (after `gather_stages`, it holds the whole model).
        pipe.save(path, &opts)
    } else {
        Ok(())
    };
    saved.map_err(|e| match e {
        PersistError::NonFinite { tensor, value, .. } => AppError(format!(
            "--save {}: not saved: tensor '{tensor}' holds {value} (training diverged)",
            path.display()
        )),
        PersistError::Io { why, .. }
        | PersistError::Unreadable { why, .. }
        | PersistError::Mismatch { why, .. } => {
            AppError(format!("--save {}: {why}", path.display()))
        }
        // Only a load compares settings.
        e @ PersistError::OtherSettings { .. } => AppError(format!("--save: {e}")),
    })
}

/// Loads a checkpoint written by [`save_pipeline`] into `pipe` (refusing non-finite values);
/// returns its step and metadata. `model` describes the model these flags build; when the file
/// holds another model (its `model` metadata), the error shows both.
pub fn load_pipeline(
    pipe: &mut Pipeline,
    path: &Path,
    model: &str,
    allow_other_settings: bool,
) -> AppResult<(u64, Vec<(String, String)>)> {
    if !path.is_dir() {
        check_readable("resume", path)?;
    }
    let opts = LoadOptions {
        require_finite: true,
        allow_other_settings,
    };
    match pipe.load(path, &opts) {
        Ok(r) => {
            if !r.other_settings.is_empty() {
                crate::say!(
                    "resuming under other settings than the checkpoint's (--resume-other-settings): {}; the run continues in other arithmetic",
                    list_settings(&r.other_settings)
                );
            }
            Ok((r.step, r.metadata))
        }
        Err(PersistError::OtherSettings { settings, .. }) => Err(AppError(format!(
            "--resume {}: the checkpoint was written under other settings that change the arithmetic: {}; use the checkpoint's, or pass --resume-other-settings to continue anyway",
            path.display(),
            list_settings(&settings)
        ))),
        Err(PersistError::Unreadable { why, .. }) => Err(AppError(format!(
            "--resume {}: the file is not a usable checkpoint (damaged, truncated or of another kind; the flags are not at fault): {why}",
            path.display()
        ))),
        Err(PersistError::Mismatch { tensor, why, .. }) => {
            let saved = checkpoint_metadata(path)
                .ok()
                .and_then(|m| m.into_iter().find(|(k, _)| k == "model").map(|(_, v)| v));
            let models = match saved {
                Some(m) if m != model => {
                    format!("\n  the checkpoint holds: {m}\n  these flags build:    {model}")
                }
                _ => String::new(),
            };
            Err(AppError(format!(
                "cannot resume from {}: it does not match the model of these flags: tensor '{tensor}': {why}{models}",
                path.display()
            )))
        }
        Err(PersistError::NonFinite { tensor, value, .. }) => Err(AppError(format!(
            "--resume {}: tensor '{tensor}' holds {value}: the checkpoint comes from a diverged run; resume from an earlier one",
            path.display()
        ))),
        Err(PersistError::Io { why, .. }) => {
            Err(AppError(format!("--resume {}: {why}", path.display())))
        }
    }
}

/// True for state keys of the optimizer inside a checkpoint file.
pub fn is_optimizer_key(name: &str) -> bool {
    name.starts_with(OPTIM_PREFIX)
}
