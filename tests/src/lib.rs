//! Shared support for the cross-crate integration tests: small models, a plain (non-pipelined)
//! reference trainer, pipelined training on a simulated cluster, comparisons, and test layers
//! (fault injection, an equal-cost linear layer).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use wgpipe_autograd::optim::{zero_grad, Optimizer, Sgd, SgdConfig};
use wgpipe_autograd::{sum_tied_grads, CostHint, ForwardCtx, Module, Param, Tape, Var};
use wgpipe_models::{
    finish_step_all, forward_all, sequence_parameters, Gelu, LayerNorm, Linear, Relu, TransformerLm,
};
use wgpipe_pipeline::{
    Balance, CheckpointMode, LinkSpec, LossFn, LossScaling, Pipeline, ScheduleKind, SimCluster,
    SkipRoute, StepReport, Transport,
};
use wgpipe_tensor::{DType, Device, Error, Result, Tensor};

pub use wgpipe_models::{cross_entropy, mse};

/// The RNG seed every pipelined and plain run uses (dropout keys).
pub const SEED: u64 = 7;
/// Learning rate and momentum of the SGD every test trains with.
pub const LR: f32 = 0.05;
pub const MOMENTUM: f32 = 0.9;

pub const ALL_MODES: [CheckpointMode; 3] = [
    CheckpointMode::Always,
    CheckpointMode::ExceptLast,
    CheckpointMode::Never,
];
/// Every schedule of the registry (the eight generators and the synthesized one).
pub const ALL_SCHEDULES: [ScheduleKind; 9] = ScheduleKind::ALL;
/// The single-chunk schedules without split backward (tests about their specific memory shape).
pub const CLASSIC_SCHEDULES: [ScheduleKind; 2] = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];

/// Whether `schedule` can run K devices and M micro-batches over `layers` layers: each of its
/// K x chunks stages needs a layer, and DualPipeV needs M >= 2K (the builder says so otherwise).
pub fn runs(schedule: ScheduleKind, k: usize, m: usize, layers: usize) -> bool {
    k * schedule.default_chunks() <= layers && (schedule != ScheduleKind::DualPipeV || m >= 2 * k)
}

/// SGD with momentum (so per-stage optimizer state matters too).
pub fn sgd() -> Box<dyn Optimizer> {
    Box::new(Sgd::with_config(SgdConfig {
        lr: LR,
        momentum: MOMENTUM,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    }))
}

// ---------------------------------------------------------------------------------------------
// Models and data
// ---------------------------------------------------------------------------------------------

/// A small MLP as 8 layers: Linear, ReLU, Linear, GELU, LayerNorm, Linear, ReLU, Linear.
/// Widths `input -> width -> ... -> out` (different at each boundary so byte counts differ).
pub fn mlp(input: usize, width: usize, out: usize, seed: u64) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let w2 = width + 4;
    vec![
        Box::new(Linear::new(input, width, seed, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(width, w2, seed + 1, &d).unwrap()),
        Box::new(Gelu::Tanh),
        Box::new(LayerNorm::new(w2, &d).unwrap()),
        Box::new(Linear::new(w2, width, seed + 2, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(width, out, seed + 3, &d).unwrap()),
    ]
}

/// A deeper Transformer LM (6 blocks: 9 layers), enough for 4 devices x 2 chunks.
pub fn deep_transformer(dropout: f32, seed: u64) -> Vec<Box<dyn Module>> {
    TransformerLm {
        layers: 6,
        ..transformer_cfg(dropout)
    }
    .build(seed, &Device::cpu())
    .unwrap()
}

/// The Transformer LM of the tests: vocab 16, d 16, 2 heads, 2 blocks, sequences of 6:
/// 5 elements (embedding, 2 blocks, LayerNorm, head).
pub fn transformer_cfg(dropout: f32) -> TransformerLm {
    TransformerLm {
        vocab: 16,
        d_model: 16,
        heads: 2,
        layers: 2,
        seq_len: 6,
        dropout,
        tie_embeddings: true,
    }
}

pub fn transformer(dropout: f32, seed: u64) -> Vec<Box<dyn Module>> {
    transformer_cfg(dropout)
        .build(seed, &Device::cpu())
        .unwrap()
}

/// Deterministic normal data `[shape]` on the CPU.
pub fn normal_data(shape: &[usize], seed: u64) -> Tensor {
    Tensor::rand_normal(shape, 0.0, 1.0, seed, &Device::cpu()).unwrap()
}

/// Integer ids in `0..vocab` as f32, `[n, t]`, from a fixed formula.
pub fn token_ids(n: usize, t: usize, vocab: usize, salt: usize) -> Tensor {
    let v: Vec<f32> = (0..n * t)
        .map(|i| ((i * 7 + salt * 13 + (i / t) * 3) % vocab) as f32)
        .collect();
    Tensor::from_vec(v, &[n, t], &Device::cpu()).unwrap()
}

/// Layers per stage, as even as possible (the first stages get the extra layers).
pub fn even_balance(layers: usize, k: usize) -> Vec<usize> {
    (0..k)
        .map(|i| layers / k + usize::from(i < layers % k))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Training runs
// ---------------------------------------------------------------------------------------------

/// What a few training steps produced: the loss of each step and every parameter at the end.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    pub losses: Vec<f32>,
    pub params: Vec<(String, Vec<f32>)>,
}

/// Every parameter's value, by name (sorted), on the host.
pub fn snapshot(params: &[(String, Param)]) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<_> = params
        .iter()
        .map(|(n, p)| (n.clone(), p.value().to_vec().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Every parameter's gradient (None where there is none), by name (sorted), on the host.
pub fn grad_snapshot(params: &[(String, Param)]) -> Vec<(String, Option<Vec<f32>>)> {
    let mut v: Vec<_> = params
        .iter()
        .map(|(n, p)| (n.clone(), p.grad().map(|g| g.to_vec().unwrap())))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// PLAIN training, the reference: the layers in order on one tape over the whole mini-batch,
/// mean loss, backward, deferred updates, the same SGD, `steps` times. Step `s` runs with
/// `ForwardCtx::train(SEED, s, 0)`.
pub fn plain_train(
    layers: &[Box<dyn Module>],
    x: &Tensor,
    y: &Tensor,
    loss_fn: &LossFn,
    steps: usize,
) -> RunResult {
    let params = sequence_parameters(layers);
    let mut opt = sgd();
    let mut losses = Vec::new();
    for step in 0..steps {
        let tape = Tape::new();
        let input = tape.constant(x.clone());
        let out = forward_all(layers, &input, &ForwardCtx::train(SEED, step as u64, 0)).unwrap();
        let loss = loss_fn(&out, y).unwrap();
        losses.push(loss.to_scalar().unwrap());
        tape.backward(&loss).unwrap();
        finish_step_all(layers).unwrap();
        // Tied copies (a tied embedding and head) train as one parameter.
        sum_tied_grads(&params).unwrap();
        opt.step(&params).unwrap();
        zero_grad(&params);
    }
    RunResult {
        losses,
        params: snapshot(&params),
    }
}

/// How to build a pipeline for a test.
#[derive(Debug, Clone)]
pub struct PipeCfg {
    pub k: usize,
    pub m: usize,
    pub mode: CheckpointMode,
    pub schedule: ScheduleKind,
    pub balance: Option<Vec<usize>>,
    pub link: LinkSpec,
    /// Memory capacity of each virtual device (`u64::MAX`: unlimited).
    pub memory: Vec<u64>,
    pub flops_per_sec: f64,
    pub transport: Transport,
    pub skip_route: SkipRoute,
    /// The dtype the layers compute in (the pipeline's precision).
    pub precision: DType,
    /// Loss scaling: `None` keeps the precision's default.
    pub loss_scaling: Option<Option<LossScaling>>,
    /// Layers re-materialized in every recording forward (`PipelineBuilder::checkpoint_layers`).
    pub checkpoint_layers: Vec<usize>,
}

impl PipeCfg {
    pub fn new(k: usize, m: usize, mode: CheckpointMode, schedule: ScheduleKind) -> Self {
        PipeCfg {
            k,
            m,
            mode,
            schedule,
            balance: None,
            link: LinkSpec::FREE,
            memory: vec![u64::MAX; k],
            flops_per_sec: 1e9,
            transport: Transport::Channels,
            skip_route: SkipRoute::Direct,
            precision: DType::F32,
            loss_scaling: None,
            checkpoint_layers: Vec::new(),
        }
    }
    pub fn balance(mut self, b: Vec<usize>) -> Self {
        self.balance = Some(b);
        self
    }
}

/// A pipeline over `layers` on a simulated cluster of CPU-backed virtual devices.
pub fn sim_pipeline(layers: Vec<Box<dyn Module>>, cfg: &PipeCfg) -> Pipeline {
    try_sim_pipeline(layers, cfg).unwrap()
}

pub fn try_sim_pipeline(
    layers: Vec<Box<dyn Module>>,
    cfg: &PipeCfg,
) -> wgpipe_pipeline::Result<Pipeline> {
    let n = layers.len();
    let specs: Vec<_> = cfg
        .memory
        .iter()
        .map(|&memory_bytes| wgpipe_pipeline::DeviceSpec {
            flops_per_sec: cfg.flops_per_sec,
            memory_bytes,
        })
        .collect();
    let cluster = SimCluster::new(&Device::cpu(), &specs, cfg.link);
    sim_builder(layers, cluster, cfg, n).build()
}

/// A builder of `n` layers on `cluster` with `cfg`'s pipeline settings.
fn sim_builder(
    layers: Vec<Box<dyn Module>>,
    cluster: SimCluster,
    cfg: &PipeCfg,
    n: usize,
) -> wgpipe_pipeline::PipelineBuilder {
    let builder = Pipeline::builder(layers).precision(cfg.precision);
    let builder = match cfg.loss_scaling {
        Some(scaling) => builder.loss_scaling(scaling),
        None => builder,
    };
    builder
        .sim(cluster)
        .balance(Balance::Explicit(cfg.balance.clone().unwrap_or_else(
            || even_balance(n, cfg.k * cfg.schedule.default_chunks()),
        )))
        .micro_batches(cfg.m)
        .checkpoint(cfg.mode)
        .checkpoint_layers(cfg.checkpoint_layers.clone())
        .skip_route(cfg.skip_route)
        .schedule(cfg.schedule)
        .seed(SEED)
        .optimizer(sgd)
        .transport(cfg.transport.clone())
}

/// `r` data-parallel replicas of the pipeline `cfg` describes (K = `cfg.k` each), on a simulated
/// cluster of R x K devices; `make` builds each replica's layers.
pub fn dp_sim_pipeline(
    r: usize,
    mut make: impl FnMut() -> Vec<Box<dyn Module>> + 'static,
    cfg: &PipeCfg,
) -> wgpipe_pipeline::Result<Pipeline> {
    let layers = make();
    let n = layers.len();
    let spec = wgpipe_pipeline::DeviceSpec {
        flops_per_sec: cfg.flops_per_sec,
        memory_bytes: cfg.memory[0],
    };
    let cluster = SimCluster::new(&Device::cpu(), &vec![spec; r * cfg.k], cfg.link);
    sim_builder(layers, cluster, cfg, n)
        .replicas(r, make)
        .build()
}

/// `steps` pipelined training steps (train_step then optimizer_step); the reports of each.
pub fn pipe_train(
    pipe: &mut Pipeline,
    x: &Tensor,
    y: &Tensor,
    loss_fn: &LossFn,
    steps: usize,
) -> (RunResult, Vec<StepReport>) {
    let mut losses = Vec::new();
    let mut reports = Vec::new();
    for _ in 0..steps {
        let r = pipe.train_step(x, y, loss_fn).unwrap();
        losses.push(r.loss);
        reports.push(r);
        pipe.optimizer_step().unwrap();
    }
    (
        RunResult {
            losses,
            params: snapshot(&pipe.named_parameters()),
        },
        reports,
    )
}

/// Largest |a - b| over the largest |b| (0 when both are 0): a norm-wise relative error, which
/// is what summation-order differences bound (an element-wise relative error is meaningless
/// for elements that happen to be near zero).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    let scale = b.iter().map(|y| y.abs() as f64).fold(0.0, f64::max);
    if diff == 0.0 {
        0.0
    } else {
        diff / scale.max(f64::MIN_POSITIVE)
    }
}

/// The worst relative error between two runs (losses and every parameter tensor), with the
/// name of where it happened.
pub fn worst_err(a: &RunResult, b: &RunResult) -> (f64, String) {
    let mut worst = (0.0, String::new());
    for (i, (x, y)) in a.losses.iter().zip(&b.losses).enumerate() {
        let e = rel_err(&[*x], &[*y]);
        if e > worst.0 {
            worst = (e, format!("loss of step {i} ({x} vs {y})"));
        }
    }
    assert_eq!(a.losses.len(), b.losses.len());
    assert_eq!(a.params.len(), b.params.len(), "parameter counts differ");
    for ((na, va), (nb, vb)) in a.params.iter().zip(&b.params) {
        assert_eq!(na, nb, "parameter names differ");
        let e = rel_err(va, vb);
        if e > worst.0 {
            worst = (e, format!("parameter {na}"));
        }
    }
    worst
}

pub fn assert_close(a: &RunResult, b: &RunResult, tol: f64, what: &str) {
    let (e, at) = worst_err(a, b);
    assert!(
        e <= tol,
        "{what}: relative error {e:.3e} > {tol:.0e} at {at}"
    );
}

// ---------------------------------------------------------------------------------------------
// Test layers
// ---------------------------------------------------------------------------------------------

/// What a [`Fault`] layer does when triggered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Panics in forward.
    Panic,
    /// Returns an error from forward.
    Error,
    /// Returns an error from its backward.
    BackwardError,
    /// Panics in its backward.
    BackwardPanic,
    /// Returns an error from the parameter part of its backward only (the W of a split
    /// backward; part of the full backward otherwise).
    WeightBackwardError,
    /// Sleeps this long in forward (a stuck layer), then goes on.
    Slow(std::time::Duration),
    /// Ends the whole process at once (`std::process::abort`): a rank of an MPI job that dies
    /// outright.
    Abort,
    /// Stops the whole process (SIGSTOP to itself, every thread frozen until a SIGCONT or a
    /// kill): a rank of an MPI job that hangs without dying.
    Stop,
    /// Multiplies its output by 1e30 twice, in the forward and its recompute alike: values that
    /// overflow to infinity (what loss scaling must skip).
    Overflow,
    /// Asks its device for a tensor larger than any it can hold (2^40 elements: on wgpu past
    /// u32 indexing and every adapter's `max_buffer_size`), so the device reports the error.
    DeviceError,
}

/// The trigger of a [`Fault`] layer, shared with the test.
#[derive(Debug, Default)]
pub struct FaultState {
    /// Fire on this micro-batch's (first, not recomputed) forward, or its backward.
    pub armed: Option<(FaultKind, u64)>,
    /// Fire in an evaluation's forward (not training) instead: a rank that fails while the
    /// pipeline evaluates.
    pub in_evaluation: bool,
    /// Stop the process (as [`FaultKind::Stop`]) at the next call of `parameters()`, once: a
    /// save reads them, so this is a rank that hangs in the middle of a save.
    pub stop_in_parameters: bool,
    /// When it fired.
    pub fired_at: Option<Instant>,
}

/// A layer `y = x * gate` (a trainable scalar, initially 1) that fails on demand at a given
/// micro-batch (of the stage it lands on).
pub struct Fault {
    pub state: Arc<Mutex<FaultState>>,
    pub gate: Param,
}

impl Fault {
    pub fn new() -> (Fault, Arc<Mutex<FaultState>>) {
        let state = Arc::new(Mutex::new(FaultState::default()));
        let gate = Param::new("gate", Tensor::ones(&[1], &Device::cpu()).unwrap());
        (
            Fault {
                state: state.clone(),
                gate,
            },
            state,
        )
    }
}

fn fire(state: &Arc<Mutex<FaultState>>) {
    state.lock().unwrap_or_else(|p| p.into_inner()).fired_at = Some(Instant::now());
}

impl Module for Fault {
    fn name(&self) -> String {
        "Fault".into()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let armed = self.state.lock().unwrap_or_else(|p| p.into_inner()).armed;
        let gated = || x.mul(&x.param(&self.gate)?);
        let Some((kind, m)) = armed else {
            return gated();
        };
        let in_evaluation = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_evaluation;
        if ctx.train == in_evaluation || ctx.micro_batch != m {
            return gated();
        }
        match kind {
            FaultKind::Panic if !ctx.recompute => {
                fire(&self.state);
                panic!("injected panic at micro-batch {m}");
            }
            FaultKind::Error if !ctx.recompute => {
                fire(&self.state);
                Err(Error::Invalid {
                    op: "Fault",
                    msg: format!("injected error at micro-batch {m}"),
                })
            }
            FaultKind::Abort if !ctx.recompute => std::process::abort(),
            FaultKind::Stop if !ctx.recompute => {
                fire(&self.state);
                stop_this_process();
                gated()
            }
            FaultKind::DeviceError if !ctx.recompute => {
                fire(&self.state);
                // 2^40 floats = 4 TiB: past every adapter's largest buffer.
                let huge = Tensor::zeros(&[1 << 40], x.value().device())?;
                Ok(x.add(&x.tape().constant(huge.narrow(0, 0, 1)?))?)
            }
            FaultKind::BackwardError | FaultKind::BackwardPanic => {
                let state = self.state.clone();
                Var::from_op("fault", &[x], x.value().clone(), move |g, _| {
                    fire(&state);
                    if kind == FaultKind::BackwardPanic {
                        panic!("injected backward panic at micro-batch {m}");
                    }
                    let _ = g;
                    Err(Error::Invalid {
                        op: "Fault",
                        msg: format!("injected backward error at micro-batch {m}"),
                    })
                })
            }
            FaultKind::Overflow => {
                fire(&self.state);
                gated()?.mul_scalar(1e30)?.mul_scalar(1e30)
            }
            FaultKind::Slow(d) if !ctx.recompute => {
                fire(&self.state);
                std::thread::sleep(d);
                gated()
            }
            FaultKind::WeightBackwardError => {
                let state = self.state.clone();
                let gate = x.param(&self.gate)?;
                let (xv, gv) = (x.value().clone(), gate.value().clone());
                let y = xv.mul(&gv)?;
                Var::from_op("fault", &[x, &gate], y, move |g, wants| {
                    if wants[1] {
                        fire(&state);
                        return Err(Error::Invalid {
                            op: "Fault",
                            msg: format!("injected weight-gradient error at micro-batch {m}"),
                        });
                    }
                    Ok(vec![Some(g.mul(&gv)?), None])
                })
            }
            _ => gated(),
        }
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::take(&mut state.stop_in_parameters) {
            state.fired_at = Some(Instant::now());
            drop(state);
            stop_this_process();
        }
        vec![("gate".into(), self.gate.clone())]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// SIGSTOP to this process: every thread frozen until a SIGCONT or a kill.
fn stop_this_process() {
    let me = std::process::id().to_string();
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &me])
        .status();
    if !stopped.as_ref().is_ok_and(|s| s.success()) {
        panic!("cannot stop this process with `kill -STOP` (procps): {stopped:?}");
    }
}

/// `y = (x + shift) W^T`: a linear layer whose input always needs a gradient (through `shift`),
/// so that the first stage does exactly the work of every other stage (with a plain `Linear`
/// first, stage 0 skips the input-gradient matmul because its input is data).
pub struct ShiftLinear {
    pub shift: Param,
    pub weight: Param,
    width: usize,
}

impl ShiftLinear {
    pub fn new(width: usize, seed: u64) -> ShiftLinear {
        let d = Device::cpu();
        let b = 1.0 / (width as f32).sqrt();
        ShiftLinear {
            shift: Param::new("shift", Tensor::zeros(&[width], &d).unwrap()),
            weight: Param::new(
                "weight",
                Tensor::rand_uniform(&[width, width], -b, b, seed, &d).unwrap(),
            ),
            width,
        }
    }
}

impl Module for ShiftLinear {
    fn name(&self) -> String {
        format!("ShiftLinear({})", self.width)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        let h = x.add(&x.param(&self.shift)?)?;
        h.matmul(&h.param(&self.weight)?.t()?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("shift".into(), self.shift.clone()),
            ("weight".into(), self.weight.clone()),
        ]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let rows: usize = input_shape[..input_shape.len() - 1].iter().product();
        CostHint {
            param_bytes: 4 * (self.width * self.width + self.width),
            flops: (2 * rows * self.width * self.width + rows * self.width) as f64,
            activation_bytes: 4 * rows * self.width,
            output_shape: input_shape.to_vec(),
        }
    }
}

/// A wgpu device for the tests ([`Device::test_wgpu`]: lavapipe unless `WGPIPE_TEST_WGPU` names
/// another adapter), or why there is none: `SKIPPED: <reason>` on stderr.
pub fn test_wgpu_or_skip(test: &str) -> Option<Device> {
    match std::panic::catch_unwind(Device::test_wgpu) {
        Ok(Ok(d)) => Some(d),
        Ok(Err(e)) => {
            eprintln!("SKIPPED: {test}: no wgpu device to test on: {e}");
            None
        }
        Err(_) => {
            eprintln!("SKIPPED: {test}: opening the wgpu test device panicked");
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Skips
// ---------------------------------------------------------------------------------------------

/// A test layer with skips: `y = x + Σ popped`, and each stash either `x` itself (`None`: the
/// identity, so a stage may stash its own input or hand on the same var as its output) or
/// `linear(x)` (so the producer's parameters get gradient only through the skip).
pub struct SkipLayer {
    pops: Vec<String>,
    stashes: Vec<(String, Option<Linear>)>,
}

impl SkipLayer {
    pub fn new() -> SkipLayer {
        SkipLayer {
            pops: Vec::new(),
            stashes: Vec::new(),
        }
    }
    pub fn pop(mut self, name: &str) -> SkipLayer {
        self.pops.push(name.into());
        self
    }
    /// Stashes `x` as it is.
    pub fn stash(mut self, name: &str) -> SkipLayer {
        self.stashes.push((name.into(), None));
        self
    }
    /// Stashes `linear(x)` (width to width).
    pub fn stash_linear(mut self, name: &str, width: usize, seed: u64) -> SkipLayer {
        let l = Linear::new(width, width, seed, &Device::cpu()).unwrap();
        self.stashes.push((name.into(), Some(l)));
        self
    }
}

impl Default for SkipLayer {
    fn default() -> Self {
        SkipLayer::new()
    }
}

impl Module for SkipLayer {
    fn name(&self) -> String {
        let stashes: Vec<&str> = self.stashes.iter().map(|(n, _)| n.as_str()).collect();
        format!("Skip(pop {:?}, stash {:?})", self.pops, stashes)
    }
    fn forward(&self, x: &Var, _ctx: &ForwardCtx) -> Result<Var> {
        if self.pops.is_empty() && self.stashes.is_empty() {
            return Ok(x.clone());
        }
        Err(Error::Invalid {
            op: "SkipLayer",
            msg: "a layer with skips runs through forward_skips".into(),
        })
    }
    fn skips(&self) -> wgpipe_autograd::Skips {
        wgpipe_autograd::Skips {
            pops: self.pops.clone(),
            stashes: self.stashes.iter().map(|(n, _)| n.clone()).collect(),
        }
    }
    fn forward_skips(&self, x: &Var, popped: &[Var], ctx: &ForwardCtx) -> Result<(Var, Vec<Var>)> {
        let mut y = x.clone();
        for p in popped {
            y = y.add(p)?;
        }
        let stashed = self
            .stashes
            .iter()
            .map(|(_, l)| match l {
                Some(l) => l.forward(x, ctx),
                None => Ok(x.clone()),
            })
            .collect::<Result<Vec<Var>>>()?;
        Ok((y, stashed))
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        self.stashes
            .iter()
            .filter_map(|(n, l)| l.as_ref().map(|l| (n, l)))
            .flat_map(|(n, l)| {
                l.parameters()
                    .into_iter()
                    .map(move |(p, v)| (format!("{n}.{p}"), v))
            })
            .collect()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// A 9-layer model of width 6 (output 3) with three skips: `a` (layer 1 -> 4, `linear(x)`),
/// `b` (2 -> 7, the identity) and `c` (4 -> 6, `linear(x)`). Cut evenly into 4 stages they
/// span 1, 3 and 1 stages; into 3 stages 1, 2 and 1; into 8 stages 3, 5 and 2.
pub fn skip_model(seed: u64) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let w = 6;
    vec![
        Box::new(Linear::new(w, w, seed, &d).unwrap()),
        Box::new(SkipLayer::new().stash_linear("a", w, seed + 1)),
        Box::new(SkipLayer::new().stash("b")),
        Box::new(Linear::new(w, w, seed + 2, &d).unwrap()),
        Box::new(SkipLayer::new().pop("a").stash_linear("c", w, seed + 3)),
        Box::new(Linear::new(w, w, seed + 4, &d).unwrap()),
        Box::new(SkipLayer::new().pop("c")),
        Box::new(SkipLayer::new().pop("b")),
        Box::new(Linear::new(w, 3, seed + 5, &d).unwrap()),
    ]
}

// ---------------------------------------------------------------------------------------------
// Multi-process runs (the `mpi` feature's worker and tests)
// ---------------------------------------------------------------------------------------------

/// A fault the MPI worker injects on one rank at one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFault {
    /// The Fault layer (last in the model) returns an error at micro-batch 1.
    Error,
    /// The Fault layer panics at micro-batch 1.
    Panic,
    /// The rank's device has room for nothing more than what lives before the step (plus 192
    /// bytes) during the step: an out-of-memory error.
    OutOfMemory,
    /// The Fault layer ends the process at micro-batch 1 (`std::process::abort`).
    Abort,
    /// The rank's device has no room left during `optimizer_step` (after a good step): the
    /// optimizer fails there.
    Optimizer,
    /// The Fault layer stops the whole process at micro-batch 1 (SIGSTOP): a rank that hangs.
    Stop,
    /// The Fault layer's output overflows at micro-batch 1; the job runs with loss scaling
    /// (see [`MpiJob::cfg`]), so the step is skipped on every rank.
    Overflow,
    /// Every rank saves a sharded checkpoint at that step (besides the job's `save_at`); this
    /// one stops (SIGSTOP) in the middle of it, when the save reads the Fault layer's
    /// parameters.
    StopInSave,
    /// Every rank evaluates the mini-batch before training that step; this one stops (SIGSTOP)
    /// in the forward of its micro-batch 1 of the evaluation.
    StopInEvaluation,
}

impl MpiFault {
    pub const ALL: [MpiFault; 9] = [
        MpiFault::Error,
        MpiFault::Panic,
        MpiFault::OutOfMemory,
        MpiFault::Abort,
        MpiFault::Optimizer,
        MpiFault::Stop,
        MpiFault::Overflow,
        MpiFault::StopInSave,
        MpiFault::StopInEvaluation,
    ];
}

/// One run of the MPI worker: what it trains and which fault it injects. The tests build the
/// in-process reference from the same description.
#[derive(Debug, Clone, PartialEq)]
pub struct MpiJob {
    pub schedule: ScheduleKind,
    pub k: usize,
    pub m: usize,
    pub steps: usize,
    /// R data-parallel replicas (the job has R x K ranks).
    pub replicas: usize,
    /// `(rank, step, fault)`: what goes wrong on that rank at that step.
    pub fault: Option<(usize, usize, MpiFault)>,
    /// After this many steps, gather the stages and save a checkpoint (`ckpt.safetensors` in
    /// the output folder, written by rank 0).
    pub save_at: Option<usize>,
    /// Save at `save_at` as a sharded checkpoint instead (the folder `ckpt` in the output
    /// folder, each rank writing its own stages, no gathering).
    pub sharded: bool,
    /// Load this checkpoint on every rank before training.
    pub resume: Option<std::path::PathBuf>,
}

impl MpiJob {
    pub fn new(schedule: ScheduleKind, k: usize) -> Self {
        MpiJob {
            schedule,
            k,
            m: 4,
            steps: 3,
            replicas: 1,
            fault: None,
            save_at: None,
            sharded: false,
            resume: None,
        }
    }

    /// The worker's command-line arguments.
    pub fn args(&self) -> Vec<String> {
        let mut v = vec![
            format!("{:?}", self.schedule),
            self.k.to_string(),
            self.m.to_string(),
            self.steps.to_string(),
            self.replicas.to_string(),
            // `2s`: a sharded save after 2 steps.
            format!(
                "{}{}",
                self.save_at.unwrap_or(0),
                if self.sharded { "s" } else { "" }
            ),
            self.resume
                .as_ref()
                .map_or("-".into(), |p| p.display().to_string()),
        ];
        if let Some((rank, step, fault)) = self.fault {
            v.extend([rank.to_string(), step.to_string(), format!("{fault:?}")]);
        }
        v
    }

    /// Parses [`MpiJob::args`].
    pub fn from_args(args: &[String]) -> Option<MpiJob> {
        let name = args.first()?;
        let schedule = ScheduleKind::ALL
            .into_iter()
            .find(|s| format!("{s:?}") == *name)?;
        let num = |i: usize| args.get(i)?.parse::<usize>().ok();
        let fault = match args.len() {
            7 => None,
            10 => Some((
                num(7)?,
                num(8)?,
                MpiFault::ALL
                    .into_iter()
                    .find(|f| format!("{f:?}") == args[9])?,
            )),
            _ => return None,
        };
        let (save_at, sharded) = match args.get(5)?.strip_suffix('s') {
            Some(n) => (n.parse::<usize>().ok(), true),
            None => (num(5), false),
        };
        let save_at = save_at.filter(|&s| s > 0);
        let resume = (args[6] != "-").then(|| args[6].clone().into());
        Some(MpiJob {
            schedule,
            k: num(1)?,
            m: num(2)?,
            steps: num(3)?,
            replicas: num(4)?,
            fault,
            save_at,
            sharded,
            resume,
        })
    }

    /// The model (an MLP, then a Fault layer that can be armed) and the state of its Fault.
    pub fn model() -> (Vec<Box<dyn Module>>, Arc<Mutex<FaultState>>) {
        let mut layers = mlp(6, 8, 3, 11);
        let (fault, state) = Fault::new();
        layers.push(Box::new(fault));
        (layers, state)
    }

    /// The mini-batch of every step.
    pub fn data() -> (Tensor, Tensor) {
        (normal_data(&[12, 6], 1), normal_data(&[12, 3], 2))
    }

    pub fn cfg(&self) -> PipeCfg {
        let overflow = matches!(self.fault, Some((_, _, MpiFault::Overflow)));
        PipeCfg {
            // f32 with a power-of-two scale: exact, so the ranks still match one process bit
            // for bit; growth after 2 good steps so that both moves of the scale show.
            loss_scaling: overflow.then_some(Some(LossScaling {
                init_scale: 1024.0,
                growth_interval: 2,
                ..LossScaling::default()
            })),
            ..PipeCfg::new(self.k, self.m, CheckpointMode::ExceptLast, self.schedule)
        }
    }
}
