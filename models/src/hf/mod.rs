//! Hugging Face checkpoint folders: reading their tensors ([`HfCheckpoint`]), building a model's
//! layers from them under the names transformers writes ([`load_llama`], [`load_gpt2`]), and
//! writing them back ([`save_hf`]; one stage's part at a time: [`save_shard`], [`write_index`]);
//! timm's BiT checkpoints ([`resnetv2_of`]).

pub mod checkpoint;
pub mod save;
pub mod timm;

pub use checkpoint::HfCheckpoint;
pub use save::{save_hf, save_shard, shard_file, write_index, write_single, HfFolder, SaveOptions};
pub use timm::{image_preprocessing, resnetv2_of, Preprocessing};

use std::collections::HashSet;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use wgpipe_autograd::{ModelFactory, Module};
use wgpipe_tensor::{Device, Error, Result};

use crate::models::{Gpt2, Gpt2Config, HfNames, Llama, LlamaConfig};

/// Layers `range` of the Llama in folder `dir` (its `config.json` and safetensors), on `dev`
/// (see [`load_layers`]).
pub fn load_llama(
    dir: &Path,
    range: Range<usize>,
    dev: &Device,
) -> Result<(Llama, Vec<Box<dyn Module>>)> {
    let llama = llama_of(dir)?;
    let checkpoint = HfCheckpoint::open(dir)?;
    let layers = load_layers(&llama, &checkpoint, range, dev)?;
    Ok((llama, layers))
}

/// The Llama of folder `dir`, from its `config.json`.
pub fn llama_of(dir: &Path) -> Result<Llama> {
    Ok(Llama {
        config: LlamaConfig::from_file(&dir.join("config.json"))?,
    })
}

/// Layers `range` of the GPT-2 in folder `dir`, whether its names start with `transformer.`
/// (`GPT2LMHeadModel`) or not (`GPT2Model`), on `dev` (see [`load_layers`]).
pub fn load_gpt2(
    dir: &Path,
    range: Range<usize>,
    dev: &Device,
) -> Result<(Gpt2, Vec<Box<dyn Module>>)> {
    let checkpoint = HfCheckpoint::open(dir)?;
    let gpt2 = gpt2_of(dir, &checkpoint)?;
    let layers = load_layers(&gpt2, &checkpoint, range, dev)?;
    Ok((gpt2, layers))
}

/// The GPT-2 of folder `dir`: its `config.json`, its names under `transformer.` or not as
/// `checkpoint` (the folder's) has them.
pub fn gpt2_of(dir: &Path, checkpoint: &HfCheckpoint) -> Result<Gpt2> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::Invalid {
        op: "load_gpt2",
        msg: format!("{}: {e}", path.display()),
    })?;
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
    Ok(gpt2)
}

/// Layers `range` of `model`, each parameter read from `checkpoint` under its key (transposed
/// back where the checkpoint stores it so), so a pipeline stage reads its own layers only. When
/// `range` is the whole model, a tensor of the checkpoint that no layer took (and that the model
/// does not call ignorable) is an error listing them: a checkpoint of another model, or a
/// renamed one ([`check_all_taken`] makes that check for a model loaded in parts).
pub fn load_layers<M: HfNames>(
    model: &M,
    checkpoint: &HfCheckpoint,
    range: Range<usize>,
    dev: &Device,
) -> Result<Vec<Box<dyn Module>>> {
    let whole = range == (0..model.num_layers());
    let first = range.start;
    // Built with zeros, not random values: every parameter is read from the checkpoint next.
    let layers = crate::init::without_random_init(|| model.build_range(0, range, dev))?;
    let mut taken = HashSet::new();
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
        refuse_untaken(model, checkpoint, &taken)?;
    }
    Ok(layers)
}

/// Fails unless every tensor of `checkpoint` is one that some layer of `model` takes (or one
/// the model calls ignorable), without reading any tensor: the check [`load_layers`] makes
/// for a whole model, for a model whose stages load their own layers (each rank of an MPI job
/// calls it once). Each layer is built alone on the host with zeros and dropped, so this
/// costs about one layer's memory, and no time drawing values.
pub fn check_all_taken<M: HfNames>(model: &M, checkpoint: &HfCheckpoint) -> Result<()> {
    let mut taken = HashSet::new();
    for i in 0..model.num_layers() {
        let layer =
            crate::init::without_random_init(|| model.build_range(0, i..i + 1, &Device::cpu()))?;
        for (name, _) in layer[0].parameters().into_iter().chain(layer[0].buffers()) {
            taken.insert(model.checkpoint_key(i, &name).0);
        }
    }
    refuse_untaken(model, checkpoint, &taken)
}

fn refuse_untaken<M: HfNames>(
    model: &M,
    checkpoint: &HfCheckpoint,
    taken: &HashSet<String>,
) -> Result<()> {
    let unused: Vec<String> = checkpoint
        .names()
        .into_iter()
        .filter(|n| !taken.contains(n) && !model.ignorable(n))
        .collect();
    if unused.is_empty() {
        return Ok(());
    }
    Err(Error::Invalid {
        op: "load",
        msg: format!(
            "{}: tensors no layer of the model takes: {}",
            checkpoint.dir().display(),
            unused.join(", ")
        ),
    })
}

/// A [`ModelFactory`] whose layers are read from `checkpoint` ([`load_layers`] of the range
/// asked for), for `Pipeline::builder_from`: under MPI each rank then reads only the tensors
/// of the stages it holds (and, once, builds each other layer alone with zeros to describe
/// it). The checkpoint is checked whole first ([`check_all_taken`]).
pub fn checkpoint_factory<M: HfNames>(
    model: &M,
    checkpoint: Arc<HfCheckpoint>,
    dev: &Device,
) -> Result<Arc<dyn ModelFactory>> {
    check_all_taken(model, &checkpoint)?;
    Ok(Arc::new(CheckpointFactory {
        model: model.clone(),
        checkpoint,
        device: dev.clone(),
    }))
}

/// [`checkpoint_factory`].
struct CheckpointFactory<M> {
    model: M,
    checkpoint: Arc<HfCheckpoint>,
    device: Device,
}

impl<M: HfNames> ModelFactory for CheckpointFactory<M> {
    fn num_layers(&self) -> usize {
        self.model.num_layers()
    }
    fn build_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        load_layers(&self.model, &self.checkpoint, range, &self.device)
    }
    /// Zeros, untouched: no tensor is read, and on the host no memory is used.
    fn describe_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        crate::init::without_random_init(|| self.model.build_range(0, range, &self.device))
    }
}
