//! GPT-2 as transformers writes it (`GPT2LMHeadModel`), as a layer sequence
//! `[TokenPositionEmbedding, TransformerBlock x n_layer, LayerNorm, Linear head]`: learned
//! positions, pre-LN blocks with biases, one packed QKV projection, the tanh GELU, a head tied
//! to the token table unless the config says otherwise. Its checkpoint names
//! (`transformer.wte`, `transformer.h.{i}.attn.c_attn`, ..., `lm_head`) and its Conv1D weights,
//! stored `[in, out]`, come from [`HfNames`](super::HfNames).

use std::ops::Range;

use serde_json::{Map, Value};
use wgpipe_autograd::Module;
use wgpipe_tensor::{Device, Error, Result};

use crate::init::sub_seed;
use crate::layers::{LayerNorm, Linear, TokenPositionEmbedding, TransformerBlock};

/// The tie group of GPT-2's token table and its head.
pub const GPT2_EMBEDDING_TIE: &str = "transformer.wte";

/// The keys of GPT-2's `config.json` this model uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub layer_norm_epsilon: f32,
    /// `resid_pdrop`, `embd_pdrop` and `attn_pdrop`, which must be equal (one dropout rate).
    pub dropout: f32,
    pub tie_word_embeddings: bool,
}

fn bad(key: &str, msg: impl std::fmt::Display) -> Error {
    Error::Invalid {
        op: "Gpt2Config",
        msg: format!("config.json: {key} {msg}"),
    }
}

fn get<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn size(obj: &Map<String, Value>, key: &str, default: usize) -> Result<usize> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| bad(key, format!("must be a positive integer, got {v}"))),
    }
}

fn number(obj: &Map<String, Value>, key: &str, default: f64) -> Result<f64> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(key, format!("must be a number, got {v}"))),
    }
}

impl Gpt2Config {
    /// Reads `config.json`'s text, transformers' defaults for absent keys; what this model
    /// does not implement (another activation, layer-wise attention scaling, an MLP width
    /// other than 4 x n_embd, different dropout rates) is an error naming the key.
    pub fn from_json(text: &str) -> Result<Gpt2Config> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| bad("", format!("is not JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| bad("", "must be a JSON object"))?;
        let model_type = get(obj, "model_type").and_then(Value::as_str);
        if model_type != Some("gpt2") {
            return Err(bad(
                "model_type",
                format!("must be \"gpt2\", got {model_type:?}"),
            ));
        }
        let n_embd = size(obj, "n_embd", 768)?;
        let n_head = size(obj, "n_head", 12)?;
        if !n_embd.is_multiple_of(n_head) {
            return Err(bad(
                "n_head",
                format!("= {n_head} does not divide n_embd = {n_embd}"),
            ));
        }
        if let Some(inner) = get(obj, "n_inner") {
            if inner.as_u64() != Some(4 * n_embd as u64) {
                return Err(bad(
                    "n_inner",
                    format!("= {inner} is not supported (4 x n_embd or null)"),
                ));
            }
        }
        let act = get(obj, "activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(bad(
                "activation_function",
                format!("{act:?} is not supported (gelu_new)"),
            ));
        }
        for (key, supported) in [
            ("scale_attn_weights", true),
            ("scale_attn_by_inverse_layer_idx", false),
            ("reorder_and_upcast_attn", false),
            ("add_cross_attention", false),
        ] {
            if let Some(v) = get(obj, key) {
                if v.as_bool() != Some(supported) {
                    return Err(bad(key, format!("= {v} is not supported ({supported})")));
                }
            }
        }
        let rates: Vec<f64> = ["resid_pdrop", "embd_pdrop", "attn_pdrop"]
            .iter()
            .map(|k| number(obj, k, 0.1))
            .collect::<Result<_>>()?;
        if rates
            .iter()
            .any(|&r| r != rates[0] || !(0.0..1.0).contains(&r))
        {
            return Err(bad(
                "resid_pdrop, embd_pdrop, attn_pdrop",
                format!("= {rates:?} must be one rate in [0, 1)"),
            ));
        }
        let eps = number(obj, "layer_norm_epsilon", 1e-5)?;
        if eps < 0.0 {
            return Err(bad(
                "layer_norm_epsilon",
                format!("= {eps} must not be negative"),
            ));
        }
        let tie = match get(obj, "tie_word_embeddings") {
            None => true,
            Some(v) => v.as_bool().ok_or_else(|| {
                bad(
                    "tie_word_embeddings",
                    format!("must be true or false, got {v}"),
                )
            })?,
        };
        Ok(Gpt2Config {
            vocab_size: size(obj, "vocab_size", 50257)?,
            n_positions: size(obj, "n_positions", 1024)?,
            n_embd,
            n_layer: size(obj, "n_layer", 12)?,
            n_head,
            layer_norm_epsilon: eps as f32,
            dropout: rates[0] as f32,
            tie_word_embeddings: tie,
        })
    }
}

/// A GPT-2 model; `prefix` is what its checkpoint puts before the body's names
/// (`"transformer."` for `GPT2LMHeadModel`, `""` for a bare `GPT2Model`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2 {
    pub config: Gpt2Config,
    pub prefix: String,
}

impl Gpt2 {
    /// `n_layer + 3` elements.
    pub fn num_layers(&self) -> usize {
        self.config.n_layer + 3
    }

    pub fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        let n = self.num_layers();
        super::check_range("Gpt2", &range, n)?;
        let c = &self.config;
        let embedding = || -> Result<TokenPositionEmbedding> {
            let e = TokenPositionEmbedding::new(
                c.vocab_size,
                c.n_positions,
                c.n_embd,
                c.dropout,
                sub_seed(seed, 0),
                dev,
            )?;
            if c.tie_word_embeddings {
                e.tok.weight.set_tie_group(GPT2_EMBEDDING_TIE);
            }
            Ok(e)
        };
        let mut layers: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        for i in range {
            let s = sub_seed(seed, i as u64);
            let layer: Box<dyn Module> = if i == 0 {
                Box::new(embedding()?)
            } else if i < n - 2 {
                let mut block = TransformerBlock::new(c.n_embd, c.n_head, c.dropout, s, dev)?
                    .with_packed_qkv()?;
                block.ln1 = LayerNorm::with_eps(c.n_embd, c.layer_norm_epsilon, dev)?;
                block.ln2 = LayerNorm::with_eps(c.n_embd, c.layer_norm_epsilon, dev)?;
                Box::new(block)
            } else if i == n - 2 {
                Box::new(LayerNorm::with_eps(c.n_embd, c.layer_norm_epsilon, dev)?)
            } else if c.tie_word_embeddings {
                let w = embedding()?
                    .tok
                    .weight
                    .tied_copy("weight", GPT2_EMBEDDING_TIE)?;
                Box::new(Linear::from_params(w, None)?)
            } else {
                Box::new(Linear::with_bias(c.n_embd, c.vocab_size, false, s, dev)?)
            };
            layers.push(layer);
        }
        Ok(layers)
    }
}

/// This crate's names inside a block against GPT-2's, and whether GPT-2 stores the matrix
/// transposed (its `Conv1D` keeps weights `[in, out]`).
const BLOCK_NAMES: [(&str, &str, bool); 12] = [
    ("ln1.weight", "ln_1.weight", false),
    ("ln1.bias", "ln_1.bias", false),
    ("attn.qkv.weight", "attn.c_attn.weight", true),
    ("attn.qkv.bias", "attn.c_attn.bias", false),
    ("attn.out.weight", "attn.c_proj.weight", true),
    ("attn.out.bias", "attn.c_proj.bias", false),
    ("ln2.weight", "ln_2.weight", false),
    ("ln2.bias", "ln_2.bias", false),
    ("mlp.fc1.weight", "mlp.c_fc.weight", true),
    ("mlp.fc1.bias", "mlp.c_fc.bias", false),
    ("mlp.fc2.weight", "mlp.c_proj.weight", true),
    ("mlp.fc2.bias", "mlp.c_proj.bias", false),
];

impl super::HfNames for Gpt2 {
    fn checkpoint_key(&self, layer: usize, name: &str) -> (String, bool) {
        let (n, p) = (self.num_layers(), &self.prefix);
        let head = layer == n - 1;
        if layer == 0 || (head && self.config.tie_word_embeddings) {
            let table = match name {
                "tok.weight" | "weight" => "wte.weight",
                "pos.weight" => "wpe.weight",
                other => other,
            };
            return (format!("{p}{table}"), false);
        }
        if head {
            return (format!("lm_head.{name}"), false);
        }
        if layer == n - 2 {
            return (format!("{p}ln_f.{name}"), false);
        }
        match BLOCK_NAMES.iter().find(|(ours, _, _)| *ours == name) {
            Some((_, theirs, transposed)) => (format!("{p}h.{}.{theirs}", layer - 1), *transposed),
            None => (format!("{p}h.{}.{name}", layer - 1), false),
        }
    }

    fn is_tied_copy(&self, layer: usize, _name: &str) -> bool {
        self.config.tie_word_embeddings && layer == self.num_layers() - 1
    }

    /// The causal-mask buffers older checkpoints hold (`attn.bias`, `attn.masked_bias`).
    fn ignorable(&self, key: &str) -> bool {
        key.ends_with(".attn.bias") || key.ends_with(".attn.masked_bias")
    }
}

impl super::BuildsRanges for Gpt2 {
    fn num_layers(&self) -> usize {
        Gpt2::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        Gpt2::build_range(self, seed, range, dev)
    }
}
