//! timm checkpoints of BiT's ResNetV2: the model's sizes read from the tensors' shapes (a
//! checkpoint file has no config), the preprocessing its folder's `config.json` states, and the
//! `config.json` timm writes beside a saved model.

use std::path::Path;

use serde_json::{json, Value};
use wgpipe_tensor::{DType, Error, Result};

use super::{HfCheckpoint, HfFolder};
use crate::data::{Interpolation, Resize};
use crate::models::ResNetV2;

fn invalid(checkpoint: &HfCheckpoint, msg: String) -> Error {
    Error::Invalid {
        op: "resnetv2_of",
        msg: format!("{}: {msg}", checkpoint.dir().display()),
    }
}

/// The ResNetV2 whose parameters `checkpoint` holds under timm's names: blocks per stage from
/// the `stages.{s}.blocks.{b}` present, each stage's channels from its first block's `conv3`,
/// the stem's and the input's from `stem.conv.weight`, the classes from `head.fc.weight`.
/// GroupNorm's 32 groups (every BiT model's) are not in the tensors and are assumed.
pub fn resnetv2_of(checkpoint: &HfCheckpoint) -> Result<ResNetV2> {
    let shape = |name: &str| -> Result<Vec<usize>> {
        checkpoint
            .shape(name)
            .map(<[usize]>::to_vec)
            .ok_or_else(|| {
                invalid(
                    checkpoint,
                    format!("not a timm ResNetV2 (BiT) checkpoint: it has no {name}"),
                )
            })
    };
    let stem = shape("stem.conv.weight")?;
    let head = shape("head.fc.weight")?;
    let (mut depths, mut channels) = (Vec::new(), Vec::new());
    while checkpoint.contains(&format!("stages.{}.blocks.0.conv3.weight", depths.len())) {
        let s = depths.len();
        let mut blocks = 0;
        while checkpoint.contains(&format!("stages.{s}.blocks.{blocks}.conv3.weight")) {
            blocks += 1;
        }
        channels.push(shape(&format!("stages.{s}.blocks.0.conv3.weight"))?[0]);
        depths.push(blocks);
    }
    if depths.is_empty() || stem.len() != 4 || head.len() != 4 {
        return Err(invalid(
            checkpoint,
            format!(
                "not a timm ResNetV2 (BiT) checkpoint: {} stages, stem.conv.weight {stem:?}, \
                 head.fc.weight {head:?}",
                depths.len()
            ),
        ));
    }
    Ok(ResNetV2 {
        depths,
        channels,
        stem_channels: stem[0],
        in_channels: stem[1],
        num_classes: head[0],
        groups: 32,
    })
}

/// How a model's images are prepared, as its timm `pretrained_cfg` states: the resize and
/// crop of the eval transform, then the per-channel mean and standard deviation subtracted and
/// divided after scaling to `[0, 1]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessing {
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
    pub crop_pct: f64,
    pub interpolation: Interpolation,
}

impl Preprocessing {
    /// BiT's fine-tuned models' (`resnetv2_50x1_bit.goog_in21k_ft_in1k`): bilinear, the whole
    /// image (`crop_pct` 1), mean and std 0.5 (timm's `IMAGENET_INCEPTION_*`: values to
    /// `[-1, 1]`).
    pub fn bit() -> Preprocessing {
        Preprocessing {
            mean: vec![0.5; 3],
            std: vec![0.5; 3],
            crop_pct: 1.0,
            interpolation: Interpolation::Bilinear,
        }
    }

    /// The resize and crop to `side` x `side` pixels.
    pub fn resize(&self, side: usize) -> Resize {
        Resize {
            side,
            crop_pct: self.crop_pct,
            interpolation: self.interpolation,
        }
    }
}

/// The preprocessing the `config.json` next to a checkpoint states (`pretrained_cfg`'s `mean`,
/// `std`, `crop_pct` and `interpolation`, as timm writes them), each value not stated being
/// BiT's ([`Preprocessing::bit`]), as is everything without such a file. A file that is there
/// but unreadable, or a value of the wrong kind, is an error naming it.
pub fn image_preprocessing(dir: &Path, channels: usize) -> Result<Preprocessing> {
    let path = dir.join("config.json");
    let default = Preprocessing::bit();
    if !path.is_file() {
        return Ok(default);
    }
    let bad = |msg: String| Error::Invalid {
        op: "image_preprocessing",
        msg: format!("{}: {msg}", path.display()),
    };
    let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let cfg = &config["pretrained_cfg"];
    let list = |key: &str| -> Result<Option<Vec<f32>>> {
        match &cfg[key] {
            Value::Null => Ok(None),
            Value::Array(v) if v.len() == channels => v
                .iter()
                .map(|x| x.as_f64().map(|x| x as f32))
                .collect::<Option<Vec<f32>>>()
                .map(Some)
                .ok_or_else(|| bad(format!("pretrained_cfg.{key} is not a list of numbers"))),
            v => Err(bad(format!(
                "pretrained_cfg.{key} is {v}, not {channels} numbers"
            ))),
        }
    };
    let crop_pct = match &cfg["crop_pct"] {
        Value::Null => default.crop_pct,
        v => v
            .as_f64()
            .filter(|c| *c > 0.0 && *c <= 1.0)
            .ok_or_else(|| bad(format!("pretrained_cfg.crop_pct is {v}, not in (0, 1]")))?,
    };
    let interpolation = match &cfg["interpolation"] {
        Value::Null => default.interpolation,
        Value::String(s) if s == "bilinear" => Interpolation::Bilinear,
        Value::String(s) if s == "bicubic" => Interpolation::Bicubic,
        v => {
            return Err(bad(format!(
                "pretrained_cfg.interpolation is {v}; \"bilinear\" and \"bicubic\" are read"
            )))
        }
    };
    let pre = Preprocessing {
        mean: list("mean")?.unwrap_or(default.mean),
        std: list("std")?.unwrap_or(default.std),
        crop_pct,
        interpolation,
    };
    if pre.std.iter().any(|&s| s.is_nan() || s <= 0.0) {
        return Err(bad(format!(
            "pretrained_cfg.std {:?} must be positive",
            pre.std
        )));
    }
    Ok(pre)
}

/// timm's name for a ResNetV2 of these sizes, when it is one timm registers
/// (`resnetv2_50x{1,3}_bit`, `resnetv2_101x{1,3}_bit`, `resnetv2_152x{2,4}_bit`).
fn timm_architecture(m: &ResNetV2) -> Option<String> {
    let names = [
        ("50", vec![3, 4, 6, 3], [1, 3]),
        ("101", vec![3, 4, 23, 3], [1, 3]),
        ("152", vec![3, 8, 36, 3], [2, 4]),
    ];
    names.into_iter().find_map(|(depth, depths, widths)| {
        widths.into_iter().find_map(|w| {
            let named = ResNetV2 {
                depths: depths.clone(),
                ..ResNetV2::bit50(w, m.num_classes)
            };
            (named == *m).then(|| format!("resnetv2_{depth}x{w}_bit"))
        })
    })
}

impl HfFolder for ResNetV2 {
    fn as_saved(&self) -> Self {
        self.clone()
    }

    /// timm's `local-dir:` loads `model.safetensors` alone.
    fn single_file(&self) -> bool {
        true
    }

    /// timm's `config.json` (as `save_for_hf` writes it): the architecture (its registered
    /// name; for other sizes `resnetv2`, which timm does not register, with `model_args` giving
    /// the sizes for building timm's `ResNetV2` in code), the classes and features, and the preprocessing
    /// (`pretrained_cfg`: BiT's bilinear resize, centre crop of the whole image, mean and
    /// std 0.5).
    fn config_json(&self, _dtype: DType) -> Value {
        let features = self.channels.last().copied().unwrap_or(0);
        let registered = timm_architecture(self);
        let mut config = json!({
            "architecture": registered.clone().unwrap_or_else(|| "resnetv2".into()),
            "num_classes": self.num_classes,
            "num_features": features,
            "global_pool": "avg",
            "pretrained_cfg": {
                "input_size": [self.in_channels, 448, 448],
                "interpolation": "bilinear",
                "crop_pct": 1.0,
                "crop_mode": "center",
                "mean": [0.5, 0.5, 0.5],
                "std": [0.5, 0.5, 0.5],
                "num_classes": self.num_classes,
                "first_conv": "stem.conv",
                "classifier": "head.fc",
            },
        });
        if registered.is_none() {
            config["model_args"] = json!({
                "layers": self.depths,
                "channels": self.channels,
                "stem_chs": self.stem_channels,
                "in_chans": self.in_channels,
                "stem_type": "fixed",
            });
        }
        config
    }
}
