//! Every schedule side by side, in one markdown table per part:
//!
//! 1. Simulated with equal costs (F = B = W = 1 per stage or chunk, full backward 2, free links):
//!    the bubble of the step, the steady bubble (inside each device's span), the closed form the
//!    generator's doc states, and the most micro-batches in flight on a device (for chunked
//!    schedules also in units of a 1F1B stage: chunks hold 1/v of a device's layers).
//! 2. Measured on a simulated CPU cluster: the peak activation memory per device of a small MLP.
//! 3. Real threads on this machine: K = 2 devices, one CPU thread each (rayon's pool has one
//!    thread, so every op runs on its stage's thread), M = 8, an MLP of equal Linear + ReLU
//!    blocks; the median step time of each schedule, its ratio to 1F1B, and the ratio the
//!    schedules' simulated bubbles allow, (1 − bubble) / (1 − bubble of 1F1B). The runs of all
//!    schedules are interleaved step by step so load changes hit all alike.
//!
//! `cargo run --release --example bench_schedules` (about a minute on 2 cores);
//! `-- --quick` skips part 3.

use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::timeline::{simulate, ActionCost, DeviceSpec, LinkSpec};
use wgpipe::pipeline::{
    ActionKind, Balance, CheckpointMode, Pipeline, Schedule, ScheduleKind, SimCluster,
};
use wgpipe::tensor::{Device, Tag, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The closed form of each schedule's bubble with equal costs, and which measure it is for.
fn closed_form(kind: ScheduleKind, k: usize, m: usize, v: usize) -> (f64, &'static str) {
    let (kf, mf, vf) = (k as f64, m as f64, v as f64);
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => ((kf - 1.0) / (mf + kf - 1.0), "step"),
        ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => {
            ((kf - 1.0) / (vf * mf + kf - 1.0), "step")
        }
        ScheduleKind::ZbH1 => ((kf - 1.0) / (3.0 * mf + kf - 1.0), "step"),
        ScheduleKind::ZbH2 | ScheduleKind::ZbV | ScheduleKind::DualPipeV => (0.0, "steady"),
    }
}

fn unit_timeline(s: &Schedule) -> Res<wgpipe::pipeline::Timeline> {
    let devices = vec![
        DeviceSpec {
            flops_per_sec: 1.0,
            memory_bytes: u64::MAX
        };
        s.num_devices()
    ];
    Ok(simulate(s, &devices, &LinkSpec::FREE, |_, a| ActionCost {
        flops: if a.kind == ActionKind::Backward {
            2.0
        } else {
            1.0
        },
        bytes: 0,
    })?)
}

fn simulated_table() -> Res<()> {
    println!("## 1. Simulated, equal costs\n");
    println!("| schedule | K | M | chunks | bubble | steady bubble | closed form | max in flight (chunk / 1F1B-stage units) |");
    println!("|---|---|---|---|---|---|---|---|");
    for (k, m) in [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)] {
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            let s = match kind.generate(k, v, m, CheckpointMode::Never) {
                Ok(s) => s,
                Err(e) => {
                    println!("| {kind:?} | {k} | {m} | {v} | - | - | - | {e} |");
                    continue;
                }
            };
            let t = unit_timeline(&s)?;
            let (cf, measure) = closed_form(kind, k, m, v);
            let in_flight = s.max_in_flight().into_iter().max().unwrap_or(0);
            println!(
                "| {} | {k} | {m} | {v} | {:.1}% | {:.1}% | {:.1}% ({measure}) | {in_flight} / {:.1} |",
                s.name,
                t.bubble_fraction() * 100.0,
                t.steady_bubble_fraction() * 100.0,
                cf * 100.0,
                in_flight as f64 / v as f64
            );
        }
    }
    Ok(())
}

/// `blocks` x [Linear(width), ReLU].
fn mlp(blocks: usize, width: usize) -> Res<Vec<Box<dyn Module>>> {
    let mut v: Vec<Box<dyn Module>> = Vec::new();
    for i in 0..blocks {
        v.push(Box::new(Linear::new(
            width,
            width,
            100 + i as u64,
            &Device::cpu(),
        )?));
        v.push(Box::new(Relu));
    }
    Ok(v)
}

fn pipeline(
    kind: ScheduleKind,
    devices: Vec<Device>,
    layers: Vec<Box<dyn Module>>,
    m: usize,
) -> Res<Pipeline> {
    let n = layers.len();
    let pieces = devices.len() * kind.default_chunks();
    Ok(Pipeline::builder(layers)
        .devices(devices)
        .balance(Balance::Explicit(vec![n / pieces; pieces]))
        .micro_batches(m)
        .checkpoint(CheckpointMode::Never)
        .schedule(kind)
        .optimizer(|| Box::new(Sgd::new(1e-3)))
        .build()?)
}

fn memory_table() -> Res<()> {
    let (k, m, width, batch) = (4, 8, 64, 64);
    println!("\n## 2. Peak activations per device, measured (simulated cluster of {k} CPU devices, MLP 8 x Linear({width}) + ReLU, batch {batch}, M = {m}, no re-materialization)\n");
    println!("| schedule | peak activations KiB per device | max in flight |");
    println!("|---|---|---|");
    let x = Tensor::rand_normal(&[batch, width], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[batch, width], 0.0, 1.0, 2, &Device::cpu())?;
    for kind in ScheduleKind::ALL {
        if kind == ScheduleKind::DualPipeV && m < 2 * k {
            continue;
        }
        let cluster = SimCluster::uniform(&Device::cpu(), k, u64::MAX, 1e12, LinkSpec::FREE);
        let n = 16;
        let pieces = k * kind.default_chunks();
        let mut pipe = Pipeline::builder(mlp(8, width)?)
            .sim(cluster)
            .balance(Balance::Explicit(vec![n / pieces; pieces]))
            .micro_batches(m)
            .checkpoint(CheckpointMode::Never)
            .schedule(kind)
            .optimizer(|| Box::new(Sgd::new(1e-3)))
            .build()?;
        let r = pipe.train_step(&x, &y, &mse)?;
        let peaks: Vec<String> = r
            .stages
            .iter()
            .map(|s| format!("{:.1}", s.memory.peak_of(Tag::Activations) as f64 / 1024.0))
            .collect();
        println!(
            "| {} | {} | {:?} |",
            pipe.schedule().name,
            peaks.join(" / "),
            pipe.schedule().max_in_flight()
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn threads_table() -> Res<()> {
    const BLOCKS: usize = 8;
    const WIDTH: usize = 1024;
    const BATCH: usize = 2048;
    const M: usize = 8;
    const STEPS: usize = 3;
    println!(
        "\n## 3. Real threads: K = 2 CPU devices, one thread each, MLP {BLOCKS} x Linear({WIDTH}) + ReLU, batch {BATCH}, M = {M}, median of {STEPS} steps after a warm-up\n"
    );
    let x = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &Device::cpu())?;
    let kinds: Vec<ScheduleKind> = ScheduleKind::ALL
        .into_iter()
        .filter(|&k| k != ScheduleKind::DualPipeV || M >= 4)
        .collect();
    let mut pipes = Vec::new();
    for &kind in &kinds {
        let devices = vec![Device::new_cpu("cpu0"), Device::new_cpu("cpu1")];
        pipes.push(pipeline(kind, devices, mlp(BLOCKS, WIDTH)?, M)?);
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    let mut bubbles: Vec<Vec<f64>> = vec![Vec::new(); kinds.len()];
    for round in 0..=STEPS {
        for (i, pipe) in pipes.iter_mut().enumerate() {
            let t0 = Instant::now();
            let r = pipe.train_step(&x, &y, &mse)?;
            pipe.optimizer_step()?;
            if round > 0 {
                times[i].push(t0.elapsed().as_secs_f64());
                bubbles[i].push(r.wall_bubble_fraction);
            }
        }
    }
    let base = kinds
        .iter()
        .position(|&k| k == ScheduleKind::OneFOneB)
        .unwrap_or(0);
    let base_time = median(times[base].clone());
    let sim_bubble = |kind: ScheduleKind| -> Res<f64> {
        let s = kind.generate(2, kind.default_chunks(), M, CheckpointMode::Never)?;
        Ok(unit_timeline(&s)?.bubble_fraction())
    };
    let base_bubble = sim_bubble(ScheduleKind::OneFOneB)?;
    println!("| schedule | step ms | measured bubble | speed-up vs 1F1B | allowed by the simulated bubbles |");
    println!("|---|---|---|---|---|");
    for (i, &kind) in kinds.iter().enumerate() {
        let t = median(times[i].clone());
        let allowed = (1.0 - sim_bubble(kind)?) / (1.0 - base_bubble);
        println!(
            "| {} | {:.0} | {:.1}% | {:.2}x | {:.2}x |",
            pipes[i].schedule().name,
            t * 1e3,
            median(bubbles[i].clone()) * 100.0,
            base_time / t,
            allowed
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let t0 = Instant::now();
    // One-thread rayon pool: each stage computes on its own thread only (see bench_pipeline_cpu).
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()?;
    println!("# Schedules\n");
    simulated_table()?;
    memory_table()?;
    if !std::env::args().any(|a| a == "--quick") {
        threads_table()?;
    }
    println!("\nwall time {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
