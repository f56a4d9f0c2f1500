//! Layers, one file each. Every layer implements [`Module`](wgpipe_autograd::Module).

pub mod activation;
pub mod attention;
pub mod batchnorm;
pub mod container;
pub mod conv;
pub mod dropout;
pub mod embedding;
pub mod flatten;
pub mod gqa_attention;
pub mod group_norm;
pub mod linear;
pub mod norm;
pub mod pool;
pub mod rms_norm;
pub mod rope;
pub mod std_conv;
pub mod swiglu;
pub mod transformer;

pub use activation::{Gelu, Relu};
pub use attention::{causal_mask, CausalSelfAttention, QkvProjection};
pub use batchnorm::BatchNorm2d;
pub use container::{Residual, Sequential};
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use embedding::{Embedding, PositionalEmbedding, TokenPositionEmbedding};
pub use flatten::Flatten;
pub use gqa_attention::{GqaAttention, GqaShape};
pub use group_norm::GroupNorm;
pub use linear::Linear;
pub use norm::LayerNorm;
pub use pool::{AvgPool2d, GlobalAvgPool, MaxPool2d};
pub use rms_norm::RmsNorm;
pub use rope::{Rope, RopeScaling};
pub use std_conv::StdConv2d;
pub use swiglu::SwiGluMlp;
pub use transformer::{Mlp, TransformerBlock};

use wgpipe_autograd::Param;
use wgpipe_tensor::Error;

/// Bytes of an f32 tensor of `shape`.
pub(crate) fn f32_bytes(shape: &[usize]) -> usize {
    4 * shape.iter().product::<usize>()
}

/// A shape error naming the layer.
pub(crate) fn shape_error(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Shape {
        op,
        msg: msg.into(),
    }
}

/// An invalid-argument error naming the layer.
pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Error {
    Error::Invalid {
        op,
        msg: msg.into(),
    }
}

/// Names of a child's parameters prefixed with `prefix.` (for composite modules).
pub fn prefix(prefix: &str, params: Vec<(String, Param)>) -> Vec<(String, Param)> {
    params
        .into_iter()
        .map(|(n, p)| (wgpipe_autograd::module::param_path(prefix, &n), p))
        .collect()
}
