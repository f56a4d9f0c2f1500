//! Reading a safetensors file: parsing and validating it, widening F16/BF16 to f32, and the
//! whole-file and one-tensor-at-a-time readers.

use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use wgpipe_tensor::{Device, Result, Tensor};

use super::err;

/// A parsed file: its bytes and header, validated by the safetensors parser.
pub(super) struct Parsed {
    pub(super) path: PathBuf,
    bytes: Vec<u8>,
    header_len: usize,
    meta: Metadata,
}

pub(super) fn parse(op: &'static str, path: &Path) -> Result<Parsed> {
    let bytes = fs::read(path).map_err(|e| err(op, path, format!("cannot read the file: {e}")))?;
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        err(
            op,
            path,
            format!("not a valid safetensors file (truncated or corrupted?): {e}"),
        )
    })?;
    Ok(Parsed {
        path: path.to_path_buf(),
        bytes,
        header_len,
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
    /// The values of tensor `name`, widened to f32.
    pub(super) fn values(&self, op: &'static str, name: &str) -> Result<Vec<f32>> {
        let info = self.info(name);
        // Offsets were validated against the file length by `read_metadata`.
        let start = 8 + self.header_len;
        let raw = &self.bytes[start + info.data_offsets.0..start + info.data_offsets.1];
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

/// Only the metadata of a safetensors file (reads the whole file to validate it).
pub fn load_metadata(path: impl AsRef<Path>) -> Result<Vec<(String, String)>> {
    Ok(parse("load_metadata", path.as_ref())?.metadata())
}
