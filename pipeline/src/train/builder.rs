//! Building a pipeline: devices, partitioning, schedule, placement.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{ForwardCtx, ModelFactory, Module, Tape, Var};
use wgpipe_tensor::memory::{with_tag, Tag};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{NonFinite, PipelineError, Result};
use crate::exec::transport::Transport;
use crate::exec::Stage;
use crate::partition::{balance_by_cost, stage_ranges, validate_balance_for};
use crate::schedule::{CheckpointMode, Schedule, ScheduleKind};
use crate::sim::SimCluster;
use crate::skips::{plan_skips, popped_bytes, SkipRoute};
use crate::train::pipeline::Pipeline;
use crate::train::replica::Replica;
use crate::train::scaler::{GradScaler, LossScaling};

/// How layers are assigned to stages.
#[derive(Clone, Debug)]
pub enum Balance {
    /// Layers per stage, e.g. `[3, 3, 2, 2]` (torchgpipe's `balance`).
    Explicit(Vec<usize>),
    /// Minimise the largest stage's parameter bytes.
    ByParams,
    /// Minimise the largest stage's forward FLOPs for inputs of this shape (the layers' cost hints).
    ByFlops { input_shape: Vec<usize> },
    /// Minimise the largest stage's measured forward+backward time on this sample micro-batch.
    ByTime { sample: Tensor },
    /// Minimise the largest stage's memory: parameters × `optimizer_factor` (SGD 2–3, Adam 4–5,
    /// as torchgpipe's balance-by-size) plus the activations of an input of this shape.
    ByMemory {
        input_shape: Vec<usize>,
        optimizer_factor: f64,
    },
}

/// A schedule to run: generated from a kind, or given whole (built by the user, parsed from
/// text, or made by a planner).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScheduleSpec {
    Kind(ScheduleKind),
    Custom(Schedule),
}

impl From<ScheduleKind> for ScheduleSpec {
    fn from(k: ScheduleKind) -> Self {
        ScheduleSpec::Kind(k)
    }
}

impl From<Schedule> for ScheduleSpec {
    fn from(s: Schedule) -> Self {
        ScheduleSpec::Custom(s)
    }
}

pub struct PipelineBuilder {
    pub(crate) layers: Vec<Box<dyn Module>>,
    devices: Vec<Device>,
    sim: Option<SimCluster>,
    balance: Balance,
    micro_batches: Option<usize>,
    chunks: Option<usize>,
    checkpoint: CheckpointMode,
    /// Layers re-materialized inside every recording forward (global indices, ascending).
    checkpoint_layers: Vec<usize>,
    pub(crate) skip_route: SkipRoute,
    schedule: ScheduleSpec,
    non_finite: NonFinite,
    action_timeout: Option<std::time::Duration>,
    seed: u64,
    pub(crate) optimizer: Option<Box<dyn Fn() -> Box<dyn Optimizer>>>,
    transport: Transport,
    /// Data parallelism: R and the factory of the layers of replicas 1..R.
    replicas: Option<(usize, LayerFactory)>,
    pub(crate) precision: DType,
    /// `None`: the default of the precision ([`crate::train::scaler::default_for`]).
    loss_scaling: Option<Option<LossScaling>>,
    /// Settings of the run outside the pipeline that every rank must share (see
    /// [`PipelineBuilder::agree_on`]).
    agreed: Vec<(String, String)>,
    /// Set by [`Pipeline::builder_from`]: `layers` are descriptions, and `build` materializes
    /// only the stages this process holds from it.
    factory: Option<Arc<dyn ModelFactory>>,
}

/// Makes a fresh copy of the model's layers (the structure; the values are copied from
/// replica 0).
pub type LayerFactory = Box<dyn FnMut() -> Vec<Box<dyn Module>>>;

impl PipelineBuilder {
    pub(crate) fn new(layers: Vec<Box<dyn Module>>) -> Self {
        PipelineBuilder {
            layers,
            devices: Vec::new(),
            sim: None,
            balance: Balance::ByParams,
            micro_batches: None,
            chunks: None,
            checkpoint: CheckpointMode::ExceptLast,
            checkpoint_layers: Vec::new(),
            skip_route: SkipRoute::Direct,
            schedule: ScheduleSpec::Kind(ScheduleKind::GPipe),
            non_finite: NonFinite::default(),
            action_timeout: None,
            seed: 0,
            optimizer: None,
            transport: Transport::default(),
            replicas: None,
            precision: DType::F32,
            loss_scaling: None,
            agreed: Vec::new(),
            factory: None,
        }
    }

    /// A builder over the model `factory` builds: each layer is built alone to be described
    /// (names, shapes, tie groups, skips, costs) and dropped, so that partitioning, the
    /// settings the ranks compare, the reports and the checkpoint layout work from the
    /// descriptions, and `build` materializes only the stages this process holds.
    pub(crate) fn from_factory(factory: Arc<dyn ModelFactory>) -> Result<Self> {
        let layers = crate::exec::described::describe(&factory)?;
        let mut b = PipelineBuilder::new(layers);
        b.factory = Some(factory);
        Ok(b)
    }

    /// Whether the layers are descriptions (see [`Pipeline::builder_from`]).
    pub(crate) fn is_described(&self) -> bool {
        self.factory.is_some()
    }

    /// Over MPI, a setting of the run outside the pipeline that every rank must share (the
    /// batch size, the number of steps, the data's seed...): `build` fails on every rank when
    /// the ranks' values differ, naming the setting and the ranks, as it does for the
    /// pipeline's own settings (model, seed, precision, loss scaling, schedule, K, M, chunks,
    /// balance, re-materialization). Nothing to check in one process.
    pub fn agree_on(mut self, name: &str, value: impl ToString) -> Self {
        self.agreed.push((name.to_string(), value.to_string()));
        self
    }

    /// The dtype the layers compute in (autocast, see `ForwardCtx::compute`): f32 (the
    /// default), f16 or bf16, in forwards and recomputes alike. The model's inputs are given to
    /// stage 0 as they are (token indices must stay f32); tensors cross stage boundaries in the
    /// dtype the layers produce them in. f16 turns on dynamic loss scaling unless
    /// [`PipelineBuilder::loss_scaling`] says otherwise.
    pub fn precision(mut self, dtype: DType) -> Self {
        self.precision = dtype;
        self
    }

    /// Dynamic loss scaling (see [`crate::train::scaler`]): `Some(rule)` to turn it on (also in f32
    /// or bf16), `None` to turn it off (also in f16). With it on, steps run under
    /// [`NonFinite::SkipStep`] whatever [`PipelineBuilder::on_non_finite`] says: a step with
    /// NaN or infinity is skipped by the next `optimizer_step` (which then changes nothing but
    /// the scale) instead of failing.
    pub fn loss_scaling(mut self, scaling: Option<LossScaling>) -> Self {
        self.loss_scaling = Some(scaling);
        self
    }

    /// One device per stage (the same device may appear several times, but then those stages
    /// share its memory and FLOP counters in the reports). Replaces an earlier `.sim(..)`.
    pub fn devices(mut self, devices: Vec<Device>) -> Self {
        self.devices = devices;
        self.sim = None;
        self
    }
    /// Run on a simulated cluster: one stage per virtual device, simulated times in the reports.
    pub fn sim(mut self, cluster: SimCluster) -> Self {
        self.devices = cluster.devices().to_vec();
        self.sim = Some(cluster);
        self
    }
    pub fn balance(mut self, balance: Balance) -> Self {
        self.balance = balance;
        self
    }
    /// M, the number of micro-batches (default 1; a custom schedule brings its own).
    pub fn micro_batches(mut self, m: usize) -> Self {
        self.micro_batches = Some(m);
        self
    }
    /// Virtual stages per device for the looped schedules (default 2 for interleaved 1F1B and
    /// looped BFS; ZB-V and DualPipeV always use 2, the others 1).
    pub fn chunks(mut self, v: usize) -> Self {
        self.chunks = Some(v);
        self
    }
    pub fn checkpoint(mut self, mode: CheckpointMode) -> Self {
        self.checkpoint = mode;
        self
    }
    /// Re-materializes these layers (global indices) in every forward that records, whatever
    /// the [`checkpoint`](Self::checkpoint) mode of the micro-batches: each run of consecutive
    /// ones inside a stage keeps only its input between the forward and the backward, and
    /// runs again just before that stage's backward (per-layer re-materialization, as wrapping
    /// modules in torch's `checkpoint_wrapper`; the gradients are bit for bit the same). Layers
    /// that pop or stash skips cannot be among them. The planner sets it where it pays.
    pub fn checkpoint_layers(mut self, layers: impl IntoIterator<Item = usize>) -> Self {
        let mut layers: Vec<usize> = layers.into_iter().collect();
        layers.sort_unstable();
        layers.dedup();
        self.checkpoint_layers = layers;
        self
    }

    /// How skips crossing several stages travel ([`SkipRoute::Direct`] by default). The planner
    /// (`plan`) models direct skips only and refuses a relaying builder; `Balance::ByMemory`
    /// charges a skip to its consumer only (as direct routing holds it).
    pub fn skip_route(mut self, route: SkipRoute) -> Self {
        self.skip_route = route;
        self
    }
    /// The schedule: a [`ScheduleKind`] to generate, or any [`Schedule`] (validated at build;
    /// its device count must match the devices given).
    pub fn schedule(mut self, schedule: impl Into<ScheduleSpec>) -> Self {
        self.schedule = schedule.into();
        self
    }
    /// What a step does with NaN or infinite values: an error naming where they first appeared
    /// (the default), skip the step, or no checks.
    pub fn on_non_finite(mut self, policy: NonFinite) -> Self {
        self.non_finite = policy;
        self
    }
    /// A time limit for each compute action (see [`Pipeline::set_action_timeout`]).
    pub fn action_timeout(mut self, limit: std::time::Duration) -> Self {
        self.action_timeout = Some(limit);
        self
    }
    /// Seed of the counter-based RNG (dropout), keyed further by step, micro-batch and layer.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// One optimizer per stage, made by `factory`.
    pub fn optimizer(mut self, factory: impl Fn() -> Box<dyn Optimizer> + 'static) -> Self {
        self.optimizer = Some(Box::new(factory));
        self
    }

    /// What carries tensors between stages (in-process channels by default).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Data parallelism: `r` pipelines over R x K devices (replica i on devices iK..(i+1)K),
    /// each training on its share of every mini-batch, gradients averaged across replicas
    /// before the optimizer step. `make_layers` is called R-1 times for the other replicas'
    /// layers: the `Module` trait has no deep copy (a layer may hold shared state, RNG keys or
    /// device buffers only it knows how to duplicate), so the factory builds the structure and
    /// the builder copies replica 0's parameter values and buffers into each copy, so that all
    /// replicas start bit-identical whatever seed the factory uses.
    pub fn replicas(
        mut self,
        r: usize,
        make_layers: impl FnMut() -> Vec<Box<dyn Module>> + 'static,
    ) -> Self {
        self.replicas = Some((r, Box::new(make_layers)));
        self
    }

    /// Partitions, places every stage's layers on its device and validates the schedule.
    pub fn build(mut self) -> Result<Pipeline> {
        if let Some((r, make_layers)) = self.replicas.take() {
            return self.build_replicated(r, make_layers);
        }
        let k = self.devices.len();
        if k == 0 {
            return Err(PipelineError::Config(
                "no devices: give one per stage with .devices(..) or .sim(..)".into(),
            ));
        }
        let schedule = match &self.schedule {
            ScheduleSpec::Kind(kind) => {
                // M >= 1 is the schedule's rule (ScheduleError::NoMicroBatches), checked there.
                let m = self.micro_batches.unwrap_or(1);
                let chunks = self.chunks.unwrap_or_else(|| kind.default_chunks());
                // Chunk counts are the schedule's rule too (ChunkRule::check).
                kind.generate(k, chunks, m, self.checkpoint)?
            }
            ScheduleSpec::Custom(schedule) => {
                schedule.validate()?;
                if schedule.num_devices() != k {
                    return Err(PipelineError::Config(format!(
                        "schedule '{}' is for {} devices but {k} were given",
                        schedule.name,
                        schedule.num_devices()
                    )));
                }
                if let Some(m) = self
                    .micro_batches
                    .filter(|&m| m != schedule.num_micro_batches)
                {
                    return Err(PipelineError::Config(format!(
                        "micro_batches({m}) differs from schedule '{}', which has {} micro-batches",
                        schedule.name, schedule.num_micro_batches
                    )));
                }
                schedule.clone()
            }
        };
        let comm = crate::exec::comm::for_transport(&self.transport);
        comm.check(schedule.num_devices())?;
        let s_total = schedule.num_stages();
        if self.factory.is_some() && matches!(self.balance, Balance::ByTime { .. }) {
            return Err(PipelineError::Config(
                "Balance::ByTime runs every layer, but a pipeline built from a model factory \
                 holds only its own: balance by params, flops or memory, or give the layers \
                 (Pipeline::builder)"
                    .into(),
            ));
        }
        let balance = match &self.balance {
            Balance::Explicit(b) => {
                validate_balance_for(b, s_total, self.layers.len())?;
                b.clone()
            }
            other => balance_by_cost(&layer_costs(&self.layers, other)?, s_total)?,
        };

        comm.agree_settings(&self.settings(&schedule, &balance))?;
        comm.connect(schedule.num_devices())?;
        let ranges = stage_ranges(&balance);
        let mut checkpointed =
            checkpointed_runs(&self.layers, &self.checkpoint_layers, &ranges)?.into_iter();
        let (skip_links, mut stage_skips) = plan_skips(&self.layers, &ranges, self.skip_route)?;
        let schedule = schedule.with_skip_transfers(&skip_links);
        schedule.validate_skips(&skip_links)?;
        let mut layers = self.layers.into_iter();
        let mut stages = Vec::with_capacity(s_total);
        for (index, range) in ranges.into_iter().enumerate() {
            let device = self.devices[schedule.placement[index]].clone();
            let mut stage_layers: Vec<Box<dyn Module>> =
                layers.by_ref().take(range.len()).collect();
            // Over MPI a rank keeps only the stages it trains: the others' layers go here,
            // before they reach a device.
            let mut absent = None;
            if let Some(rank) = self
                .transport
                .holder_rank(schedule.placement[index], schedule.num_devices())
            {
                let (placeholders, a) =
                    crate::exec::absent::absent_layers(stage_layers, range.start, rank);
                stage_layers = placeholders;
                absent = Some(a);
            } else if let Some(factory) = &self.factory {
                // Held here: the descriptions give way to the layers themselves.
                stage_layers = crate::exec::described::materialize(
                    factory.as_ref(),
                    range.clone(),
                    &stage_layers,
                )
                .map_err(|e| e.at(&format!(" (stage {index})")))?;
            }
            for l in &mut stage_layers {
                with_tag(Tag::Parameters, || l.to_device(&device)).map_err(|e| {
                    PipelineError::Config(format!(
                        "placing layer {} on stage {index} (device {device}): {e}",
                        l.name()
                    ))
                })?;
            }
            stages.push(Stage {
                index,
                device,
                first_layer: range.start,
                layers: stage_layers,
                skips: std::mem::take(&mut stage_skips[index]),
                absent,
                checkpointed: checkpointed.next().unwrap_or_default(),
            });
        }
        crate::exec::tied::check_stage_ties(&stages)?;
        let optimizers = match &self.optimizer {
            Some(f) => stages.iter().map(|_| f()).collect(),
            None => Vec::new(),
        };
        let scaler = self
            .loss_scaling
            .unwrap_or_else(|| crate::train::scaler::default_for(self.precision))
            .map(GradScaler::new)
            .transpose()?;
        Ok(Pipeline {
            replicas: vec![Replica {
                // Over MPI this process's replica is the job's `rank / K`.
                index: comm.replicas(schedule.num_devices(), 1).1,
                stages,
                optimizers,
                sim: self.sim,
                stuck: None,
            }],
            schedule,
            comm,
            transport: self.transport,
            seed: self.seed,
            step: 0,
            non_finite: self.non_finite,
            action_timeout: self.action_timeout,
            round: 0,
            precision: self.precision,
            scaler,
            grads_scale: std::cell::Cell::new(None),
            overflowed: false,
        })
    }

    /// What every rank of a job must share, by name: the model (its layers' names and
    /// parameter count), the pipeline's settings, then the run's own ([`Self::agree_on`]).
    fn settings(&self, schedule: &Schedule, balance: &[usize]) -> Vec<(String, String)> {
        let names: Vec<String> = self.layers.iter().map(|l| l.name()).collect();
        let params: usize = self
            .layers
            .iter()
            .flat_map(|l| l.parameters())
            .map(|(_, p)| p.value().numel())
            .sum();
        let scaling = self
            .loss_scaling
            .unwrap_or_else(|| crate::train::scaler::default_for(self.precision));
        let mut out = vec![
            (
                "model".to_string(),
                format!(
                    "{} layers, {params} parameters, layer names hashed {:016x}",
                    names.len(),
                    fnv1a(names.join("|").as_bytes())
                ),
            ),
            ("seed".into(), self.seed.to_string()),
            ("precision".into(), self.precision.name().into()),
            ("loss scaling".into(), format!("{scaling:?}")),
            ("schedule".into(), schedule.name.clone()),
            ("devices (K)".into(), schedule.num_devices().to_string()),
            (
                "micro-batches".into(),
                schedule.num_micro_batches.to_string(),
            ),
            ("stages".into(), schedule.num_stages().to_string()),
            ("balance".into(), format!("{balance:?}")),
            ("re-materialization".into(), self.checkpoint.name().into()),
            (
                "re-materialized layers".into(),
                format!("{:?}", self.checkpoint_layers),
            ),
        ];
        out.extend(self.agreed.iter().cloned());
        out
    }

    /// R replicas: replica 0 built as usual on the first K devices; the others with the same
    /// partition and schedule on theirs, starting from replica 0's values.
    fn build_replicated(mut self, r: usize, mut make_layers: LayerFactory) -> Result<Pipeline> {
        let n = self.devices.len();
        if r == 0 || n == 0 || !n.is_multiple_of(r) {
            return Err(PipelineError::Config(format!(
                "replicas({r}) needs R x K devices (K per replica), but {n} were given"
            )));
        }
        if self.transport.crosses_processes() {
            return Err(PipelineError::Config(format!(
                "replicas({r}) with a transport across processes: there the replicas are the ranks (mpirun -np R x K, without .replicas)"
            )));
        }
        let k = n / r;
        let devices = std::mem::take(&mut self.devices);
        let sim = self.sim.take();
        let part = |i: usize| {
            let ds = devices[i * k..(i + 1) * k].to_vec();
            let sim = sim.as_ref().map(|c| c.part(i * k..(i + 1) * k));
            (ds, sim)
        };
        let config = |b: &PipelineBuilder, layers, i: usize| {
            let (devices, sim) = part(i);
            PipelineBuilder {
                layers,
                devices,
                sim,
                balance: b.balance.clone(),
                micro_batches: b.micro_batches,
                chunks: b.chunks,
                checkpoint: b.checkpoint,
                checkpoint_layers: b.checkpoint_layers.clone(),
                skip_route: b.skip_route,
                schedule: b.schedule.clone(),
                non_finite: b.non_finite,
                action_timeout: b.action_timeout,
                seed: b.seed,
                optimizer: None,
                transport: b.transport.clone(),
                replicas: None,
                precision: b.precision,
                agreed: b.agreed.clone(),
                // Replica 0 is built from the factory; the others from `make_layers`.
                factory: if i == 0 { b.factory.clone() } else { None },
                // The pipeline keeps replica 0's scaler for all.
                loss_scaling: if i == 0 { b.loss_scaling } else { Some(None) },
            }
        };
        let layers = std::mem::take(&mut self.layers);
        let mut first = config(&self, layers, 0).build()?;
        // The others take replica 0's partition and schedule as they are (a cost-balanced
        // partition measured again could come out different).
        self.balance = Balance::Explicit(first.balance());
        self.schedule = ScheduleSpec::Custom(first.schedule.clone());
        for i in 1..r {
            let mut replica = config(&self, make_layers(), i).build()?.replicas.remove(0);
            replica.index = i;
            crate::train::replicas::copy_values(&first.replicas[0], &replica, i)?;
            first.replicas.push(replica);
        }
        if let Some(f) = &self.optimizer {
            first.set_optimizer(f);
        }
        Ok(first)
    }
}

/// Each stage's runs of consecutive checkpointed `layers` (global indices, ascending), as
/// indices into the stage's layers; an error names a layer out of range or one with skips.
fn checkpointed_runs(
    model: &[Box<dyn Module>],
    layers: &[usize],
    stages: &[Range<usize>],
) -> Result<Vec<Vec<Range<usize>>>> {
    for &i in layers {
        let Some(l) = model.get(i) else {
            return Err(PipelineError::Config(format!(
                "checkpoint_layers: layer {i} does not exist (the model has {} layers)",
                model.len()
            )));
        };
        let skips = l.skips();
        if !skips.is_empty() {
            return Err(PipelineError::Config(format!(
                "checkpoint_layers: layer {i} ({}) pops or stashes skips ({:?} / {:?}); a \
                 re-materialized run of layers takes one input and gives one output",
                l.name(),
                skips.pops,
                skips.stashes
            )));
        }
    }
    Ok(stages
        .iter()
        .map(|range| {
            let mut runs: Vec<Range<usize>> = Vec::new();
            for &i in layers.iter().filter(|&&i| range.contains(&i)) {
                let local = i - range.start;
                match runs.last_mut() {
                    Some(run) if run.end == local => run.end += 1,
                    _ => runs.push(local..local + 1),
                }
            }
            runs
        })
        .collect())
}

/// The cost of each layer under a balancing rule.
fn layer_costs(layers: &[Box<dyn Module>], balance: &Balance) -> Result<Vec<f64>> {
    let param_bytes = |l: &dyn Module| -> f64 {
        l.parameters()
            .iter()
            .map(|(_, p)| p.value().numel() * 4)
            .sum::<usize>() as f64
    };
    match balance {
        Balance::Explicit(_) => unreachable!("explicit balances are not cost-balanced"),
        Balance::ByParams => Ok(layers.iter().map(|l| param_bytes(l.as_ref())).collect()),
        Balance::ByFlops { input_shape } => {
            let mut shape = input_shape.clone();
            Ok(layers
                .iter()
                .map(|l| {
                    let c = l.cost(&shape);
                    shape = c.output_shape;
                    c.flops
                })
                .collect())
        }
        Balance::ByMemory {
            input_shape,
            optimizer_factor,
        } => {
            // A skip's bytes count where its consumer is (see `popped_bytes`).
            let popped = popped_bytes(layers, input_shape)?;
            let mut shape = input_shape.clone();
            Ok(layers
                .iter()
                .zip(popped)
                .map(|(l, skip)| {
                    let c = l.cost(&shape);
                    shape = c.output_shape;
                    c.param_bytes as f64 * optimizer_factor
                        + c.activation_bytes as f64
                        + skip as f64
                })
                .collect())
        }
        Balance::ByTime { sample } => profile_layers(layers, sample),
    }
}

/// Measured forward+backward seconds of each layer on `sample` (the best of three runs, so that
/// one-off costs such as kernel compilation do not count), skips included (a layer gets what it
/// pops, and back-propagates from what it stashes too). Gradients made here are cleared.
fn profile_layers(layers: &[Box<dyn Module>], sample: &Tensor) -> Result<Vec<f64>> {
    let mut x = sample.clone();
    let mut stashed: HashMap<String, Tensor> = HashMap::new();
    let mut costs = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let ctx = ForwardCtx::train(0, 0, 0).at_layer(i as u64);
        let decl = l.skips();
        let popped: Vec<Tensor> = decl
            .pops
            .iter()
            .map(|n| {
                stashed.remove(n).ok_or_else(|| {
                    PipelineError::Config(format!("layer {i} pops skip '{n}', never stashed"))
                })
            })
            .collect::<Result<_>>()?;
        let mut best = f64::INFINITY;
        let mut out = None;
        for _ in 0..3 {
            let t0 = Instant::now();
            let tape = Tape::new();
            let input = tape.leaf(x.clone());
            let pops: Vec<Var> = popped.iter().map(|t| tape.leaf(t.clone())).collect();
            let (y, stashes) = l.forward_skips(&input, &pops, &ctx)?;
            let mut loss = y.sum(&[], false)?;
            for s in &stashes {
                loss = loss.add(&s.sum(&[], false)?)?;
            }
            tape.backward(&loss)?;
            x.device().synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
            out = Some((y.value().clone(), stashes));
        }
        for (_, p) in l.parameters() {
            p.zero_grad();
        }
        costs.push(best);
        let (y, stashes) = out.expect("three runs happened");
        for (n, s) in decl.stashes.into_iter().zip(stashes) {
            stashed.insert(n, s.value().clone());
        }
        x = y;
    }
    Ok(costs)
}

/// FNV-1a, 64 bits: a short stable fingerprint of a text (the ranks compare the model's layer
/// names by it, not by the names themselves).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
