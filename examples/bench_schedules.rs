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
//! The synthesized schedule (`synth`) is in every table: in the first with the registry's
//! defaults (equal costs, 1F1B's memory, the V); in the real-thread rows also synthesized from
//! the costs measured on this machine (per-stage F, I, W from a ZB-H1 and a ZB-V step's wall
//! timeline, in-process transfers taken as free) under 1F1B's peak and twice that.
//!
//! `--synth` adds issue 33's grid: the synthesizer against the best of the eight generators that
//! fits the same memory cap, simulated in 144 cells (K, M, I/F, W/F, transfer/F, cap).
//!
//! `--back-to-back` prints issue 33's steps back to back alone: 20 steps (`--steps`) of 1F1B,
//! ZB-H1 and ZB-V on real threads, one at a time and back to back (`Pipeline::train_steps`).
//!
//! `cargo run --release --example bench_schedules` (about a minute on 2 cores);
//! `-- --quick` skips the real-thread runs; `-- --quick --synth` prints the grid alone;
//! `-- --back-to-back` the back-to-back table alone.

use std::ops::ControlFlow;
use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::schedule::{Placement, StageCosts, SynthSpec};
use wgpipe::pipeline::sim::synth::{grid, synthesize, Origin, Synthesis};
use wgpipe::pipeline::sim::timeline::{simulate, ActionCost, DeviceSpec, LinkSpec};
use wgpipe::pipeline::{
    ActionKind, Balance, CheckpointMode, Pipeline, Schedule, ScheduleKind, ScheduleSpec,
    SimCluster, StepReport, StepsOptions, StepsPath,
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
    let pieces = devices.len() * kind.default_chunks();
    pipeline_of(kind.into(), pieces, devices, layers, m)
}

/// A pipeline running `schedule` over `pieces` stages of equal layer counts.
fn pipeline_of(
    schedule: ScheduleSpec,
    pieces: usize,
    devices: Vec<Device>,
    layers: Vec<Box<dyn Module>>,
    m: usize,
) -> Res<Pipeline> {
    let n = layers.len();
    Ok(Pipeline::builder(layers)
        .devices(devices)
        .balance(Balance::Explicit(vec![n / pieces; pieces]))
        .micro_batches(m)
        .checkpoint(CheckpointMode::Never)
        .schedule(schedule)
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
const THREADS_K: usize = 2;
/// The real-thread MLP: BLOCKS x [Linear(WIDTH), ReLU] on mini-batches of BATCH.
const BLOCKS: usize = 8;
const WIDTH: usize = 1024;
const BATCH: usize = 2048;

/// Per stage, the median wall time of its forwards, input parts and weight parts in a step
/// (`stages` stages; a kind absent on a stage costs 0).
fn measured_costs(report: &StepReport, stages: usize) -> Vec<StageCosts> {
    let median_of = |stage: usize, kind: ActionKind| {
        let times: Vec<f64> = report
            .wall_timeline
            .events
            .iter()
            .filter(|e| e.stage == stage && e.kind == kind)
            .map(|e| e.end - e.start)
            .collect();
        if times.is_empty() {
            0.0
        } else {
            median(times)
        }
    };
    (0..stages)
        .map(|s| StageCosts {
            forward: median_of(s, ActionKind::Forward),
            input: median_of(s, ActionKind::BackwardInput),
            weight: median_of(s, ActionKind::BackwardWeight),
        })
        .collect()
}

/// The synthesized schedule for the measured costs under `cap`: the faster (simulated) of the
/// one-stage-per-device placement and the V.
fn synthesized_for(costs: &[(Placement, Vec<StageCosts>)], cap: usize) -> Res<Synthesis> {
    let mut best: Option<Synthesis> = None;
    for (placement, stages) in costs {
        let spec = SynthSpec {
            placement: placement.devices(THREADS_K),
            micro_batches: THREADS_M,
            stages: stages.clone(),
            transfer: 0.0,
            memory_cap: vec![cap; THREADS_K],
        };
        let s = synthesize(&spec)?;
        if best.as_ref().is_none_or(|b| s.step < b.step) {
            best = Some(s);
        }
    }
    Ok(best.expect("two placements"))
}

/// One real-thread row: its label, median step seconds, median measured bubble, and the most
/// micro-batches a device holds (in 1F1B-stage units).
struct ThreadRow {
    label: String,
    kind: Option<ScheduleKind>,
    secs: f64,
    bubble: f64,
    held: f64,
}

/// Real threads: median step ms of each schedule on K = 2 CPU devices, one thread each; then
/// the schedules synthesized from the costs measured in ZB-H1's and ZB-V's first steps, under
/// 1F1B's peak and twice that.
fn thread_times() -> Res<Vec<ThreadRow>> {
    const STEPS: usize = 5;
    let x = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &Device::cpu())?;
    let devices = || vec![Device::new_cpu("cpu0"), Device::new_cpu("cpu1")];
    let mut pipes: Vec<(String, Option<ScheduleKind>, Pipeline)> = Vec::new();
    for kind in ScheduleKind::ALL {
        let pipe = pipeline(kind, devices(), mlp(BLOCKS, WIDTH)?, THREADS_M)?;
        pipes.push((kind.name().to_string(), Some(kind), pipe));
    }
    // The costs: the second of two steps of ZB-H1 (one stage per device) and ZB-V (the V).
    let mut costs = Vec::new();
    for (kind, placement) in [
        (ScheduleKind::ZbH1, Placement::Looped { chunks: 1 }),
        (ScheduleKind::ZbV, Placement::V),
    ] {
        let (_, _, pipe) = pipes
            .iter_mut()
            .find(|p| p.1 == Some(kind))
            .expect("listed");
        pipe.train_step(&x, &y, &mse)?;
        pipe.optimizer_step()?;
        let r = pipe.train_step(&x, &y, &mse)?;
        pipe.optimizer_step()?;
        let stages = placement.devices(THREADS_K).len();
        costs.push((placement, measured_costs(&r, stages)));
    }
    let peak = grid::one_f_one_b_peak(THREADS_K, THREADS_M)?;
    for factor in [1, 2] {
        let s = synthesized_for(&costs, factor * peak)?;
        let made_by = match s.origin {
            Origin::Placer(_) => "placer".to_string(),
            Origin::Generator(kind) => format!("= {kind}"),
        };
        let label = format!("synth, measured costs, cap {factor}x 1F1B ({made_by})");
        let pieces = s.schedule.num_stages();
        let pipe = pipeline_of(
            s.schedule.into(),
            pieces,
            devices(),
            mlp(BLOCKS, WIDTH)?,
            THREADS_M,
        )?;
        pipes.push((label, None, pipe));
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); pipes.len()];
    let mut bubbles: Vec<Vec<f64>> = vec![Vec::new(); pipes.len()];
    for round in 0..=STEPS {
        for (i, (_, _, pipe)) in pipes.iter_mut().enumerate() {
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
        .map(|(i, (label, kind, pipe))| {
            let s = pipe.schedule();
            let v = s.max_chunks().max(1) as f64;
            let held = s.max_in_flight().into_iter().max().unwrap_or(0) as f64 / v;
            ThreadRow {
                label: label.clone(),
                kind: *kind,
                secs: median(times[i].clone()),
                bubble: median(bubbles[i].clone()),
                held,
            }
        })
        .collect())
}

/// Issue 33's grid (see `wgpipe_pipeline::sim::synth::grid`): one row per cell, then the
/// summary.
fn synth_grid() -> Res<()> {
    println!("\n# The synthesizer against the generators (simulated)\n");
    println!(
        "Costs per device and micro-batch with F = 1 (split evenly among a schedule's chunks), \
         every message between devices taking the transfer time; the cap is 1F1B's peak \
         (min(K, M) micro-batches of a device's share of the model) or twice that; a generator \
         counts only where its micro-batches in flight, over its chunks, fit the cap. \
         synth / best < 1: the synthesized step is faster; made by: the placer policy that won, \
         or the generator whose schedule the search kept (never faster than the best generator \
         by construction).\n"
    );
    println!("| K | M | I/F | W/F | transfer/F | cap | best generator (step) | synth step | synth / best | placer alone / best | made by |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let (mut faster, mut slower, mut placer_wins, mut n) = (0, 0, 0, 0);
    let (mut worst, mut best_ratio) = (0.0f64, f64::INFINITY);
    for cell in grid::cells() {
        let r = grid::evaluate(cell)?;
        let ratio = r.ratio();
        let placer = r.synthesis.placer_step / r.best_generator.1;
        n += 1;
        faster += usize::from(ratio <= 0.97);
        slower += usize::from(ratio > 1.0);
        placer_wins += usize::from(placer < 1.0);
        worst = worst.max(ratio);
        best_ratio = best_ratio.min(ratio);
        let made_by = match r.synthesis.origin {
            Origin::Placer(p) => format!("placer: {p}"),
            Origin::Generator(kind) => format!("generator {kind}"),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} ({:.2}) | {:.2} | {:.3} | {:.3} | {made_by} |",
            cell.k,
            cell.m,
            cell.input,
            cell.weight,
            cell.transfer,
            r.cap,
            r.best_generator.0,
            r.best_generator.1,
            r.synthesis.step,
            ratio,
            placer,
        );
    }
    println!(
        "\n{n} cells: synthesized at least 3% faster than the best generator in {faster} \
         ({:.0}%), slower in {slower}; worst ratio {worst:.3}, best {best_ratio:.3}; the placer \
         alone beats the best generator in {placer_wins}.",
        100.0 * faster as f64 / n as f64
    );
    Ok(())
}

/// Issue 33's steps back to back on real threads (K = 2, the MLP of the real-thread rows):
/// `steps` steps of 1F1B, ZB-H1 and ZB-V through `Pipeline::train_steps`, one step at a time
/// and back to back, each pipeline after one warm-up step. The two alternate in `rounds` runs
/// of steps / rounds so that load changes hit both alike (each run's first step cannot overlap
/// the one before it: a little against back to back). Printed: wall time per step, compute
/// time per step and device (the load's drift shows there), the bubble measured over the runs
/// (1 - busy / (K x wall), the time between steps idle) beside the simulator's bubble with equal
/// costs, of one step and steady (inside each device's span: what is left when the ramps of a
/// step are filled by its neighbours).
fn back_to_back(steps: u64, rounds: u64) -> Res<()> {
    let x = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &Device::cpu())?;
    let y = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &Device::cpu())?;
    let per_run = (steps / rounds).max(1);
    println!("# Steps back to back (real threads)\n");
    println!(
        "K = {THREADS_K}, M = {THREADS_M}, two CPU devices with one thread each, MLP {BLOCKS} x \
         Linear({WIDTH}) + ReLU, batch {BATCH}, SGD; {} steps each way through train_steps, in \
         {rounds} alternating runs of {per_run}, after a warm-up step. Bubble over the runs: \
         1 - busy / (K x wall) from the first action of a run to the end of its last (the time \
         between steps idle); simulated: equal costs, of one step (steady: inside each device's \
         span).\n",
        per_run * rounds
    );
    println!("| schedule | one at a time: ms/step | back to back: ms/step | speed-up | busy ms/step/device: one at a time, back to back | bubble over the runs: one at a time | back to back | simulated bubble (steady) | steps begun before the last one ended | rollbacks |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbV,
    ] {
        let sim = unit_timeline(&kind.generate(
            THREADS_K,
            kind.default_chunks(),
            THREADS_M,
            CheckpointMode::Never,
        )?)?;
        // Per way (one at a time, back to back): the pipeline, call seconds, busy device
        // seconds, run seconds, overlapped steps, rollbacks.
        let mut ways = Vec::new();
        for _ in 0..2 {
            let devices = vec![Device::new_cpu("cpu0"), Device::new_cpu("cpu1")];
            let mut pipe = pipeline(kind, devices, mlp(BLOCKS, WIDTH)?, THREADS_M)?;
            pipe.train_step(&x, &y, &mse)?;
            pipe.optimizer_step()?;
            ways.push((pipe, 0.0, 0.0, 0.0, 0, 0));
        }
        for _ in 0..rounds {
            for (i, way) in ways.iter_mut().enumerate() {
                let opts = StepsOptions {
                    steps: per_run,
                    step_at_a_time: i == 0,
                    ..StepsOptions::default()
                };
                let t0 = Instant::now();
                let r = way.0.train_steps(
                    &opts,
                    |_| Ok((x.clone(), y.clone())),
                    &mse,
                    |_| ControlFlow::Continue(()),
                )?;
                way.1 += t0.elapsed().as_secs_f64();
                way.2 += r.busy_secs.iter().sum::<f64>();
                way.3 += r.wall_secs();
                way.4 += r.overlapped_steps();
                way.5 += r.rollbacks;
                assert_eq!(r.path == StepsPath::BackToBack, i == 1);
            }
        }
        let n = (per_run * rounds) as f64;
        let k = THREADS_K as f64;
        let bubble = |w: &(Pipeline, f64, f64, f64, usize, u64)| 1.0 - w.2 / (k * w.3);
        let (one, b2b) = (&ways[0], &ways[1]);
        println!(
            "| {} | {:.0} | {:.0} | {:.3}x | {:.0}, {:.0} | {:.1}% | {:.1}% | {:.1}% ({:.1}%) | {} of {} | {} |",
            kind.name(),
            one.1 / n * 1e3,
            b2b.1 / n * 1e3,
            one.1 / b2b.1,
            one.2 / (n * k) * 1e3,
            b2b.2 / (n * k) * 1e3,
            bubble(one) * 100.0,
            bubble(b2b) * 100.0,
            sim.bubble_fraction() * 100.0,
            sim.steady_bubble_fraction() * 100.0,
            b2b.4,
            (per_run - 1) * rounds,
            b2b.5
        );
    }
    Ok(())
}

/// Every schedule side by side: simulated bubbles and memory, and real-thread step times.
#[derive(Parser)]
struct Args {
    /// Skip the real-thread runs (simulated columns only)
    #[arg(long)]
    quick: bool,
    /// Also print issue 33's grid: the synthesizer against the generators, simulated
    #[arg(long)]
    synth: bool,
    /// Print issue 33's steps-back-to-back table alone (real threads)
    #[arg(long)]
    back_to_back: bool,
    /// Steps of each way of --back-to-back
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Alternating runs the steps of --back-to-back are cut into
    #[arg(long, default_value_t = 2)]
    rounds: u64,
}

fn main() -> Res<()> {
    let args = Args::parse();
    let t0 = Instant::now();
    // One-thread rayon pool: each stage computes on its own thread only (see bench_pipeline_cpu).
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()?;
    if args.back_to_back {
        back_to_back(args.steps, args.rounds.max(1))?;
        println!("\nwall time {:.1} s", t0.elapsed().as_secs_f64());
        return Ok(());
    }
    let threads = if args.quick {
        Vec::new()
    } else {
        thread_times()?
    };
    let base = threads
        .iter()
        .find(|r| r.kind == Some(ScheduleKind::OneFOneB))
        .map(|r| (r.secs, r.bubble));
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
            let real = match (threads.iter().find(|r| r.kind == Some(kind)), base) {
                (Some(r), Some((b, b_bubble))) if (k, m) == (2, THREADS_M) => {
                    let (ms, bubble) = (r.secs, r.bubble);
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
    if let Some((b, _)) = base {
        println!(
            "\n## Real threads, K = {THREADS_K}, M = {THREADS_M} (the rows above and the synthesized \
             schedules)\n"
        );
        println!("| schedule | most held per device (1F1B units) | step ms | measured bubble | vs 1F1B |");
        println!("|---|---|---|---|---|");
        let mut rows: Vec<&ThreadRow> = threads.iter().collect();
        rows.sort_by(|a, b| a.secs.total_cmp(&b.secs));
        for r in rows {
            println!(
                "| {} | {:.1} | {:.0} | {:.1}% | {:.2}x |",
                r.label,
                r.held,
                r.secs * 1e3,
                r.bubble * 100.0,
                b / r.secs
            );
        }
    }
    if args.synth {
        synth_grid()?;
    }
    println!("\nwall time {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
