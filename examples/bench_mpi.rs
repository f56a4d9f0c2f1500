//! Stages in two processes over MPI: the measured step time beside the simulator's prediction.
//!
//! `mpirun -np 2 target/release/examples/bench_mpi` (build with `--features mpi`; as root add
//! `--allow-run-as-root`). Three measurements, all on this transport (MPI through each rank's
//! communication thread, tensors encoded to the wire format):
//! 1. the link: median swap time of a small and a large message between the two ranks, giving
//!    latency and bandwidth;
//! 2. the step: a K = 2 pipeline (an MLP of wide Linear + ReLU layers, GPipe, M = 8), one stage
//!    per rank, the median wall time of several steps after warm-up;
//! 3. the prediction: the simulator replaying the same schedule with each compute action's
//!    measured time and the measured link (the cost model of `timeline::simulate`).
//!
//! The ratio measured / predicted is what the simulator misses: scheduling and communication-
//! thread overheads, and contention when the two ranks share cores. Rank 0 prints.

use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::sim::timeline::{simulate, ActionCost};
use wgpipe::pipeline::MpiComm;
use wgpipe::pipeline::{
    ActionKind, Balance, CheckpointMode, DeviceSpec, LinkSpec, Pipeline, ScheduleKind, Transport,
};
use wgpipe::tensor::{Device, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const WIDTH: usize = 512;
const LAYERS: usize = 8;
const BATCH: usize = 2048;
const M: usize = 8;
const WARMUP: usize = 2;
const STEPS: usize = 6;

fn main() -> Res<()> {
    let comm = MpiComm::init()?;
    if comm.size() != 2 {
        return Err(format!("run with mpirun -np 2 (this job has {} ranks)", comm.size()).into());
    }
    let peer = 1 - comm.rank();
    // 1. The link.
    let (small, large) = (64usize, 4 << 20);
    let t_small = comm.measure_swap(peer, small, 50)?;
    let t_large = comm.measure_swap(peer, large, 10)?;
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
    Ok(())
}
