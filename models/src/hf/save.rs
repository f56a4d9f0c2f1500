//! Writing a model back as a Hugging Face folder that transformers' `from_pretrained` loads:
//! `config.json` with transformers' keys, the tensors under their transformers names (a tied
//! head written once, as the table; GPT-2's Conv1D weights as `[in, out]`), in the dtype asked
//! for, in one `model.safetensors` or, past a shard size, in shards with
//! `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::Path;

use std::io::Write;

use serde_json::{json, Value};
use wgpipe_autograd::Param;
use wgpipe_tensor::{DType, Error, Result};

use crate::layers::RopeScaling;
use crate::models::{Gpt2, Gpt2Config, HfNames, Llama, LlamaConfig};

/// How [`save_hf`] writes the tensors.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaveOptions {
    /// The dtype of the stored tensors (f32, or f16/bf16 rounded to nearest even).
    pub dtype: DType,
    /// Shards of at most this many bytes (a tensor larger than it gets a shard of its own);
    /// `None`: one file.
    pub max_shard_bytes: Option<usize>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            dtype: DType::F32,
            max_shard_bytes: None,
        }
    }
}

fn io(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "save_hf",
        msg: format!("{}: {e}", path.display()),
    }
}

/// A model written back as a Hugging Face folder: its `config.json`, and the form its names
/// take there.
pub trait HfFolder: HfNames {
    /// The model as it is saved (GPT-2 as `GPT2LMHeadModel`, its names under `transformer.`).
    fn as_saved(&self) -> Self;
    /// `config.json` as transformers writes it, for tensors stored as `dtype`.
    fn config_json(&self, dtype: DType) -> Value;
    /// Whether its library reads one `model.safetensors` only (timm does; transformers reads
    /// shards and their index too), so that a folder written shard by shard is completed by
    /// [`write_single`] rather than [`write_index`].
    fn single_file(&self) -> bool {
        false
    }
}

impl HfFolder for Llama {
    fn as_saved(&self) -> Self {
        self.clone()
    }
    fn config_json(&self, dtype: DType) -> Value {
        llama_config_json(&self.config, dtype)
    }
}

impl HfFolder for Gpt2 {
    fn as_saved(&self) -> Self {
        Gpt2 {
            prefix: "transformer.".into(),
            ..self.clone()
        }
    }
    fn config_json(&self, dtype: DType) -> Value {
        gpt2_config_json(&self.config, dtype)
    }
}

/// Writes `params` (named `{layer}.{name}`, as a layer sequence or a pipeline names them) of
/// `model` into folder `dir` (made if absent): one file, or shards with an index past
/// `options.max_shard_bytes`, then `config.json`.
pub fn save_hf<M: HfFolder>(
    dir: &Path,
    model: &M,
    params: &[(String, Param)],
    options: SaveOptions,
) -> Result<()> {
    let model = model.as_saved();
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let tensors = by_key(dir, &model, params, options.dtype)?;
    let shards = split(&tensors, options.max_shard_bytes);
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, names) in shards.iter().enumerate() {
        let file = if count == 1 {
            "model.safetensors".to_string()
        } else {
            shard_file(i, count)
        };
        write_file(&dir.join(&file), names, &tensors, options.dtype)?;
        for n in names {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
    }
    if count > 1 {
        let total: usize = tensors.values().map(|t| t.bytes).sum();
        write_index_json(dir, weight_map, total)?;
    }
    write_json(&dir.join("config.json"), &model.config_json(options.dtype))
}

/// The file name of shard `shard` (from 0) of `shards`, as transformers names them
/// (`model-00001-of-00004.safetensors`).
pub fn shard_file(shard: usize, shards: usize) -> String {
    format!("model-{:05}-of-{shards:05}.safetensors", shard + 1)
}

/// Writes shard `shard` of `shards` of a folder that several writers fill, each its own part
/// of the model (a pipeline's device, a rank under MPI): `params`, but for tied copies, whose
/// table another shard writes. Once every shard is written, [`write_index`] completes the
/// folder; until then it does not load.
pub fn save_shard<M: HfFolder>(
    dir: &Path,
    model: &M,
    params: &[(String, Param)],
    shard: usize,
    shards: usize,
    dtype: DType,
) -> Result<()> {
    let model = model.as_saved();
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let own: Vec<(String, Param)> = params
        .iter()
        .filter(|(name, _)| match split_name(dir, name) {
            Ok((layer, rest)) => !model.is_tied_copy(layer, rest),
            Err(_) => true, // refused with its name by by_key
        })
        .cloned()
        .collect();
    let tensors = by_key(dir, &model, &own, dtype)?;
    let names: Vec<String> = tensors.keys().cloned().collect();
    write_file(
        &dir.join(shard_file(shard, shards)),
        &names,
        &tensors,
        dtype,
    )
}

/// Completes a folder whose `shards` shards [`save_shard`] wrote: the index, built from the
/// shards' own headers (every tensor in exactly one shard), and `config.json`.
pub fn write_index<M: HfFolder>(dir: &Path, model: &M, shards: usize, dtype: DType) -> Result<()> {
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for shard in 0..shards {
        let file = shard_file(shard, shards);
        for (name, bytes) in super::checkpoint::tensor_sizes(&dir.join(&file))? {
            if let Some(first) = weight_map.insert(name.clone(), Value::String(file.clone())) {
                return Err(io(
                    dir,
                    format!("tensor {name} is in both {first} and {file}"),
                ));
            }
            total += bytes;
        }
    }
    write_index_json(dir, weight_map, total)?;
    write_json(
        &dir.join("config.json"),
        &model.as_saved().config_json(dtype),
    )
}

/// Completes a folder whose `shards` shards [`save_shard`] wrote as one `model.safetensors`
/// (the shards merged a block at a time, then removed) and `config.json`: for a library that
/// reads one file (timm's `local-dir:`), where [`write_index`] leaves the shards and an index.
pub fn write_single<M: HfFolder>(dir: &Path, model: &M, shards: usize, dtype: DType) -> Result<()> {
    let files: Vec<std::path::PathBuf> = (0..shards)
        .map(|s| dir.join(shard_file(s, shards)))
        .collect();
    super::checkpoint::merge_files(&files, &dir.join("model.safetensors"))?;
    for f in &files {
        std::fs::remove_file(f).map_err(|e| io(f, e))?;
    }
    write_json(
        &dir.join("config.json"),
        &model.as_saved().config_json(dtype),
    )
}

fn write_index_json(
    dir: &Path,
    weight_map: serde_json::Map<String, Value>,
    total: usize,
) -> Result<()> {
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_json(&dir.join("model.safetensors.index.json"), &index)
}

/// `{layer}.{name}` split.
fn split_name<'a>(dir: &Path, name: &'a str) -> Result<(usize, &'a str)> {
    name.split_once('.')
        .and_then(|(l, r)| Some((l.parse::<usize>().ok()?, r)))
        .ok_or_else(|| {
            io(
                dir,
                format!("parameter {name} is not named {{layer}}.{{name}}"),
            )
        })
}

/// A tensor to write: the parameter, whether the checkpoint stores it transposed, its shape
/// as stored and its size in bytes once encoded.
struct ToWrite {
    param: Param,
    transposed: bool,
    shape: Vec<usize>,
    bytes: usize,
}

/// The tensors of `params` by `model`'s checkpoint keys, in key order (a key met twice, a
/// tied head, is kept once); nothing is read or encoded yet.
fn by_key<M: HfNames>(
    dir: &Path,
    model: &M,
    params: &[(String, Param)],
    dtype: DType,
) -> Result<BTreeMap<String, ToWrite>> {
    let mut tensors = BTreeMap::new();
    for (name, p) in params {
        let (layer, rest) = split_name(dir, name)?;
        let (key, transposed) = model.checkpoint_key(layer, rest);
        let mut shape = p.shape();
        if transposed {
            shape.reverse();
        }
        let bytes = shape.iter().product::<usize>() * dtype.size_of();
        tensors.entry(key).or_insert(ToWrite {
            param: p.clone(),
            transposed,
            shape,
            bytes,
        });
    }
    Ok(tensors)
}

/// Values read and encoded at a time by [`write_file`] (4 MiB of f32).
const BLOCK_VALUES: usize = 1 << 20;

/// One safetensors file of the tensors `names`, streamed: the header first (from the shapes),
/// then each tensor read, encoded and written in turn, so that writing a stage's shard holds
/// one tensor's bytes at a time, not the shard's.
fn write_file(
    path: &Path,
    names: &[String],
    tensors: &BTreeMap<String, ToWrite>,
    dtype: DType,
) -> Result<()> {
    let stored = match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
    };
    let listed: Vec<(String, &str, Vec<usize>, u64)> = names
        .iter()
        .map(|n| {
            (
                n.clone(),
                stored,
                tensors[n].shape.clone(),
                tensors[n].bytes as u64,
            )
        })
        .collect();
    let file = std::fs::File::create(path).map_err(|e| io(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    let write = |out: &mut std::io::BufWriter<std::fs::File>, bytes: &[u8]| {
        out.write_all(bytes).map_err(|e| io(path, e))
    };
    write(&mut out, &super::checkpoint::safetensors_header(&listed))?;
    for n in names {
        let t = &tensors[n];
        let mut value = t.param.value();
        if t.transposed {
            value = value.t()?.contiguous()?;
        }
        // Read and encoded a block of rows at a time: a 262 MB table would otherwise be
        // copied out whole, then encoded whole, beside itself.
        let rows = value.shape().first().copied().unwrap_or(1);
        let per_row = value.numel() / rows.max(1);
        let block = (BLOCK_VALUES / per_row.max(1)).max(1);
        for start in (0..rows.max(1)).step_by(block) {
            let part = if value.shape().is_empty() {
                value.clone()
            } else {
                value.narrow(0, start, block.min(rows - start))?
            };
            write(&mut out, &encode(&part.to_vec()?, dtype))?;
        }
    }
    out.flush().map_err(|e| io(path, e))
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| io(path, e))?;
    std::fs::write(path, text + "\n").map_err(|e| io(path, e))
}

/// The values in `dtype`, little-endian.
fn encode(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        DType::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

/// The tensor names in shards of at most `max` bytes each, in name order.
fn split(tensors: &BTreeMap<String, ToWrite>, max: Option<usize>) -> Vec<Vec<String>> {
    let Some(max) = max else {
        return vec![tensors.keys().cloned().collect()];
    };
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut size = 0;
    for (name, t) in tensors {
        if shards.is_empty() || (size + t.bytes > max && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("a shard").push(name.clone());
        size += t.bytes;
    }
    shards
}

/// `config.json` as transformers writes a LlamaConfig (the rotary scaling in the
/// `rope_theta` + `rope_scaling` form, which transformers 4 reads and 5 converts).
fn llama_config_json(c: &LlamaConfig, dtype: DType) -> Value {
    let l = &c.layer;
    let rope_scaling = match l.rope_scaling {
        RopeScaling::Default => Value::Null,
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings,
        }),
    };
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": l.hidden_size,
        "intermediate_size": l.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": l.num_attention_heads,
        "num_key_value_heads": l.num_key_value_heads,
        "head_dim": l.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": l.rms_norm_eps,
        "rope_theta": l.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": l.attention_bias,
        "mlp_bias": l.mlp_bias,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": torch_dtype(dtype),
    })
}

/// `config.json` as transformers writes a GPT2Config.
fn gpt2_config_json(c: &Gpt2Config, dtype: DType) -> Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.n_positions,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": Value::Null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": c.layer_norm_epsilon,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
        "scale_attn_weights": true,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": torch_dtype(dtype),
    })
}

fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
    }
}
