//! Losses as plain functions on a tape: each returns a 0-d `Var`, the mean over all positions,
//! so the gradient of a mini-batch's loss is the same however it was split into micro-batches
//! (when each micro-batch's loss is scaled by its share of the mini-batch).
//! Losses compute in f32: a half model's logits or predictions are cast first (see
//! [`crate::autocast`]).

use wgpipe_autograd::Var;
use wgpipe_tensor::{Error, Result, Tensor};

use crate::autocast::loss_input;

/// Cross-entropy of `logits [.., C]` against integer class ids `targets [..]` (f32 values
/// holding integers in `0..C`), averaged over every position:
/// `-mean(log_softmax(logits)[target])`, with the softmax and the loss fused in one row kernel
/// (and the backward in one), bit for bit the composed ops.
pub fn cross_entropy(logits: &Var, targets: &Tensor) -> Result<Var> {
    let s = logits.shape().to_vec();
    if s.is_empty() || s[..s.len() - 1] != *targets.shape() {
        return Err(Error::Shape {
            op: "cross_entropy",
            msg: format!(
                "logits {s:?} must be the targets' shape {:?} plus a class axis",
                targets.shape()
            ),
        });
    }
    let c = s[s.len() - 1];
    let n = targets.numel();
    loss_input(logits)?
        .reshape(&[n, c])?
        .cross_entropy_rows(&targets.reshape(&[n])?)?
        .mean(&[], false)
}

/// Mean squared error `mean((pred - target)^2)` over every element.
pub fn mse(pred: &Var, target: &Tensor) -> Result<Var> {
    if pred.shape() != target.shape() {
        return Err(Error::Shape {
            op: "mse",
            msg: format!(
                "prediction {:?} and target {:?} differ",
                pred.shape(),
                target.shape()
            ),
        });
    }
    let t = pred.tape().constant(target.clone());
    loss_input(pred)?.sub(&t)?.square()?.mean(&[], false)
}
