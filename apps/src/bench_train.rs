//! Training-step throughput on every device found, for two fixed workloads that other libraries
//! can run too:
//!
//! * `mlp`: 4 Linear layers of width 1024 with ReLU between them, batch 256, MSE loss,
//!   forward + backward + SGD;
//! * `block`: one pre-LayerNorm decoder block (d_model 256, 4 heads, causal attention, MLP 4x
//!   with GELU), batch 8, sequence 128, MSE loss against a random target, forward + backward +
//!   SGD.
//!
//! Each runs plainly (a tape over the layers) and through a 1-stage pipeline (M = 1, no
//! re-materialization), which shows the pipeline's own overhead. The table carries reference
//! columns measured on this kind of 2-core machine: PyTorch's CPU build and Burn's wgpu backend
//! on lavapipe.

use std::time::Instant;

use clap::{Parser, ValueEnum};

use crate::autograd::optim::{zero_grad, Optimizer};
use crate::autograd::{ForwardCtx, Module, Sgd, Tape, Var};
use crate::bail;
use crate::error::{AppError, AppResult, Context};
use crate::models::{
    finish_step_all, forward_all, mse, sequence_parameters, Linear, Relu, TransformerBlock,
};
use crate::pipeline::{CheckpointMode, Pipeline};
use crate::tensor::{Device, Tensor};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Mlp,
    Block,
}

impl Workload {
    pub fn describe(self) -> &'static str {
        match self {
            Workload::Mlp => "MLP 4x Linear(1024) + ReLU, batch 256, MSE",
            Workload::Block => "pre-LN decoder block d256 h4, batch 8 x seq 128",
        }
    }
    /// Reference steps/s: (PyTorch CPU, Burn wgpu on lavapipe).
    pub fn reference(self) -> (f64, f64) {
        match self {
            Workload::Mlp => (33.0, 2.3),
            Workload::Block => (34.0, 2.1),
        }
    }
}

#[derive(Parser, Clone, Debug)]
#[command(
    args_override_self = true,
    name = "bench_train",
    about = "Training-step throughput (steps/s) of two fixed workloads on every device found"
)]
pub struct BenchArgs {
    /// Seconds to measure each (workload, device, mode) after the warm-up.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// At most this many measured steps per cell.
    #[arg(long, default_value_t = 200)]
    pub max_steps: usize,
    /// Warm-up steps before measuring (kernel compilation, buffer pools).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Devices to measure (cpu, wgpu:N, wgpu:NAME); default: the CPU and every wgpu adapter.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<String>>,
    /// Workloads to run; default both.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Option<Vec<Workload>>,
    /// Skip the 1-stage pipeline rows.
    #[arg(long)]
    pub no_pipeline: bool,
}

impl BenchArgs {
    pub fn parse_from_args<I, S>(args: I) -> AppResult<BenchArgs>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        let argv = std::iter::once(std::ffi::OsString::from("bench_train"))
            .chain(args.into_iter().map(Into::into));
        BenchArgs::try_parse_from(argv).map_err(|e| AppError(e.to_string()))
    }
}

/// One measured cell.
#[derive(Debug, Clone)]
pub struct BenchRow {
    pub workload: Workload,
    pub device: String,
    /// Steps/s without a pipeline.
    pub plain: f64,
    /// Steps/s through a 1-stage pipeline (None with --no-pipeline).
    pub pipelined: Option<f64>,
    /// Loss after the last step (a sanity check that it trains).
    pub loss: f32,
}

/// The workload's layers, input and target on `dev` (deterministic).
/// A workload: its layers, input and target.
type Work = (Vec<Box<dyn Module>>, Tensor, Tensor);

fn workload(w: Workload, dev: &Device) -> AppResult<Work> {
    Ok(match w {
        Workload::Mlp => {
            let mut layers: Vec<Box<dyn Module>> = Vec::new();
            for i in 0..4 {
                layers.push(Box::new(Linear::new(1024, 1024, i, dev)?));
                if i < 3 {
                    layers.push(Box::new(Relu));
                }
            }
            let x = Tensor::rand_normal(&[256, 1024], 0.0, 1.0, 1, dev)?;
            let y = Tensor::rand_normal(&[256, 1024], 0.0, 1.0, 2, dev)?;
            (layers, x, y)
        }
        Workload::Block => {
            let layers: Vec<Box<dyn Module>> =
                vec![Box::new(TransformerBlock::new(256, 4, 0.0, 3, dev)?)];
            let x = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 4, dev)?;
            let y = Tensor::rand_normal(&[8, 128, 256], 0.0, 1.0, 5, dev)?;
            (layers, x, y)
        }
    })
}

/// Times `step` for `warmup` steps, then for up to `seconds` / `max_steps`: steps/s and the
/// last loss. Every step reads its loss back, so the device has finished when the clock stops.
fn time_steps(
    args: &BenchArgs,
    mut step: impl FnMut(u64) -> AppResult<f32>,
) -> AppResult<(f64, f32)> {
    let mut loss = 0.0;
    for i in 0..args.warmup {
        loss = step(i as u64)?;
    }
    let t0 = Instant::now();
    let mut n = 0;
    while n < args.max_steps.max(1) && (n == 0 || t0.elapsed().as_secs_f64() < args.seconds) {
        loss = step((args.warmup + n) as u64)?;
        n += 1;
    }
    Ok((n as f64 / t0.elapsed().as_secs_f64(), loss))
}

fn bench_plain(args: &BenchArgs, w: Workload, dev: &Device) -> AppResult<(f64, f32)> {
    let (layers, x, y) = workload(w, dev)?;
    let params = sequence_parameters(&layers);
    let mut opt = Sgd::new(1e-3);
    time_steps(args, |step| {
        let tape = Tape::new();
        let input = tape.constant(x.clone());
        let out = forward_all(&layers, &input, &ForwardCtx::train(0, step, 0))?;
        let loss = mse(&out, &y)?;
        tape.backward(&loss)?;
        finish_step_all(&layers)?;
        opt.step(&params)?;
        zero_grad(&params);
        Ok(loss.to_scalar()?)
    })
}

fn bench_pipelined(args: &BenchArgs, w: Workload, dev: &Device) -> AppResult<(f64, f32)> {
    let (layers, x, y) = workload(w, dev)?;
    let mut pipe = Pipeline::builder(layers)
        .devices(vec![dev.clone()])
        .micro_batches(1)
        .checkpoint(CheckpointMode::Never)
        .optimizer(|| Box::new(Sgd::new(1e-3)))
        .build()?;
    let loss_fn = |o: &Var, t: &Tensor| mse(o, t);
    time_steps(args, |_| {
        let r = pipe.train_step(&x, &y, &loss_fn)?;
        pipe.optimizer_step()?;
        Ok(r.loss)
    })
}

/// The devices to measure: the CPU and every wgpu adapter, or those named.
fn devices(args: &BenchArgs) -> AppResult<Vec<(String, Result<Device, String>)>> {
    let mut out = Vec::new();
    match &args.devices {
        Some(list) => {
            for spec in list {
                out.push((spec.clone(), Device::parse(spec).map_err(|e| e.to_string())));
            }
        }
        None => {
            out.push(("cpu".into(), Ok(Device::cpu())));
            for a in Device::adapters() {
                let label = format!(
                    "wgpu:{} {} ({}{})",
                    a.index,
                    a.name,
                    a.backend,
                    if a.is_software { ", software" } else { "" }
                );
                out.push((label, Device::wgpu(a.index).map_err(|e| e.to_string())));
            }
        }
    }
    if out.is_empty() {
        bail!("--devices is empty");
    }
    Ok(out)
}

/// Runs every workload on every device; prints progress to stderr and returns the rows.
pub fn run(args: BenchArgs) -> AppResult<Vec<BenchRow>> {
    crate::limits::check_positive("seconds", args.seconds, 3600.0)?;
    crate::limits::check_range("max-steps", args.max_steps, 1, 1_000_000)?;
    crate::limits::check_range("warmup", args.warmup, 0, 10_000)?;
    let workloads = args
        .workloads
        .clone()
        .unwrap_or_else(|| vec![Workload::Mlp, Workload::Block]);
    let devs = devices(&args)?;
    if args.devices.is_none() && Device::adapters().is_empty() {
        eprintln!("no wgpu adapter found (install mesa-vulkan-drivers for lavapipe): CPU only");
    }
    let mut rows = Vec::new();
    for w in &workloads {
        for (label, dev) in &devs {
            let dev = match dev {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("skipping {label}: {e}");
                    continue;
                }
            };
            eprintln!("measuring {:?} on {label} ...", w);
            let (plain, loss) =
                bench_plain(&args, *w, dev).context(format!("{w:?} on {label}, plain"))?;
            let pipelined = if args.no_pipeline {
                None
            } else {
                Some(
                    bench_pipelined(&args, *w, dev)
                        .context(format!("{w:?} on {label}, 1-stage pipeline"))?
                        .0,
                )
            };
            rows.push(BenchRow {
                workload: *w,
                device: label.clone(),
                plain,
                pipelined,
                loss,
            });
        }
    }
    println!("{}", table(&rows));
    Ok(rows)
}

/// The rows as a markdown table with the reference columns.
pub fn table(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| workload | device | wgpipe plain (steps/s) | wgpipe 1-stage pipeline (steps/s) | PyTorch CPU (ref) | Burn wgpu lavapipe (ref) |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let (torch, burn) = r.workload.reference();
        s.push_str(&format!(
            "| {} | {} | {:.2} | {} | {torch} | {burn} |\n",
            r.workload.describe(),
            r.device,
            r.plain,
            r.pipelined.map_or("-".into(), |p| format!("{p:.2}")),
        ));
    }
    s
}
