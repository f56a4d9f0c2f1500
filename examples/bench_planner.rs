//! The planner against the configuration a user would pick by hand, on a heterogeneous simulated
//! cluster (2 fast devices with much memory, 2 slow ones with little; a PCIe-like link).
//!
//! * For the GPipe tables' Transformer LM and AmoebaNet-D shapes (as in `bench_gpipe_tables`):
//!   the hand-picked configuration (all 4 devices in the given order, even balance, GPipe,
//!   M = 4K, always re-materialize) against the plan, both predicted and then run on the
//!   simulated cluster: the ratio of step times.
//! * The largest Transformer (in blocks) that fits the same memory caps by hand and with the
//!   planner (the planner's verdict is checked by running two Adam steps).
//! * How long the search takes for 100 layers on 16 devices.
//! * Scale: a 96-layer GPT-like Transformer (an analytic profile: d_model 4096, sequences of
//!   2048, FLOPs and bytes by the usual formulas) on 16, 64, 256 and 1024 simulated devices in
//!   nodes of 8 (300 GB/s inside a node, 25 GB/s between nodes): planning time, the chosen
//!   R x K, schedule, M and balance; and the same 16 devices as one node, where the choice
//!   differs.
//!
//! * Re-materialization per layer: the Transformer on two devices whose memories hold less
//!   than its plain step, planned with and without checkpointing layers inside stages: both
//!   steps, and the plan with checkpointed layers run on the simulated cluster.
//!
//! `cargo run --release --example bench_planner` (a minute or two on 2 cores);
//! `-- --speed` for the search-speed and scale sections only, `-- --layer-remat` for the
//! per-layer section only.

use std::time::Instant;

use wgpipe::autograd::optim::Optimizer;
use wgpipe::autograd::{Adam, Module};
use wgpipe::models::{cross_entropy, AmoebaNet, TransformerLm};
use wgpipe::pipeline::plan::{
    plan, plan_on, profile_layers, Affine, LayerProfile, PlanError, PlanOptions, PlanReport,
    Profile,
};
use wgpipe::pipeline::{
    Balance, CheckpointMode, DeviceSpec, LinkSpec, LossFn, Pipeline, PipelineError, PlanInputs,
    ScheduleKind, SimCluster, Topology,
};
use wgpipe::tensor::{Device, Tensor};
use wgpipe_apps::Parser;

type Res<T> = Result<T, Box<dyn std::error::Error>>;
type Layers = Vec<Box<dyn Module>>;

/// Rates as in `bench_gpipe_tables` (a V100 scaled to the narrow models); the slow devices are
/// a quarter as fast.
const FAST: f64 = 15e12 / 32.0;
const SLOW: f64 = FAST / 4.0;
const PCIE: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 10e9,
    latency_sec: 10e-6,
};
const SEQ: usize = 32;
const VOCAB: usize = 64;
const BATCH: usize = 64;
const IMG: usize = 16;

fn lm(blocks: usize) -> TransformerLm {
    TransformerLm {
        vocab: VOCAB,
        d_model: 64,
        heads: 4,
        layers: blocks,
        seq_len: SEQ,
        dropout: 0.0,
        // The planner does not cost the exchange of tied gradients yet.
        tie_embeddings: false,
    }
}

fn tokens(n: usize, salt: usize) -> Res<Tensor> {
    let v: Vec<f32> = (0..n * SEQ)
        .map(|i| ((i * 7 + salt * 13 + (i / SEQ) * 3) % VOCAB) as f32)
        .collect();
    Ok(Tensor::from_vec(v, &[n, SEQ], &Device::cpu())?)
}

fn adam() -> Box<dyn Optimizer> {
    Box::new(Adam::new(1e-3))
}

/// 2 fast devices with `big` bytes, then 2 slow ones with `small`.
fn cluster_specs(big: u64, small: u64) -> Vec<DeviceSpec> {
    let d = |flops_per_sec, memory_bytes| DeviceSpec {
        flops_per_sec,
        memory_bytes,
    };
    vec![d(FAST, big), d(FAST, big), d(SLOW, small), d(SLOW, small)]
}

type MakeLayers = std::rc::Rc<dyn Fn() -> Res<Layers>>;

struct Model {
    name: &'static str,
    make: MakeLayers,
    x: Tensor,
    y: Tensor,
}

/// Trains two steps (train + Adam) on the simulated cluster; the second step's simulated time,
/// or None when a device ran out of memory.
fn run(pipe: &mut Pipeline, x: &Tensor, y: &Tensor) -> Res<Option<f64>> {
    let loss: &LossFn = &cross_entropy;
    let mut t = 0.0;
    for _ in 0..2 {
        match pipe.train_step(x, y, loss) {
            Ok(r) => {
                t = r
                    .simulated
                    .as_ref()
                    .ok_or("no simulated report")?
                    .makespan_secs
            }
            Err(e) if e.to_string().contains("out of memory") => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        match pipe.optimizer_step() {
            Ok(()) => {}
            Err(e) if e.to_string().contains("out of memory") => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(t))
}

/// The configuration a user would try first: all devices, even balance, GPipe, M = 4K, always
/// re-materialize.
fn by_hand(layers: Layers, specs: &[DeviceSpec]) -> Res<Pipeline> {
    let k = specs.len();
    let n = layers.len();
    let even: Vec<usize> = (0..k).map(|i| n / k + usize::from(i < n % k)).collect();
    Ok(Pipeline::builder(layers)
        .sim(SimCluster::new(&Device::cpu(), specs, PCIE))
        .balance(Balance::Explicit(even))
        .micro_batches(4 * k)
        .checkpoint(CheckpointMode::Always)
        .schedule(ScheduleKind::GPipe)
        .optimizer(adam)
        .build()?)
}

/// The plan (data-parallel replicas included) for the layers `make` builds, its predicted
/// step, and the pipeline built from it.
fn planned(
    make: MakeLayers,
    specs: &[DeviceSpec],
    x: &Tensor,
    y: &Tensor,
) -> Result<(Pipeline, wgpipe::pipeline::PlanReport), PlanError> {
    let loss: &LossFn = &cross_entropy;
    let inputs = PlanInputs {
        inputs: x,
        targets: y,
        loss,
        batch: BATCH,
        options: PlanOptions::default(),
    };
    let cluster = SimCluster::new(&Device::cpu(), specs, PCIE);
    let layers = make().map_err(|e| PipelineError::Config(e.to_string()))?;
    // A replica's layers: the same model (a failure leaves them empty, which the builder names).
    let copy = move || make().unwrap_or_default();
    let (builder, report, _) = Pipeline::builder(layers)
        .optimizer(adam)
        .plan_replicated(&cluster, &inputs, copy)?;
    Ok((builder.build()?, report))
}

fn compare(m: &Model, specs: &[DeviceSpec]) -> Res<()> {
    println!("\n## {}: by hand vs planned", m.name);
    let mut hand = by_hand((m.make)()?, specs)?;
    let t_hand = run(&mut hand, &m.x, &m.y)?;
    let started = Instant::now();
    let (mut pipe, report) = planned(m.make.clone(), specs, &m.x, &m.y)?;
    let planning = started.elapsed().as_secs_f64();
    print!("{report}");
    let t_plan = run(&mut pipe, &m.x, &m.y)?.ok_or("the plan ran out of memory")?;
    let predicted = report.best.prediction.step_secs;
    println!(
        "planning (profile + search): {planning:.2} s wall; predicted step {predicted:.4e} s, \
         simulated {t_plan:.4e} s ({:+.2}%)",
        (predicted / t_plan - 1.0) * 100.0
    );
    match t_hand {
        Some(t) => println!(
            "by hand (GPipe, even balance, M = {}, always re-materialize): {t:.4e} s; planned is \
             {:.2}x faster",
            4 * specs.len(),
            t / t_plan
        ),
        None => println!("by hand: out of memory"),
    }
    Ok(())
}

/// Whether `blocks` Transformer blocks train by hand, and with the planner (its verdict run).
fn fits(blocks: usize, specs: &[DeviceSpec], x: &Tensor, y: &Tensor) -> Res<(bool, bool)> {
    let layers: MakeLayers = std::rc::Rc::new(move || Ok(lm(blocks).build(1, &Device::cpu())?));
    let hand =
        layers()?.len() >= specs.len() && run(&mut by_hand(layers()?, specs)?, x, y)?.is_some();
    let planned = match planned(layers, specs, x, y) {
        Ok((mut pipe, _)) => {
            run(&mut pipe, x, y)?.ok_or("the planner said it fits, but it ran out of memory")?;
            true
        }
        Err(PlanError::NoFit(_)) => false,
        Err(e) => return Err(e.into()),
    };
    Ok((hand, planned))
}

/// The largest block count for which `pick` says yes (doubling, then bisection).
fn largest(pick: &dyn Fn(usize) -> Res<bool>) -> Res<usize> {
    let mut lo = 1;
    if !pick(lo)? {
        return Ok(0);
    }
    let mut hi = 2;
    while pick(hi)? {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if pick(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// 100 layers (the measured profile of a Transformer's blocks, repeated) on 16 devices of four
/// kinds: the search's time.
fn search_speed(profile: &Profile) -> Res<()> {
    let blocks: Vec<_> = profile.layers[1..profile.layers.len() - 2].to_vec();
    let mut big = profile.clone();
    big.layers = vec![profile.layers[0].clone()];
    while big.layers.len() < 98 {
        big.layers
            .push(blocks[big.layers.len() % blocks.len()].clone());
    }
    big.layers
        .extend(profile.layers[profile.layers.len() - 2..].iter().cloned());
    let specs: Vec<DeviceSpec> = (0..16)
        .map(|i| DeviceSpec {
            flops_per_sec: if i % 4 < 2 { FAST } else { SLOW },
            memory_bytes: if i % 2 == 0 { 64 << 20 } else { 32 << 20 },
        })
        .collect();
    let started = Instant::now();
    let r = plan(&big, &specs, PCIE, 256, &PlanOptions::default())?;
    println!(
        "\n## search speed: {} layers on 16 devices (4 kinds), batch 256: {:.2} s wall, {} \
         candidates predicted; chosen {:?} R={} K={} v={} M={} step {:.4e} s",
        big.layers.len(),
        started.elapsed().as_secs_f64(),
        r.evaluated,
        r.best.candidate.kind,
        r.best.candidate.replicas,
        r.best.candidate.pipeline_devices(),
        r.best.candidate.chunks,
        r.best.candidate.micro_batches,
        r.best.prediction.step_secs
    );
    Ok(())
}

/// One block of a GPT-like Transformer (d_model 4096, sequences of 2048 tokens, flash-style
/// attention), per sample: forward 24 s d^2 + 4 s^2 d FLOPs, backward twice that (half for
/// the input, half for the weights); 12 d^2 parameters at 16 bytes each in all (16-bit
/// weights and gradients, 32-bit master copy and two Adam moments); 34 s d bytes of
/// activations kept for the backward, 2 s d bytes sent to the next stage.
fn gpt_block() -> LayerProfile {
    let (s, d) = (2048.0, 4096.0);
    let per = |x: f64| Affine {
        fixed: 0.0,
        per_sample: x,
    };
    let forward = 24.0 * s * d * d + 4.0 * s * s * d;
    let params = (12.0 * d * d) as u64;
    LayerProfile {
        name: "gpt block".into(),
        forward_flops: per(forward),
        backward_flops: per(2.0 * forward),
        backward_flops_from_data: per(2.0 * forward),
        backward_input_flops: per(forward),
        backward_input_flops_from_data: per(forward),
        backward_weight_flops: per(forward),
        accumulate_flops: params as f64,
        param_bytes: 2 * params,
        grad_bytes: 2 * params,
        optimizer_state_bytes: 12 * params,
        optimizer_step_bytes: 4 * params,
        stash_bytes: per(34.0 * s * d),
        forward_extra_bytes: per(4.0 * s * d),
        no_grad_peak_bytes: per(6.0 * s * d),
        backward_extra_bytes: per(8.0 * s * d),
        backward_input_extra_bytes: per(8.0 * s * d),
        weight_keep_bytes: per(4.0 * s * d),
        backward_weight_extra_bytes: per(2.0 * s * d),
        output_bytes: per(2.0 * s * d),
        ..LayerProfile::default()
    }
}

const NODE: usize = 8;
const NVLINK: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 300e9,
    latency_sec: 2e-6,
};
const NETWORK: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 25e9,
    latency_sec: 10e-6,
};
/// 80 GB devices at 300 TFLOP/s (a data-centre GPU at a realistic share of its 16-bit peak).
const GPU: DeviceSpec = DeviceSpec {
    flops_per_sec: 300e12,
    memory_bytes: 80_000_000_000,
};
const GPT_LAYERS: usize = 96;
const GPT_BATCH: usize = 1024;

/// "min-max layers per stage (stages)" for a balance.
fn balance_summary(b: &[usize]) -> String {
    let (lo, hi) = (b.iter().min().unwrap_or(&0), b.iter().max().unwrap_or(&0));
    if lo == hi {
        format!("{lo} x {}", b.len())
    } else {
        format!("{lo}-{hi} ({} stages)", b.len())
    }
}

fn remat_summary(r: &PlanReport) -> String {
    let mut modes: Vec<String> = r
        .best
        .candidate
        .remat
        .iter()
        .map(|m| m.to_string())
        .collect();
    modes.dedup();
    match r.best.candidate.checkpoint_layers.len() {
        0 => modes.join("/"),
        n => format!("{} + {n} layers", modes.join("/")),
    }
}

/// One row of the scale table.
fn scale_row(devices: usize, what: &str, links: &Topology, layer_remat: bool) -> Res<PlanReport> {
    let profile = Profile {
        layers: vec![gpt_block(); GPT_LAYERS],
        input_bytes: Affine {
            fixed: 0.0,
            per_sample: 2.0 * 2048.0 * 4096.0,
        },
        profiled_at: 1,
        ..Profile::default()
    };
    let specs = vec![GPU; devices];
    let started = Instant::now();
    let options = PlanOptions {
        layer_remat,
        ..PlanOptions::default()
    };
    let r = plan_on(&profile, &specs, links, GPT_BATCH, &options)?;
    let secs = started.elapsed().as_secs_f64();
    let c = &r.best.candidate;
    println!(
        "| {devices:>7} | {what:<13} | {GPT_LAYERS:>6} | {secs:>8.2} | {:>10} | {:>11.3} | {:>4} x {:<4} | {:<15} | {:>3} | {:>3} | {:<16} | {:<11} |",
        r.evaluated,
        r.best.prediction.step_secs,
        c.pipeline_devices(),
        c.replicas,
        format!("{:?}", c.kind),
        c.chunks,
        c.micro_batches,
        balance_summary(&c.balance),
        remat_summary(&r),
    );
    Ok(r)
}

/// Planning time and the chosen plan for a 96-layer Transformer on 16 to 1024 devices in
/// nodes of 8, and on 16 devices as one node.
fn scale(layer_remat: bool) -> Res<()> {
    println!(
        "\n## scale: a 96-layer GPT-like Transformer (d_model 4096, seq 2048, batch {GPT_BATCH}; \
         analytic profile), devices of 80 GB at 300 TFLOP/s, nodes of {NODE}: 300 GB/s inside \
         a node, 25 GB/s between nodes (step: the plan's predicted, simulated step; plan: wall \
         clock of the search; candidates: those predicted in full)\n"
    );
    println!(
        "| devices | links         | layers | plan (s) | candidates | step (s)    | K x R       | schedule        | v   | M   | balance          | remat       |"
    );
    println!(
        "|---------|---------------|--------|----------|------------|-------------|-------------|-----------------|-----|-----|------------------|-------------|"
    );
    for devices in [16, 64, 256, 1024] {
        let links = Topology::nodes(devices, NODE, NVLINK, NETWORK)?;
        scale_row(devices, "nodes of 8", &links, layer_remat)?;
    }
    scale_row(16, "one node", &Topology::flat(NVLINK), layer_remat)?;
    Ok(())
}

/// The planner against hand-picked configurations on a heterogeneous simulated cluster.
#[derive(Parser)]
struct Args {
    /// Only the search-speed row (100 layers on 16 devices) and the scale table
    #[arg(long)]
    speed: bool,
    /// Only the scale table
    #[arg(long)]
    scale: bool,
    /// Only the per-layer re-materialization section
    #[arg(long)]
    layer_remat: bool,
    /// Plan the scale table with re-materialization chosen per stage only
    #[arg(long)]
    no_layer_remat: bool,
}

/// The Transformer LM (8 blocks) on two devices with memory caps below its plain step's peak:
/// planned with and without per-layer re-materialization.
fn layer_remat() -> Res<()> {
    // Activations fill the memories at this batch; M fixed at 2K, as a user would fix it.
    let batch = 4 * BATCH;
    let (x, y) = (tokens(batch, 0)?, tokens(batch, 5)?);
    let loss: &LossFn = &cross_entropy;
    let plan_at = |memory_bytes: u64, layer_remat: bool| {
        let specs = vec![
            DeviceSpec {
                flops_per_sec: FAST,
                memory_bytes,
            };
            2
        ];
        let inputs = PlanInputs {
            inputs: &x,
            targets: &y,
            loss,
            batch,
            options: PlanOptions {
                min_stages: 2,
                max_replicas: 1,
                micro_batches: Some(vec![4]),
                layer_remat,
                ..PlanOptions::default()
            },
        };
        let layers = lm(8)
            .build(1, &Device::cpu())
            .map_err(|e| PipelineError::Config(e.to_string()))?;
        let cluster = SimCluster::new(&Device::cpu(), &specs, PCIE);
        let (builder, report, _) = Pipeline::builder(layers)
            .optimizer(adam)
            .plan(&cluster, &inputs)?;
        Ok::<_, PlanError>((builder, report))
    };
    let (_, ample) = plan_at(u64::MAX, true)?;
    let peak = *ample
        .best
        .prediction
        .peak_bytes
        .iter()
        .max()
        .ok_or("no devices")?;
    println!(
        "\n## re-materialization per layer: Transformer LM (8 blocks, d_model 64, batch {batch}, \
         M = 4) on 2 devices at {FAST:.2e} FLOP/s; plain plan peak {:.2} MiB, step {:.4e} s",
        peak as f64 / (1 << 20) as f64,
        ample.best.prediction.step_secs
    );
    println!("| memory (x plain peak) | per stage only: step | with layers: step | checkpointed layers | speed-up | simulated, measured peak / memory |");
    println!("|---|---|---|---|---|---|");
    for fraction in [0.9, 0.8, 0.7, 0.6, 0.5] {
        let cap = (peak as f64 * fraction) as u64;
        let step = |r: &Result<(_, PlanReport), PlanError>| match r {
            Ok((_, r)) => format!(
                "{:.4e} s ({:?} M={}, {})",
                r.best.prediction.step_secs,
                r.best.candidate.kind,
                r.best.candidate.micro_batches,
                remat_summary(r)
            ),
            Err(PlanError::NoFit(_)) => "does not fit".to_string(),
            Err(e) => format!("error: {e}"),
        };
        let whole = plan_at(cap, false);
        let with = plan_at(cap, true);
        let (mut layers, mut speedup, mut ran) =
            ("-".to_string(), "-".to_string(), "-".to_string());
        let with_step = step(&with);
        if let Ok((builder, r)) = with {
            let c = &r.best.candidate;
            layers = format!(
                "{} of {}",
                c.checkpoint_layers.len(),
                c.balance.iter().sum::<usize>()
            );
            speedup = match &whole {
                Ok((_, w)) => format!(
                    "{:.3}x",
                    w.best.prediction.step_secs / r.best.prediction.step_secs
                ),
                Err(_) => "fits only so".to_string(),
            };
            let mut pipe = builder.build()?;
            // Two steps: the second's simulated time and the largest measured peak.
            let mut measured = (0.0, 0usize);
            for _ in 0..2 {
                let report = pipe.train_step(&x, &y, loss)?;
                pipe.optimizer_step()?;
                let t = report
                    .simulated
                    .as_ref()
                    .ok_or("no simulated report")?
                    .makespan_secs;
                let p = report
                    .stages
                    .iter()
                    .map(|s| s.memory.peak)
                    .max()
                    .unwrap_or(0);
                measured = (t, measured.1.max(p));
            }
            ran = format!(
                "{:.4e} s, {:.2}",
                measured.0,
                measured.1 as f64 / cap as f64
            );
        }
        println!(
            "| {fraction} | {} | {with_step} | {layers} | {speedup} | {ran} |",
            step(&whole)
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let args = Args::parse();
    if args.scale {
        return scale(!args.no_layer_remat);
    }
    if args.layer_remat {
        return layer_remat();
    }
    let only_speed = args.speed;
    let specs = cluster_specs(64 << 20, 16 << 20);
    let lm_model = Model {
        name: "Transformer LM (24 blocks, d_model 64, seq 32, batch 64)",
        make: std::rc::Rc::new(|| Ok(lm(24).build(1, &Device::cpu())?)),
        x: tokens(BATCH, 0)?,
        y: tokens(BATCH, 5)?,
    };
    let mut layers = (lm_model.make)()?;
    let loss: &LossFn = &cross_entropy;
    let profile = profile_layers(
        &mut layers,
        &lm_model.x,
        &lm_model.y,
        loss,
        Some(&adam),
        &Device::cpu(),
    )?;
    search_speed(&profile)?;
    scale(!args.no_layer_remat)?;
    if only_speed {
        return Ok(());
    }
    println!(
        "cluster: 2 devices at {:.2e} FLOP/s with 64 MiB, 2 at {:.2e} FLOP/s with 16 MiB; \
         link 10 GB/s, 10 us (simulated times)",
        FAST, SLOW
    );
    compare(&lm_model, &specs)?;
    let amoeba = Model {
        name: "AmoebaNet-D (6 normal cells, 16 filters, 16x16 images, batch 64)",
        make: std::rc::Rc::new(|| {
            Ok(AmoebaNet {
                normal_cells: 6,
                filters: 16,
                num_classes: 10,
                in_channels: 3,
            }
            .build(1, &Device::cpu())?)
        }),
        x: Tensor::rand_normal(&[BATCH, 3, IMG, IMG], 0.0, 1.0, 3, &Device::cpu())?,
        y: Tensor::from_vec(
            (0..BATCH).map(|i| (i % 10) as f32).collect(),
            &[BATCH],
            &Device::cpu(),
        )?,
    };
    compare(&amoeba, &specs)?;

    let caps = cluster_specs(24 << 20, 8 << 20);
    let (x, y) = (tokens(BATCH, 0)?, tokens(BATCH, 5)?);
    let hand = largest(&|b| Ok(fits(b, &caps, &x, &y)?.0))?;
    let plan = largest(&|b| Ok(fits(b, &caps, &x, &y)?.1))?;
    layer_remat()?;
    println!(
        "\n## largest Transformer that trains on 2 x 24 MiB + 2 x 8 MiB (batch {BATCH}): by hand \
         {hand} blocks, planned {plan} blocks ({:.2}x)",
        plan as f64 / hand.max(1) as f64
    );
    Ok(())
}
