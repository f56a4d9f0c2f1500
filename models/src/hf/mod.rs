//! Hugging Face checkpoint folders: reading their tensors ([`HfCheckpoint`]), building a model's
//! layers from them under the names transformers writes, and writing them back ([`save_llama`]).

pub mod checkpoint;
pub mod save;

pub use checkpoint::HfCheckpoint;
pub use save::{save_llama, SaveOptions};

use std::ops::Range;
use std::path::Path;

use wgpipe_autograd::Module;
use wgpipe_tensor::{Device, Error, Result};

use crate::models::{Llama, LlamaConfig};

/// Layers `range` of the Llama in folder `dir` (its `config.json` and safetensors), on `dev`:
/// each parameter read from the checkpoint under its transformers name, so a pipeline stage
/// reads its own layers only. A tied head reads the embedding table. When `range` is the whole
/// model, a tensor of the checkpoint that no layer took is an error (a checkpoint of another
/// model, or a renamed one), listing them.
pub fn load_llama(
    dir: &Path,
    range: Range<usize>,
    dev: &Device,
) -> Result<(Llama, Vec<Box<dyn Module>>)> {
    let llama = Llama {
        config: LlamaConfig::from_file(&dir.join("config.json"))?,
    };
    let checkpoint = HfCheckpoint::open(dir)?;
    let whole = range == (0..llama.num_layers());
    let first = range.start;
    let layers = llama.build_range(0, range, dev)?;
    let mut taken = std::collections::HashSet::new();
    for (k, layer) in layers.iter().enumerate() {
        let i = first + k;
        for (name, p) in layer.parameters().into_iter().chain(layer.buffers()) {
            let key = llama.checkpoint_name(i, &name);
            let wanted_by = format!("layer {i} ({}) parameter {name}", layer.name());
            p.set_value(checkpoint.read(&key, &p.shape(), &wanted_by, dev)?);
            taken.insert(key);
        }
    }
    if whole {
        let unused: Vec<String> = checkpoint
            .names()
            .into_iter()
            .filter(|n| !taken.contains(n))
            .collect();
        if !unused.is_empty() {
            return Err(Error::Invalid {
                op: "load_llama",
                msg: format!(
                    "{}: tensors no layer of the model takes: {}",
                    dir.display(),
                    unused.join(", ")
                ),
            });
        }
    }
    Ok((llama, layers))
}
