//! train_cnn's `--from`: a BiT ResNetV2 fine-tuned from a timm checkpoint. The body's layers
//! are read from the checkpoint (each rank reading only its own stages' tensors under MPI) and
//! the head is a fresh one for the data's classes, as timm's `reset_classifier` makes it.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::autograd::{ModelFactory, Module};
use crate::error::{AppResult, Context};
use crate::models::hf::{
    checkpoint_factory, image_preprocessing, resnetv2_of, HfCheckpoint, Preprocessing,
};
use crate::models::ResNetV2;
use crate::tensor::{Device, Result};

/// A timm checkpoint of a BiT ResNetV2, opened (only its header read).
pub struct BitCheckpoint {
    pub checkpoint: Arc<HfCheckpoint>,
    /// The model as the checkpoint holds it (its own classes).
    pub pretrained: ResNetV2,
    /// The preprocessing its folder's config.json states (BiT's without one).
    pub preprocessing: Preprocessing,
    /// The folder it is in.
    pub dir: PathBuf,
}

/// Opens `path`: a `.safetensors` file, or a folder holding `model.safetensors` (or shards and
/// their index) and, optionally, timm's `config.json`.
pub fn open_bit(path: &Path) -> AppResult<BitCheckpoint> {
    let what = format!("--from {}", path.display());
    let checkpoint = if path.is_dir() {
        HfCheckpoint::open(path)
    } else {
        HfCheckpoint::open_file(path)
    }
    .context(what.clone())?;
    let pretrained = resnetv2_of(&checkpoint).context(what.clone())?;
    let dir = checkpoint.dir().to_path_buf();
    let preprocessing = image_preprocessing(&dir, pretrained.in_channels).context(what.clone())?;
    Ok(BitCheckpoint {
        checkpoint: Arc::new(checkpoint),
        pretrained,
        preprocessing,
        dir,
    })
}

impl BitCheckpoint {
    /// The model to fine-tune for `num_classes` classes: the pretrained one with its head
    /// replaced.
    pub fn for_classes(&self, num_classes: usize) -> ResNetV2 {
        ResNetV2 {
            num_classes,
            ..self.pretrained.clone()
        }
    }

    /// A factory of `model`'s layers (see [`BitCheckpoint::for_classes`]): every layer but
    /// the head read from the checkpoint on `device`, the head fresh from `seed`. The
    /// checkpoint is checked whole first (every tensor one the pretrained model takes).
    pub fn factory(
        &self,
        model: &ResNetV2,
        seed: u64,
        device: &Device,
    ) -> AppResult<Arc<dyn ModelFactory>> {
        let body = checkpoint_factory(&self.pretrained, self.checkpoint.clone(), device)
            .context(format!("--from {}", self.dir.display()))?;
        Ok(Arc::new(FreshHead {
            body,
            model: model.clone(),
            seed,
            device: device.clone(),
        }))
    }
}

/// [`BitCheckpoint::factory`].
struct FreshHead {
    body: Arc<dyn ModelFactory>,
    model: ResNetV2,
    seed: u64,
    device: Device,
}

impl FreshHead {
    /// The body's layers of `range` from `body`, then the fresh head if `range` reaches it.
    fn layers(
        &self,
        range: Range<usize>,
        body: impl Fn(Range<usize>) -> Result<Vec<Box<dyn Module>>>,
    ) -> Result<Vec<Box<dyn Module>>> {
        let head = self.model.num_layers() - 1;
        let mut layers = if range.start < head {
            body(range.start..range.end.min(head))?
        } else {
            Vec::new()
        };
        if range.end > head {
            layers.push(
                self.model
                    .new_head(self.model.num_classes, self.seed, &self.device)?,
            );
        }
        Ok(layers)
    }
}

impl ModelFactory for FreshHead {
    fn num_layers(&self) -> usize {
        self.model.num_layers()
    }
    fn build_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        self.layers(range, |r| self.body.build_range(r))
    }
    fn describe_range(&self, range: Range<usize>) -> Result<Vec<Box<dyn Module>>> {
        self.layers(range, |r| self.body.describe_range(r))
    }
}
