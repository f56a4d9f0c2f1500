//! The autocast policy: the dtype each kind of layer computes in, read from
//! [`ForwardCtx::compute`]. One table, here; the layers follow it. Every layer reads its
//! weights with `Var::param`, in the dtype of its input (cast first where the table says so).
//!
//! | layer kind | input | weights | output |
//! |---|---|---|---|
//! | `Linear` (also attention's q/k/v or packed qkv and out, the MLP, the LM head), `Conv2d` | cast to `compute` | the param's cached `compute` copy ([`Param::value_in`](wgpipe_autograd::Param::value_in)) | `compute` |
//! | `Embedding` | ids (f32) | looked up in the f32 table | cast to `compute` |
//! | `PositionalEmbedding` | its dtype | cached copy in the input's dtype | input's dtype |
//! | fused `causal_attention` (and `causal_attention_packed`) | q, k, v in `compute` | dropout multipliers in `compute` | `compute` |
//! | `LayerNorm`, `BatchNorm2d` | its dtype (the half stream) | cached copy in the input's dtype | input's dtype |
//! | activations, pooling, dropout, flatten, residual adds, concat, skips | its dtype | - | input's dtype |
//! | losses (`cross_entropy`, `mse`) | cast to f32 | - | f32 |
//!
//! Unlike torch's autocast, the residual stream stays in `compute` between layers (norms run on
//! it rather than casting to f32 and back), so what a stage stores for backward and what
//! crosses a stage boundary is half. Precision is kept where it matters by the kernels: every
//! half op accumulates in f32 (sums, means, matmul, softmax, layer-norm and batch-norm
//! statistics) and rounds its result once; weights stay f32 masters whose gradients are cast
//! back and accumulate in f32; batch-norm running statistics stay f32; losses are f32.
//!
//! With `compute = F32` every cast is a no-op that records nothing, so an f32 model runs
//! exactly the ops it ran before autocast existed. A layer that forgets its cast fails loudly:
//! every op refuses operands of different dtypes with `Error::DTypeMismatch`.

use wgpipe_autograd::{ForwardCtx, Var};
use wgpipe_tensor::{DType, Result};

/// The input of a matmul-like layer (linear, convolution) in the context's compute dtype.
pub fn compute_input(x: &Var, ctx: &ForwardCtx) -> Result<Var> {
    x.to_dtype(ctx.compute)
}

/// The input of a loss (logits, predictions) in f32: log-softmax, cross-entropy and squared
/// errors are computed in full precision whatever the model computed in.
pub fn loss_input(x: &Var) -> Result<Var> {
    x.to_dtype(DType::F32)
}
