//! Writing a model back as a Hugging Face folder that transformers' `from_pretrained` loads:
//! `config.json` with transformers' keys, the tensors under their transformers names (a tied
//! head written once, as the table; GPT-2's Conv1D weights as `[in, out]`), in the dtype asked
//! for, in one `model.safetensors` or, past a shard size, in shards with
//! `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use wgpipe_autograd::Param;
use wgpipe_tensor::{DType, Error, Result};

use crate::layers::RopeScaling;
use crate::models::{Gpt2, Gpt2Config, HfNames, Llama, LlamaConfig};

/// How [`save_llama`] writes the tensors.
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
        op: "save_llama",
        msg: format!("{}: {e}", path.display()),
    }
}

/// Writes `params` (named `{layer}.{name}`, as a layer sequence or a pipeline names them) of
/// `llama` into folder `dir` (made if absent).
pub fn save_llama(
    dir: &Path,
    llama: &Llama,
    params: &[(String, Param)],
    options: SaveOptions,
) -> Result<()> {
    save(
        dir,
        llama,
        params,
        options,
        &llama_config_json(&llama.config, options.dtype),
    )
}

/// [`save_llama`] for GPT-2 (written as `GPT2LMHeadModel`, its names under `transformer.`).
pub fn save_gpt2(
    dir: &Path,
    gpt2: &Gpt2,
    params: &[(String, Param)],
    options: SaveOptions,
) -> Result<()> {
    let as_lm_head_model = Gpt2 {
        prefix: "transformer.".into(),
        ..gpt2.clone()
    };
    save(
        dir,
        &as_lm_head_model,
        params,
        options,
        &gpt2_config_json(&gpt2.config, options.dtype),
    )
}

/// The tensors of `params` under `model`'s checkpoint keys, then `config`.
fn save<M: HfNames>(
    dir: &Path,
    model: &M,
    params: &[(String, Param)],
    options: SaveOptions,
    config: &Value,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    // By checkpoint key: a tied head is the table again, written once.
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (name, p) in params {
        let (layer, rest) = name
            .split_once('.')
            .and_then(|(l, r)| Some((l.parse::<usize>().ok()?, r)))
            .ok_or_else(|| {
                io(
                    dir,
                    format!("parameter {name} is not named {{layer}}.{{name}}"),
                )
            })?;
        let (key, transposed) = model.checkpoint_key(layer, rest);
        if tensors.contains_key(&key) {
            continue;
        }
        let mut value = p.value();
        if transposed {
            value = value.t()?.contiguous()?;
        }
        let values = value.to_vec()?;
        tensors.insert(
            key,
            (value.shape().to_vec(), encode(&values, options.dtype)),
        );
    }
    let dtype = match options.dtype {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    };
    let shards = split(&tensors, options.max_shard_bytes);
    let count = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, names) in shards.iter().enumerate() {
        let file = if count == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let views = names
            .iter()
            .map(|n| {
                let (shape, bytes) = &tensors[n];
                TensorView::new(dtype, shape.clone(), bytes)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| io(dir, format!("{n}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join(&file);
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|e| io(&path, e))?;
        for n in names {
            weight_map.insert(n.clone(), Value::String(file.clone()));
        }
    }
    if count > 1 {
        let total: usize = tensors.values().map(|(_, b)| b.len()).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&dir.join("model.safetensors.index.json"), &index)?;
    }
    write_json(&dir.join("config.json"), config)
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
fn split(
    tensors: &BTreeMap<String, (Vec<usize>, Vec<u8>)>,
    max: Option<usize>,
) -> Vec<Vec<String>> {
    let Some(max) = max else {
        return vec![tensors.keys().cloned().collect()];
    };
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut size = 0;
    for (name, (_, bytes)) in tensors {
        if shards.is_empty() || (size + bytes.len() > max && size > 0) {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("a shard").push(name.clone());
        size += bytes.len();
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
