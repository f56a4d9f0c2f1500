//! A ResNet-style CNN (CIFAR-style stem) as a layer sequence:
//! `[stem, BasicBlock x sum(blocks), GlobalAvgPool, Linear head]`.
//!
//! * stem: `conv1` 3x3 (stride 1, no bias) → `bn1` → ReLU, `in_channels → width`.
//! * stage `s` has `blocks[s]` basic blocks of `width * 2^s` channels; the first block of every
//!   stage after the first halves the resolution (stride 2) and gets a `downsample` shortcut
//!   (1x1 strided conv + BN).
//! * `BasicBlock`: `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`, parameter names as
//!   torchvision's (`conv1.weight`, `bn1.running_mean`, `downsample.0.weight`, ...).
//!
//! Input `[N, in_channels, H, W]`, output logits `[N, num_classes]`.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{Device, Error, Result};

use crate::init::sub_seed;
use crate::layers::transformer::chain;
use crate::layers::{BatchNorm2d, Conv2d, GlobalAvgPool, Linear, Relu, Sequential};

#[derive(Debug, Clone, PartialEq)]
pub struct ResNet {
    /// Basic blocks per stage, e.g. `[2, 2, 2, 2]` for ResNet-18's layout.
    pub blocks: Vec<usize>,
    /// Channels of the first stage (doubled at each later stage).
    pub width: usize,
    pub num_classes: usize,
    pub in_channels: usize,
}

/// A `k x k` convolution without bias, padding `k / 2`.
pub(crate) fn conv(
    c_in: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    groups: usize,
    seed: u64,
    dev: &Device,
) -> Result<Conv2d> {
    Conv2d::with_params(
        c_in,
        c_out,
        (k, k),
        Conv2dParams {
            stride: (stride, stride),
            padding: (k / 2, k / 2),
            dilation: (1, 1),
            groups,
        },
        false,
        seed,
        dev,
    )
}

/// The residual block of ResNet-18/34.
pub struct BasicBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm2d,
    pub conv2: Conv2d,
    pub bn2: BatchNorm2d,
    /// `Sequential["0": 1x1 conv, "1": BN]` when the shape changes.
    pub downsample: Option<Sequential>,
    c_in: usize,
    c_out: usize,
    stride: usize,
}

impl BasicBlock {
    pub fn new(c_in: usize, c_out: usize, stride: usize, seed: u64, dev: &Device) -> Result<Self> {
        let downsample = if stride != 1 || c_in != c_out {
            Some(
                Sequential::new("downsample")
                    .with(
                        "0",
                        conv(c_in, c_out, 1, stride, 1, sub_seed(seed, 2), dev)?,
                    )
                    .with("1", BatchNorm2d::new(c_out, dev)?),
            )
        } else {
            None
        };
        Ok(BasicBlock {
            conv1: conv(c_in, c_out, 3, stride, 1, sub_seed(seed, 0), dev)?,
            bn1: BatchNorm2d::new(c_out, dev)?,
            conv2: conv(c_out, c_out, 3, 1, 1, sub_seed(seed, 1), dev)?,
            bn2: BatchNorm2d::new(c_out, dev)?,
            downsample,
            c_in,
            c_out,
            stride,
        })
    }

    fn named(&self) -> Vec<(&'static str, &dyn Module)> {
        let mut v: Vec<(&'static str, &dyn Module)> = vec![
            ("conv1", &self.conv1),
            ("bn1", &self.bn1),
            ("conv2", &self.conv2),
            ("bn2", &self.bn2),
        ];
        if let Some(d) = &self.downsample {
            v.push(("downsample", d));
        }
        v
    }
}

impl Module for BasicBlock {
    fn name(&self) -> String {
        format!(
            "BasicBlock({}->{}, stride {})",
            self.c_in, self.c_out, self.stride
        )
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let h = self
            .bn1
            .forward(&self.conv1.forward(x, ctx)?, ctx)?
            .relu()?;
        let h = self.bn2.forward(&self.conv2.forward(&h, ctx)?, ctx)?;
        let s = match &self.downsample {
            Some(d) => d.forward(x, ctx)?,
            None => x.clone(),
        };
        h.add(&s)?.relu()
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.named()
            .into_iter()
            .flat_map(|(n, m)| crate::layers::prefix(n, m.parameters()))
            .collect()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        self.named()
            .into_iter()
            .flat_map(|(n, m)| crate::layers::prefix(n, m.buffers()))
            .collect()
    }
    fn set_train(&mut self, train: bool) {
        self.bn1.set_train(train);
        self.bn2.set_train(train);
        if let Some(d) = &mut self.downsample {
            d.set_train(train);
        }
    }
    fn finish_step(&self) -> Result<()> {
        self.named()
            .into_iter()
            .try_for_each(|(_, m)| m.finish_step())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut c = chain(
            &[&self.conv1, &self.bn1, &Relu, &self.conv2, &self.bn2, &Relu],
            input_shape,
        );
        if let Some(d) = &self.downsample {
            let s = d.cost(input_shape);
            c.param_bytes += s.param_bytes;
            c.flops += s.flops;
            c.activation_bytes += s.activation_bytes;
        }
        c.flops += c.output_shape.iter().product::<usize>() as f64;
        c
    }
}

impl ResNet {
    /// The number of layers: the stem, the blocks, the pool and the head.
    pub fn num_layers(&self) -> usize {
        self.blocks.iter().sum::<usize>() + 3
    }

    /// Element `i` is initialised from `sub_seed(seed, i)` (the head, after the pool, which has
    /// no parameters, from `sub_seed(seed, i - 1)`).
    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(seed, 0..self.num_layers(), dev)
    }

    /// Layers `range` of [`ResNet::build`]'s sequence alone, with the same values: a rank
    /// builds only its stages' layers.
    pub fn build_range(
        &self,
        seed: u64,
        range: std::ops::Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        if self.blocks.is_empty() || self.width == 0 || self.num_classes == 0 {
            return Err(Error::Invalid {
                op: "ResNet",
                msg: format!("needs at least one stage, width > 0 and classes > 0: {self:?}"),
            });
        }
        super::check_range("ResNet", &range, self.num_layers())?;
        let seed_of = |i: usize| sub_seed(seed, i as u64);
        let mut v: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        if range.contains(&0) {
            v.push(Box::new(
                Sequential::new(format!("Stem({}->{})", self.in_channels, self.width))
                    .with(
                        "conv1",
                        conv(self.in_channels, self.width, 3, 1, 1, seed_of(0), dev)?,
                    )
                    .with("bn1", BatchNorm2d::new(self.width, dev)?)
                    .with("relu", Relu),
            ));
        }
        // The channels are followed through every block; only those in `range` are built.
        let mut i = 1;
        let mut c_in = self.width;
        for (s, &n) in self.blocks.iter().enumerate() {
            let c_out = self.width << s;
            for b in 0..n {
                let stride = if s > 0 && b == 0 { 2 } else { 1 };
                if range.contains(&i) {
                    v.push(Box::new(BasicBlock::new(
                        c_in,
                        c_out,
                        stride,
                        seed_of(i),
                        dev,
                    )?));
                }
                c_in = c_out;
                i += 1;
            }
        }
        if range.contains(&i) {
            v.push(Box::new(GlobalAvgPool));
        }
        if range.contains(&(i + 1)) {
            v.push(Box::new(Linear::new(
                c_in,
                self.num_classes,
                seed_of(i),
                dev,
            )?));
        }
        Ok(v)
    }
}

impl super::BuildsRanges for ResNet {
    fn num_layers(&self) -> usize {
        ResNet::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: std::ops::Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        ResNet::build_range(self, seed, range, dev)
    }
}
