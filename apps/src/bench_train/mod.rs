//! Training-step throughput on every device found, for three fixed workloads that other
//! libraries can run too:
//!
//! * `mlp`: 4 Linear layers of width 1024 with ReLU between them, batch 256, MSE loss,
//!   forward + backward + SGD;
//! * `block`: one pre-LayerNorm decoder block (d_model 256, 4 heads, causal attention with q, k
//!   and v from one projection, MLP 4x with exact GELU), batch 8, sequence 128, MSE loss against
//!   a random target, forward + backward + SGD;
//! * `prim`: the same block written from primitive ops ([`PrimitiveBlock`]: narrow, reshape,
//!   permute, `q @ k^T`, masked_fill, softmax, `@ v`), as PyTorch's reference block is written;
//! * `lm`: the main job's model on one device (TransformerLm vocab 28, d_model 64, 4 heads, 4
//!   blocks, context 64, tanh GELU), batch 32, cross-entropy, AdamW lr 3e-4.
//!
//! Each runs plainly (a tape over the layers) and through a 1-stage pipeline (M = 1, no
//! re-materialization), which shows the pipeline's own overhead. With `--torch-python` (or
//! `WGPIPE_TORCH_PYTHON`) naming a Python that imports torch, the same steps run in PyTorch on
//! as many threads, alternating with wgpipe's (`--rounds`), and the table gets a measured
//! reference column and the ratio; with `--torch-preload` PyTorch runs a second time in each
//! round with that library preloaded (MKL's vendor check overridden, see README), and the table
//! gets that column and ratio too. Burn's figures (wgpu on lavapipe) are quoted from issue 15.
//!
//! Here: the flags, the rows and their table, and the run over workloads, devices and rounds;
//! in `workloads.rs` the workloads and wgpipe's timed steps on them, in `torch.rs` the PyTorch
//! column's runs of `scripts/torch_reference.py`.

mod torch;
mod workloads;

pub use workloads::{workload, MatmulTimes, Work};

use clap::{Parser, ValueEnum};

use crate::bail;
use crate::error::{AppResult, Context};
use crate::tensor::Device;
use torch::{bench_torch, torch_python};
use workloads::{bench_pipelined, bench_plain};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    Mlp,
    Block,
    Prim,
    Lm,
}

impl Workload {
    pub const ALL: [Workload; 4] = [Workload::Mlp, Workload::Block, Workload::Prim, Workload::Lm];

    pub fn describe(self) -> &'static str {
        match self {
            Workload::Mlp => "MLP 4x Linear(1024) + ReLU, batch 256, MSE, SGD",
            Workload::Block => {
                "pre-LN decoder block d256 h4 (fused QKV), batch 8 x seq 128, exact GELU, SGD"
            }
            Workload::Prim => {
                "the same block from primitive ops (narrow/permute/matmul/masked_fill/softmax)"
            }
            Workload::Lm => "main job's LM (d64, 4 blocks, ctx 64), batch 32, AdamW",
        }
    }
    /// The name `torch_reference.py` knows the workload by. Both blocks have PyTorch's block as
    /// reference: it is written from primitive ops, as `prim` is.
    pub fn key(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp",
            Workload::Block | Workload::Prim => "block",
            Workload::Lm => "lm",
        }
    }
    /// Burn 0.22's wgpu backend on lavapipe, steps/s, as issue 15 quotes it (not measured here).
    pub fn burn_lavapipe_from_issue(self) -> Option<f64> {
        match self {
            Workload::Mlp => Some(1.61),
            Workload::Block => Some(1.58),
            Workload::Prim | Workload::Lm => None,
        }
    }
}

/// The environment variable naming a Python with torch for the reference column.
pub const TORCH_PYTHON_ENV: &str = "WGPIPE_TORCH_PYTHON";

#[derive(Parser, Clone, Debug)]
#[command(
    args_override_self = true,
    name = "bench_train",
    about = "Training-step throughput (steps/s) of three fixed workloads on every device found"
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
    /// Workloads to run; default all three.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Option<Vec<Workload>>,
    /// Skip the 1-stage pipeline rows.
    #[arg(long)]
    pub no_pipeline: bool,
    /// A Python that imports torch: the CPU rows get a PyTorch column measured in this run
    /// (default: $WGPIPE_TORCH_PYTHON; no column when unset).
    #[arg(long)]
    pub torch_python: Option<String>,
    /// A shared library preloaded into a second PyTorch run per round (LD_PRELOAD), for
    /// PyTorch at full speed beside PyTorch as shipped: on AMD CPUs, MKL's vendor check
    /// overridden (README, bench_train, shows how to build it).
    #[arg(long)]
    pub torch_preload: Option<String>,
    /// Measurements per cell, wgpipe and PyTorch alternating; the table shows medians.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Times every product of the CPU rows' plain steps (shape, operand layouts, kernel) and
    /// prints where each round's matmul time went, per step, on stderr.
    #[arg(long)]
    pub matmul_times: bool,
}

impl BenchArgs {
    /// The flags as parsed from `args` (without the program name).
    pub fn parse_from_args<I, S>(args: I) -> AppResult<BenchArgs>
    where
        I: IntoIterator<Item = S>,
        S: Into<std::ffi::OsString> + Clone,
    {
        crate::args::parse_args("bench_train", args)
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
    /// PyTorch's steps/s for this workload in this run (CPU rows with a torch Python).
    pub torch: Option<f64>,
    /// Every round's plain figure (their spread is the run-to-run noise).
    pub plain_rounds: Vec<f64>,
    /// Every round's PyTorch figure (its spread is the machine's noise, for comparison).
    pub torch_rounds: Vec<f64>,
    /// Every round's figure of PyTorch with `--torch-preload` (MKL at full speed).
    pub torch_full_rounds: Vec<f64>,
    /// FLOPs of one plain training step, as the device's counter saw them (matmuls at 2 m k n,
    /// elementwise ops at their own counts).
    pub flops_per_step: f64,
    /// The CPU's f32 FMA peak on the backend's threads, measured in this run (CPU rows).
    pub fma_peak_gflops: Option<f64>,
    /// The last round's products, with `--matmul-times` (CPU rows).
    pub matmuls: MatmulTimes,
}

impl BenchRow {
    /// wgpipe / PyTorch: the median of each round's own ratio (a round runs wgpipe, then
    /// PyTorch), which a slow stretch of the machine moves less than a ratio of medians.
    pub fn torch_ratio(&self) -> Option<f64> {
        median_ratio(&self.plain_rounds, &self.torch_rounds)
    }

    /// wgpipe / PyTorch with `--torch-preload`, as [`BenchRow::torch_ratio`].
    pub fn torch_full_ratio(&self) -> Option<f64> {
        median_ratio(&self.plain_rounds, &self.torch_full_rounds)
    }

    /// The spread of wgpipe's and PyTorch's rounds: `max / min - 1` (with 2 rounds or more).
    pub fn spreads(&self) -> (Option<f64>, Option<f64>) {
        (spread(&self.plain_rounds), spread(&self.torch_rounds))
    }

    /// Steps/s at the FMA peak: the ceiling no implementation of these FLOPs can pass here.
    pub fn steps_at_peak(&self) -> Option<f64> {
        self.fma_peak_gflops
            .filter(|_| self.flops_per_step > 0.0)
            .map(|p| p * 1e9 / self.flops_per_step)
    }
}

/// The median of the rounds' ratios `own / reference` (`None` without reference rounds).
fn median_ratio(own: &[f64], reference: &[f64]) -> Option<f64> {
    let ratios: Vec<f64> = own.iter().zip(reference).map(|(w, t)| w / t).collect();
    (!ratios.is_empty()).then(|| median(&ratios))
}

/// `max / min - 1` over `v`, with 2 values or more.
fn spread(v: &[f64]) -> Option<f64> {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (v.len() >= 2 && min > 0.0).then(|| max / min - 1.0)
}

/// The median of `v` (non-empty).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// A CPU row's device: the CPU's vendor and family beside every figure (on AMD, family 25 is Zen
/// 4 and 26 Zen 5, whose AVX-512 units differ in width: the ratios differ with them).
fn cpu_label() -> String {
    let model = crate::peak::cpu_model().unwrap_or_else(|| "model unknown".into());
    format!("cpu ({})", model.split(':').next().unwrap_or(&model))
}

/// The devices to measure: the CPU and every wgpu adapter, or those named.
fn devices(args: &BenchArgs) -> AppResult<Vec<(String, Result<Device, String>)>> {
    let mut out = Vec::new();
    match &args.devices {
        Some(list) => {
            for spec in list {
                let dev = Device::parse(spec).map_err(|e| e.to_string());
                // The adapter's name in the label (it says which reference column applies).
                let label = match dev.as_ref().ok().and_then(Device::adapter_info) {
                    Some(a) => format!("{spec} {} ({})", a.name, a.backend),
                    None if dev.as_ref().is_ok_and(Device::is_cpu) => cpu_label(),
                    None => spec.clone(),
                };
                out.push((label, dev));
            }
        }
        None => {
            out.push((cpu_label(), Ok(Device::cpu())));
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
    crate::limits::check_range("rounds", args.rounds, 1, 100)?;
    let workloads = args
        .workloads
        .clone()
        .unwrap_or_else(|| Workload::ALL.to_vec());
    let devs = devices(&args)?;
    if args.devices.is_none() && Device::adapters().is_empty() {
        eprintln!("no wgpu adapter found (install mesa-vulkan-drivers for lavapipe): CPU only");
    }
    let py = torch_python(&args);
    // The ceiling the CPU rows are quoted against, measured before and after the rounds (the
    // best of both: another process busy through one probe once made it read half the peak).
    let measure_peak = || {
        devs.iter()
            .any(|(_, d)| d.as_ref().is_ok_and(Device::is_cpu))
            .then(|| {
                let budget = std::time::Duration::from_secs_f64(args.seconds.min(1.5));
                let p = crate::peak::cpu_fma_peak_gflops(crate::tensor::cpu_threads(), budget);
                eprintln!(
                    "CPU f32 FMA peak: {p:.0} GFLOP/s on {} threads",
                    crate::tensor::cpu_threads()
                );
                p
            })
    };
    let peak_before = measure_peak();
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
            let with_torch = py.as_deref().filter(|_| dev.is_cpu());
            let (mut plain, mut piped, mut torch, mut torch_full) =
                (vec![], vec![], vec![], vec![]);
            let (mut loss, mut flops_per_step) = (0.0, 0.0);
            let mut matmuls = MatmulTimes::default();
            for round in 0..args.rounds {
                eprintln!("measuring {w:?} on {label} (round {}) ...", round + 1);
                let t = bench_plain(&args, *w, dev).context(format!("{w:?} on {label}, plain"))?;
                plain.push(t.steps_per_sec);
                (loss, flops_per_step) = (t.loss, t.flops_per_step);
                if !t.matmuls.times.is_empty() {
                    eprintln!(
                        "  round {}, {w:?}: the products of a step\n{}",
                        round + 1,
                        t.matmuls.table(1.0 / t.steps_per_sec)
                    );
                }
                matmuls = t.matmuls;
                if !args.no_pipeline {
                    piped.push(
                        bench_pipelined(&args, *w, dev)
                            .context(format!("{w:?} on {label}, 1-stage pipeline"))?
                            .steps_per_sec,
                    );
                }
                if let Some(py) = with_torch {
                    torch.push(bench_torch(&args, py, *w, None)?);
                    if let Some(lib) = &args.torch_preload {
                        torch_full.push(bench_torch(&args, py, *w, Some(lib))?);
                    }
                }
                // Each round's figures, so that a wide spread can be traced to its rounds.
                eprintln!(
                    "  round {}: wgpipe {:.2}{}{}{} steps/s",
                    round + 1,
                    t.steps_per_sec,
                    piped
                        .last()
                        .filter(|_| piped.len() == round + 1)
                        .map_or(String::new(), |p| format!(", 1-stage pipeline {p:.2}")),
                    torch
                        .last()
                        .filter(|_| torch.len() == round + 1)
                        .map_or(String::new(), |p| format!(", PyTorch {p:.2}")),
                    torch_full
                        .last()
                        .filter(|_| torch_full.len() == round + 1)
                        .map_or(String::new(), |p| format!(", PyTorch preloaded {p:.2}")),
                );
            }
            rows.push(BenchRow {
                workload: *w,
                device: label.clone(),
                plain: median(&plain),
                pipelined: (!piped.is_empty()).then(|| median(&piped)),
                loss,
                torch: (!torch.is_empty()).then(|| median(&torch)),
                plain_rounds: plain,
                torch_rounds: torch,
                torch_full_rounds: torch_full,
                flops_per_step,
                fma_peak_gflops: peak_before.filter(|_| dev.is_cpu()),
                matmuls,
            });
        }
    }
    let fma_peak = peak_before.zip(measure_peak()).map(|(a, b)| a.max(b));
    for peak in rows.iter_mut().filter_map(|r| r.fma_peak_gflops.as_mut()) {
        *peak = fma_peak.unwrap_or(*peak);
    }
    println!("{}", table(&rows));
    if let Some(p) = fma_peak {
        // The table's "% of peak" columns depend on the CPU: name it beside them.
        println!(
            "CPU: {}; f32 FMA peak {p:.0} GFLOP/s on {} threads",
            crate::peak::cpu_model().unwrap_or_else(|| "model unknown".into()),
            crate::tensor::cpu_threads()
        );
    }
    Ok(rows)
}

/// The rows as a markdown table: wgpipe's figures, PyTorch's from this run and the ratio (as
/// shipped, and with `--torch-preload` when given), the
/// FLOPs of a step and, on the CPU, the steps/s the FMA peak would allow and the share of it
/// wgpipe and PyTorch reach, the spread of each over the rounds (`max / min - 1`), and Burn's
/// figures as issue 15 quotes them.
pub fn table(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| workload | device | wgpipe plain (steps/s) | wgpipe 1-stage pipeline (steps/s) | PyTorch CPU, this run (steps/s) | wgpipe / PyTorch (median of the rounds' ratios) | PyTorch preloaded, e.g. MKL at full speed (steps/s) | wgpipe / PyTorch preloaded | GFLOP per step | steps/s at the CPU's FMA peak | wgpipe / PyTorch, % of that | spread over rounds, wgpipe / PyTorch | Burn wgpu lavapipe (from issue 15) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let opt = |v: Option<f64>| v.map_or("-".into(), |p| format!("{p:.2}"));
    let pct = |v: Option<f64>| v.map_or("-".into(), |p| format!("{:.0}%", 100.0 * p));
    for r in rows {
        let burn = if r.device.contains("lavapipe") || r.device.contains("llvmpipe") {
            r.workload.burn_lavapipe_from_issue()
        } else {
            None
        };
        let ceiling = r.steps_at_peak();
        let (own_spread, torch_spread) = r.spreads();
        s.push_str(&format!(
            "| {} | {} | {:.2} | {} | {} | {} | {} | {} | {:.3} | {} | {} / {} | {} / {} | {} |\n",
            r.workload.describe(),
            r.device,
            r.plain,
            opt(r.pipelined),
            opt(r.torch),
            opt(r.torch_ratio()),
            opt((!r.torch_full_rounds.is_empty()).then(|| median(&r.torch_full_rounds))),
            opt(r.torch_full_ratio()),
            r.flops_per_step / 1e9,
            opt(ceiling),
            pct(ceiling.map(|c| r.plain / c)),
            pct(ceiling.zip(r.torch).map(|(c, t)| t / c)),
            pct(own_spread),
            pct(torch_spread),
            opt(burn),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_the_median_of_the_rounds_ratios_and_spread_is_max_over_min() {
        let row = BenchRow {
            workload: Workload::Mlp,
            device: "cpu".into(),
            plain: 30.0,
            pipelined: None,
            loss: 0.0,
            torch: Some(30.0),
            plain_rounds: vec![30.0, 20.0, 33.0],
            torch_rounds: vec![30.0, 25.0, 30.0],
            torch_full_rounds: vec![],
            flops_per_step: 3e9,
            fma_peak_gflops: Some(300.0),
            matmuls: MatmulTimes::default(),
        };
        // Rounds' ratios 1.0, 0.8, 1.1; the ratio of the medians would be 30 / 30 = 1.0 too,
        // so a fourth round tells the two apart below.
        assert_eq!(row.torch_ratio(), Some(1.0));
        let (own, torch) = row.spreads();
        assert!((own.unwrap() - 0.65).abs() < 1e-12 && (torch.unwrap() - 0.2).abs() < 1e-12);
        assert_eq!(row.steps_at_peak(), Some(100.0));
        let skewed = BenchRow {
            plain_rounds: vec![10.0, 20.0, 30.0, 40.0],
            torch_rounds: vec![40.0, 10.0, 30.0, 20.0],
            ..row
        };
        // Ratios 0.25, 2, 1, 2: median 1.5, where the medians (25 / 25) give 1.
        assert_eq!(skewed.torch_ratio(), Some(1.5));
    }
}
