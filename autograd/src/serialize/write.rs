//! Writing a safetensors file: tensors read back from their devices as little-endian F32,
//! streamed to a temporary file, synced, then renamed over the target (see `temporary.rs`).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::Path;

use safetensors::tensor::{Dtype, View};
use wgpipe_tensor::{Result, Tensor};

use super::err;
use super::temporary::{clean_stale_temporaries, create_temporary, sync_dir};

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
