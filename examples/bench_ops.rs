//! Op throughput on every device of this machine: the CPU backend and each wgpu adapter
//! (lavapipe included). Prints a Markdown table.
//!
//! `cargo run --release --example bench_ops [-- --quick | --matmul-only | --cpu-only |
//! --list-adapters]`
//!
//! On wgpu adapters matmul picks its variant by the autotune where it is on (`WGPIPE_AUTOTUNE`;
//! default on for GPUs, off for software adapters): the warm-up call runs the trial.
//!
//! - matmul (square n x n, f32 then f16 operands on the same device; f16 accumulates in f32):
//!   GFLOP/s counting 2 n^3 per product, "queued" = N products enqueued then one
//!   `synchronize`, "read-back" = each product read back to the host; the f16 rows also give
//!   their speed relative to the f32 row above them;
//! - elementwise add of two 16M-float tensors: GB/s counting 12 bytes per element (two reads,
//!   one write);
//! - softmax over the rows of a 4096 x 1024 matrix: rows per second;
//! - a chain of six ops on a 2 x 4 x 8 tensor: microseconds per op, the cost of an op beyond
//!   its arithmetic (checks, layouts, allocation, dispatch);
//! - on the CPU, its f32 FMA peak: every thread running chains of vector multiply-adds on
//!   registers (`wgpipe_apps::peak`), the ceiling for the matmul rows;
//! - cores busy: CPU time of this process over wall time during the queued runs (on a shared
//!   machine, how much of it the CPU backend or a software adapter really got).

use std::time::{Duration, Instant};

use wgpipe::tensor::{DType, Device, Tensor};
use wgpipe_apps::Parser;

/// Op throughput on the CPU backend and every wgpu adapter, as a Markdown table.
#[derive(Parser)]
struct Args {
    /// Print the wgpu adapters, one per line, and exit (scripts/gpu-check.sh reads it)
    #[arg(long)]
    list_adapters: bool,
    /// Time each op for 0.3 s instead of 1.5 s
    #[arg(long)]
    quick: bool,
    /// Only the matmul rows (and the CPU's FMA peak)
    #[arg(long)]
    matmul_only: bool,
    /// Only the CPU backend (no wgpu adapters)
    #[arg(long)]
    cpu_only: bool,
}

/// CPU seconds this process has used (all threads), from /proc on Linux.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0) // USER_HZ
}

thread_local! {
    /// CPU cores this process kept busy during the last `time_per_call` (CPU time / wall time).
    static CORES: std::cell::Cell<Option<f64>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` until about `budget` has passed (at least once after a warm-up); seconds per call.
fn time_per_call(budget: Duration, mut f: impl FnMut() -> usize) -> f64 {
    f(); // warm-up: pipelines compiled, buffers pooled
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut calls = 0usize;
    while calls == 0 || start.elapsed() < budget {
        calls += f();
    }
    let wall = start.elapsed().as_secs_f64();
    let cores = cpu0.zip(cpu_seconds()).map(|(a, b)| (b - a) / wall);
    CORES.with(|c| c.set(cores));
    wall / calls as f64
}

fn cores() -> String {
    CORES
        .with(|c| c.get())
        .map_or("?".into(), |c| format!("{c:.1}"))
}

struct Row {
    device: String,
    op: String,
    size: String,
    queued: String,
    cores: String,
    readback: String,
}

fn main() {
    let args = Args::parse();
    if args.list_adapters {
        // `index: name (backend, driver[, software])`, one per line (scripts/gpu-check.sh).
        for a in Device::adapters() {
            let sw = if a.is_software { ", software" } else { "" };
            println!("{}: {} ({}, {}{sw})", a.index, a.name, a.backend, a.driver);
        }
        return;
    }
    let (quick, matmul_only) = (args.quick, args.matmul_only);
    let budget = Duration::from_millis(if quick { 300 } else { 1500 });

    let mut devices = vec![Device::cpu()];
    let adapters = if args.cpu_only {
        Vec::new()
    } else {
        Device::adapters()
    };
    for a in adapters {
        match Device::wgpu(a.index) {
            Ok(d) => devices.push(d),
            Err(e) => eprintln!("skipping adapter {} ({}): {e}", a.index, a.name),
        }
    }

    let mut rows = Vec::new();
    for dev in &devices {
        let kind = match dev.adapter_info() {
            Some(i) => format!(
                "{} [{}{}]",
                dev.name(),
                i.backend,
                if i.is_software { ", software" } else { "" }
            ),
            None => format!(
                "{} [{} threads, {}]",
                dev.name(),
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                wgpipe_apps::peak::cpu_model().unwrap_or_else(|| "model unknown".into())
            ),
        };
        eprintln!("benchmarking {kind}");
        if dev.is_cpu() {
            // The ceiling the CPU rows are read against (matmul's GFLOP/s as a share of it).
            let threads = wgpipe::tensor::cpu_threads();
            let peak = wgpipe_apps::peak::cpu_fma_peak_gflops(threads, budget);
            rows.push(Row {
                device: kind.clone(),
                op: format!("f32 FMA peak ({threads} threads, registers only)"),
                size: "-".into(),
                queued: format!("{peak:.1} GFLOP/s"),
                cores: "-".into(),
                readback: "-".into(),
            });
        }

        for n in [256usize, 512, 1024, 2048] {
            let mut f32_queued = None;
            for dtype in [DType::F32, DType::F16] {
                let a = Tensor::rand_uniform(&[n, n], -1.0, 1.0, 1, dev)
                    .and_then(|t| t.to_dtype(dtype))
                    .unwrap();
                let b = Tensor::rand_uniform(&[n, n], -1.0, 1.0, 2, dev)
                    .and_then(|t| t.to_dtype(dtype))
                    .unwrap();
                let flops = 2.0 * (n as f64).powi(3);
                // Enqueue a batch of products sized to the budget, then wait once.
                let probe = time_per_call(Duration::ZERO, || {
                    let c = a.matmul(&b).unwrap();
                    dev.synchronize().unwrap();
                    drop(c);
                    1
                });
                let batch = ((budget.as_secs_f64() / 4.0 / probe) as usize).clamp(1, 64);
                let queued = time_per_call(budget, || {
                    for _ in 0..batch {
                        let _ = a.matmul(&b).unwrap();
                    }
                    dev.synchronize().unwrap();
                    batch
                });
                let busy = cores();
                let readback = time_per_call(budget, || {
                    let c = a.matmul(&b).unwrap();
                    std::hint::black_box(c.to_vec().unwrap());
                    1
                });
                let relative = match f32_queued {
                    Some(t32) => format!(" ({:.2}x f32)", t32 / queued),
                    None => String::new(),
                };
                f32_queued.get_or_insert(queued);
                rows.push(Row {
                    device: kind.clone(),
                    op: format!("matmul {dtype}"),
                    size: format!("{n}x{n}x{n}"),
                    queued: format!("{:.1} GFLOP/s{relative}", flops / queued / 1e9),
                    cores: busy,
                    readback: format!("{:.1} GFLOP/s", flops / readback / 1e9),
                });
                eprintln!(
                    "  matmul {dtype} {n}: {:.1} / {:.1} GFLOP/s{relative}",
                    flops / queued / 1e9,
                    flops / readback / 1e9
                );
            }
        }
        if matmul_only {
            continue;
        }

        let len = 16 << 20;
        let x = Tensor::rand_uniform(&[len], -1.0, 1.0, 3, dev).unwrap();
        let y = Tensor::rand_uniform(&[len], -1.0, 1.0, 4, dev).unwrap();
        let bytes = 12.0 * len as f64;
        let queued = time_per_call(budget, || {
            for _ in 0..4 {
                let _ = x.add(&y).unwrap();
            }
            dev.synchronize().unwrap();
            4
        });
        let busy = cores();
        let readback = time_per_call(budget, || {
            std::hint::black_box(x.add(&y).unwrap().to_vec().unwrap());
            1
        });
        rows.push(Row {
            device: kind.clone(),
            op: "add".into(),
            size: "16M f32".into(),
            queued: format!("{:.1} GB/s", bytes / queued / 1e9),
            cores: busy,
            readback: format!("{:.1} GB/s", bytes / readback / 1e9),
        });

        let (r, c) = (4096usize, 1024usize);
        let s = Tensor::rand_uniform(&[r, c], -4.0, 4.0, 5, dev).unwrap();
        let queued = time_per_call(budget, || {
            for _ in 0..4 {
                let _ = s.softmax(-1).unwrap();
            }
            dev.synchronize().unwrap();
            4
        });
        let busy = cores();
        let readback = time_per_call(budget, || {
            std::hint::black_box(s.softmax(-1).unwrap().to_vec().unwrap());
            1
        });
        rows.push(Row {
            device: kind.clone(),
            op: "softmax (last axis)".into(),
            size: format!("{r}x{c}"),
            queued: format!("{:.3} M rows/s", r as f64 / queued / 1e6),
            cores: busy,
            readback: format!("{:.3} M rows/s", r as f64 / readback / 1e6),
        });

        // Ops on tensors so small that the arithmetic is nothing: what each op costs beyond it
        // (checks, layouts, the output's allocation; on wgpu the dispatch). A model written from
        // many small ops pays it per op.
        let t = Tensor::rand_uniform(&[2, 4, 8], -1.0, 1.0, 6, dev).unwrap();
        let bias = Tensor::rand_uniform(&[8], -1.0, 1.0, 7, dev).unwrap();
        const TINY_OPS: usize = 6;
        let tiny_chain = || -> wgpipe::tensor::Result<Tensor> {
            let h = t.add(&bias)?.permute(&[0, 2, 1])?.mul_scalar(0.5)?;
            h.reshape(&[2, 32])?.exp()?.sum(&[1], false)
        };
        let queued = time_per_call(budget, || {
            for _ in 0..64 {
                let _ = tiny_chain().unwrap();
            }
            dev.synchronize().unwrap();
            64 * TINY_OPS
        });
        let busy = cores();
        let readback = time_per_call(budget, || {
            std::hint::black_box(tiny_chain().unwrap().to_vec().unwrap());
            TINY_OPS
        });
        rows.push(Row {
            device: kind.clone(),
            op: format!("{TINY_OPS} tiny ops in a chain (add, permute, scale, reshape, exp, sum)"),
            size: "2x4x8".into(),
            queued: format!("{:.2} us/op", queued * 1e6),
            cores: busy,
            readback: format!("{:.2} us/op", readback * 1e6),
        });
    }

    // "cores busy": CPU time of this process over wall time while the queued ops ran (for the
    // CPU backend and software adapters, how much of the machine the run actually got).
    println!("| device | op | size | queued (N ops, one sync) | cores busy | with read-back |");
    println!("|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} |",
            r.device, r.op, r.size, r.queued, r.cores, r.readback
        );
    }
}
