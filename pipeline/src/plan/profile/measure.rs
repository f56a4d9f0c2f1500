//! The measured dry run: each layer (and the loss) run on the profiling device, its FLOPs,
//! bytes and, where asked, times read off the device's counters.

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{ForwardCtx, Module, Param, Tape, Var};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{PipelineError, Result};
use crate::LossFn;

use super::ProfileRun;

/// One layer's measurements at one micro-batch size.
#[derive(Default)]
pub(super) struct Point {
    pub(super) forward_flops: f64,
    pub(super) backward_flops: f64,
    pub(super) backward_input_flops: f64,
    pub(super) backward_weight_flops: f64,
    pub(super) accumulate_flops: f64,
    pub(super) backward_flops_from_data: f64,
    pub(super) backward_input_flops_from_data: f64,
    pub(super) param_bytes: u64,
    pub(super) grad_bytes: u64,
    pub(super) stash: f64,
    pub(super) forward_extra: f64,
    pub(super) no_grad_peak: f64,
    pub(super) forward_residue: f64,
    pub(super) backward_extra: f64,
    pub(super) backward_input_extra: f64,
    pub(super) weight_keep: f64,
    pub(super) backward_weight_extra: f64,
    pub(super) output_bytes: f64,
    /// Seconds of the forward, full backward, input part, weight part (0 when not timed).
    pub(super) times: [f64; 4],
}

pub(super) struct LossPoint {
    pub(super) flops: f64,
    pub(super) peak: f64,
    pub(super) kept: f64,
    pub(super) secs: f64,
}

/// Counters of the profiling device: FLOPs and live bytes now, peak since `mark`.
struct Meter<'a> {
    dev: &'a Device,
    flops0: u64,
    live0: usize,
}

impl<'a> Meter<'a> {
    fn mark(dev: &'a Device) -> Meter<'a> {
        dev.memory().reset_peak();
        Meter {
            dev,
            flops0: dev.flops(),
            live0: dev.memory_stats().live,
        }
    }
    fn flops(&self) -> f64 {
        (self.dev.flops() - self.flops0) as f64
    }
    /// Live bytes now minus at the mark.
    fn grown(&self) -> f64 {
        self.dev.memory_stats().live as f64 - self.live0 as f64
    }
    /// Peak since the mark minus live at the mark.
    fn peak(&self) -> f64 {
        self.dev.memory_stats().peak as f64 - self.live0 as f64
    }
}

pub(super) fn bytes_of(t: &Tensor) -> f64 {
    crate::sim::wire_bytes(t) as f64
}

/// The tensors the layers stashed so far, by skip name.
pub(super) type Stashed = Vec<(String, Tensor)>;

/// Measures every layer on `x` (b samples) in turn, each popping layer on the tensors its
/// producers stashed, then the loss on the last output. Also returns every stashed tensor.
pub(super) fn run_at(
    layers: &[Box<dyn Module>],
    x: &Tensor,
    y: &Tensor,
    loss_fn: &LossFn,
    first_trainable: usize,
    dev: &Device,
    run: ProfileRun,
) -> Result<(Vec<Point>, LossPoint, f64, Stashed)> {
    let input_bytes = bytes_of(x);
    let mut h = x.clone();
    let mut stashed: Stashed = Vec::new();
    let mut points = Vec::with_capacity(layers.len());
    let mut cases = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let kept = LayerState::take(l.as_ref());
        // `resolve_skips` checked that each pop has an earlier stash.
        let popped: Vec<Tensor> = l
            .skips()
            .pops
            .iter()
            .filter_map(|n| stashed.iter().find(|(s, _)| s == n).map(|(_, t)| t.clone()))
            .collect();
        let ctx = ctx(i, run.compute);
        let (point, out, stashes) =
            measure_layer(l.as_ref(), &h, &popped, ctx, i <= first_trainable, dev);
        stashed.extend(l.skips().stashes.into_iter().zip(stashes));
        kept.restore(l.as_ref());
        let (point, seeds) = point.map_err(|e| layer_error(i, l.as_ref(), e))?;
        points.push(point);
        if run.reps > 0 {
            cases.push(TimedCase {
                x: h,
                popped,
                ctx,
                seeds,
            });
        }
        h = out;
    }
    let mut loss = measure_loss(&h, y, loss_fn, dev)?;
    if run.reps > 0 {
        let (times, loss_secs) = time_interleaved(layers, &cases, (&h, y, loss_fn), run.reps, dev)?;
        for (p, t) in points.iter_mut().zip(times) {
            p.times = t;
        }
        loss.secs = loss_secs;
    }
    Ok((points, loss, input_bytes, stashed))
}

fn layer_error(i: usize, l: &dyn Module, e: wgpipe_tensor::Error) -> PipelineError {
    PipelineError::Config(format!("profiling layer {i} ({}): {e}", l.name()))
}

/// A layer's parameter gradients and buffers, taken before its dry runs (which leave the
/// gradients zeroed) and put back after them.
struct LayerState {
    grads: Vec<(Param, Option<Tensor>)>,
    buffers: Vec<(Param, Tensor)>,
}

impl LayerState {
    fn take(l: &dyn Module) -> LayerState {
        LayerState {
            grads: l
                .parameters()
                .into_iter()
                .map(|(_, p)| {
                    let g = p.grad();
                    p.zero_grad();
                    (p, g)
                })
                .collect(),
            buffers: l
                .buffers()
                .into_iter()
                .map(|(_, b)| {
                    let v = b.value();
                    (b, v)
                })
                .collect(),
        }
    }

    fn restore(self, l: &dyn Module) {
        for (p, g) in self.grads {
            p.set_grad(g);
        }
        // Statistics the dry runs recorded (batch norm) are applied, then undone.
        let _ = l.finish_step();
        for (b, v) in self.buffers {
            b.set_value(v);
        }
    }
}

/// What timing a layer runs on: its input, popped skips, context and backward seeds.
struct TimedCase {
    x: Tensor,
    popped: Vec<Tensor>,
    ctx: ForwardCtx,
    seeds: Seeds,
}

/// The backward seeds of a layer: its output's and its stashed skips'.
struct Seeds {
    output: Tensor,
    skips: Vec<Tensor>,
}

/// Median seconds of each layer's four timed parts ([`time_layer_once`]) and of the loss over
/// `reps` rounds, each round timing every layer once and then the loss: a burst of other work
/// on a shared machine lands on one round of several layers, which the medians drop, instead of
/// on every repetition of one layer.
fn time_interleaved(
    layers: &[Box<dyn Module>],
    cases: &[TimedCase],
    (out, y, loss_fn): (&Tensor, &Tensor, &LossFn),
    reps: usize,
    dev: &Device,
) -> Result<(Vec<[f64; 4]>, f64)> {
    let kept: Vec<LayerState> = layers
        .iter()
        .map(|l| LayerState::take(l.as_ref()))
        .collect();
    let mut layer_times = vec![[const { Vec::new() }; 4]; cases.len()];
    let mut loss_times = Vec::with_capacity(reps);
    let timed = (|| -> Result<()> {
        for _ in 0..reps {
            for (i, (l, case)) in layers.iter().zip(cases).enumerate() {
                let t = time_layer_once(l.as_ref(), case, dev)
                    .map_err(|e| layer_error(i, l.as_ref(), e))?;
                for (all, t) in layer_times[i].iter_mut().zip(t) {
                    all.push(t);
                }
            }
            dev.synchronize()?;
            let clock = std::time::Instant::now();
            measure_loss(out, y, loss_fn, dev)?;
            dev.synchronize()?;
            loss_times.push(clock.elapsed().as_secs_f64());
        }
        Ok(())
    })();
    for (l, k) in layers.iter().zip(kept) {
        k.restore(l.as_ref());
    }
    timed?;
    let times = layer_times
        .into_iter()
        .map(|t| t.map(|mut v| median(&mut v)))
        .collect();
    Ok((times, median(&mut loss_times)))
}

/// A backward seed for `v`: ones in its dtype (a half output gets a half gradient, as the
/// pipeline's next stage sends it).
fn seed_for(v: &Tensor, dev: &Device) -> wgpipe_tensor::Result<Tensor> {
    Tensor::ones(v.shape(), dev)?.to_dtype(v.dtype())
}

fn ctx(i: usize, compute: DType) -> ForwardCtx {
    ForwardCtx::train(0, 0, 0)
        .at_layer(i as u64)
        .with_compute(compute)
}

/// A recorded forward of layer `i` on `x` and its popped skips (tape leaves, as the worker
/// makes them): the tape, its output and its stashed skips.
fn recorded(
    l: &dyn Module,
    x: &Tensor,
    popped: &[Tensor],
    ctx: ForwardCtx,
    from_data: bool,
) -> wgpipe_tensor::Result<(Tape, Var, Vec<Var>)> {
    let tape = Tape::new();
    let input = if from_data {
        tape.constant(x.clone())
    } else {
        tape.leaf(x.clone())
    };
    let popped: Vec<Var> = popped.iter().map(|t| tape.leaf(t.clone())).collect();
    let (y, stashed) = l.forward_skips(&input, &popped, &ctx)?;
    Ok((tape, y, stashed))
}

fn measure_layer(
    l: &dyn Module,
    x: &Tensor,
    popped: &[Tensor],
    ctx: ForwardCtx,
    from_data: bool,
    dev: &Device,
) -> (wgpipe_tensor::Result<(Point, Seeds)>, Tensor, Vec<Tensor>) {
    let mut out = x.clone();
    let mut stashes = Vec::new();
    let r = (|| -> wgpipe_tensor::Result<(Point, Seeds)> {
        let mut p = Point {
            param_bytes: l
                .parameters()
                .iter()
                .map(|(_, p)| bytes_of(&p.value()) as u64)
                .sum(),
            ..Point::default()
        };
        // Forward recording: FLOPs, what stays, the transient above it.
        let m = Meter::mark(dev);
        let (tape, y, stashed) = recorded(l, x, popped, ctx, false)?;
        p.forward_flops = m.flops();
        p.stash = m.grown();
        p.forward_extra = m.peak() - m.grown();
        p.output_bytes = bytes_of(y.value());
        out = y.value().clone();
        stashes = stashed.iter().map(|v| v.value().clone()).collect();
        // The stashed skips are roots of the backward too, seeded with their gradients (which
        // the pipeline receives from the consumers).
        let skip_seeds = stashed
            .iter()
            .map(|v| seed_for(v.value(), dev))
            .collect::<wgpipe_tensor::Result<Vec<_>>>()?;
        // First full backward: stores the parameter gradients (no sum yet).
        let seed = seed_for(y.value(), dev)?;
        let m = Meter::mark(dev);
        drop(tape.backward_roots(&roots(&y, &seed, &stashed, &skip_seeds))?);
        let first_flops = m.flops();
        drop((tape, y, stashed));
        p.grad_bytes = l
            .parameters()
            .iter()
            .filter_map(|(_, p)| p.grad())
            .map(|g| bytes_of(&g) as u64)
            .sum();
        // Second: adds to them, as every later micro-batch does.
        let (tape, y, stashed) = recorded(l, x, popped, ctx, false)?;
        let m = Meter::mark(dev);
        drop(tape.backward_roots(&roots(&y, &seed, &stashed, &skip_seeds))?);
        p.backward_flops = m.flops();
        p.backward_extra = m.peak();
        p.accumulate_flops = (p.backward_flops - first_flops).max(0.0);
        drop((tape, y, stashed));
        // Split backward: input part, what it keeps, weight part.
        let (tape, y, stashed) = recorded(l, x, popped, ctx, false)?;
        let base = Meter::mark(dev);
        // Its own output gradient, dropped after the input part: the weight part may keep it.
        let own_seed = seed_for(y.value(), dev)?;
        let m = Meter::mark(dev);
        let (grads, weights) =
            tape.backward_split_roots(&roots(&y, &own_seed, &stashed, &skip_seeds))?;
        p.backward_input_flops = m.flops();
        p.backward_input_extra = m.peak();
        drop((grads, tape, y, own_seed, stashed));
        // What is left above the base with the stash gone: what the weight part needs.
        p.weight_keep = (base.grown() + p.stash).max(0.0);
        let m = Meter::mark(dev);
        weights.run()?;
        p.backward_weight_flops = m.flops();
        p.backward_weight_extra = m.peak();
        // Without recording.
        let m = Meter::mark(dev);
        {
            let tape = Tape::no_grad();
            let input = tape.constant(x.clone());
            let popped: Vec<Var> = popped.iter().map(|t| tape.constant(t.clone())).collect();
            let (y, _) = l.forward_skips(&input, &popped, &ctx)?;
            p.no_grad_peak = m.peak().max(bytes_of(y.value()));
        }
        p.forward_residue = m.grown().max(0.0);
        // From data (stage 0's first layers): no input gradient.
        if from_data {
            let (tape, y, stashed) = recorded(l, x, popped, ctx, true)?;
            let m = Meter::mark(dev);
            drop(tape.backward_roots(&roots(&y, &seed, &stashed, &skip_seeds))?);
            p.backward_flops_from_data = m.flops();
            let (tape, y, stashed) = recorded(l, x, popped, ctx, true)?;
            let m = Meter::mark(dev);
            let (grads, weights) =
                tape.backward_split_roots(&roots(&y, &seed, &stashed, &skip_seeds))?;
            p.backward_input_flops_from_data = m.flops();
            drop(grads);
            weights.run()?;
        } else {
            p.backward_flops_from_data = p.backward_flops;
            p.backward_input_flops_from_data = p.backward_input_flops;
        }
        let seeds = Seeds {
            output: seed,
            skips: skip_seeds,
        };
        Ok((p, seeds))
    })();
    (r, out, stashes)
}

/// Seconds of one run of each of: a recorded forward, a full backward, the input part and
/// the weight part of a split backward (each timed alone, the device synchronized around it so
/// a GPU's queued work is counted).
fn time_layer_once(
    l: &dyn Module,
    case: &TimedCase,
    dev: &Device,
) -> wgpipe_tensor::Result<[f64; 4]> {
    let TimedCase {
        x,
        popped,
        ctx,
        seeds,
    } = case;
    let mut t = [0.0; 4];
    dev.synchronize()?;
    let clock = std::time::Instant::now();
    let (tape, y, stashed) = recorded(l, x, popped, *ctx, false)?;
    dev.synchronize()?;
    t[0] = clock.elapsed().as_secs_f64();
    let clock = std::time::Instant::now();
    drop(tape.backward_roots(&roots(&y, &seeds.output, &stashed, &seeds.skips))?);
    dev.synchronize()?;
    t[1] = clock.elapsed().as_secs_f64();
    drop((tape, y, stashed));
    let (tape, y, stashed) = recorded(l, x, popped, *ctx, false)?;
    dev.synchronize()?;
    let clock = std::time::Instant::now();
    let (grads, weights) =
        tape.backward_split_roots(&roots(&y, &seeds.output, &stashed, &seeds.skips))?;
    dev.synchronize()?;
    t[2] = clock.elapsed().as_secs_f64();
    drop((grads, tape, y, stashed));
    let clock = std::time::Instant::now();
    weights.run()?;
    dev.synchronize()?;
    t[3] = clock.elapsed().as_secs_f64();
    Ok(t)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The roots of a layer's backward: its output and its stashed skips, with their seeds.
fn roots<'a>(
    y: &'a Var,
    seed: &'a Tensor,
    stashed: &'a [Var],
    skip_seeds: &'a [Tensor],
) -> Vec<(&'a Var, &'a Tensor)> {
    std::iter::once((y, seed))
        .chain(stashed.iter().zip(skip_seeds))
        .collect()
}

/// The loss as the pipeline's loss side runs it (its scale factor included).
fn measure_loss(out: &Tensor, y: &Tensor, loss_fn: &LossFn, dev: &Device) -> Result<LossPoint> {
    let m = Meter::mark(dev);
    let kept = {
        let tape = Tape::new();
        let output = tape.leaf(out.clone());
        let target = y.to_device(dev)?;
        let loss = loss_fn(&output, &target)?.mul_scalar(0.5)?;
        loss.value().to_scalar()?;
        let grads = tape.backward(&loss)?;
        let g = grads.get(&output).cloned();
        drop(grads);
        let kept = loss.value().clone();
        drop(g);
        kept
    };
    let point = LossPoint {
        flops: m.flops(),
        peak: m.peak(),
        kept: m.grown().max(0.0),
        secs: 0.0,
    };
    drop(kept);
    Ok(point)
}

/// Optimizer state after two steps on the layer's parameters, and the peak a step adds above
/// parameters, gradients and state while the values and state to undo it are kept (as the
/// pipeline's atomic optimizer step keeps them). Values, gradients are put back.
pub(super) fn optimizer_bytes(
    l: &dyn Module,
    o: &mut dyn Optimizer,
    dev: &Device,
) -> Result<(u64, u64)> {
    let params = l.parameters();
    if params.is_empty() {
        return Ok((0, 0));
    }
    let kept: Vec<_> = params.iter().map(|(_, p)| (p.value(), p.grad())).collect();
    for (_, p) in &params {
        if p.grad().is_none() {
            p.set_grad(Some(p.value().mul_scalar(0.0)?));
        }
    }
    let mut step_peak = 0f64;
    let mut state = 0u64;
    for _ in 0..2 {
        let before = Meter::mark(dev);
        let keep = (
            params
                .iter()
                .map(|(_, p)| (p.value(), p.grad()))
                .collect::<Vec<_>>(),
            o.state(),
        );
        o.step(&params)?;
        step_peak = step_peak.max(before.peak());
        drop(keep);
        state = o.state().iter().map(|(_, t)| bytes_of(t) as u64).sum();
    }
    for ((_, p), (v, g)) in params.iter().zip(kept) {
        p.set_value(v);
        p.set_grad(g);
    }
    Ok((state, step_peak.ceil() as u64))
}
