//! Llama's decoder layer as transformers writes it (`LlamaDecoderLayer`): pre-norm residual
//! blocks of RMSNorm, grouped-query attention with rotary positions and the SwiGLU MLP, its
//! parameters named as in a checkpoint under `model.layers.{i}.` (`input_layernorm.weight`,
//! `self_attn.{q,k,v,o}_proj.weight`, `post_attention_layernorm.weight`,
//! `mlp.{gate,up,down}_proj.weight`).

use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_tensor::{Device, Result};

use crate::init::sub_seed;
use crate::layers::{GqaAttention, GqaShape, RmsNorm, Rope, RopeScaling, SwiGluMlp};

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

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
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
