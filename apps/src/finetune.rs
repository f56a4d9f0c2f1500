//! What both fine-tuning examples (`finetune_lm`, `train_cnn --from`) do alike: freezing the
//! first layers, and writing the trained model back as a folder its own library loads.

use std::path::Path;

use crate::error::{AppError, AppResult};
use crate::models::hf::{save_shard, write_index, write_single, HfFolder};
use crate::pipeline::Pipeline;
use crate::tensor::DType;

/// Makes the parameters of layers `0..layers` untrainable (the embedding or the stem first),
/// and every tied parameter: the only ties of a Llama or a GPT-2 are the head's to the
/// embedding's table, which is always frozen here, and a rank holding the head alone knows its
/// tie group, not the table's layer. The number of tensors frozen on this rank.
pub fn freeze_first(pipe: &Pipeline, layers: usize) -> usize {
    let mut frozen = 0;
    for (name, p) in pipe.named_parameters() {
        if layer_of(&name).is_some_and(|l| l < layers) || p.tie_group().is_some() {
            p.set_trainable(false);
            frozen += 1;
        }
    }
    frozen
}

/// The layer a pipeline's parameter name (`{layer}.{name}`) belongs to.
pub fn layer_of(name: &str) -> Option<usize> {
    name.split('.').next()?.parse().ok()
}

/// Writes the pipeline's model into `dir` as a Hugging Face (or timm) folder: each device's
/// stages as one shard, by the process that trains them, then (rank 0) the index and
/// config.json, or for a library that reads one file (timm) the shards merged into
/// `model.safetensors`. `flag` names the option in errors.
pub fn save_folder<M: HfFolder>(
    pipe: &mut Pipeline,
    model: &M,
    dir: &Path,
    dtype: DType,
    flag: &str,
) -> AppResult<()> {
    let k = pipe.num_devices();
    pipe.write_by_device(
        |d, params| save_shard(dir, model, params, d, k, dtype).map_err(|e| e.to_string()),
        || {
            if model.single_file() {
                write_single(dir, model, k, dtype)
            } else {
                write_index(dir, model, k, dtype)
            }
            .map_err(|e| e.to_string())
        },
    )
    .map_err(|e| AppError(format!("{flag} {}: {e}", dir.display())))
}
