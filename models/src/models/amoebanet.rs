//! AmoebaNet-D (Real et al. 2019), the image model of the GPipe paper, as a layer sequence:
//! `[stem, Normal x N, Reduction, Normal x N, Reduction, Normal x N, ReLU+GlobalAvgPool,
//! Linear head]`; the cells have `filters` channels per state in the first third, doubled by
//! each reduction cell.
//!
//! Every cell reads two inputs: `h_{i-1}`, the previous cell's output (its sequence input), and
//! `h_{i-2}`, the output of the cell before that, which is the previous cell's *input*: each cell
//! stashes its input as a skip (`"cell{j}.input"`) and the next one pops it (see
//! [`wgpipe_autograd::skips`]), so a pipeline carries `h_{i-2}` from stage to stage directly.
//! The first cell reads the stem's output for both.
//!
//! A cell preprocesses `h_{i-1}` (ReLU, 1x1 conv, BN) and `h_{i-2}` (the same when its channels
//! differ; a factorized reduction when the previous cell halved the resolution) into states 0
//! and 1, then makes 5 states, each the sum of two ops on earlier states (pairs below), and
//! outputs the concatenation of some states along the channels. The genotype is the reference
//! AmoebaNet-D of TensorFlow's TPU models, which GPipe trained (torchgpipe's benchmark uses it
//! too, and reproduces GPipe's Table 1 parameter counts with it):
//!
//! | cell      | pairs (state: op)                                                          | output    |
//! |-----------|----------------------------------------------------------------------------|-----------|
//! | normal    | 1: conv1x1 + 1: maxpool3x3; 1: id + 0: conv1x7-7x1; 0: conv1x1 + 0: conv1x7-7x1; 2: maxpool3x3 + 2: id; 1: avgpool3x3 + 5: conv1x1 | 0, 3, 4, 6 |
//! | reduction | 0: maxpool2x2 + 0: maxpool3x3; 2: id + 1: conv3x3; 2: conv1x7-7x1 + 2: maxpool3x3; 3: id + 1: maxpool2x2; 2: avgpool3x3 + 3: conv1x1 | 4, 5, 6 |
//!
//! In a reduction cell the ops on states 0 and 1 have stride 2 (an identity there is a
//! factorized reduction). `conv1x1` is ReLU, 1x1 conv, BN; `conv1x7-7x1` and `conv3x3` are
//! bottlenecks (1x1 to C/4, then 1x7 and 7x1 or 3x3, then 1x1 back to C, each conv after a
//! ReLU and before a BN). Convolutions have no bias.
//!
//! The stem is the small-image one (3x3 conv, BN, full resolution), not ImageNet's (a strided
//! conv and two reduction cells). Input `[N, in_channels, H, W]` with H, W divisible by 4;
//! output logits `[N, num_classes]`.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Skips, Var};
use wgpipe_tensor::ops::Conv2dParams;
use wgpipe_tensor::{Device, Error, Result};

use super::resnet::conv;
use crate::init::sub_seed;
use crate::layers::{
    prefix, AvgPool2d, BatchNorm2d, Conv2d, GlobalAvgPool, Linear, MaxPool2d, Relu, Sequential,
};

#[derive(Debug, Clone, PartialEq)]
pub struct AmoebaNet {
    /// Normal cells per third (GPipe's `L` is 3 x this).
    pub normal_cells: usize,
    /// Channels per cell state in the first third, also the stem's output channels (GPipe's
    /// `D` is 4 x this: torchgpipe's `num_filters // 4`).
    pub filters: usize,
    pub num_classes: usize,
    pub in_channels: usize,
}

/// The identity (a cell edge without an op).
#[derive(Debug, Clone, Copy, Default)]
pub struct Identity;

impl Module for Identity {
    fn name(&self) -> String {
        "Identity".into()
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        Ok(x.clone())
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// A convolution without bias: kernel `(kh, kw)`, stride `(sh, sw)`, padding half the kernel.
fn conv_rect(
    c_in: usize,
    c_out: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    seed: u64,
    dev: &Device,
) -> Result<Conv2d> {
    let params = Conv2dParams {
        stride,
        padding: (kernel.0 / 2, kernel.1 / 2),
        ..Conv2dParams::default()
    };
    Conv2d::with_params(c_in, c_out, kernel, params, false, seed, dev)
}

/// ReLU → `k x k` conv (stride) → BN, `c_in -> c_out` channels.
pub fn relu_conv_bn(
    c_in: usize,
    c_out: usize,
    k: usize,
    stride: usize,
    seed: u64,
    dev: &Device,
) -> Result<Sequential> {
    Ok(
        Sequential::new(format!("ReluConvBn{k}x{k}/{stride}({c_in}->{c_out})"))
            .with("relu", Relu)
            .with("conv", conv(c_in, c_out, k, stride, 1, seed, dev)?)
            .with("bn", BatchNorm2d::new(c_out, dev)?),
    )
}

/// A bottleneck: 1x1 to `c/4`, then `kernels` (each a ReLU, conv, BN; the stride on the axis
/// each kernel spans), then 1x1 back to `c`.
fn bottleneck(
    label: &str,
    c: usize,
    kernels: &[(usize, usize)],
    stride: usize,
    seed: u64,
    dev: &Device,
) -> Result<Sequential> {
    let q = (c / 4).max(1);
    let mut s = Sequential::new(format!("{label}/{stride}({c})"))
        .with("relu0", Relu)
        .with("conv0", conv(c, q, 1, 1, 1, sub_seed(seed, 0), dev)?)
        .with("bn0", BatchNorm2d::new(q, dev)?);
    for (i, &(kh, kw)) in kernels.iter().enumerate() {
        let st = (
            if kh > 1 { stride } else { 1 },
            if kw > 1 { stride } else { 1 },
        );
        let n = i + 1;
        s = s
            .with(format!("relu{n}"), Relu)
            .with(
                format!("conv{n}"),
                conv_rect(q, q, (kh, kw), st, sub_seed(seed, n as u64), dev)?,
            )
            .with(format!("bn{n}"), BatchNorm2d::new(q, dev)?);
    }
    let n = kernels.len() + 1;
    Ok(s.with(format!("relu{n}"), Relu)
        .with(
            format!("conv{n}"),
            conv(q, c, 1, 1, 1, sub_seed(seed, n as u64), dev)?,
        )
        .with(format!("bn{n}"), BatchNorm2d::new(c, dev)?))
}

/// Halves the resolution without losing the odd pixels: ReLU, then two 1x1 convs of stride 2
/// (to `c_out / 2` channels each), one on the input and one on it shifted by one pixel down and
/// right, concatenated, then BN. The input's height and width must be even.
pub struct FactorizedReduce {
    a: Conv2d,
    b: Conv2d,
    bn: BatchNorm2d,
    c_in: usize,
    c_out: usize,
}

impl FactorizedReduce {
    pub fn new(c_in: usize, c_out: usize, seed: u64, dev: &Device) -> Result<Self> {
        if !c_out.is_multiple_of(2) {
            return Err(Error::Invalid {
                op: "FactorizedReduce",
                msg: format!("needs an even number of output channels, got {c_out}"),
            });
        }
        Ok(FactorizedReduce {
            a: conv(c_in, c_out / 2, 1, 2, 1, sub_seed(seed, 0), dev)?,
            b: conv(c_in, c_out / 2, 1, 2, 1, sub_seed(seed, 1), dev)?,
            bn: BatchNorm2d::new(c_out, dev)?,
            c_in,
            c_out,
        })
    }

    fn children(&self) -> [(&str, &dyn Module); 3] {
        [("a", &self.a), ("b", &self.b), ("bn", &self.bn)]
    }
}

impl Module for FactorizedReduce {
    fn name(&self) -> String {
        format!("FactorizedReduce({}->{})", self.c_in, self.c_out)
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let s = x.shape().to_vec();
        if s.len() != 4 || !s[2].is_multiple_of(2) || !s[3].is_multiple_of(2) {
            return Err(Error::Shape {
                op: "FactorizedReduce",
                msg: format!("needs [N, C, H, W] with H and W even, got {s:?}"),
            });
        }
        let x = x.relu()?;
        // With H even, the shifted half (rows and columns 1, 3, ...) needs no padding.
        let shifted = x.narrow(2, 1, s[2] - 1)?.narrow(3, 1, s[3] - 1)?;
        let y = Var::concat(
            &[&self.a.forward(&x, ctx)?, &self.b.forward(&shifted, ctx)?],
            1,
        )?;
        self.bn.forward(&y, ctx)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.children()
            .into_iter()
            .flat_map(|(n, m)| prefix(n, m.parameters()))
            .collect()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        prefix("bn", self.bn.buffers())
    }
    fn set_train(&mut self, train: bool) {
        self.bn.set_train(train);
    }
    fn finish_step(&self) -> Result<()> {
        self.bn.finish_step()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let a = self.a.cost(input_shape);
        let out = vec![
            a.output_shape[0],
            self.c_out,
            a.output_shape[2],
            a.output_shape[3],
        ];
        let bn = self.bn.cost(&out);
        CostHint {
            param_bytes: 2 * a.param_bytes + bn.param_bytes,
            flops: 2.0 * a.flops + bn.flops,
            activation_bytes: 2 * a.activation_bytes + bn.activation_bytes,
            output_shape: out,
        }
    }
}

/// The ops of the genotype.
#[derive(Debug, Clone, Copy)]
enum Op {
    None,
    Conv1x1,
    Conv3x3,
    Conv1x7x7x1,
    Max3,
    Max2,
    Avg3,
}

impl Op {
    fn build(self, c: usize, stride: usize, seed: u64, dev: &Device) -> Result<Box<dyn Module>> {
        Ok(match self {
            Op::None if stride == 1 => Box::new(Identity),
            Op::None => Box::new(FactorizedReduce::new(c, c, seed, dev)?),
            Op::Conv1x1 => Box::new(relu_conv_bn(c, c, 1, stride, seed, dev)?),
            Op::Conv3x3 => Box::new(bottleneck("Conv3x3", c, &[(3, 3)], stride, seed, dev)?),
            Op::Conv1x7x7x1 => Box::new(bottleneck(
                "Conv1x7-7x1",
                c,
                &[(1, 7), (7, 1)],
                stride,
                seed,
                dev,
            )?),
            Op::Max3 => Box::new(MaxPool2d::new(3, stride, 1)),
            Op::Max2 => Box::new(MaxPool2d::new(2, stride, 0)),
            Op::Avg3 => Box::new(AvgPool2d::new(3, stride, 1)),
        })
    }
}

/// AmoebaNet-D's normal cell: (input state, op) for the two edges of each new state, and the
/// states concatenated into the output.
const NORMAL: [(usize, Op); 10] = [
    (1, Op::Conv1x1),
    (1, Op::Max3),
    (1, Op::None),
    (0, Op::Conv1x7x7x1),
    (0, Op::Conv1x1),
    (0, Op::Conv1x7x7x1),
    (2, Op::Max3),
    (2, Op::None),
    (1, Op::Avg3),
    (5, Op::Conv1x1),
];
const NORMAL_CONCAT: [usize; 4] = [0, 3, 4, 6];
const REDUCTION: [(usize, Op); 10] = [
    (0, Op::Max2),
    (0, Op::Max3),
    (2, Op::None),
    (1, Op::Conv3x3),
    (2, Op::Conv1x7x7x1),
    (2, Op::Max3),
    (3, Op::None),
    (1, Op::Max2),
    (2, Op::Avg3),
    (3, Op::Conv1x1),
];
const REDUCTION_CONCAT: [usize; 3] = [4, 5, 6];

/// The shape of a cell: its channels and those of its two inputs, and whether it or the cell
/// before it reduces the resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellShape {
    /// Channels of `h_{i-2}`.
    pub c_prev_prev: usize,
    /// Channels of `h_{i-1}`.
    pub c_prev: usize,
    /// Channels of each state (the output has `c` x the concatenated states).
    pub c: usize,
    pub reduction: bool,
    /// The previous cell reduced: `h_{i-2}` has twice `h_{i-1}`'s resolution.
    pub reduction_prev: bool,
}

impl CellShape {
    /// Channels of the cell's output.
    pub fn c_out(&self) -> usize {
        let states = if self.reduction {
            REDUCTION_CONCAT.len()
        } else {
            NORMAL_CONCAT.len()
        };
        self.c * states
    }
}

/// One AmoebaNet-D cell (see the module docs). Parameters `pre1.*`, `pre2.*`, `op{i}.*`.
pub struct Cell {
    shape: CellShape,
    pre1: Sequential,
    pre2: Box<dyn Module>,
    ops: Vec<(usize, Box<dyn Module>)>,
    concat: &'static [usize],
    /// The skip holding `h_{i-2}` (`None`: the first cell, which reads its input twice).
    pop: Option<String>,
    /// The skip it stashes its input into, for the next cell (`None` for the last cell).
    stash: Option<String>,
}

impl Cell {
    /// A cell of `shape` popping `h_{i-2}` from skip `pop` and stashing its input as `stash`.
    pub fn new(
        shape: CellShape,
        pop: Option<String>,
        stash: Option<String>,
        seed: u64,
        dev: &Device,
    ) -> Result<Cell> {
        let CellShape {
            c_prev_prev,
            c_prev,
            c,
            reduction,
            reduction_prev,
        } = shape;
        let pre1 = relu_conv_bn(c_prev, c, 1, 1, sub_seed(seed, 0), dev)?;
        let pre2: Box<dyn Module> = if reduction_prev {
            Box::new(FactorizedReduce::new(
                c_prev_prev,
                c,
                sub_seed(seed, 1),
                dev,
            )?)
        } else if c_prev_prev != c {
            Box::new(relu_conv_bn(c_prev_prev, c, 1, 1, sub_seed(seed, 1), dev)?)
        } else {
            Box::new(Identity)
        };
        let (genotype, concat): (&[(usize, Op)], &'static [usize]) = if reduction {
            (&REDUCTION, &REDUCTION_CONCAT)
        } else {
            (&NORMAL, &NORMAL_CONCAT)
        };
        let ops = genotype
            .iter()
            .enumerate()
            .map(|(i, &(input, op))| {
                let stride = if reduction && input < 2 { 2 } else { 1 };
                Ok((
                    input,
                    op.build(c, stride, sub_seed(seed, 2 + i as u64), dev)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Cell {
            shape,
            pre1,
            pre2,
            ops,
            concat,
            pop,
            stash,
        })
    }

    pub fn shape(&self) -> CellShape {
        self.shape
    }

    fn named(&self) -> Vec<(String, &dyn Module)> {
        let mut v: Vec<(String, &dyn Module)> = vec![
            ("pre1".into(), &self.pre1),
            ("pre2".into(), self.pre2.as_ref()),
        ];
        for (i, (_, op)) in self.ops.iter().enumerate() {
            v.push((format!("op{i}"), op.as_ref()));
        }
        v
    }

    /// The cell on `h1` = `h_{i-1}` and `h2` = `h_{i-2}`.
    fn run(&self, h1: &Var, h2: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let mut states = vec![self.pre1.forward(h1, ctx)?, self.pre2.forward(h2, ctx)?];
        for pair in self.ops.chunks(2) {
            let a = pair[0].1.forward(&states[pair[0].0], ctx)?;
            let b = pair[1].1.forward(&states[pair[1].0], ctx)?;
            states.push(a.add(&b)?);
        }
        let out: Vec<&Var> = self.concat.iter().map(|&i| &states[i]).collect();
        Var::concat(&out, 1)
    }
}

impl Module for Cell {
    fn name(&self) -> String {
        let kind = if self.shape.reduction {
            "ReductionCell"
        } else {
            "NormalCell"
        };
        format!("{kind}({}->{})", self.shape.c_prev, self.shape.c_out())
    }
    /// The cell alone (no skips): `h_{i-2}` = `h_{i-1}` = `x`, as for the first cell.
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if let Some(pop) = &self.pop {
            return Err(Error::Invalid {
                op: "AmoebaNet cell",
                msg: format!("{} reads h_(i-2) from skip '{pop}': run it in its sequence (forward_all or a pipeline)", self.name()),
            });
        }
        self.run(x, x, ctx)
    }
    fn skips(&self) -> Skips {
        Skips {
            pops: self.pop.iter().cloned().collect(),
            stashes: self.stash.iter().cloned().collect(),
        }
    }
    fn forward_skips(&self, x: &Var, popped: &[Var], ctx: &ForwardCtx) -> Result<(Var, Vec<Var>)> {
        let h2 = popped.first().unwrap_or(x);
        let y = self.run(x, h2, ctx)?;
        let stashed = self.stash.iter().map(|_| x.clone()).collect();
        Ok((y, stashed))
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.named()
            .into_iter()
            .flat_map(|(n, m)| prefix(&n, m.parameters()))
            .collect()
    }
    fn buffers(&self) -> Vec<(String, Param)> {
        self.named()
            .into_iter()
            .flat_map(|(n, m)| prefix(&n, m.buffers()))
            .collect()
    }
    fn set_train(&mut self, train: bool) {
        self.pre1.set_train(train);
        self.pre2.set_train(train);
        for (_, op) in &mut self.ops {
            op.set_train(train);
        }
    }
    fn finish_step(&self) -> Result<()> {
        self.named()
            .into_iter()
            .try_for_each(|(_, m)| m.finish_step())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut total = self.pre1.cost(input_shape);
        // `h_{i-2}`: twice the resolution after a reduction cell.
        let mut prev_prev = input_shape.to_vec();
        prev_prev[1] = self.shape.c_prev_prev;
        if self.shape.reduction_prev {
            prev_prev[2] *= 2;
            prev_prev[3] *= 2;
        }
        let c2 = self.pre2.cost(&prev_prev);
        let mut shapes = vec![total.output_shape.clone(), c2.output_shape.clone()];
        let add = |total: &mut CostHint, c: &CostHint| {
            total.param_bytes += c.param_bytes;
            total.flops += c.flops;
            total.activation_bytes += c.activation_bytes;
        };
        add(&mut total, &c2);
        for pair in self.ops.chunks(2) {
            let ca = pair[0].1.cost(&shapes[pair[0].0]);
            let cb = pair[1].1.cost(&shapes[pair[1].0]);
            add(&mut total, &ca);
            add(&mut total, &cb);
            total.flops += ca.output_shape.iter().product::<usize>() as f64;
            shapes.push(ca.output_shape);
        }
        let mut out = shapes[self.concat[0]].clone();
        out[1] = self.shape.c_out();
        total.output_shape = out;
        total
    }
}

impl AmoebaNet {
    /// The number of layers: the stem, the 3N + 2 cells, the pooling and the head.
    pub fn num_layers(&self) -> usize {
        3 * self.normal_cells + 5
    }

    /// Element `i` is initialised from `sub_seed(seed, i)`: the stem, the 3N + 2 cells, the
    /// pooling and the head.
    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        self.build_range(seed, 0..self.num_layers(), dev)
    }

    /// Layers `range` of [`AmoebaNet::build`]'s sequence alone, with the same values: a rank
    /// builds only its stages' layers.
    pub fn build_range(
        &self,
        seed: u64,
        range: std::ops::Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        if self.filters == 0 || self.num_classes == 0 || self.in_channels == 0 {
            return Err(Error::Invalid {
                op: "AmoebaNet",
                msg: format!("filters, classes and in_channels must be positive: {self:?}"),
            });
        }
        if !self.filters.is_multiple_of(2) {
            return Err(Error::Invalid {
                op: "AmoebaNet",
                msg: format!("filters must be even (factorized reductions halve them): {self:?}"),
            });
        }
        super::check_range("AmoebaNet", &range, self.num_layers())?;
        let f = self.filters;
        let mut v: Vec<Box<dyn Module>> = Vec::with_capacity(range.len());
        if range.contains(&0) {
            v.push(Box::new(
                Sequential::new(format!("Stem({}->{f})", self.in_channels))
                    .with(
                        "conv",
                        conv(self.in_channels, f, 3, 1, 1, sub_seed(seed, 0), dev)?,
                    )
                    .with("bn", BatchNorm2d::new(f, dev)?),
            ));
        }
        let n = self.normal_cells;
        let reductions = [n, 2 * n + 1];
        let cells = 3 * n + 2;
        // The channels are followed through every cell; only those in `range` are built.
        let (mut c_prev_prev, mut c_prev, mut c) = (f, f, f);
        let mut reduction_prev = false;
        for j in 0..cells {
            let reduction = reductions.contains(&j);
            if reduction {
                c *= 2;
            }
            let shape = CellShape {
                c_prev_prev,
                c_prev,
                c,
                reduction,
                reduction_prev,
            };
            if range.contains(&(1 + j)) {
                let pop = (j > 0).then(|| format!("cell{}.input", j - 1));
                let stash = (j + 1 < cells).then(|| format!("cell{j}.input"));
                let cell = Cell::new(shape, pop, stash, sub_seed(seed, 1 + j as u64), dev)?;
                v.push(Box::new(cell));
            }
            c_prev_prev = c_prev;
            c_prev = shape.c_out();
            reduction_prev = reduction;
        }
        if range.contains(&(1 + cells)) {
            v.push(Box::new(
                Sequential::new("ReLU+GlobalAvgPool")
                    .with("relu", Relu)
                    .with("pool", GlobalAvgPool),
            ));
        }
        if range.contains(&(2 + cells)) {
            v.push(Box::new(Linear::new(
                c_prev,
                self.num_classes,
                sub_seed(seed, 2 + cells as u64),
                dev,
            )?));
        }
        Ok(v)
    }
}

impl super::BuildsRanges for AmoebaNet {
    fn num_layers(&self) -> usize {
        AmoebaNet::num_layers(self)
    }
    fn build_range(
        &self,
        seed: u64,
        range: std::ops::Range<usize>,
        dev: &Device,
    ) -> Result<Vec<Box<dyn Module>>> {
        AmoebaNet::build_range(self, seed, range, dev)
    }
}
