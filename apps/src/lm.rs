//! What the language-model examples share: token ids as tensors, and the held-out loss through
//! the stages.

use crate::bail;
use crate::error::AppResult;
use crate::models::cross_entropy;
use crate::models::data::TextDataset;
use crate::pipeline::Pipeline;
use crate::tensor::{Device, Tensor};

/// Token ids as the f32 tensor of `shape` the embedding takes, on the host.
pub fn ids_tensor(ids: &[u32], shape: &[usize]) -> AppResult<Tensor> {
    let v: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    Ok(Tensor::from_vec(v, shape, &Device::cpu())?)
}

/// Mean loss over up to `max_batches` held-out batches, through `Pipeline::evaluate`: a
/// forward-only schedule across the stages (and ranks), so that no process needs the whole
/// model. Each batch's loss weighs its micro-batches by their rows, as a training step's does.
pub fn held_out_loss(
    pipe: &mut Pipeline,
    val: &TextDataset,
    batch: usize,
    seq_len: usize,
    max_batches: usize,
) -> AppResult<f32> {
    let rows = batch
        .min(val.len().saturating_sub(1) / seq_len)
        .max(pipe.num_micro_batches());
    let batches = val.eval_batches(rows, seq_len)?;
    if batches.is_empty() {
        bail!(
            "the held-out text ({} tokens) is too short for one batch of {rows} x {seq_len}",
            val.len()
        );
    }
    let mut sum = 0.0;
    let n = batches.len().min(max_batches);
    for (x, y) in batches.iter().take(n) {
        sum += pipe.evaluate(
            &ids_tensor(x, &[rows, seq_len])?,
            &ids_tensor(y, &[rows, seq_len])?,
            &|logits, t| cross_entropy(logits, t),
        )?;
    }
    Ok(sum / n as f32)
}
