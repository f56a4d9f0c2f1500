//! Llama as transformers writes it (`LlamaForCausalLM`), as a layer sequence
//! `[Embedding, LlamaDecoderLayer x n, RmsNorm, Linear head]`: input token ids `[B, T]`,
//! output logits `[B, T, vocab]`. The decoder layer is pre-norm residual blocks of RMSNorm,
//! grouped-query attention with rotary positions and the SwiGLU MLP. Parameters are named as
//! in a checkpoint, under the prefix [`Llama::checkpoint_prefix`] gives each layer:
//! `model.embed_tokens`, `model.layers.{i}` (`input_layernorm.weight`,
//! `self_attn.{q,k,v,o}_proj.weight`, `post_attention_layernorm.weight`,
//! `mlp.{gate,up,down}_proj.weight`), `model.norm`, `lm_head` (absent when tied).

use std::ops::Range;

use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_tensor::{Device, Error, Result};

use super::llama_config::LlamaConfig;
use crate::init::{normal, sub_seed};
use crate::layers::{
    Embedding, GqaAttention, GqaShape, Linear, RmsNorm, Rope, RopeScaling, SwiGluMlp,
};

/// The tie group of the token embedding table and the tied head's weight.
pub const LLAMA_EMBEDDING_TIE: &str = "model.embed_tokens";

/// transformers' `initializer_range`: projections and the embedding start as N(0, 0.02).
const INIT_STD: f32 = 0.02;

/// A Llama model description; its layers come from [`Llama::build`] (random, as
/// transformers initializes) or from a checkpoint folder (`load_llama` of the `hf` module).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama {
    pub config: LlamaConfig,
}

impl Llama {
    /// `num_hidden_layers + 3` elements: embedding, decoder layers, final norm, head.
    pub fn num_layers(&self) -> usize {
        self.config.num_hidden_layers + 3
    }

    /// The checkpoint name prefix of layer `i`'s parameters.
    pub fn checkpoint_prefix(&self, i: usize) -> String {
        let n = self.config.num_hidden_layers;
        match i {
            0 => "model.embed_tokens".into(),
            i if i <= n => format!("model.layers.{}", i - 1),
            i if i == n + 1 => "model.norm".into(),
            _ => "lm_head".into(),
        }
    }

    /// The checkpoint name of parameter `name` of layer `i` (for the tied head, the table it
    /// is a copy of).
    pub fn checkpoint_name(&self, i: usize, name: &str) -> String {
        if i == self.num_layers() - 1 && self.config.tie_word_embeddings {
            return format!("{}.{name}", self.checkpoint_prefix(0));
        }
        format!("{}.{name}", self.checkpoint_prefix(i))
    }

    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(seed, 0..self.num_layers(), dev)
    }

    /// Layers `range`, each from the seed and its index alone (a tied head built without the
    /// embedding makes the table to copy from the embedding's seed).
    pub fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        let n = self.num_layers();
        super::check_range("Llama", &range, n)?;
        let cfg = &self.config;
        let (h, v) = (cfg.layer.hidden_size, cfg.vocab_size);
        let embedding = || -> Result<Embedding> {
            let e =
                Embedding::from_tensor(normal(&[v, h], 0.0, INIT_STD, sub_seed(seed, 0), dev)?)?;
            if cfg.tie_word_embeddings {
                e.weight.set_tie_group(LLAMA_EMBEDDING_TIE);
            }
            Ok(e)
        };
        let mut layers: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        for i in range {
            let s = sub_seed(seed, i as u64);
            let layer: Box<dyn Module> = if i == 0 {
                Box::new(embedding()?)
            } else if i < n - 2 {
                Box::new(LlamaDecoderLayer::random(&cfg.layer, s, dev)?)
            } else if i == n - 2 {
                Box::new(RmsNorm::new(h, cfg.layer.rms_norm_eps, dev)?)
            } else if cfg.tie_word_embeddings {
                let w = embedding()?
                    .weight
                    .tied_copy("weight", LLAMA_EMBEDDING_TIE)?;
                Box::new(Linear::from_params(w, None)?)
            } else {
                Box::new(Linear::from_tensors(
                    normal(&[v, h], 0.0, INIT_STD, s, dev)?,
                    None,
                )?)
            };
            layers.push(layer);
        }
        Ok(layers)
    }
}

impl super::HfNames for Llama {
    fn checkpoint_key(&self, layer: usize, name: &str) -> (String, bool) {
        (self.checkpoint_name(layer, name), false)
    }
    fn is_tied_copy(&self, layer: usize, _name: &str) -> bool {
        self.config.tie_word_embeddings && layer == self.num_layers() - 1
    }
}

impl super::BuildsRanges for Llama {
    fn num_layers(&self) -> usize {
        Llama::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        Llama::build_range(self, seed, range, dev)
    }
}

/// The sizes and constants of a Llama's decoder layers (the keys of its `config.json` of the
/// same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlamaLayerConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` unless the config says otherwise.
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub attention_bias: bool,
    pub mlp_bias: bool,
}

impl LlamaLayerConfig {
    pub fn attention_shape(&self) -> GqaShape {
        GqaShape {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
        }
    }

    pub fn rope(&self) -> Result<Rope> {
        Rope::new(self.head_dim, self.rope_theta, self.rope_scaling)
    }
}

#[derive(Module)]
pub struct LlamaDecoderLayer {
    #[wgpipe(module)]
    pub input_layernorm: RmsNorm,
    #[wgpipe(module)]
    pub self_attn: GqaAttention,
    #[wgpipe(module)]
    pub post_attention_layernorm: RmsNorm,
    #[wgpipe(module)]
    pub mlp: SwiGluMlp,
}

impl LlamaDecoderLayer {
    /// Norm weights ones and projections with PyTorch's Linear initialization from `seed`.
    pub fn new(cfg: &LlamaLayerConfig, seed: u64, dev: &Device) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(LlamaDecoderLayer {
            input_layernorm: RmsNorm::new(h, cfg.rms_norm_eps, dev)?,
            self_attn: GqaAttention::new(
                cfg.attention_shape(),
                cfg.rope()?,
                cfg.attention_bias,
                sub_seed(seed, 0),
                dev,
            )?,
            post_attention_layernorm: RmsNorm::new(h, cfg.rms_norm_eps, dev)?,
            mlp: SwiGluMlp::new(
                h,
                cfg.intermediate_size,
                cfg.mlp_bias,
                sub_seed(seed, 1),
                dev,
            )?,
        })
    }

    /// As transformers initializes one: norms ones, every projection N(0, 0.02).
    pub fn random(cfg: &LlamaLayerConfig, seed: u64, dev: &Device) -> Result<Self> {
        let layer = LlamaDecoderLayer::new(cfg, seed, dev)?;
        for (k, (name, p)) in layer.parameters().into_iter().enumerate() {
            if name.ends_with("proj.weight") {
                p.set_value(normal(
                    &p.shape(),
                    0.0,
                    INIT_STD,
                    sub_seed(seed, 100 + k as u64),
                    dev,
                )?);
            } else if name.ends_with("proj.bias") {
                p.set_value(p.value().zeros_like()?);
            }
        }
        Ok(layer)
    }

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if x.rank() != 3 {
            return Err(Error::Shape {
                op: "LlamaDecoderLayer",
                msg: format!("input {:?} must be [B, T, hidden]", x.shape()),
            });
        }
        let h = x.add(
            &self
                .self_attn
                .forward(&self.input_layernorm.forward(x, ctx)?, ctx)?,
        )?;
        h.add(
            &self
                .mlp
                .forward(&self.post_attention_layernorm.forward(&h, ctx)?, ctx)?,
        )
    }
}
