//! A Hugging Face checkpoint folder's tensors: `model.safetensors`, or
//! `model.safetensors.index.json` and the shards its `weight_map` names. Only the headers are
//! read when the folder is opened; a tensor's bytes are read when it is asked for, so a pipeline
//! stage reads its own layers' tensors and nothing else. f32, f16 and bf16 tensors all come back
//! as f32 (the run's precision casts them, as it does its f32 master weights).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;
use wgpipe_tensor::{Device, Error, Result, Tensor};

/// Where one tensor lies: its file, dtype, shape and byte range in the file.
#[derive(Debug, Clone)]
struct Entry {
    file: PathBuf,
    dtype: StoredDType,
    shape: Vec<usize>,
    start: u64,
    len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoredDType {
    F32,
    F16,
    BF16,
}

impl StoredDType {
    fn parse(s: &str) -> Option<StoredDType> {
        match s {
            "F32" => Some(StoredDType::F32),
            "F16" => Some(StoredDType::F16),
            "BF16" => Some(StoredDType::BF16),
            _ => None,
        }
    }
    fn name(self) -> &'static str {
        match self {
            StoredDType::F32 => "F32",
            StoredDType::F16 => "F16",
            StoredDType::BF16 => "BF16",
        }
    }
    fn size(self) -> u64 {
        match self {
            StoredDType::F32 => 4,
            StoredDType::F16 | StoredDType::BF16 => 2,
        }
    }
}

fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "checkpoint",
        msg: format!("{}: {msg}", path.display()),
    }
}

/// The tensors of a checkpoint folder, by name.
pub struct HfCheckpoint {
    dir: PathBuf,
    entries: HashMap<String, Entry>,
}

impl HfCheckpoint {
    /// Reads the headers of `dir`'s safetensors (one file, or the shards of its index).
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            shards(&index, dir)?
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(bad(
                    dir,
                    "has neither model.safetensors nor model.safetensors.index.json",
                ));
            }
            vec![single]
        };
        let mut entries = HashMap::new();
        for file in files {
            for (name, entry) in header(&file)? {
                if let Some(first) = entries.insert(name.clone(), entry) {
                    return Err(bad(
                        dir,
                        format!(
                            "tensor {name} is in both {} and {}",
                            first.file.display(),
                            file.display()
                        ),
                    ));
                }
            }
        }
        if index.exists() {
            check_weight_map(&index, &entries)?;
        }
        Ok(HfCheckpoint {
            dir: dir.to_path_buf(),
            entries,
        })
    }

    /// One safetensors file on its own (a timm checkpoint, say).
    pub fn open_file(file: &Path) -> Result<HfCheckpoint> {
        let entries = header(file)?.into_iter().collect();
        Ok(HfCheckpoint {
            dir: file.to_path_buf(),
            entries,
        })
    }

    /// The folder (or the file) the checkpoint was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The names of every tensor, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.entries.keys().cloned().collect();
        v.sort();
        v
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The shape tensor `name` is stored with.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Tensor `name` as f32 on `dev`, which must have `shape`; `wanted_by` says who asked (a
    /// stage and layer) in the error for a missing tensor.
    pub fn read(
        &self,
        name: &str,
        shape: &[usize],
        wanted_by: &str,
        dev: &Device,
    ) -> Result<Tensor> {
        let e = self.entries.get(name).ok_or_else(|| {
            bad(
                &self.dir,
                format!("has no tensor {name} (wanted by {wanted_by})"),
            )
        })?;
        if e.shape != shape {
            return Err(bad(
                &e.file,
                format!(
                    "tensor {name} has shape {:?}, {wanted_by} expects {shape:?}",
                    e.shape
                ),
            ));
        }
        let values =
            read_values(e).map_err(|err| bad(&e.file, format!("reading {name}: {err}")))?;
        Tensor::from_vec(values, shape, dev)
    }
}

/// The values of `e` as f32, read from its file in blocks of 1 MiB converted as they come:
/// the tensor's f32 values are the only allocation the size of the tensor (a 131 MB bf16
/// table would otherwise be read whole beside its 262 MB of f32).
fn read_values(e: &Entry) -> std::io::Result<Vec<f32>> {
    const BLOCK: usize = 1 << 20;
    let size = e.dtype.size() as usize;
    let mut f = File::open(&e.file)?;
    f.seek(SeekFrom::Start(e.start))?;
    let mut values = Vec::with_capacity(e.len as usize / size);
    let mut block = vec![0u8; BLOCK.min(e.len as usize)];
    let mut left = e.len as usize;
    while left > 0 {
        let bytes = &mut block[..BLOCK.min(left)];
        f.read_exact(bytes)?;
        match e.dtype {
            StoredDType::F32 => values.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            StoredDType::F16 => values.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            StoredDType::BF16 => values.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
        }
        left -= bytes.len();
    }
    Ok(values)
}

/// The shard files an index names, each once, each inside `dir`.
/// The `weight_map` object of the index file `index`.
fn weight_map(index: &Path) -> Result<serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(index).map_err(|e| bad(index, e))?;
    let value: Value =
        serde_json::from_str(&text).map_err(|e| bad(index, format!("is not JSON: {e}")))?;
    match value {
        Value::Object(mut o) => match o.remove("weight_map") {
            Some(Value::Object(map)) => Ok(map),
            _ => Err(bad(index, "has no weight_map object")),
        },
        _ => Err(bad(index, "has no weight_map object")),
    }
}

fn shards(index: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let map = weight_map(index)?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in &map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(index, format!("weight_map[{name}] is not a file name")))?;
        let plain = Path::new(file);
        if plain.components().count() != 1 || plain.is_absolute() {
            return Err(bad(
                index,
                format!("weight_map[{name}] = {file:?} is not a file inside the folder"),
            ));
        }
        let path = dir.join(plain);
        // A name inside the folder may still be a link that leads out of it.
        if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize()) {
            if !real.starts_with(&root) {
                return Err(bad(
                    index,
                    format!(
                        "weight_map[{name}] = {file:?} leads out of the folder (to {})",
                        real.display()
                    ),
                ));
            }
        }
        if !files.contains(&path) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Fails unless every tensor `index`'s weight map places in a file is in that file's header:
/// an index that names another shard than the one holding a tensor, or a tensor no shard
/// holds, is a folder copied half-way or edited by hand.
fn check_weight_map(index: &Path, entries: &HashMap<String, Entry>) -> Result<()> {
    let map = weight_map(index)?;
    for (name, file) in &map {
        let file = file.as_str().unwrap_or_default();
        match entries.get(name) {
            None => {
                return Err(bad(
                    index,
                    format!("weight_map[{name}] = {file:?}, but no shard holds {name}"),
                ))
            }
            Some(e) if e.file.file_name() != Some(std::ffi::OsStr::new(file)) => {
                return Err(bad(
                    index,
                    format!(
                        "weight_map[{name}] = {file:?}, but {name} is in {}",
                        e.file.display()
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Every tensor of a safetensors file, from its header: an 8-byte little-endian length, then
/// that many bytes of JSON (`{name: {dtype, shape, data_offsets}, "__metadata__": ..}`); the
/// offsets count from the end of the header and must lie inside the file.
/// The tensors of one safetensors file and their sizes in bytes, from its header alone.
pub(crate) fn tensor_sizes(file: &Path) -> Result<Vec<(String, usize)>> {
    Ok(header(file)?
        .into_iter()
        .map(|(name, e)| (name, e.len as usize))
        .collect())
}

/// A safetensors file's beginning for `tensors` (name, stored dtype, shape, bytes), their data
/// following in this order: the header's length, then the header padded with spaces so that
/// the data starts 8-byte aligned, as the format's own writer pads it.
pub(crate) fn safetensors_header(tensors: &[(String, &str, Vec<usize>, u64)]) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut offset = 0;
    for (name, dtype, shape, len) in tensors {
        map.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut text = Value::Object(map).to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(text.as_bytes());
    bytes
}

/// The tensors of the safetensors files `sources` (no name in two of them) as one file `out`,
/// in name order, their bytes copied as stored, a block at a time: no tensor is held whole.
pub(crate) fn merge_files(sources: &[PathBuf], out: &Path) -> Result<()> {
    let mut entries = std::collections::BTreeMap::new();
    for file in sources {
        for (name, e) in header(file)? {
            if let Some(first) = entries.insert(name.clone(), e) {
                return Err(bad(
                    out,
                    format!(
                        "tensor {name} is in both {} and {}",
                        first.file.display(),
                        file.display()
                    ),
                ));
            }
        }
    }
    let listed: Vec<(String, &str, Vec<usize>, u64)> = entries
        .iter()
        .map(|(name, e)| (name.clone(), e.dtype.name(), e.shape.clone(), e.len))
        .collect();
    let mut w = std::io::BufWriter::new(File::create(out).map_err(|e| bad(out, e))?);
    let fail = |e: std::io::Error| bad(out, e);
    w.write_all(&safetensors_header(&listed)).map_err(fail)?;
    let mut block = vec![0u8; 1 << 20];
    for e in entries.values() {
        let mut f = File::open(&e.file).map_err(|err| bad(&e.file, err))?;
        f.seek(SeekFrom::Start(e.start))
            .map_err(|err| bad(&e.file, err))?;
        let mut left = e.len as usize;
        while left > 0 {
            let n = left.min(block.len());
            f.read_exact(&mut block[..n])
                .map_err(|err| bad(&e.file, err))?;
            w.write_all(&block[..n]).map_err(fail)?;
            left -= n;
        }
    }
    w.flush().map_err(fail)
}

fn header(file: &Path) -> Result<Vec<(String, Entry)>> {
    let mut f = File::open(file).map_err(|e| bad(file, e))?;
    let file_len = f.metadata().map_err(|e| bad(file, e))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| bad(file, format!("too short for a safetensors header: {e}")))?;
    let n = u64::from_le_bytes(len);
    if n > file_len.saturating_sub(8) {
        return Err(bad(
            file,
            format!("its header claims {n} bytes, the file has {file_len}"),
        ));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(|e| bad(file, e))?;
    let value: Value =
        serde_json::from_slice(&text).map_err(|e| bad(file, format!("header is not JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad(file, "header is not a JSON object"))?;
    let data_start = 8 + n;
    let mut out = Vec::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let what = |msg: &str| bad(file, format!("tensor {name}: {msg}"));
        let dtype_name = info.get("dtype").and_then(Value::as_str).unwrap_or("?");
        let dtype = StoredDType::parse(dtype_name).ok_or_else(|| {
            what(&format!(
                "dtype {dtype_name} is not supported (F32, F16, BF16)"
            ))
        })?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| what("no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| what("shape is not a list of sizes"))?;
        let offsets = info
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| what("data_offsets is not [begin, end]"))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
            .ok_or_else(|| what("the shape's size overflows"))?;
        let (begin, end) = offsets;
        if end < begin || end - begin != numel.saturating_mul(dtype.size()) {
            return Err(what(&format!(
                "data_offsets [{begin}, {end}] do not hold {shape:?} of {dtype_name}"
            )));
        }
        if data_start + end > file_len {
            return Err(what(&format!(
                "its bytes end at {}, past the file's {file_len} (truncated?)",
                data_start + end
            )));
        }
        out.push((
            name.clone(),
            Entry {
                file: file.to_path_buf(),
                dtype,
                shape,
                start: data_start + begin,
                len: end - begin,
            },
        ));
    }
    // Two tensors on the same bytes: a writer's bug or a crafted file; either way not data.
    let mut by_start: Vec<&(String, Entry)> = out.iter().filter(|(_, e)| e.len > 0).collect();
    by_start.sort_by_key(|(_, e)| e.start);
    for pair in by_start.windows(2) {
        let ((a, ea), (b, eb)) = (pair[0], pair[1]);
        if eb.start < ea.start + ea.len {
            return Err(bad(
                file,
                format!("tensors {a} and {b} overlap (their byte ranges share bytes)"),
            ));
        }
    }
    Ok(out)
}
