//! A Llama's `config.json` as transformers reads it (`LlamaConfig`): the keys this model uses,
//! each absent key given transformers' default, the rotary scaling from `rope_parameters`
//! (transformers 5) or the older `rope_theta` and `rope_scaling` keys, and a clear error naming
//! any key whose value is missing, of the wrong type, out of range or not supported.

use serde_json::{Map, Value};
use wgpipe_tensor::{Error, Result};

use super::llama::LlamaLayerConfig;
use crate::layers::{GqaShape, RopeScaling};

/// The whole model's configuration: its layers' and the sizes around them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub max_position_embeddings: usize,
    /// The head's weight is the token embedding table (no `lm_head.weight` in the checkpoint).
    pub tie_word_embeddings: bool,
    pub layer: LlamaLayerConfig,
}

fn bad(key: &str, msg: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "LlamaConfig",
        msg: format!("config.json: {key} {msg}"),
    }
}

/// `key` as a positive integer, or `default` when absent or null.
fn size(obj: &Map<String, Value>, key: &str, default: Option<usize>) -> Result<usize> {
    match obj.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| bad(key, "is missing")),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => {
                usize::try_from(n).map_err(|_| bad(key, format!("= {n} is too large")))
            }
            _ => Err(bad(key, format!("must be a positive integer, got {v}"))),
        },
    }
}

/// `key` as a finite number, or `default` when absent or null.
fn number(obj: &Map<String, Value>, key: &str, default: Option<f64>) -> Result<f64> {
    match obj.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| bad(key, "is missing")),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(key, format!("must be a number, got {v}"))),
    }
}

fn flag(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(key, format!("must be true or false, got {v}"))),
    }
}

impl LlamaConfig {
    /// Reads `config.json`'s text.
    pub fn from_json(text: &str) -> Result<LlamaConfig> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| bad("", format!("is not JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| bad("", "must be a JSON object"))?;
        match obj.get("model_type").and_then(Value::as_str) {
            Some("llama") => {}
            other => {
                return Err(bad(
                    "model_type",
                    format!(
                        "must be \"llama\", got {}",
                        other.map_or("none".into(), |s| format!("{s:?}"))
                    ),
                ))
            }
        }
        let hidden = size(obj, "hidden_size", Some(4096))?;
        let heads = size(obj, "num_attention_heads", Some(32))?;
        let kv_heads = size(obj, "num_key_value_heads", Some(heads))?;
        if !heads.is_multiple_of(kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                format!("= {kv_heads} does not divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = size(obj, "head_dim", Some(hidden / heads.max(1)))?;
        if !head_dim.is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                format!("= {head_dim} must be even for rotary positions"),
            ));
        }
        if obj
            .get("hidden_act")
            .and_then(Value::as_str)
            .is_some_and(|a| a != "silu")
        {
            return Err(bad(
                "hidden_act",
                format!("{} is not supported (silu)", obj["hidden_act"]),
            ));
        }
        let eps = number(obj, "rms_norm_eps", Some(1e-6))?;
        if eps < 0.0 {
            return Err(bad("rms_norm_eps", format!("= {eps} must not be negative")));
        }
        let (rope_theta, rope_scaling) = rope(obj)?;
        Ok(LlamaConfig {
            vocab_size: size(obj, "vocab_size", Some(32000))?,
            num_hidden_layers: size(obj, "num_hidden_layers", Some(32))?,
            max_position_embeddings: size(obj, "max_position_embeddings", Some(2048))?,
            tie_word_embeddings: flag(obj, "tie_word_embeddings", false)?,
            layer: LlamaLayerConfig {
                hidden_size: hidden,
                intermediate_size: size(obj, "intermediate_size", Some(11008))?,
                num_attention_heads: heads,
                num_key_value_heads: kv_heads,
                head_dim,
                rms_norm_eps: eps as f32,
                rope_theta,
                rope_scaling,
                attention_bias: flag(obj, "attention_bias", false)?,
                mlp_bias: flag(obj, "mlp_bias", false)?,
            },
        })
    }

    /// Reads `path` (a `config.json`).
    pub fn from_file(path: &std::path::Path) -> Result<LlamaConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Invalid {
            op: "LlamaConfig",
            msg: format!("{}: {e}", path.display()),
        })?;
        LlamaConfig::from_json(&text).map_err(|e| match e {
            Error::Invalid { op, msg } => Error::Invalid {
                op,
                msg: format!("{}: {msg}", path.display()),
            },
            e => e,
        })
    }

    pub fn attention_shape(&self) -> GqaShape {
        self.layer.attention_shape()
    }
}

/// `rope_theta` and the scaling, from `rope_parameters` or else `rope_theta` + `rope_scaling`.
fn rope(obj: &Map<String, Value>) -> Result<(f32, RopeScaling)> {
    let (key, params) = match (obj.get("rope_parameters"), obj.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => ("rope_parameters", Some(p)),
        (_, Some(Value::Object(p))) => ("rope_scaling", Some(p)),
        (_, Some(Value::Null) | None) => ("rope_scaling", None),
        (_, Some(v)) => return Err(bad("rope_scaling", format!("must be an object, got {v}"))),
    };
    let theta_default = number(obj, "rope_theta", Some(10000.0))?;
    let theta = match params {
        Some(p) => number(p, "rope_theta", Some(theta_default))?,
        None => theta_default,
    };
    if theta <= 1.0 {
        return Err(bad("rope_theta", format!("= {theta} must be > 1")));
    }
    let Some(p) = params else {
        return Ok((theta as f32, RopeScaling::Default));
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let field = |k: &str| {
        number(p, k, None).map_err(|_| bad(&format!("{key}.{k}"), "is missing or not a number"))
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: field("factor")? as f32,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: field("factor")? as f32,
            low_freq_factor: field("low_freq_factor")? as f32,
            high_freq_factor: field("high_freq_factor")? as f32,
            original_max_position_embeddings: size(p, "original_max_position_embeddings", None)
                .map_err(|e| bad(&format!("{key}.original_max_position_embeddings"), e))?,
        },
        other => {
            return Err(bad(
                &format!("{key}.rope_type"),
                format!("{other:?} is not supported (default, linear, llama3)"),
            ))
        }
    };
    Ok((theta as f32, scaling))
}
