//! BiT's ResNetV2 as timm writes it (`resnetv2_50x1_bit` and its family): a layer sequence
//! `[stem, pre-activation bottleneck x depth per stage, final norm, head]` on NCHW images.
//! The stem is a 7x7/2 weight-standardized convolution, a zero pad of 1 and a 3x3/2 max pool
//! (timm's "fixed" stem); each block is `x + conv3(act(norm3(conv2(act(norm2(conv1(p)))))))`
//! with `p = act(norm1(x))` and, where the shape changes, the shortcut `downsample(p)` (a 1x1
//! StdConv); norms are GroupNorm(32) + ReLU, convolutions StdConv2d with eps 1e-8; the head is
//! the global average and a biased 1x1 convolution to the classes. Parameters keep timm's
//! names (`stem.conv.weight`, `stages.{s}.blocks.{b}.conv1.weight`, `norm.weight`,
//! `head.fc.weight`).

use std::ops::Range;

use wgpipe_autograd::{ForwardCtx, Module, Var};
use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{Device, Error, Result};

use crate::init::sub_seed;
use crate::layers::{Conv2d, GroupNorm, StdConv2d};

/// BiT's weight-standardization epsilon and GroupNorm's.
const STD_EPS: f32 = 1e-8;
const NORM_EPS: f32 = 1e-5;

/// The sizes of a ResNetV2: blocks per stage, each stage's output channels, the stem's.
#[derive(Debug, Clone, PartialEq)]
pub struct ResNetV2 {
    pub depths: Vec<usize>,
    pub channels: Vec<usize>,
    pub stem_channels: usize,
    pub in_channels: usize,
    pub num_classes: usize,
    pub groups: usize,
}

impl ResNetV2 {
    /// timm's `resnetv2_50x{width}_bit`: depths 3, 4, 6, 3, channels (256, 512, 1024, 2048)
    /// and a stem of 64, all times `width`.
    pub fn bit50(width: usize, num_classes: usize) -> ResNetV2 {
        ResNetV2 {
            depths: vec![3, 4, 6, 3],
            channels: [256, 512, 1024, 2048].iter().map(|c| c * width).collect(),
            stem_channels: 64 * width,
            in_channels: 3,
            num_classes,
            groups: 32,
        }
    }

    /// `sum(depths) + 3` layers.
    pub fn num_layers(&self) -> usize {
        self.depths.iter().sum::<usize>() + 3
    }

    /// `(stage, block)` of layer `i` when it is a block.
    fn block_of(&self, i: usize) -> Option<(usize, usize)> {
        let mut first = 1;
        for (s, &d) in self.depths.iter().enumerate() {
            if i >= first && i < first + d {
                return Some((s, i - first));
            }
            first += d;
        }
        None
    }

    /// The checkpoint prefix of layer `i`'s parameters.
    pub fn checkpoint_prefix(&self, i: usize) -> String {
        match (i, self.block_of(i)) {
            (0, _) => "stem".into(),
            (_, Some((s, b))) => format!("stages.{s}.blocks.{b}"),
            (i, None) if i == self.num_layers() - 2 => "norm".into(),
            _ => "head".into(),
        }
    }

    fn check(&self) -> Result<()> {
        let ok = !self.depths.is_empty()
            && self.depths.len() == self.channels.len()
            && self.depths.iter().all(|&d| d > 0)
            && self.num_classes > 0
            && self.groups > 0
            && std::iter::once(self.stem_channels)
                .chain(self.channels.iter().flat_map(|&c| [c, c / 4]))
                .all(|c| c > 0 && c.is_multiple_of(self.groups));
        if ok {
            Ok(())
        } else {
            Err(Error::Invalid {
                op: "ResNetV2",
                msg: format!(
                    "depths and channels must pair up, and the stem's, every stage's and its \
                     bottleneck's (a quarter) channels be multiples of {} groups: {self:?}",
                    self.groups
                ),
            })
        }
    }

    /// A fresh head for `num_classes` classes on this model's features, as timm initializes
    /// one (`reset_classifier`: weight N(0, 0.01), bias zero): for fine-tuning a pretrained body
    /// on other classes, load layers `0..num_layers() - 1` and push this instead of the
    /// checkpoint's head.
    pub fn new_head(&self, num_classes: usize, seed: u64, dev: &Device) -> Result<Box<dyn Module>> {
        let features = *self.channels.last().ok_or_else(|| Error::Invalid {
            op: "ResNetV2::new_head",
            msg: "the model has no stages".into(),
        })?;
        if num_classes == 0 {
            return Err(Error::Invalid {
                op: "ResNetV2::new_head",
                msg: "num_classes must be positive".into(),
            });
        }
        let fc = Conv2d::with_params(
            features,
            num_classes,
            (1, 1),
            Conv2dParams::default(),
            true,
            seed,
            dev,
        )?;
        fc.weight.set_value(crate::init::normal(
            &fc.weight.shape(),
            0.0,
            0.01,
            seed,
            dev,
        )?);
        if let Some(b) = &fc.bias {
            b.set_value(b.value().zeros_like()?);
        }
        Ok(Box::new(ConvHead { fc }))
    }

    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(seed, 0..self.num_layers(), dev)
    }

    pub fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        self.check()?;
        let n = self.num_layers();
        super::check_range("ResNetV2", &range, n)?;
        let last = *self.channels.last().expect("checked");
        let mut layers: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        for i in range {
            let s = sub_seed(seed, i as u64);
            let layer: Box<dyn Module> = match self.block_of(i) {
                _ if i == 0 => Box::new(BitStem {
                    conv: StdConv2d::new(
                        self.in_channels,
                        self.stem_channels,
                        7,
                        2,
                        STD_EPS,
                        s,
                        dev,
                    )?,
                }),
                Some((stage, block)) => {
                    let c_in = match (stage, block) {
                        (0, 0) => self.stem_channels,
                        (_, 0) => self.channels[stage - 1],
                        _ => self.channels[stage],
                    };
                    let stride = if stage > 0 && block == 0 { 2 } else { 1 };
                    Box::new(PreActBottleneck::new(
                        c_in,
                        self.channels[stage],
                        stride,
                        self.groups,
                        s,
                        dev,
                    )?)
                }
                None if i == n - 2 => Box::new(GroupNormRelu {
                    norm: GroupNorm::new(self.groups, last, NORM_EPS, dev)?,
                }),
                None => Box::new(ConvHead {
                    fc: Conv2d::with_params(
                        last,
                        self.num_classes,
                        (1, 1),
                        Conv2dParams::default(),
                        true,
                        s,
                        dev,
                    )?,
                }),
            };
            layers.push(layer);
        }
        Ok(layers)
    }
}

/// The 7x7/2 StdConv, a zero pad of one on each side, a 3x3/2 max pool (no activation: the
/// blocks are pre-activation).
#[derive(Module)]
pub struct BitStem {
    #[wgpipe(module)]
    pub conv: StdConv2d,
}

impl BitStem {
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let y = zero_pad(&self.conv.forward(x, ctx)?, 1)?;
        y.max_pool2d(Pool2dParams {
            kernel: (3, 3),
            stride: (2, 2),
            padding: (0, 0),
        })
    }
}

/// `x` with `p` zeros on each side of its last two axes (timm's `ConstantPad2d(p, 0)`).
fn zero_pad(x: &Var, p: usize) -> Result<Var> {
    let s = x.shape().to_vec();
    let zeros = |shape: &[usize]| -> Result<Var> {
        let z = wgpipe_tensor::Tensor::zeros_in(shape, x.value().dtype(), x.device())?;
        Ok(x.tape().constant(z))
    };
    let side = zeros(&[s[0], s[1], s[2], p])?;
    let wide = Var::concat(&[&side, x, &side], 3)?;
    let row = zeros(&[s[0], s[1], p, s[3] + 2 * p])?;
    Var::concat(&[&row, &wide, &row], 2)
}

/// timm's `GroupNormAct`: GroupNorm then ReLU, its parameters the norm's own (`weight`,
/// `bias`, as timm's subclass of GroupNorm names them).
pub struct GroupNormRelu {
    pub norm: GroupNorm,
}

impl Module for GroupNormRelu {
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        self.norm.forward(x, ctx)?.relu()
    }
    fn parameters(&self) -> Vec<(String, wgpipe_autograd::Param)> {
        self.norm.parameters()
    }
}

/// The shortcut's 1x1 StdConv (timm's `DownsampleConv`, its norm an identity when preact).
#[derive(Module)]
pub struct Downsample {
    #[wgpipe(module)]
    pub conv: StdConv2d,
}

/// The pre-activation bottleneck (see the module doc); the stride is on the 3x3.
#[derive(Module)]
pub struct PreActBottleneck {
    #[wgpipe(module)]
    pub downsample: Option<Downsample>,
    #[wgpipe(module)]
    pub norm1: GroupNormRelu,
    #[wgpipe(module)]
    pub conv1: StdConv2d,
    #[wgpipe(module)]
    pub norm2: GroupNormRelu,
    #[wgpipe(module)]
    pub conv2: StdConv2d,
    #[wgpipe(module)]
    pub norm3: GroupNormRelu,
    #[wgpipe(module)]
    pub conv3: StdConv2d,
}

impl PreActBottleneck {
    pub fn new(
        c_in: usize,
        c_out: usize,
        stride: usize,
        groups: usize,
        seed: u64,
        dev: &Device,
    ) -> Result<Self> {
        let mid = c_out / 4;
        let norm = |c| -> Result<GroupNormRelu> {
            Ok(GroupNormRelu {
                norm: GroupNorm::new(groups, c, NORM_EPS, dev)?,
            })
        };
        let conv = |a, b, k, st, i| StdConv2d::new(a, b, k, st, STD_EPS, sub_seed(seed, i), dev);
        let downsample = if c_in != c_out || stride != 1 {
            Some(Downsample {
                conv: conv(c_in, c_out, 1, stride, 0)?,
            })
        } else {
            None
        };
        Ok(PreActBottleneck {
            downsample,
            norm1: norm(c_in)?,
            conv1: conv(c_in, mid, 1, 1, 1)?,
            norm2: norm(mid)?,
            conv2: conv(mid, mid, 3, stride, 2)?,
            norm3: norm(mid)?,
            conv3: conv(mid, c_out, 1, 1, 3)?,
        })
    }

    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let pre = self.norm1.forward(x, ctx)?;
        let shortcut = match &self.downsample {
            Some(d) => d.conv.forward(&pre, ctx)?,
            None => x.clone(),
        };
        let h = self.conv1.forward(&pre, ctx)?;
        let h = self.conv2.forward(&self.norm2.forward(&h, ctx)?, ctx)?;
        let h = self.conv3.forward(&self.norm3.forward(&h, ctx)?, ctx)?;
        h.add(&shortcut)
    }
}

impl Downsample {
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        self.conv.forward(x, ctx)
    }
}

/// The global average over the image, then a biased 1x1 convolution to the classes
/// (timm's `ClassifierHead` with `use_conv`): `[N, C, H, W]` to `[N, classes]`.
#[derive(Module)]
pub struct ConvHead {
    #[wgpipe(module)]
    pub fc: Conv2d,
}

impl ConvHead {
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let s = x.shape().to_vec();
        if s.len() != 4 {
            return Err(Error::Shape {
                op: "ConvHead",
                msg: format!("input {s:?} must be [N, C, H, W]"),
            });
        }
        let pooled = x.mean(&[2, 3], true)?;
        let y = self.fc.forward(&pooled, ctx)?;
        let classes = y.shape()[1];
        y.reshape(&[s[0], classes])
    }
}

impl super::HfNames for ResNetV2 {
    fn checkpoint_key(&self, layer: usize, name: &str) -> (String, bool) {
        (format!("{}.{name}", self.checkpoint_prefix(layer)), false)
    }
}

impl super::BuildsRanges for ResNetV2 {
    fn num_layers(&self) -> usize {
        ResNetV2::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        ResNetV2::build_range(self, seed, range, dev)
    }
}
