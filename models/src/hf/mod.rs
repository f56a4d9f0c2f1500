//! Hugging Face checkpoint folders: reading their tensors ([`HfCheckpoint`]), building a model's
//! layers from them under the names transformers writes ([`load_llama`], [`load_gpt2`]), and
//! writing them back ([`save_llama`], [`save_gpt2`]).

pub mod checkpoint;
pub mod save;

pub use checkpoint::HfCheckpoint;
pub use save::{save_gpt2, save_llama, SaveOptions};

use std::ops::Range;
use std::path::Path;

use wgpipe_autograd::Module;
use wgpipe_tensor::{Device, Error, Result};

use crate::models::{Gpt2, Gpt2Config, HfNames, Llama, LlamaConfig};

/// Layers `range` of the Llama in folder `dir` (its `config.json` and safetensors), on `dev`
/// (see [`load_layers`]).
pub fn load_llama(
    dir: &Path,
    range: Range<usize>,
    dev: &Device,
) -> Result<(Llama, Vec<Box<dyn Module>>)> {
    let llama = Llama {
        config: LlamaConfig::from_file(&dir.join("config.json"))?,
    };
    let checkpoint = HfCheckpoint::open(dir)?;
    let layers = load_layers(&llama, &checkpoint, range, dev)?;
    Ok((llama, layers))
}

/// Layers `range` of the GPT-2 in folder `dir`, whether its names start with `transformer.`
/// (`GPT2LMHeadModel`) or not (`GPT2Model`), on `dev` (see [`load_layers`]).
pub fn load_gpt2(
    dir: &Path,
    range: Range<usize>,
    dev: &Device,
) -> Result<(Gpt2, Vec<Box<dyn Module>>)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Invalid {
        op: "load_gpt2",
        msg: format!("{}: {e}", path.display()),
    })?;
    let checkpoint = HfCheckpoint::open(dir)?;
    let prefix = if checkpoint.contains("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let gpt2 = Gpt2 {
        config: Gpt2Config::from_json(&text).map_err(|e| match e {
            Error::Invalid { op, msg } => Error::Invalid {
                op,
                msg: format!("{}: {msg}", path.display()),
            },
            e => e,
        })?,
        prefix: prefix.into(),
    };
    let layers = load_layers(&gpt2, &checkpoint, range, dev)?;
    Ok((gpt2, layers))
}

/// Layers `range` of `model`, each parameter read from `checkpoint` under its key (transposed
/// back where the checkpoint stores it so), so a pipeline stage reads its own layers only. When
/// `range` is the whole model, a tensor of the checkpoint that no layer took (and that the model
/// does not call ignorable) is an error listing them: a checkpoint of another model, or a
/// renamed one.
pub fn load_layers<M: HfNames>(
    model: &M,
    checkpoint: &HfCheckpoint,
    range: Range<usize>,
    dev: &Device,
) -> Result<Vec<Box<dyn Module>>> {
    let whole = range == (0..model.num_layers());
    let first = range.start;
    let layers = model.build_range(0, range, dev)?;
    let mut taken = std::collections::HashSet::new();
    for (k, layer) in layers.iter().enumerate() {
        let i = first + k;
        for (name, p) in layer.parameters().into_iter().chain(layer.buffers()) {
            let (key, transposed) = model.checkpoint_key(i, &name);
            let wanted_by = format!("layer {i} ({}) parameter {name}", layer.name());
            let shape = p.shape();
            let value = if transposed {
                let stored = [shape[1], shape[0]];
                checkpoint
                    .read(&key, &stored, &wanted_by, dev)?
                    .t()?
                    .contiguous()?
            } else {
                checkpoint.read(&key, &shape, &wanted_by, dev)?
            };
            p.set_value(value);
            taken.insert(key);
        }
    }
    if whole {
        let unused: Vec<String> = checkpoint
            .names()
            .into_iter()
            .filter(|n| !taken.contains(n) && !model.ignorable(n))
            .collect();
        if !unused.is_empty() {
            return Err(Error::Invalid {
                op: "load",
                msg: format!(
                    "{}: tensors no layer of the model takes: {}",
                    checkpoint.dir().display(),
                    unused.join(", ")
                ),
            });
        }
    }
    Ok(layers)
}
