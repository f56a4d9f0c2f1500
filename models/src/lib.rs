//! wgpipe-models: layers (Linear, Embedding, LayerNorm, attention, Conv2d, BatchNorm, pooling),
//! losses, and whole models (a Transformer LM, a ResNet-style CNN, an AmoebaNet-D-style CNN)
//! written as sequences of [`Module`]s, so they run plain or cut into pipeline stages.
//!
//! Every layer implements the settled [`Module`] trait of `wgpipe-autograd`: parameters with
//! hierarchical names relative to the layer (`attn.q.weight`, `mlp.fc1.bias`), buffers
//! (batch-norm running statistics), deferred updates in `finish_step`, and cost hints.
//! Initialisation follows PyTorch's defaults and is a pure function of a `seed`, equal on
//! every backend (see [`init`]).

pub mod autocast;
pub mod data;
pub mod hf;
pub mod init;
pub mod layers;
pub mod loss;
pub mod models;
pub mod sequence;

pub use layers::*;
pub use loss::{cross_entropy, mse};
pub use models::{
    factory, replace_head, AmoebaNet, BuildsRanges, Gpt2, Gpt2Config, HfNames, Llama, LlamaConfig,
    ResNet, ResNetV2, TransformerLm,
};
pub use sequence::{
    finish_step_all, forward_all, parameter_count, sequence_buffers, sequence_parameters,
};
pub use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Tape, Var};
pub use wgpipe_tensor::{Device, Error, Result, Tensor};
