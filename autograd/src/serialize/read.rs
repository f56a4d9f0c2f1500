//! Reading a safetensors file: parsing and validating its header, reading one tensor at a time
//! from its offset (never the whole file: a rank loading its stages from a checkpoint of the
//! whole model holds only what it asks for), and widening F16/BF16 to f32.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use wgpipe_tensor::{Device, Result, Tensor};

use super::err;

/// The largest header read (safetensors' own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// A parsed file: its header, validated as the safetensors parser validates it (offsets
/// contiguous, each tensor's bytes matching its dtype and shape, the file as long as the header
/// says), and the open file its tensors are read from.
pub(super) struct Parsed {
    pub(super) path: PathBuf,
    file: Mutex<fs::File>,
    /// Where the tensors' bytes start in the file (after the length and the header).
    data_start: u64,
    meta: Metadata,
}

pub(super) fn parse(op: &'static str, path: &Path) -> Result<Parsed> {
    let cannot = |e: std::io::Error| err(op, path, format!("cannot read the file: {e}"));
    let mut file = fs::File::open(path).map_err(cannot)?;
    let len = file.metadata().map_err(cannot)?.len();
    let bad = |why: String| {
        err(
            op,
            path,
            format!("not a valid safetensors file (truncated or corrupted?): {why}"),
        )
    };
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad(format!("{len} bytes, shorter than a header")))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > MAX_HEADER {
        return Err(bad(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(cannot)?;
    // Deserializing validates the offsets, dtypes and shapes against each other.
    let meta: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("its header: {e}")))?;
    let data = len - 8 - n;
    if meta.data_len() as u64 != data {
        return Err(bad(format!(
            "the header describes {} bytes of tensors, the file holds {data}",
            meta.data_len()
        )));
    }
    Ok(Parsed {
        path: path.to_path_buf(),
        file: Mutex::new(file),
        data_start: 8 + n,
        meta,
    })
}

impl Parsed {
    /// Tensor names in file order.
    pub(super) fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }
    pub(super) fn info(&self, name: &str) -> &TensorInfo {
        self.meta.info(name).expect("name comes from the header")
    }
    pub(super) fn metadata(&self) -> Vec<(String, String)> {
        let mut m: Vec<(String, String)> = self
            .meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        m.sort();
        m
    }
    /// The values of tensor `name`, widened to f32, read from the file.
    pub(super) fn values(&self, op: &'static str, name: &str) -> Result<Vec<f32>> {
        let info = self.info(name);
        let (begin, end) = info.data_offsets;
        let mut raw = vec![0u8; end - begin];
        {
            let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
            f.seek(SeekFrom::Start(self.data_start + begin as u64))
                .and_then(|_| f.read_exact(&mut raw))
                .map_err(|e| err(op, &self.path, format!("reading tensor '{name}': {e}")))?;
        }
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

pub(super) fn loadable(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

pub(super) fn unsupported_dtype(name: &str, d: Dtype) -> String {
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

/// Only the metadata of a safetensors file (reads its header, and checks the file's length
/// against it).
pub fn load_metadata(path: impl AsRef<Path>) -> Result<Vec<(String, String)>> {
    Ok(parse("load_metadata", path.as_ref())?.metadata())
}
