//! An AmoebaNet-D-style CNN (the image model of the GPipe paper) as a layer sequence:
//! `[stem, Normal x N, Reduction, Normal x N, Reduction, Normal x N, ReLU+GlobalAvgPool,
//! Linear head]`, `filters` channels in the first stage, doubled by each reduction cell.
//!
//! Cells are built from separable convolutions (ReLU → depthwise k x k → pointwise 1x1 → BN),
//! 3x3 max and average pooling, identities and additions, as AmoebaNet's are. Simplifications,
//! so that each cell is one sequence element with one input (what a pipeline cuts between):
//!
//! * AmoebaNet's cells take two inputs (the outputs of the two previous cells); here a cell
//!   takes only the previous cell's output, so every "hidden state" a real cell would read from
//!   the cell before last reads the (pre-processed) previous output instead.
//! * A cell's output is the *sum* of its unused hidden states, not their concatenation (so a
//!   cell's width stays `C` and no extra 1x1 reduction is needed).
//! * Each separable convolution is applied once, not stacked twice.
//!
//! Cell wiring (`s0` = ReLU → 1x1 conv → BN of the input, to the cell's channels):
//!
//! | node | normal cell (stride 1)        | reduction cell (`s0` → stride 2)       |
//! |------|-------------------------------|----------------------------------------|
//! | n1   | sep3x3(s0) + s0               | maxpool3x3/2(s0) + sep3x3/2(s0)        |
//! | n2   | avgpool3x3(s0) + sep5x5(s0)   | avgpool3x3/2(s0) + sep5x5/2(s0)        |
//! | n3   | maxpool3x3(n1) + sep3x3(n2)   | sep3x3(n1) + maxpool3x3(n2)            |
//! | n4   | avgpool3x3(n2) + n1           | avgpool3x3(n1) + n2                    |
//! | out  | n3 + n4                       | n3 + n4                                |
//!
//! Input `[N, in_channels, H, W]` (H, W divisible by 4), output logits `[N, num_classes]`.

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_tensor::{Device, Error, Result};

use super::resnet::conv;
use crate::init::sub_seed;
use crate::layers::{
    prefix, AvgPool2d, BatchNorm2d, GlobalAvgPool, Linear, MaxPool2d, Relu, Sequential,
};

#[derive(Debug, Clone, PartialEq)]
pub struct AmoebaNet {
    /// Normal cells per stage (GPipe's `L`; 3 stages).
    pub normal_cells: usize,
    /// Channels of the first stage (GPipe's `D`).
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
        CostHint {
            output_shape: input_shape.to_vec(),
            ..CostHint::default()
        }
    }
}

/// ReLU → depthwise `k x k` (stride) → pointwise 1x1 → BN; parameters `dw.*`, `pw.*`, `bn.*`.
pub fn sep_conv(c: usize, k: usize, stride: usize, seed: u64, dev: &Device) -> Result<Sequential> {
    Ok(Sequential::new(format!("SepConv{k}x{k}/{stride}({c})"))
        .with("relu", Relu)
        .with("dw", conv(c, c, k, stride, c, sub_seed(seed, 0), dev)?)
        .with("pw", conv(c, c, 1, 1, 1, sub_seed(seed, 1), dev)?)
        .with("bn", BatchNorm2d::new(c, dev)?))
}

/// Which op an edge applies.
#[derive(Debug, Clone, Copy)]
enum Op {
    Id,
    Sep(usize),
    Max,
    Avg,
}

/// One edge: the state it reads (0 = `s0`, `i` = node `n_i`) and its op.
struct Edge {
    input: usize,
    op: Box<dyn Module>,
}

/// A cell: `prep` makes `s0`; node `i` is the sum of its two edges; the output is the sum of
/// the states in `outputs`. Parameters `prep.*`, `n{i}.{a,b}.*`.
pub struct Cell {
    label: String,
    prep: Sequential,
    nodes: Vec<[Edge; 2]>,
    outputs: Vec<usize>,
}

impl Cell {
    fn build(
        label: String,
        c_in: usize,
        c: usize,
        wiring: &[[(usize, Op, usize); 2]],
        outputs: Vec<usize>,
        seed: u64,
        dev: &Device,
    ) -> Result<Cell> {
        let prep = Sequential::new("prep")
            .with("relu", Relu)
            .with("conv", conv(c_in, c, 1, 1, 1, sub_seed(seed, 0), dev)?)
            .with("bn", BatchNorm2d::new(c, dev)?);
        let mut nodes = Vec::new();
        for (i, edges) in wiring.iter().enumerate() {
            let mk = |j: usize| -> Result<Edge> {
                let (input, op, stride) = edges[j];
                let s = sub_seed(seed, 1 + 2 * i as u64 + j as u64);
                let op: Box<dyn Module> = match op {
                    Op::Id => Box::new(Identity),
                    Op::Sep(k) => Box::new(sep_conv(c, k, stride, s, dev)?),
                    Op::Max => Box::new(MaxPool2d::new(3, stride, 1)),
                    Op::Avg => Box::new(AvgPool2d::new(3, stride, 1)),
                };
                Ok(Edge { input, op })
            };
            nodes.push([mk(0)?, mk(1)?]);
        }
        Ok(Cell {
            label,
            prep,
            nodes,
            outputs,
        })
    }

    /// A normal cell, `c -> c` channels, same resolution.
    pub fn normal(c: usize, seed: u64, dev: &Device) -> Result<Cell> {
        use Op::*;
        let wiring = [
            [(0, Sep(3), 1), (0, Id, 1)],
            [(0, Avg, 1), (0, Sep(5), 1)],
            [(1, Max, 1), (2, Sep(3), 1)],
            [(2, Avg, 1), (1, Id, 1)],
        ];
        Cell::build(
            format!("NormalCell({c})"),
            c,
            c,
            &wiring,
            vec![3, 4],
            seed,
            dev,
        )
    }

    /// A reduction cell, `c_in -> c` channels, half the resolution.
    pub fn reduction(c_in: usize, c: usize, seed: u64, dev: &Device) -> Result<Cell> {
        use Op::*;
        let wiring = [
            [(0, Max, 2), (0, Sep(3), 2)],
            [(0, Avg, 2), (0, Sep(5), 2)],
            [(1, Sep(3), 1), (2, Max, 1)],
            [(1, Avg, 1), (2, Id, 1)],
        ];
        let label = format!("ReductionCell({c_in}->{c})");
        Cell::build(label, c_in, c, &wiring, vec![3, 4], seed, dev)
    }

    fn named(&self) -> Vec<(String, &dyn Module)> {
        let mut v: Vec<(String, &dyn Module)> = vec![("prep".into(), &self.prep)];
        for (i, [a, b]) in self.nodes.iter().enumerate() {
            v.push((format!("n{}.a", i + 1), a.op.as_ref()));
            v.push((format!("n{}.b", i + 1), b.op.as_ref()));
        }
        v
    }

    fn named_mut(&mut self) -> Vec<&mut Box<dyn Module>> {
        self.nodes
            .iter_mut()
            .flat_map(|[a, b]| [&mut a.op, &mut b.op])
            .collect()
    }
}

impl Module for Cell {
    fn name(&self) -> String {
        self.label.clone()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let mut states = vec![self.prep.forward(x, ctx)?];
        for [a, b] in &self.nodes {
            let ya = a.op.forward(&states[a.input], ctx)?;
            let yb = b.op.forward(&states[b.input], ctx)?;
            states.push(ya.add(&yb)?);
        }
        let mut out = states[self.outputs[0]].clone();
        for &o in &self.outputs[1..] {
            out = out.add(&states[o])?;
        }
        Ok(out)
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
        self.prep.set_train(train);
        for m in self.named_mut() {
            m.set_train(train);
        }
    }
    fn finish_step(&self) -> Result<()> {
        self.named()
            .into_iter()
            .try_for_each(|(_, m)| m.finish_step())
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let mut total = self.prep.cost(input_shape);
        let mut shapes = vec![total.output_shape.clone()];
        for [a, b] in &self.nodes {
            let ca = a.op.cost(&shapes[a.input]);
            let cb = b.op.cost(&shapes[b.input]);
            for c in [&ca, &cb] {
                total.param_bytes += c.param_bytes;
                total.flops += c.flops;
                total.activation_bytes += c.activation_bytes;
            }
            total.flops += ca.output_shape.iter().product::<usize>() as f64;
            shapes.push(ca.output_shape);
        }
        let out = shapes[self.outputs[0]].clone();
        total.flops += ((self.outputs.len() - 1) * out.iter().product::<usize>()) as f64;
        total.output_shape = out;
        total
    }
}

impl AmoebaNet {
    /// Element `i` is initialised from `sub_seed(seed, i)`.
    pub fn build(&self, seed: u64, dev: &Device) -> Result<Vec<Box<dyn Module>>> {
        if self.filters == 0 || self.num_classes == 0 || self.in_channels == 0 {
            return Err(Error::Invalid {
                op: "AmoebaNet",
                msg: format!("filters, classes and in_channels must be positive: {self:?}"),
            });
        }
        let mut k = 0u64;
        let mut next = || {
            k += 1;
            sub_seed(seed, k - 1)
        };
        let f = self.filters;
        let mut v: Vec<Box<dyn Module>> = Vec::new();
        v.push(Box::new(
            Sequential::new(format!("Stem({}->{f})", self.in_channels))
                .with("conv", conv(self.in_channels, f, 3, 1, 1, next(), dev)?)
                .with("bn", BatchNorm2d::new(f, dev)?),
        ));
        let mut c = f;
        for stage in 0..3 {
            if stage > 0 {
                v.push(Box::new(Cell::reduction(c, 2 * c, next(), dev)?));
                c *= 2;
            }
            for _ in 0..self.normal_cells {
                v.push(Box::new(Cell::normal(c, next(), dev)?));
            }
        }
        v.push(Box::new(
            Sequential::new("ReLU+GlobalAvgPool")
                .with("relu", Relu)
                .with("pool", GlobalAvgPool),
        ));
        v.push(Box::new(Linear::new(c, self.num_classes, next(), dev)?));
        Ok(v)
    }
}
