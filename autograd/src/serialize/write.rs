//! Writing a safetensors file: tensors read back from their devices as little-endian F32,
//! streamed to a temporary file, synced, then renamed over the target (see `temporary.rs`).

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, View};
use wgpipe_tensor::{Result, Tensor};

use super::err;
use super::temporary::{clean_stale_temporaries, create_temporary, sync_dir};

/// A tensor as the writer streams it: read back from its device and turned into little-endian
/// F32 bytes only when the writer reaches it, so a save holds one tensor's bytes at a time, not
/// a second copy of the model. What goes wrong on the way (a failed read-back, a non-finite
/// value under `require_finite`) is kept in `failed`; the file is then thrown away.
struct StreamedF32<'a> {
    name: &'a str,
    tensor: &'a Tensor,
    require_finite: bool,
    failed: &'a RefCell<Option<String>>,
}

impl StreamedF32<'_> {
    fn bytes(&self) -> std::result::Result<Vec<u8>, String> {
        let values = self
            .tensor
            .to_vec()
            .map_err(|e| format!("tensor '{}': {e}", self.name))?;
        if self.require_finite {
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(format!(
                    "not saved: tensor '{}' holds {v} (a non-finite value)",
                    self.name
                ));
            }
        }
        Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

impl View for &StreamedF32<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        self.tensor.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self.bytes() {
            Ok(bytes) => Cow::Owned(bytes),
            Err(e) => {
                self.failed.borrow_mut().get_or_insert(e);
                // The file is removed; what is written in its place does not matter.
                Cow::Owned(Vec::new())
            }
        }
    }
    fn data_len(&self) -> usize {
        4 * self.tensor.numel()
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
/// read-back), one tensor at a time as the file is streamed.
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
    let failed = RefCell::new(None);
    let data: Vec<(&str, StreamedF32)> = tensors
        .iter()
        .map(|(name, tensor)| {
            let view = StreamedF32 {
                name,
                tensor,
                require_finite,
                failed: &failed,
            };
            (name.as_str(), view)
        })
        .collect();
    let meta = (!meta.is_empty()).then_some(meta);

    clean_stale_temporaries(path);
    let tmp = create_temporary(path).map_err(|e| err(op, path, e))?;
    let written = write_synced(&tmp, data.iter().map(|(n, d)| (*n, d)), meta);
    if let Some(e) = failed.into_inner() {
        let _ = fs::remove_file(&tmp);
        return Err(err(op, path, e));
    }
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

fn write_synced<'a>(
    tmp: &Path,
    data: impl Iterator<Item = (&'a str, &'a StreamedF32<'a>)>,
    meta: Option<HashMap<String, String>>,
) -> std::result::Result<(), String> {
    // Streams the tensors to the file (one tensor's bytes in memory at a time), then syncs.
    safetensors::serialize_to_file(data, meta, tmp).map_err(|e| e.to_string())?;
    fs::OpenOptions::new()
        .write(true)
        .open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| e.to_string())
}
