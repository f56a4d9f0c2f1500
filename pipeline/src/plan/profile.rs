//! The per-layer profile the planner's cost model runs on: FLOPs and bytes of every layer,
//! measured by a dry run of small micro-batches on a device of the same backend (its FLOP
//! counter and memory accounting), never estimated from shapes.
//!
//! Each quantity is measured at two micro-batch sizes b and 2b and kept as an affine function
//! of the micro-batch size (`fixed + per_sample · b`): FLOPs and activation bytes grow with the
//! samples, while some parts do not (the addition that accumulates a later micro-batch's
//! parameter gradient, per-call scalars). Layers run one at a time, each on the output of the
//! one before, so a model that does not fit anywhere whole can still be profiled.
//!
//! Where asked ([`profile_layers_timed`]), each layer's forward, full backward and the two
//! parts of a split backward (and the loss) are also timed on the profiling device, a few
//! repetitions each, median: [`Profile::with_measured_times`] then plans with those times
//! instead of FLOPs over a rate (real devices, whose rates nobody gave). The repetitions run in
//! rounds over all the layers (each layer's input is kept until they are done), so that a burst
//! of other work on a shared machine falls on one repetition of several layers, which the
//! medians drop, rather than on every repetition of one layer.

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{resolve_skips, ForwardCtx, Module, Param, SkipEdge, Tape, Var};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{PipelineError, Result};
use crate::LossFn;

/// `fixed + per_sample · b` for a micro-batch of b samples.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Affine {
    pub fixed: f64,
    pub per_sample: f64,
}

impl Affine {
    /// The value at `b` samples (never negative: a fit through two noisy-free points can still
    /// give a slightly negative intercept for quantities that are zero at b = 0).
    pub fn at(&self, b: usize) -> f64 {
        (self.fixed + self.per_sample * b as f64).max(0.0)
    }
    /// Bytes at `b` samples, rounded up.
    pub fn bytes(&self, b: usize) -> u64 {
        self.at(b).ceil() as u64
    }
    /// The line through `(b1, v1)` and `(b2, v2)`, `b1 < b2`.
    fn fit(b1: usize, v1: f64, b2: usize, v2: f64) -> Affine {
        let per_sample = (v2 - v1) / (b2 - b1) as f64;
        Affine {
            fixed: v1 - per_sample * b1 as f64,
            per_sample,
        }
    }
}

/// What one layer costs. FLOPs are those the device counts; bytes those its accounting sees.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerProfile {
    pub name: String,
    /// Forward (recorded or not: the same arithmetic).
    pub forward_flops: Affine,
    /// Full backward of a micro-batch whose parameter gradients add to earlier ones.
    pub backward_flops: Affine,
    /// The input part of a split backward.
    pub backward_input_flops: Affine,
    /// The weight part of a split backward (adding to earlier gradients).
    pub backward_weight_flops: Affine,
    /// FLOPs of adding a micro-batch's parameter gradients to the accumulated ones: the first
    /// backward of a step stores them instead.
    pub accumulate_flops: f64,
    /// Backward FLOPs when the layer's input needs no gradient (the model's first layers, before
    /// any parameter, on stage 0 whose input is data).
    pub backward_flops_from_data: Affine,
    /// The input part of a split backward when the input needs no gradient.
    pub backward_input_flops_from_data: Affine,
    pub param_bytes: u64,
    /// The accumulated parameter gradients.
    pub grad_bytes: u64,
    /// Optimizer state after a step (momentum, Adam moments, counters).
    pub optimizer_state_bytes: u64,
    /// Peak bytes an optimizer step adds above parameters, gradients and state (the values and
    /// state kept to undo it, the new values).
    pub optimizer_step_bytes: u64,
    /// Bytes a recorded forward keeps until its backward (saved tensors and the output).
    pub stash_bytes: Affine,
    /// Peak above the stash while a recorded forward runs (temporaries).
    pub forward_extra_bytes: Affine,
    /// Peak of a forward that records nothing, above what was live before it (output included).
    pub no_grad_peak_bytes: Affine,
    /// What a forward leaves behind until the end of the step when its output and tape are
    /// gone (batch norm's statistics, applied by `finish_step`).
    pub forward_residue_bytes: Affine,
    /// Peak of a full backward above what was live before it (stash and output gradient
    /// included there): input gradient, parameter-gradient temporaries and sums.
    pub backward_extra_bytes: Affine,
    /// The same for the input part of a split backward.
    pub backward_input_extra_bytes: Affine,
    /// What the input part keeps for the weight part.
    pub weight_keep_bytes: Affine,
    /// Peak of the weight part above what was live before it.
    pub backward_weight_extra_bytes: Affine,
    /// The output tensor (what goes to the next stage).
    pub output_bytes: Affine,
    /// Measured seconds (zero when not timed): recorded forward, full backward adding to the
    /// gradients, and the input and weight parts of a split backward.
    pub forward_secs: Affine,
    pub backward_secs: Affine,
    pub backward_input_secs: Affine,
    pub backward_weight_secs: Affine,
}

/// The loss on the last stage's device: FLOPs of the loss and its gradient, and its bytes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossProfile {
    pub flops: Affine,
    /// Peak while the loss and its gradient run, above what was live before (the target copy
    /// and the gradient of the output included).
    pub peak_bytes: Affine,
    /// What stays for the rest of the step (the loss value).
    pub kept_bytes: Affine,
    /// Measured seconds of the loss and its gradient (zero when not timed).
    pub secs: Affine,
}

/// A skip: its producer and consumer layers and the bytes of its stashed tensor (what crosses
/// the skip's link and what the consumer's stage holds until its backward).
#[derive(Debug, Clone, PartialEq)]
pub struct SkipProfile {
    pub edge: SkipEdge,
    pub bytes: Affine,
}

/// Every layer's profile, the loss's, the model's input bytes and its skips.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Profile {
    pub layers: Vec<LayerProfile>,
    /// In [`resolve_skips`]' order (so [`crate::skips::skip_links`] numbers their links as the
    /// builder does).
    pub skips: Vec<SkipProfile>,
    pub loss: LossProfile,
    pub input_bytes: Affine,
    /// Index of the first layer with trainable parameters: on stage 0, where the input is data,
    /// it and the layers before it compute no input gradient.
    pub first_trainable: usize,
    /// The smaller micro-batch size profiled (the other is twice it).
    pub profiled_at: usize,
    /// Repetitions each time was measured with (median); 0: not timed.
    pub timed_reps: usize,
    /// The device the times were measured on.
    pub timed_on: String,
    /// Tied parameters whose copies sit in more than one layer: after each step the stages
    /// holding them exchange gradients (priced as the simulated cluster prices it).
    pub ties: Vec<TieProfile>,
}

/// One tie group: the layers holding a copy (ascending) and the bytes of its gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct TieProfile {
    pub layers: Vec<usize>,
    pub bytes: u64,
}

/// The tie groups of `layers` with copies in more than one layer.
fn tie_profiles(layers: &[Box<dyn Module>]) -> Vec<TieProfile> {
    let mut params = Vec::new();
    let mut owner = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        for (n, p) in l.parameters() {
            params.push((n, p));
            owner.push(i);
        }
    }
    wgpipe_autograd::tied_groups(&params)
        .into_iter()
        .filter_map(|(_, idx)| {
            let mut holders: Vec<usize> = idx.iter().map(|&i| owner[i]).collect();
            holders.dedup();
            let bytes = (params[idx[0]].1.value().numel() * 4) as u64;
            (holders.len() > 1).then_some(TieProfile {
                layers: holders,
                bytes,
            })
        })
        .collect()
}

impl Profile {
    /// This profile with measured seconds in place of FLOPs, as FLOPs at `rate` per second
    /// (seconds x rate), so that the cost model, whose simulator divides FLOPs by each device's
    /// rate, predicts the measured times on devices of that rate. What was not timed alone
    /// (the addition into accumulated gradients, the backwards of stage 0's first layers whose
    /// input is data) keeps its FLOP share of the full backward it is part of.
    pub fn with_measured_times(&self, rate: f64) -> Result<Profile> {
        if self.timed_reps == 0 {
            return Err(PipelineError::Config(
                "the profile has no measured times (profile with profile_layers_timed)".into(),
            ));
        }
        let (b1, b2) = (self.profiled_at, 2 * self.profiled_at);
        let secs = |a: Affine| Affine {
            fixed: a.fixed * rate,
            per_sample: a.per_sample * rate,
        };
        // `of` scaled at each profiled size as `flops` is to `time` there.
        let like = |of: Affine, flops: Affine, time: Affine| {
            let at = |b: usize| {
                let f = flops.at(b);
                if f > 0.0 {
                    of.at(b) * time.at(b) * rate / f
                } else {
                    0.0
                }
            };
            Affine::fit(b1, at(b1), b2, at(b2))
        };
        let mut out = self.clone();
        for l in &mut out.layers {
            let full = l.backward_flops;
            let ratio = if full.at(b2) > 0.0 {
                l.backward_secs.at(b2) * rate / full.at(b2)
            } else {
                0.0
            };
            l.accumulate_flops *= ratio;
            l.backward_flops_from_data = like(l.backward_flops_from_data, full, l.backward_secs);
            l.backward_input_flops_from_data = like(
                l.backward_input_flops_from_data,
                l.backward_input_flops,
                l.backward_input_secs,
            );
            l.forward_flops = secs(l.forward_secs);
            l.backward_flops = secs(l.backward_secs);
            l.backward_input_flops = secs(l.backward_input_secs);
            l.backward_weight_flops = secs(l.backward_weight_secs);
        }
        out.loss.flops = secs(self.loss.secs);
        Ok(out)
    }

    /// Bytes of stage input `s` for a micro-batch of `b`: the model input or the output of the
    /// layer before `first_layer`.
    pub fn input_bytes_of(&self, first_layer: usize, b: usize) -> u64 {
        if first_layer == 0 {
            self.input_bytes.bytes(b)
        } else {
            self.layers[first_layer - 1].output_bytes.bytes(b)
        }
    }
}

/// A profile of `layers` by dry runs of micro-batches of `b` and `2b` samples, the first rows of
/// `inputs` and `targets` (which need at least 2b rows), on a fresh virtual device of `on`'s
/// backend. `optimizer` makes the optimizer whose state and step are measured (none: no state).
/// The layers' parameters, gradients and buffers are as before afterwards, and the layers end up
/// on `on`.
pub fn profile_layers(
    layers: &mut [Box<dyn Module>],
    inputs: &Tensor,
    targets: &Tensor,
    loss_fn: &LossFn,
    optimizer: Option<&dyn Fn() -> Box<dyn Optimizer>>,
    on: &Device,
) -> Result<Profile> {
    profile_layers_timed(
        layers,
        inputs,
        targets,
        loss_fn,
        optimizer,
        on,
        ProfileRun::default(),
    )
}

/// How [`profile_layers_timed`] runs the layers.
#[derive(Debug, Clone, Copy)]
pub struct ProfileRun {
    /// Timed repetitions of each measurement (0: FLOPs and bytes only).
    pub reps: usize,
    /// The dtype the layers compute in (the pipeline's precision): half activations make
    /// half stashes and half links in the profile, as in the pipeline.
    pub compute: DType,
}

impl Default for ProfileRun {
    fn default() -> Self {
        ProfileRun {
            reps: 0,
            compute: DType::F32,
        }
    }
}

/// [`profile_layers`] in `run.compute`, and with `run.reps > 0` each layer's and the loss's
/// times too, measured on `on`'s backend (the median of `reps` runs, after the measurements
/// that warm it up).
pub fn profile_layers_timed(
    layers: &mut [Box<dyn Module>],
    inputs: &Tensor,
    targets: &Tensor,
    loss_fn: &LossFn,
    optimizer: Option<&dyn Fn() -> Box<dyn Optimizer>>,
    on: &Device,
    run: ProfileRun,
) -> Result<Profile> {
    let n = inputs.shape().first().copied().unwrap_or(0);
    if n < 2 || targets.shape().first().copied().unwrap_or(0) < 2 {
        return Err(PipelineError::Config(format!(
            "profiling needs a sample of at least 2 rows; inputs {:?}, targets {:?}",
            inputs.shape(),
            targets.shape()
        )));
    }
    let b1 = (n / 2).min(2);
    let edges = resolve_skips(layers).map_err(|e| PipelineError::Config(e.to_string()))?;
    let dev = on.virtual_device("profile", None);
    for (i, l) in layers.iter_mut().enumerate() {
        l.to_device(&dev).map_err(|e| {
            PipelineError::Config(format!("profiling: placing layer {i} ({}): {e}", l.name()))
        })?;
    }
    let first_trainable = layers
        .iter()
        .position(|l| l.parameters().iter().any(|(_, p)| p.is_trainable()))
        .unwrap_or(layers.len());
    let at = |b: usize| -> Result<(Vec<Point>, LossPoint, f64, Stashed)> {
        let x = inputs.narrow(0, 0, b)?.to_device(&dev)?;
        let y = targets.narrow(0, 0, b)?;
        run_at(layers, &x, &y, loss_fn, first_trainable, &dev, run)
    };
    let (small, loss_small, in_small, skips_small) = at(b1)?;
    let (large, loss_large, in_large, skips_large) = at(2 * b1)?;
    let skip_bytes = |stashed: &Stashed, name: &str| {
        stashed
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, t)| bytes_of(t))
    };
    let skips = edges
        .into_iter()
        .map(|edge| SkipProfile {
            bytes: Affine::fit(
                b1,
                skip_bytes(&skips_small, &edge.name),
                2 * b1,
                skip_bytes(&skips_large, &edge.name),
            ),
            edge,
        })
        .collect();
    let fit =
        |f: &dyn Fn(&Point) -> f64, i: usize| Affine::fit(b1, f(&small[i]), 2 * b1, f(&large[i]));
    let mut out = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let (state, step) = match optimizer {
            Some(make) => optimizer_bytes(l.as_ref(), make().as_mut(), &dev)?,
            None => (0, 0),
        };
        let s = &large[i];
        out.push(LayerProfile {
            name: l.name(),
            forward_flops: fit(&|p| p.forward_flops, i),
            backward_flops: fit(&|p| p.backward_flops, i),
            backward_input_flops: fit(&|p| p.backward_input_flops, i),
            backward_weight_flops: fit(&|p| p.backward_weight_flops, i),
            accumulate_flops: s.accumulate_flops,
            backward_flops_from_data: fit(&|p| p.backward_flops_from_data, i),
            backward_input_flops_from_data: fit(&|p| p.backward_input_flops_from_data, i),
            param_bytes: s.param_bytes,
            grad_bytes: s.grad_bytes,
            optimizer_state_bytes: state,
            optimizer_step_bytes: step,
            stash_bytes: fit(&|p| p.stash, i),
            forward_extra_bytes: fit(&|p| p.forward_extra, i),
            no_grad_peak_bytes: fit(&|p| p.no_grad_peak, i),
            forward_residue_bytes: fit(&|p| p.forward_residue, i),
            backward_extra_bytes: fit(&|p| p.backward_extra, i),
            backward_input_extra_bytes: fit(&|p| p.backward_input_extra, i),
            weight_keep_bytes: fit(&|p| p.weight_keep, i),
            backward_weight_extra_bytes: fit(&|p| p.backward_weight_extra, i),
            output_bytes: fit(&|p| p.output_bytes, i),
            forward_secs: fit(&|p| p.times[0], i),
            backward_secs: fit(&|p| p.times[1], i),
            backward_input_secs: fit(&|p| p.times[2], i),
            backward_weight_secs: fit(&|p| p.times[3], i),
        });
    }
    let loss = LossProfile {
        flops: Affine::fit(b1, loss_small.flops, 2 * b1, loss_large.flops),
        peak_bytes: Affine::fit(b1, loss_small.peak, 2 * b1, loss_large.peak),
        kept_bytes: Affine::fit(b1, loss_small.kept, 2 * b1, loss_large.kept),
        secs: Affine::fit(b1, loss_small.secs, 2 * b1, loss_large.secs),
    };
    Ok(Profile {
        layers: out,
        skips,
        loss,
        input_bytes: Affine::fit(b1, in_small, 2 * b1, in_large),
        first_trainable,
        profiled_at: b1,
        timed_reps: run.reps,
        timed_on: if run.reps > 0 {
            on.name().to_string()
        } else {
            String::new()
        },
        ties: tie_profiles(layers),
    })
}

/// One layer's measurements at one micro-batch size.
#[derive(Default)]
struct Point {
    forward_flops: f64,
    backward_flops: f64,
    backward_input_flops: f64,
    backward_weight_flops: f64,
    accumulate_flops: f64,
    backward_flops_from_data: f64,
    backward_input_flops_from_data: f64,
    param_bytes: u64,
    grad_bytes: u64,
    stash: f64,
    forward_extra: f64,
    no_grad_peak: f64,
    forward_residue: f64,
    backward_extra: f64,
    backward_input_extra: f64,
    weight_keep: f64,
    backward_weight_extra: f64,
    output_bytes: f64,
    /// Seconds of the forward, full backward, input part, weight part (0 when not timed).
    times: [f64; 4],
}

struct LossPoint {
    flops: f64,
    peak: f64,
    kept: f64,
    secs: f64,
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

fn bytes_of(t: &Tensor) -> f64 {
    crate::sim::wire_bytes(t) as f64
}

/// The tensors the layers stashed so far, by skip name.
type Stashed = Vec<(String, Tensor)>;

/// Measures every layer on `x` (b samples) in turn, each popping layer on the tensors its
/// producers stashed, then the loss on the last output. Also returns every stashed tensor.
fn run_at(
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
fn optimizer_bytes(l: &dyn Module, o: &mut dyn Optimizer, dev: &Device) -> Result<(u64, u64)> {
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
