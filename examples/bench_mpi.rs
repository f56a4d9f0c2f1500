//! Stages in two processes over MPI: the measured step time beside the simulator's prediction.
//!
//! `mpirun -np 2 target/release/examples/bench_mpi` (build with `--features mpi`; as root add
//! `--allow-run-as-root`). Four measurements:
//! 1. the link: for 4 B to 16 MiB, the one-way time of a tensor on this transport (a frame
//!    through each rank's communication thread) beside plain blocking MPI send/receive of the
//!    same bytes, in alternating rounds of the same run;
//! 2. the step: a K = 2 pipeline (an MLP of wide Linear + ReLU layers, GPipe, M = 8), one stage
//!    per rank, the median wall time of several steps after warm-up;
//! 3. the prediction: the simulator replaying the same schedule with each compute action's
//!    measured time and the measured link (the cost model of `timeline::simulate`).
//!
//! 4. the main job's model at K = 2 over MPI, then with in-process threads.
//!
//! The ratio measured / predicted is what the simulator misses: scheduling and communication-
//! thread overheads, and contention when the two ranks share cores. Rank 0 prints.
//!
//! `mpirun -np 4 ... bench_mpi`: K = 2 x R = 2 of the main job's model, steps with the gradient
//! reduction overlapping the backward and without, alternating.

use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::sim::timeline::{simulate, ActionCost};
use wgpipe::pipeline::MpiComm;
use wgpipe::pipeline::{
    ActionKind, Balance, CheckpointMode, DeviceSpec, LinkSpec, Pipeline, ScheduleKind, Transport,
};
use wgpipe::tensor::{Device, Tensor};
use wgpipe_apps::bench_train::{workload, Work, Workload};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const WIDTH: usize = 512;
const LAYERS: usize = 8;
const BATCH: usize = 2048;
const M: usize = 8;
const WARMUP: usize = 2;
const STEPS: usize = 6;

/// Message sizes of the link table (bytes).
const SIZES: [usize; 7] = [4, 64, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The link table: for each size, the one-way time (half the median round trip) of the
/// transport (a tensor's path) and of plain blocking MPI, measured in alternating rounds.
fn link_table(comm: &MpiComm, peer: usize) -> Res<Vec<(usize, f64, f64)>> {
    let mut rows = Vec::new();
    for &bytes in &SIZES {
        let reps = if bytes >= 4 << 20 { 10 } else { 200 };
        let (mut ours, mut raw) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            ours.extend(comm.measure_ping_pong(peer, bytes, reps)?);
            raw.extend(comm.raw_ping_pong(peer, bytes, reps)?);
        }
        rows.push((bytes, median(ours) / 2.0, median(raw) / 2.0));
    }
    Ok(rows)
}

fn main() -> Res<()> {
    let comm = MpiComm::init()?;
    match comm.size() {
        2 => two_ranks(&comm),
        4 => overlap(&comm),
        n => Err(format!(
            "run with mpirun -np 2 (the link and K=2) or -np 4 (K=2 x R=2, the reduction's overlap); this job has {n} ranks"
        )
        .into()),
    }
}

/// K = 2 steps of the main job's model: the median wall time of `steps` after two warm-ups.
fn main_job_steps(
    transport: Transport,
    devices: usize,
    replicas: Option<&MpiComm>,
    steps: usize,
) -> Res<(f64, f64)> {
    // The main job's model and batch, as bench_train times them.
    let Work { layers, x, y } = workload(Workload::Lm, &Device::cpu())?;
    let cpu = Device::cpu();
    let mut pipe = Pipeline::builder(layers)
        .devices(vec![cpu.clone(); devices])
        .micro_batches(4)
        .checkpoint(CheckpointMode::Never)
        .schedule(ScheduleKind::OneFOneB)
        .optimizer(|| Box::new(Sgd::new(0.01)))
        .transport(transport)
        .build()?;
    let ce = |o: &wgpipe::autograd::Var, t: &Tensor| wgpipe::models::cross_entropy(o, t);
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let mut overlapped = String::new();
    for step in 0..2 + steps {
        // Rounds alternate with and without the overlap (when there are replicas).
        let overlap = step % 2 == 0;
        if let Some(comm) = replicas {
            comm.set_overlap_reduction(overlap);
        }
        let t0 = Instant::now();
        let report = pipe.train_step(&x, &y, &ce)?;
        pipe.optimizer_step()?;
        if overlap && !report.wall_timeline.collectives.is_empty() {
            overlapped = overlap_of(&report.wall_timeline);
        }
        if step >= 2 {
            if overlap { &mut on } else { &mut off }.push(t0.elapsed().as_secs_f64());
        }
    }
    let off = if off.is_empty() {
        f64::NAN
    } else {
        median(off)
    };
    if !overlapped.is_empty() && replicas.is_some_and(|c| c.rank() < 2) {
        println!("the last step with the overlap:\n{overlapped}");
    }
    Ok((median(on), off))
}

/// This rank's gradient buckets in a step's measured timeline, beside the end of its device's
/// last compute action: how much of the reduction ran while the backward still ran.
fn overlap_of(t: &wgpipe::pipeline::Timeline) -> String {
    let Some(device) = t.collectives.first().map(|c| c.device) else {
        return String::new();
    };
    // The backward ends with the replica's last compute action (on any of its devices).
    let backward_end = t
        .events
        .iter()
        .filter(|e| e.peer.is_none())
        .map(|e| e.end)
        .fold(0.0, f64::max);
    let mut during = 0.0;
    let spans: Vec<String> = t
        .collectives
        .iter()
        .map(|c| {
            during += (c.end.min(backward_end) - c.start).max(0.0);
            format!("{:.1}-{:.1}", c.start * 1e3, c.end * 1e3)
        })
        .collect();
    format!(
        "  device {device}'s gradient buckets (ms on the step's clock): {}; the replica's last compute action ends at {:.1} ms: {:.1} ms of this device's reduction ran during the backward",
        spans.join(", "),
        backward_end * 1e3,
        during * 1e3
    )
}

/// mpirun -np 4: K = 2 x R = 2 of the main job's model, steps with the reduction overlapping
/// the backward and without, alternating.
fn overlap(comm: &MpiComm) -> Res<()> {
    let (with, without) = main_job_steps(Transport::Mpi(comm.clone()), 2, Some(comm), 20)?;
    if comm.rank() == 0 {
        println!(
            "K=2 x R=2 over mpirun -np 4, the main job's model (TransformerLm d64, 4 blocks, batch 32, 1F1B M=4), median of 10 steps each, alternating:"
        );
        println!(
            "  step with the reduction overlapping the backward {:.1} ms, after the backward {:.1} ms: {:.2}x",
            with * 1e3,
            without * 1e3,
            without / with
        );
    }
    Ok(())
}

fn two_ranks(comm: &MpiComm) -> Res<()> {
    let peer = 1 - comm.rank();
    // 1. The link.
    let rows = link_table(comm, peer)?;
    if comm.rank() == 0 {
        println!("link between 2 ranks, one-way time (half the median round trip), 3 alternating rounds:");
        println!("| bytes | transport µs | raw MPI µs | transport GB/s | raw MPI GB/s | transport / raw bandwidth |");
        println!("|---|---|---|---|---|---|");
        for &(bytes, ours, raw) in &rows {
            println!(
                "| {bytes} | {:.2} | {:.2} | {:.3} | {:.3} | {:.2} |",
                ours * 1e6,
                raw * 1e6,
                bytes as f64 / ours / 1e9,
                bytes as f64 / raw / 1e9,
                raw / ours
            );
        }
        let (_, ours, raw) = rows[0];
        println!(
            "small-message latency: transport {:.1} µs, raw MPI {:.2} µs ({:.1}x)",
            ours * 1e6,
            raw * 1e6,
            ours / raw
        );
    }
    let (small, large) = (SIZES[1], SIZES[5]);
    let (t_small, t_large) = (rows[1].1, rows[5].1);
    let link = LinkSpec {
        bandwidth_bytes_per_sec: (large - small) as f64 / (t_large - t_small).max(1e-9),
        latency_sec: t_small,
    };

    // 2. The step.
    let cpu = Device::cpu();
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    for i in 0..LAYERS {
        layers.push(Box::new(Linear::new(WIDTH, WIDTH, i as u64, &cpu)?));
        layers.push(Box::new(Relu));
    }
    let mut pipe = Pipeline::builder(layers)
        .devices(vec![cpu.clone(), cpu.clone()])
        .balance(Balance::Explicit(vec![LAYERS, LAYERS]))
        .micro_batches(M)
        .checkpoint(CheckpointMode::Never)
        .schedule(ScheduleKind::GPipe)
        .optimizer(|| Box::new(Sgd::new(0.01)))
        .transport(Transport::Mpi(comm.clone()))
        .build()?;
    let x = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &cpu)?;
    let y = Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &cpu)?;
    let mut walls = Vec::new();
    let mut last = None;
    for step in 0..WARMUP + STEPS {
        let t0 = Instant::now();
        let r = pipe.train_step(&x, &y, &mse)?;
        pipe.optimizer_step()?;
        if step >= WARMUP {
            walls.push(t0.elapsed().as_secs_f64());
            last = Some(r);
        }
    }
    walls.sort_by(f64::total_cmp);
    let measured = walls[walls.len() / 2];
    let report = last.ok_or("no step measured")?;

    // 3. The prediction: each compute action's measured seconds as its cost on a device of
    // rate 1, each send's bytes over the measured link.
    let t = &report.wall_timeline;
    let sent: Vec<u64> = report.stages.iter().map(|s| s.bytes_sent).collect();
    let sends_per_device: Vec<usize> = (0..2)
        .map(|d| {
            pipe.schedule().devices[d]
                .iter()
                .filter(|a| matches!(a.kind, ActionKind::SendActivation | ActionKind::SendGrad))
                .count()
        })
        .collect();
    let cost = |device: usize, action: wgpipe::pipeline::Action| {
        if matches!(
            action.kind,
            ActionKind::SendActivation | ActionKind::SendGrad
        ) {
            return ActionCost {
                flops: 0.0,
                bytes: sent[device] / sends_per_device[device].max(1) as u64,
            };
        }
        let secs = t
            .events
            .iter()
            .find(|e| {
                e.device == device
                    && e.peer.is_none()
                    && e.kind == action.kind
                    && e.stage == action.stage
                    && e.micro_batch == action.micro_batch
            })
            .map_or(0.0, |e| e.end - e.start);
        ActionCost {
            flops: secs,
            bytes: 0,
        }
    };
    let unit = DeviceSpec {
        flops_per_sec: 1.0,
        memory_bytes: u64::MAX,
    };
    let predicted = simulate(pipe.schedule(), &[unit, unit], &link, cost)?.makespan;
    if comm.rank() == 0 {
        println!(
            "link (measured on this transport): latency {:.1} µs, bandwidth {:.2} GB/s ({} B swap {:.1} µs, {} MiB swap {:.2} ms)",
            link.latency_sec * 1e6,
            link.bandwidth_bytes_per_sec / 1e9,
            small,
            t_small * 1e6,
            large >> 20,
            t_large * 1e3
        );
        println!(
            "K=2 over mpirun -np 2, GPipe M={M}, MLP {LAYERS}x2 layers of width {WIDTH}, batch {BATCH}, {} MiB per activation message",
            sent[0] as f64 / sends_per_device[0].max(1) as f64 / (1 << 20) as f64
        );
        println!(
            "step time: measured {:.1} ms (median of {STEPS}), simulator {:.1} ms; measured / predicted = {:.2}",
            measured * 1e3,
            predicted * 1e3,
            measured / predicted
        );
    }
    drop(pipe);

    // 4. The main job's model, K = 2 over MPI, then (rank 0 alone, rank 1 gone) the same K = 2
    // with in-process threads.
    let (over_mpi, _) = main_job_steps(Transport::Mpi(comm.clone()), 2, None, 8)?;
    comm.finish();
    if comm.rank() == 0 {
        let (threads, _) = main_job_steps(Transport::default(), 2, None, 8)?;
        println!(
            "the main job's model (TransformerLm d64, 4 blocks, batch 32, 1F1B M=4), K=2: over MPI {:.1} ms/step, in-process threads {:.1} ms/step: MPI / threads = {:.2}",
            over_mpi * 1e3,
            threads * 1e3,
            over_mpi / threads
        );
    }
    Ok(())
}
