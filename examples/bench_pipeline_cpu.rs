//! Real threads, real wall clock: a K = 2 pipeline over two CPU devices (one stage thread each),
//! M = 8 micro-batches, against the same model as one stage (K = 1).
//!
//! Fairness: the CPU matmul (gemm) and the other CPU kernels parallelise with rayon, which would
//! let K = 1 use every core by itself. So the rayon global pool is built with ONE thread: every op
//! runs on its calling thread, each stage uses one core, and K = 1 and K = 2 run with the same
//! per-op threading. For honesty K = 1 with rayon on all cores is measured too, in a child process
//! (the global pool can be built only once per process).
//!
//! The model: an MLP of identical wide `Linear` + ReLU layers, cut in two equal halves; no
//! re-materialization (`CheckpointMode::Never`); SGD. Reported: the median of several steps after
//! warm-up, and the measured bubble (idle share of stage time on the wall clock). Micro-batches
//! are 1024 rows, so every op's work dwarfs thread and channel overhead. K = 1 runs both as one
//! mini-batch (M = 1) and micro-batched (M = 8); the speed-up is over the faster of the two.
//!
//! Caveats. With a one-thread rayon pool, any kernel that calls rayon without first checking
//! `rayon::current_num_threads() > 1` hands its work to that single pool thread, which would
//! serialise the stages; the ops of this MLP (2-D matmul through gemm, bias, ReLU, MSE, SGD) all
//! take their single-threaded paths. The figures need two idle cores: on a shared machine run it
//! when nothing else is busy (or with a higher scheduling priority), else K = 2 cannot win.
//!
//! `cargo run --release --example bench_pipeline_cpu`

use std::process::Command;
use std::time::Instant;

use wgpipe::autograd::{Module, Sgd};
use wgpipe::models::{mse, Linear, Relu};
use wgpipe::pipeline::{Balance, CheckpointMode, LossFn, Pipeline};
use wgpipe::tensor::{Device, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const WIDTH: usize = 1024;
const LAYERS: usize = 12;
const BATCH: usize = 8192;
const M: usize = 8;
const WARMUP: usize = 1;
const STEPS: usize = 4;
const CHILD_FLAG: &str = "--child-k1-all-cores";

fn mlp() -> Res<Vec<Box<dyn Module>>> {
    let mut v: Vec<Box<dyn Module>> = Vec::new();
    for i in 0..LAYERS {
        v.push(Box::new(Linear::new(
            WIDTH,
            WIDTH,
            100 + i as u64,
            &Device::cpu(),
        )?));
        v.push(Box::new(Relu));
    }
    Ok(v)
}

struct Measured {
    /// Median wall seconds of `train_step` + `optimizer_step`.
    step: f64,
    /// Median measured bubble of `train_step` (1 - sum busy / (K x wall)).
    bubble: f64,
    /// Median per-stage busy seconds.
    busy: Vec<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One configuration under measurement, with its samples.
struct Runner {
    pipe: Pipeline,
    steps: Vec<f64>,
    bubbles: Vec<f64>,
    busy: Vec<Vec<f64>>,
}

impl Runner {
    fn new(k: usize, m: usize) -> Res<Runner> {
        let devices: Vec<Device> = (0..k)
            .map(|i| Device::new_cpu(&format!("cpu{i}")))
            .collect();
        let per_stage = 2 * LAYERS / k;
        let pipe = Pipeline::builder(mlp()?)
            .devices(devices)
            .balance(Balance::Explicit(vec![per_stage; k]))
            .micro_batches(m)
            .checkpoint(CheckpointMode::Never)
            .optimizer(|| Box::new(Sgd::new(1e-3)))
            .build()?;
        Ok(Runner {
            pipe,
            steps: Vec::new(),
            bubbles: Vec::new(),
            busy: vec![Vec::new(); k],
        })
    }

    /// One training step; recorded unless it is a warm-up step.
    fn step(&mut self, x: &Tensor, y: &Tensor, record: bool) -> Res<()> {
        let loss: &LossFn = &mse;
        let t0 = Instant::now();
        let r = self.pipe.train_step(x, y, loss)?;
        self.pipe.optimizer_step()?;
        let wall = t0.elapsed().as_secs_f64();
        if record {
            self.steps.push(wall);
            self.bubbles.push(r.wall_bubble_fraction);
            for (b, s) in self.busy.iter_mut().zip(&r.stages) {
                b.push(s.busy_secs);
            }
        }
        Ok(())
    }

    fn result(&self) -> Measured {
        Measured {
            step: median(self.steps.clone()),
            bubble: median(self.bubbles.clone()),
            busy: self.busy.iter().cloned().map(median).collect(),
        }
    }
}

fn data() -> Res<(Tensor, Tensor)> {
    Ok((
        Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 1, &Device::cpu())?,
        Tensor::rand_normal(&[BATCH, WIDTH], 0.0, 1.0, 2, &Device::cpu())?,
    ))
}

/// Measures the configurations `(K, M)` interleaved, one step of each per round (so that a
/// change of machine load hits all of them alike).
fn measure(configs: &[(usize, usize)]) -> Res<Vec<Measured>> {
    let (x, y) = data()?;
    let mut runners: Vec<Runner> = configs
        .iter()
        .map(|&(k, m)| Runner::new(k, m))
        .collect::<Res<_>>()?;
    for round in 0..WARMUP + STEPS {
        for r in &mut runners {
            r.step(&x, &y, round >= WARMUP)?;
        }
    }
    Ok(runners.iter().map(Runner::result).collect())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() -> Res<()> {
    if std::env::args().any(|a| a == CHILD_FLAG) {
        // Child: rayon's default pool (all cores), K = 1, M = 1.
        let r = measure(&[(1, 1)])?;
        println!("{} {}", r[0].step, rayon::current_num_threads());
        return Ok(());
    }
    let t0 = Instant::now();
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build_global()?;
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let flops = 3.0 * 2.0 * (LAYERS * BATCH * WIDTH * WIDTH) as f64;
    println!("# Pipeline on CPU threads: K=2 vs K=1 (wall clock)\n");
    println!(
        "MLP {LAYERS} x (Linear {WIDTH}x{WIDTH} + ReLU), {:.1}M params, mini-batch {BATCH}, MSE, SGD, \
         no re-materialization; {:.1} GFLOP per step; {cores} cores; median of {STEPS} steps after {WARMUP} warm-up. \
         Step = train_step + optimizer_step. Per-op threading: rayon global pool of {} thread(s) \
         (each stage thread computes on one core), the same for K=1 and K=2.\n",
        (LAYERS * (WIDTH * WIDTH + WIDTH)) as f64 / 1e6,
        flops / 1e9,
        rayon::current_num_threads()
    );
    let load0 = load_average();
    let mut r = measure(&[(1, 1), (1, M), (2, M)])?.into_iter();
    let (k1, k1m, k2) = (r.next().unwrap(), r.next().unwrap(), r.next().unwrap());

    let child = Command::new(std::env::current_exe()?)
        .arg(CHILD_FLAG)
        .output()?;
    let out = String::from_utf8_lossy(&child.stdout);
    let mut it = out.split_whitespace();
    let (all_cores, threads): (Option<f64>, Option<usize>) = (
        it.next().and_then(|s| s.parse().ok()),
        it.next().and_then(|s| s.parse().ok()),
    );

    let ideal = (M as f64) / (M + 1) as f64 * 2.0;
    // The reference: the faster of the two one-thread K=1 runs (the conservative choice).
    let best1 = k1.step.min(k1m.step);
    println!("| config | stage devices | per-op threads | step ms (median) | GFLOP/s | speed-up vs best K=1 | measured bubble | stage busy ms |");
    println!("|---|---|---|---|---|---|---|---|");
    let row = |name: &str, devs: &str, thr: String, r: &Measured| {
        let busy: Vec<String> = r.busy.iter().map(|b| format!("{:.0}", b * 1e3)).collect();
        println!(
            "| {name} | {devs} | {thr} | {:.1} | {:.1} | {:.2}x | {:.1}% | {} |",
            r.step * 1e3,
            flops / r.step / 1e9,
            best1 / r.step,
            r.bubble * 100.0,
            busy.join(" / ")
        );
    };
    row("K=1, M=1", "cpu0", "1".into(), &k1);
    row("K=1, M=8", "cpu0", "1".into(), &k1m);
    row("K=2, M=8", "cpu0, cpu1", "1 per stage".into(), &k2);
    match all_cores {
        Some(t) => println!(
            "| K=1, M=1, rayon on all cores | cpu0 | {} | {:.1} | {:.1} | {:.2}x | - | - |",
            threads.unwrap_or(0),
            t * 1e3,
            flops / t / 1e9,
            best1 / t
        ),
        None => println!(
            "| K=1, M=1, rayon on all cores | child process failed: {} |",
            String::from_utf8_lossy(&child.stderr).trim()
        ),
    }
    println!(
        "\nK=2 speed-up over the best one-thread K=1: {:.2}x (over K=1 M=1: {:.2}x; over K=1 M=8: {:.2}x); \
         ideal M/(M+K-1)*K = {ideal:.2}x; ideal bubble (K-1)/(M+K-1) = {:.1}%.",
        best1 / k2.step,
        k1.step / k2.step,
        k1m.step / k2.step,
        100.0 / (M + 1) as f64
    );
    if let Some(t) = all_cores {
        println!(
            "K=2 (one core per stage) vs K=1 with rayon on all cores: {:.2}x.",
            t / k2.step
        );
    }
    println!(
        "Load average (1/5/15 min) before: {load0}; after: {} (other processes on the machine \
         compete for its cores; the K=1/K=2 steps were interleaved so load changes hit both).",
        load_average()
    );
    println!("\nwall time {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
