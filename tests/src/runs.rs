//! Training runs: the plain reference trainer, pipelines on a simulated cluster, comparisons.

use super::*;

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
