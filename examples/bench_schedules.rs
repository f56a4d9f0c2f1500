//! Every schedule side by side in one markdown table, one row per schedule x (K, M):
//!
//! - bubbles simulated with equal costs (F = B = W = 1 per stage or chunk, full backward 2, free
//!   links): of the step and steady (inside each device's span), beside the closed form each
//!   generator's doc states;
//! - the most micro-batches in flight on a device (for chunked schedules also in 1F1B-stage
//!   units: a chunk holds 1/v of a device's layers), and the peak activation memory per device
//!   measured by the memory accounting of a simulated CPU cluster (a small MLP);
//! - in the rows K = 2, M = 8, real threads on this machine: two CPU devices with one thread each
//!   (rayon's pool has one thread, so every op runs on its stage's thread), an MLP of equal
//!   Linear + ReLU blocks, the median step time, the measured bubble, the speed-up over 1F1B, the
//!   one the simulated bubbles allow with equal costs, (1 - bubble) / (1 - bubble of 1F1B), and
//!   the most any schedule could gain, 1 / (1 - measured bubble of 1F1B) (real F, B and W costs
//!   are not equal: stage 0 has no input gradient to compute, the last stage has the loss). The
//!   steps of all schedules are interleaved so load changes hit all alike; run it on an idle
//!   machine.
//!
//! `cargo run --release --example bench_schedules` (about a minute on 2 cores);
//! `-- --quick` skips the real-thread runs.

use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::sim::timeline::{simulate, ActionCost, DeviceSpec, LinkSpec};
use wgpipe::pipeline::{
    ActionKind, Balance, CheckpointMode, Pipeline, Schedule, ScheduleKind, SimCluster,
};
use wgpipe::tensor::{Device, Tag, Tensor};
use wgpipe_apps::Parser;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The closed form of each schedule's bubble with equal costs (the registry's), and which
/// measure it is for.
fn closed_form(kind: ScheduleKind, k: usize, m: usize, v: usize) -> (f64, &'static str) {
    (kind.def().bubble)(k as f64, m as f64, v as f64)
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

/// Peak activation KiB per device, measured by the memory accounting of a simulated cluster of
/// `k` CPU devices (MLP 8 x Linear(64) + ReLU, batch 64, no re-materialization).
fn measured_peaks(kind: ScheduleKind, k: usize, m: usize) -> Res<Vec<f64>> {
    let (width, batch) = (64, 64);
    let x = Tensor::rand_normal(&[batch, width], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[batch, width], 0.0, 1.0, 2, &Device::cpu())?;
    let cluster = SimCluster::uniform(&Device::cpu(), k, u64::MAX, 1e12, LinkSpec::FREE);
    let mut pipe = pipeline(kind, cluster.devices().to_vec(), mlp(8, width)?, m)?;
    let r = pipe.train_step(&x, &y, &mse)?;
    Ok(r.stages
        .iter()
        .map(|s| s.memory.peak_of(Tag::Activations) as f64 / 1024.0)
        .collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const THREADS_M: usize = 8;

/// Real threads: median step ms of each schedule on K = 2 CPU devices, one thread each.
fn thread_times() -> Res<Vec<(ScheduleKind, f64, f64)>> {
    const BLOCKS: usize = 8;
    const WIDTH: usize = 1024;
    const BATCH: usize = 2048;
    const STEPS: usize = 5;
    let x = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &Device::cpu())?;
    let mut pipes = Vec::new();
    for kind in ScheduleKind::ALL {
        let devices = vec![Device::new_cpu("cpu0"), Device::new_cpu("cpu1")];
        pipes.push((
            kind,
            pipeline(kind, devices, mlp(BLOCKS, WIDTH)?, THREADS_M)?,
        ));
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); pipes.len()];
    let mut bubbles: Vec<Vec<f64>> = vec![Vec::new(); pipes.len()];
    for round in 0..=STEPS {
        for (i, (_, pipe)) in pipes.iter_mut().enumerate() {
            let t0 = Instant::now();
            let r = pipe.train_step(&x, &y, &mse)?;
            pipe.optimizer_step()?;
            if round > 0 {
                times[i].push(t0.elapsed().as_secs_f64());
                bubbles[i].push(r.wall_bubble_fraction);
            }
        }
    }
    Ok(pipes
        .iter()
        .enumerate()
        .map(|(i, (kind, _))| (*kind, median(times[i].clone()), median(bubbles[i].clone())))
        .collect())
}

/// Every schedule side by side: simulated bubbles and memory, and real-thread step times.
#[derive(Parser)]
struct Args {
    /// Skip the real-thread runs (simulated columns only)
    #[arg(long)]
    quick: bool,
}

fn main() -> Res<()> {
    let args = Args::parse();
    let t0 = Instant::now();
    // One-thread rayon pool: each stage computes on its own thread only (see bench_pipeline_cpu).
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()?;
    let threads = if args.quick {
        Vec::new()
    } else {
        thread_times()?
    };
    let base = threads
        .iter()
        .find(|(k, _, _)| *k == ScheduleKind::OneFOneB)
        .map(|(_, t, b)| (*t, *b));
    let base_bubble =
        unit_timeline(&ScheduleKind::OneFOneB.generate(2, 1, THREADS_M, CheckpointMode::Never)?)?
            .bubble_fraction();
    println!("# Schedules\n");
    println!(
        "Bubbles simulated with equal costs (F = B = W = 1 per stage or chunk, full backward 2, free \
         links): of the step, and steady (inside each device's span); the closed form is for the \
         measure named. In flight: the most (stage, micro-batch) pairs a device holds, in chunks and \
         in 1F1B-stage units. Peak activations: measured per device on a simulated CPU cluster (MLP \
         8 x Linear(64) + ReLU, batch 64, no re-materialization). Real threads (rows K=2, M={THREADS_M}): \
         two CPU devices with one thread each (rayon pool of 1), MLP 8 x Linear(1024) + ReLU, batch \
         2048, median of 5 steps after a warm-up, interleaved across schedules; the speed-up over \
         1F1B beside what the simulated bubbles allow with equal costs, (1 - bubble) / (1 - bubble of \
         1F1B), and the most any schedule could gain here, 1 / (1 - measured bubble of 1F1B).\n"
    );
    println!("| schedule | K | M | chunks | bubble | steady bubble | closed form | in flight (chunks / 1F1B units) | peak activations KiB per device | real threads: step ms, measured bubble, vs 1F1B (equal-cost bound; zero-bubble bound) |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (k, m) in [(2, 4), (2, THREADS_M), (4, 8), (4, 16), (8, 16), (8, 32)] {
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            let s = match kind.generate(k, v, m, CheckpointMode::Never) {
                Ok(s) => s,
                Err(e) => {
                    println!("| {kind:?} | {k} | {m} | {v} | - | - | - | - | - | {e} |");
                    continue;
                }
            };
            let t = unit_timeline(&s)?;
            let (cf, measure) = closed_form(kind, k, m, v);
            let in_flight = s.max_in_flight().into_iter().max().unwrap_or(0);
            let peaks: Vec<String> = measured_peaks(kind, k, m)?
                .iter()
                .map(|p| format!("{p:.0}"))
                .collect();
            let real = match (threads.iter().find(|(x, _, _)| *x == kind), base) {
                (Some((_, ms, bubble)), Some((b, b_bubble))) if (k, m) == (2, THREADS_M) => {
                    format!(
                        "{:.0} ms, {:.1}%, {:.2}x ({:.2}x; {:.2}x)",
                        ms * 1e3,
                        bubble * 100.0,
                        b / ms,
                        (1.0 - t.bubble_fraction()) / (1.0 - base_bubble),
                        1.0 / (1.0 - b_bubble)
                    )
                }
                _ => "-".into(),
            };
            println!(
                "| {} | {k} | {m} | {v} | {:.1}% | {:.1}% | {:.1}% ({measure}) | {in_flight} / {:.1} | {} | {real} |",
                s.name,
                t.bubble_fraction() * 100.0,
                t.steady_bubble_fraction() * 100.0,
                cf * 100.0,
                in_flight as f64 / v as f64,
                peaks.join(" / ")
            );
        }
    }
    println!("\nwall time {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
