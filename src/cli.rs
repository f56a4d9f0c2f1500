//! What the examples share: the device and pipeline flags, placing K stages on devices,
//! building the pipeline from the flags, whole-pipeline checkpoints, the progress bar, the trace
//! and SVG outputs, Ctrl-C, and one error type that turns every failure into a clear message.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::autograd::optim::Optimizer;
use crate::autograd::serialize::{load_checkpoint, save_checkpoint, OPTIM_PREFIX};
use crate::autograd::{Module, Param};
use crate::pipeline::{
    Balance, CheckpointMode, LinkSpec, Pipeline, PipelineError, ScheduleKind, SimCluster,
    StepReport,
};
use crate::tensor::{Device, Tensor};

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// An error of an example: one line (or a few) that says what went wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppError(pub String);

pub type AppResult<T> = Result<T, AppError>;

impl AppError {
    pub fn new(msg: impl Into<String>) -> AppError {
        AppError(msg.into())
    }
}

impl fmt::Display for AppError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AppError {}

macro_rules! from_error {
    ($($t:ty),*) => {$(
        impl From<$t> for AppError {
            fn from(e: $t) -> AppError {
                AppError(e.to_string())
            }
        }
    )*};
}
from_error!(
    crate::tensor::Error,
    PipelineError,
    crate::models::data::DataError,
    std::io::Error
);

/// `Err(AppError)` with a formatted message.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::cli::AppError(format!($($arg)*)))
    };
}

/// Adds context in front of an error's message.
pub trait Context<T> {
    fn context(self, what: impl fmt::Display) -> AppResult<T>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: impl fmt::Display) -> AppResult<T> {
        self.map_err(|e| AppError(format!("{what}: {e}")))
    }
}

/// Prints the error and exits with status 2 (the examples' `main`).
pub fn exit_on_error(r: AppResult<impl Sized>) {
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

// ---------------------------------------------------------------------------------------------
// Ctrl-C
// ---------------------------------------------------------------------------------------------

static STOP: AtomicBool = AtomicBool::new(false);

/// Installs a Ctrl-C (SIGINT/SIGTERM) handler that asks the training loop to stop after the
/// current step (it then saves when `--save` is set). A second Ctrl-C exits at once.
pub fn install_ctrl_c() {
    let _ = ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted again: exiting without saving");
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: stopping after this step (Ctrl-C again to exit at once)");
    });
}

/// The flag Ctrl-C sets: the examples' `run` functions stop after the step during which it
/// was set (their `run_with` variants take another flag, e.g. in tests).
pub fn ctrl_c_flag() -> &'static AtomicBool {
    &STOP
}

// ---------------------------------------------------------------------------------------------
// Flags
// ---------------------------------------------------------------------------------------------

/// Where the stages run.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The best device: K wgpu devices on the GPU if there is one, else a simulated cluster.
    Auto,
    /// K CPU devices (real arithmetic, wall-clock timeline).
    Cpu,
    /// K wgpu devices: on separate adapters when there are several GPUs, else on one adapter.
    Gpu,
    /// A simulated cluster of K virtual devices on the CPU (see --sim-*; simulated timeline).
    Sim,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CheckpointArg {
    Always,
    ExceptLast,
    Never,
}

impl From<CheckpointArg> for CheckpointMode {
    fn from(c: CheckpointArg) -> CheckpointMode {
        match c {
            CheckpointArg::Always => CheckpointMode::Always,
            CheckpointArg::ExceptLast => CheckpointMode::ExceptLast,
            CheckpointArg::Never => CheckpointMode::Never,
        }
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ScheduleArg {
    /// Fill-drain: all forwards, then all backwards.
    Gpipe,
    /// One forward, one backward (PipeDream-Flush): fewer activations alive.
    #[value(name = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved 1F1B over --chunks virtual stages per device.
    #[value(name = "interleaved-1f1b")]
    Interleaved1F1B,
    /// Breadth-first over --chunks virtual stages per device.
    #[value(name = "looped-bfs")]
    LoopedBfs,
    /// Zero bubble H1: split backward, 1F1B memory.
    #[value(name = "zb-h1")]
    ZbH1,
    /// Zero bubble H2: split backward, about twice 1F1B's memory.
    #[value(name = "zb-h2")]
    ZbH2,
    /// Zero bubble V: two chunks per device in a V, 1F1B memory.
    #[value(name = "zb-v")]
    ZbV,
    /// DualPipeV: two chunks per device in a V (needs M >= 2K).
    #[value(name = "dualpipe-v")]
    DualPipeV,
}

impl From<ScheduleArg> for ScheduleKind {
    fn from(s: ScheduleArg) -> ScheduleKind {
        match s {
            ScheduleArg::Gpipe => ScheduleKind::GPipe,
            ScheduleArg::OneFOneB => ScheduleKind::OneFOneB,
            ScheduleArg::Interleaved1F1B => ScheduleKind::Interleaved1F1B,
            ScheduleArg::LoopedBfs => ScheduleKind::LoopedBfs,
            ScheduleArg::ZbH1 => ScheduleKind::ZbH1,
            ScheduleArg::ZbH2 => ScheduleKind::ZbH2,
            ScheduleArg::ZbV => ScheduleKind::ZbV,
            ScheduleArg::DualPipeV => ScheduleKind::DualPipeV,
        }
    }
}

/// `--balance`: layers per stage (`3,3,2,2`) or a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BalanceArg {
    Explicit(Vec<usize>),
    Time,
    Params,
    Flops,
    Memory,
}

impl FromStr for BalanceArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "time" => Ok(BalanceArg::Time),
            "params" => Ok(BalanceArg::Params),
            "flops" => Ok(BalanceArg::Flops),
            "memory" => Ok(BalanceArg::Memory),
            list => list
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<Vec<_>, _>>()
                .map(BalanceArg::Explicit)
                .map_err(|_| {
                    format!(
                        "'{list}' is neither a list of layers per stage (e.g. 3,3,2,2) nor one of time, params, flops, memory"
                    )
                }),
        }
    }
}

impl fmt::Display for BalanceArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BalanceArg::Explicit(v) => {
                let s: Vec<String> = v.iter().map(|x| x.to_string()).collect();
                f.write_str(&s.join(","))
            }
            BalanceArg::Time => f.write_str("time"),
            BalanceArg::Params => f.write_str("params"),
            BalanceArg::Flops => f.write_str("flops"),
            BalanceArg::Memory => f.write_str("memory"),
        }
    }
}

/// The flags every training example has: devices, pipeline, checkpoints and outputs.
#[derive(Args, Clone, Debug)]
pub struct PipelineArgs {
    /// Where the stages run: auto (GPU if any, else a simulated cluster on the CPU), cpu, gpu, sim.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Number of pipeline stages K (one device each).
    #[arg(long, default_value_t = 4)]
    pub stages: usize,
    /// Micro-batches M per mini-batch.
    #[arg(long, default_value_t = 8)]
    pub micro_batches: usize,
    /// Re-materialization: always, except-last (the last micro-batch keeps its tape), never.
    #[arg(long, value_enum, default_value_t = CheckpointArg::ExceptLast)]
    pub checkpoint: CheckpointArg,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = ScheduleArg::Gpipe)]
    pub schedule: ScheduleArg,
    /// Virtual stages per device for interleaved-1f1b and looped-bfs (default 2; zb-v and
    /// dualpipe-v always use 2, the others 1). The model is cut into stages x chunks pieces.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Layers per stage (e.g. 3,3,2,2) or a balancing rule: time, params, flops, memory.
    #[arg(long, default_value = "flops")]
    pub balance: BalanceArg,
    /// Seed of the initialisation, the data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save a checkpoint (parameters, buffers, every stage's optimizer state, step) here at the
    /// end, and on Ctrl-C.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save (bit-exact continuation; --steps is the total).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Stop at this step as Ctrl-C would (then save with --save); the learning-rate schedule
    /// still spans --steps, so a later --resume with the same flags continues bit-exactly.
    #[arg(long)]
    pub stop_at: Option<u64>,
    /// Chrome trace of the last step (open in Perfetto or chrome://tracing).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// SVG timeline of the last step (stages as rows).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// No progress bar (plain log lines instead).
    #[arg(long)]
    pub quiet: bool,
    /// --device sim: compute rate of each virtual device, in GFLOP/s.
    #[arg(long, default_value_t = 100.0)]
    pub sim_gflops: f64,
    /// --device sim: memory of each virtual device, in GiB (an allocation past it is an
    /// out-of-memory error of that stage).
    #[arg(long, default_value_t = 16.0)]
    pub sim_memory_gib: f64,
    /// --device sim: link bandwidth between neighbouring devices, in GB/s (latency 10 µs).
    #[arg(long, default_value_t = 10.0)]
    pub sim_link_gbs: f64,
}

impl PipelineArgs {
    /// Checks what the pipeline builder would reject, with messages that name the flags.
    /// Virtual stages per device: `--chunks`, or the schedule's own count.
    pub fn chunks(&self) -> usize {
        self.chunks
            .unwrap_or_else(|| ScheduleKind::from(self.schedule).default_chunks())
    }

    pub fn validate(&self, num_layers: usize, what: &str) -> AppResult<()> {
        if self.stages == 0 {
            bail!("--stages must be at least 1");
        }
        if self.micro_batches == 0 {
            bail!("--micro-batches must be at least 1 (M = 0 micro-batches cannot carry a mini-batch)");
        }
        if self.chunks == Some(0) {
            bail!("--chunks must be at least 1");
        }
        let pieces = self.stages * self.chunks();
        if pieces > num_layers {
            bail!(
                "--stages {} x {} chunks = {pieces} pieces is more than the {num_layers} layers of the model ({what}): every piece needs at least one layer; use fewer stages or chunks, or more layers",
                self.stages,
                self.chunks()
            );
        }
        if let BalanceArg::Explicit(b) = &self.balance {
            if b.len() != pieces {
                bail!(
                    "--balance {} has {} entries but --stages x chunks is {pieces}",
                    self.balance,
                    b.len(),
                );
            }
            let sum: usize = b.iter().sum();
            if sum != num_layers || b.contains(&0) {
                bail!(
                    "--balance {} must give every stage at least one layer and sum to the {num_layers} layers of the model ({what}); it sums to {sum}",
                    self.balance
                );
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// The K stage devices chosen from `--device`.
pub struct Placement {
    pub devices: Vec<Device>,
    pub sim: Option<SimCluster>,
    /// One line for the user, e.g. "4 stages on a simulated cluster of 4 V100-like devices".
    pub description: String,
}

/// The virtual devices of `--device sim` (and of `auto` without a GPU).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimSpec {
    pub gflops: f64,
    pub memory_gib: f64,
    pub link_gbs: f64,
}

impl PipelineArgs {
    pub fn sim_spec(&self) -> SimSpec {
        SimSpec {
            gflops: self.sim_gflops,
            memory_gib: self.sim_memory_gib,
            link_gbs: self.sim_link_gbs,
        }
    }
}

/// Places `k` stages: see [`DeviceChoice`].
pub fn place(choice: DeviceChoice, k: usize, sim: SimSpec) -> AppResult<Placement> {
    if !(sim.gflops > 0.0 && sim.memory_gib > 0.0 && sim.link_gbs > 0.0) {
        bail!("--sim-gflops, --sim-memory-gib and --sim-link-gbs must be positive");
    }
    match choice {
        DeviceChoice::Cpu => Ok(Placement {
            devices: (0..k)
                .map(|i| Device::new_cpu(&format!("cpu{i}")))
                .collect(),
            sim: None,
            description: format!("{k} stages on {k} CPU devices (wall-clock times)"),
        }),
        DeviceChoice::Sim => Ok(sim_placement(k, sim, "")),
        DeviceChoice::Gpu => gpu_placement(k, true),
        DeviceChoice::Auto => {
            if let Ok(spec) = std::env::var(crate::tensor::DEVICE_ENV) {
                return env_placement(k, sim, spec.trim());
            }
            let has_gpu = Device::adapters().iter().any(|a| !a.is_software);
            if has_gpu {
                gpu_placement(k, false)
            } else {
                Ok(sim_placement(k, sim, "no GPU found: "))
            }
        }
    }
}

/// `--device auto` when `WGPIPE_DEVICE` is set: `cpu` means the simulated cluster, anything
/// else opens K devices as [`Device::parse`] reads it.
fn env_placement(k: usize, sim: SimSpec, spec: &str) -> AppResult<Placement> {
    let env = crate::tensor::DEVICE_ENV;
    match spec {
        "cpu" => Ok(sim_placement(k, sim, &format!("{env}=cpu: "))),
        "" | "auto" => {
            gpu_placement(k, false).or_else(|_| Ok(sim_placement(k, sim, "no GPU found: ")))
        }
        _ => {
            let devices = (0..k)
                .map(|_| Device::parse(spec))
                .collect::<Result<Vec<_>, _>>()
                .context(format!("{env}={spec}"))?;
            let description = format!("{k} stages on {} ({env}={spec})", devices[0].name());
            Ok(Placement {
                devices,
                sim: None,
                description,
            })
        }
    }
}

fn sim_placement(k: usize, sim: SimSpec, why: &str) -> Placement {
    let link = LinkSpec {
        bandwidth_bytes_per_sec: sim.link_gbs * 1e9,
        latency_sec: 10e-6,
    };
    let memory = (sim.memory_gib * (1u64 << 30) as f64) as u64;
    let cluster = SimCluster::uniform(&Device::cpu(), k, memory, sim.gflops * 1e9, link);
    Placement {
        devices: cluster.devices().to_vec(),
        sim: Some(cluster),
        description: format!(
            "{why}{k} stages on a simulated cluster of {k} virtual devices ({} GFLOP/s, {} GiB, {} GB/s links; set with --sim-*) whose arithmetic runs on the CPU; step times and bubbles are simulated",
            sim.gflops, sim.memory_gib, sim.link_gbs
        ),
    }
}

/// K wgpu devices: round-robin over the hardware adapters (software ones only when
/// `allow_software` and there is no hardware one).
fn gpu_placement(k: usize, allow_software: bool) -> AppResult<Placement> {
    let all = Device::adapters();
    let mut hw: Vec<_> = all.iter().filter(|a| !a.is_software).collect();
    hw.sort_by_key(|a| if a.is_discrete { 0 } else { 1 });
    let mut note = "";
    if hw.is_empty() && allow_software {
        hw = all.iter().filter(|a| a.is_software).collect();
        note = " (a software adapter: expect it to be slower than --device cpu)";
    }
    if hw.is_empty() {
        bail!(
            "--device gpu: no wgpu adapter found (no Vulkan, Metal or DX12 driver); use --device cpu or --device sim"
        );
    }
    // With several discrete GPUs use them all; else all stages share the best adapter.
    let discrete: Vec<_> = hw.iter().filter(|a| a.is_discrete).copied().collect();
    let pool = if discrete.len() > 1 {
        discrete
    } else {
        vec![hw[0]]
    };
    let mut devices = Vec::with_capacity(k);
    for i in 0..k {
        let a = pool[i % pool.len()];
        devices.push(Device::wgpu(a.index).context(format!("opening wgpu adapter {}", a.name))?);
    }
    let names: Vec<String> = pool.iter().map(|a| a.name.clone()).collect();
    let description = if pool.len() == 1 {
        format!(
            "{k} stages as {k} wgpu devices (one queue each) on {}{note}",
            names[0]
        )
    } else {
        format!(
            "{k} stages on {} GPUs: {}{note}",
            pool.len(),
            names.join(", ")
        )
    };
    Ok(Placement {
        devices,
        sim: None,
        description,
    })
}

/// Builds the pipeline from the flags. `sample` is one micro-batch of inputs (for
/// `--balance time`), `input_shape` its shape (for `flops` and `memory`).
pub fn build_pipeline(
    layers: Vec<Box<dyn Module>>,
    args: &PipelineArgs,
    placement: &Placement,
    sample: &Tensor,
    optimizer: impl Fn() -> Box<dyn Optimizer> + 'static,
) -> AppResult<Pipeline> {
    let input_shape = sample.shape().to_vec();
    let balance = match &args.balance {
        BalanceArg::Explicit(b) => Balance::Explicit(b.clone()),
        BalanceArg::Params => Balance::ByParams,
        BalanceArg::Flops => Balance::ByFlops { input_shape },
        BalanceArg::Memory => Balance::ByMemory {
            input_shape,
            optimizer_factor: 4.0,
        },
        BalanceArg::Time => Balance::ByTime {
            sample: sample.clone(),
        },
    };
    let mut b = Pipeline::builder(layers)
        .balance(balance)
        .micro_batches(args.micro_batches)
        .checkpoint(args.checkpoint.into())
        .schedule(ScheduleKind::from(args.schedule))
        .chunks(args.chunks())
        .seed(args.seed)
        .optimizer(optimizer);
    b = match &placement.sim {
        Some(c) => b.sim(c.clone()),
        None => b.devices(placement.devices.clone()),
    };
    b.build().context("building the pipeline")
}

/// The layers of each stage, e.g. `stage 0: 0..2 TokenPositionEmbedding(..), TransformerBlock(..)`.
pub fn describe_stages(pipe: &Pipeline) -> String {
    let mut s = String::new();
    for st in pipe.stages() {
        let names: Vec<String> = st.layers.iter().map(|l| l.name()).collect();
        s.push_str(&format!(
            "  stage {} on {}: layers {}..{}  {}\n",
            st.index,
            st.device.name(),
            st.first_layer,
            st.first_layer + st.layers.len(),
            names.join(", ")
        ));
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Whole-pipeline checkpoints
// ---------------------------------------------------------------------------------------------

/// The optimizers of all stages seen as one, for [`save_checkpoint`] / [`load_checkpoint`]:
/// per-parameter state is keyed by global parameter names (disjoint across stages); the shared
/// counters (`@steps`, `@lr`) are equal on every stage and stored once.
struct StagedOptimizer<'a> {
    optimizers: &'a mut [Box<dyn Optimizer>],
    /// Parameter name → stage.
    owner: HashMap<String, usize>,
}

impl Optimizer for StagedOptimizer<'_> {
    fn step(&mut self, _params: &[(String, Param)]) -> crate::tensor::Result<()> {
        Err(crate::tensor::Error::Invalid {
            op: "StagedOptimizer::step",
            msg: "only for saving and loading state; step through Pipeline::optimizer_step".into(),
        })
    }
    fn lr(&self) -> f32 {
        self.optimizers.first().map_or(0.0, |o| o.lr())
    }
    fn set_lr(&mut self, lr: f32) {
        for o in self.optimizers.iter_mut() {
            o.set_lr(lr);
        }
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        let mut all = Vec::new();
        for (i, o) in self.optimizers.iter().enumerate() {
            for (k, t) in o.state() {
                if !k.starts_with('@') || i == 0 {
                    all.push((k, t));
                }
            }
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> crate::tensor::Result<()> {
        let n = self.optimizers.len();
        let mut per: Vec<Vec<(String, Tensor)>> = vec![Vec::new(); n];
        for (k, t) in state {
            if k.starts_with('@') {
                for p in per.iter_mut() {
                    p.push((k.clone(), t.clone()));
                }
                continue;
            }
            let pname = k.rsplit_once('.').map_or(k.as_str(), |(p, _)| p);
            match self.owner.get(pname) {
                Some(&s) => per[s].push((k, t)),
                None => {
                    return Err(crate::tensor::Error::Invalid {
                        op: "load_state",
                        msg: format!("state '{k}' belongs to no parameter of the pipeline"),
                    })
                }
            }
        }
        // Check every stage's state on a scratch copy first would need a factory; the
        // optimizers validate their own input before changing anything, so a failure in a
        // later stage leaves earlier ones loaded: load_checkpoint then reports the error and
        // the caller stops.
        for (o, s) in self.optimizers.iter_mut().zip(per) {
            o.load_state(s)?;
        }
        Ok(())
    }
    fn steps(&self) -> u64 {
        self.optimizers.first().map_or(0, |o| o.steps())
    }
}

/// Parameters, buffers, and the stage that owns each parameter.
type Staged = (
    Vec<(String, Param)>,
    Vec<(String, Param)>,
    HashMap<String, usize>,
);

fn staged(pipe: &Pipeline) -> Staged {
    let mut owner = HashMap::new();
    for st in pipe.stages() {
        for (i, l) in st.layers.iter().enumerate() {
            for (n, _) in l.parameters() {
                owner.insert(format!("{}.{n}", st.first_layer + i), st.index);
            }
        }
    }
    (pipe.named_parameters(), pipe.named_buffers(), owner)
}

/// Saves parameters, buffers, every stage's optimizer state and `step` to `path` (atomically).
pub fn save_pipeline(
    pipe: &mut Pipeline,
    path: &Path,
    step: u64,
    metadata: &[(String, String)],
) -> AppResult<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).context(format!("creating {}", dir.display()))?;
    }
    let (params, buffers, owner) = staged(pipe);
    let opt = StagedOptimizer {
        optimizers: pipe.optimizers_mut(),
        owner,
    };
    save_checkpoint(path, &params, &buffers, &opt, step, metadata)
        .context(format!("saving checkpoint {}", path.display()))
}

/// Loads a checkpoint written by [`save_pipeline`] into `pipe`; returns its step and metadata.
/// `model` describes the model these flags build; when the checkpoint was saved with another
/// `model` entry in its metadata, the error shows both.
pub fn load_pipeline(
    pipe: &mut Pipeline,
    path: &Path,
    model: &str,
) -> AppResult<(u64, Vec<(String, String)>)> {
    if !path.exists() {
        bail!("--resume {}: file not found", path.display());
    }
    let saved_model = crate::autograd::serialize::load_metadata(path)
        .ok()
        .and_then(|m| m.into_iter().find(|(k, _)| k == "model").map(|(_, v)| v));
    let (params, buffers, owner) = staged(pipe);
    let mut opt = StagedOptimizer {
        optimizers: pipe.optimizers_mut(),
        owner,
    };
    let info = load_checkpoint(path, &params, &buffers, &mut opt).map_err(|e| {
        let models = match &saved_model {
            Some(m) if m != model => {
                format!("\n  the checkpoint holds: {m}\n  these flags build:    {model}")
            }
            _ => String::new(),
        };
        AppError(format!(
            "cannot resume from {}: it does not match the model of these flags{models}\n  {}",
            path.display(),
            shorten(&e.to_string(), 600)
        ))
    })?;
    // The step keys the dropout RNG, so it must continue where the checkpoint left off.
    pipe.set_step(info.step);
    Ok((info.step, info.metadata))
}

/// At most about `max` characters of `msg`, cut after a whole "... in the model" item where
/// there is one, saying how many items were left out.
fn shorten(msg: &str, max: usize) -> String {
    if msg.len() <= max {
        return msg.to_string();
    }
    let item = " in the model, ";
    match msg[..max].rfind(item) {
        Some(i) => {
            let cut = i + item.len() - 2;
            let rest = msg[cut..].matches(" in the file").count();
            format!("{}, ... ({rest} more)", &msg[..cut])
        }
        None => format!(
            "{} ... (truncated)",
            &msg[..msg.floor_char_boundary_compat(max)]
        ),
    }
}

trait FloorCharBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorCharBoundary for str {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        i = i.min(self.len());
        while !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// True for state keys of the optimizer inside a checkpoint file.
pub fn is_optimizer_key(name: &str) -> bool {
    name.starts_with(OPTIM_PREFIX)
}

// ---------------------------------------------------------------------------------------------
// Progress and outputs
// ---------------------------------------------------------------------------------------------

/// A progress bar over `total` steps starting at `start` (hidden with `quiet`).
pub fn progress_bar(start: u64, total: u64, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(
        Some(total),
        if quiet {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        },
    );
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:30.cyan/blue}] step {pos}/{len} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_position(start);
    pb
}

fn create_parent(path: &Path) -> AppResult<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).context(format!("creating {}", dir.display()))?;
    }
    Ok(())
}

/// Writes the Chrome trace and the SVG timeline of `report`; returns the paths written.
pub fn write_pictures(
    report: &StepReport,
    label: &str,
    trace: &Path,
    timeline: &Path,
) -> AppResult<()> {
    // The report labels its own clock (simulated in simulated mode, else wall clock).
    let title = format!("{label} — step {}", report.step);
    create_parent(trace)?;
    std::fs::write(trace, report.chrome_trace_json(&title))
        .context(format!("writing {}", trace.display()))?;
    create_parent(timeline)?;
    std::fs::write(timeline, report.svg_timeline(&title))
        .context(format!("writing {}", timeline.display()))?;
    Ok(())
}

/// `path` or the default under `target/wgpipe/`.
pub fn out_path(path: &Option<PathBuf>, default: &str) -> PathBuf {
    path.clone()
        .unwrap_or_else(|| PathBuf::from("target/wgpipe").join(default))
}

/// A small deterministic generator for sampling (splitmix64).
#[derive(Clone, Debug)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

// ---------------------------------------------------------------------------------------------
// The training loop
// ---------------------------------------------------------------------------------------------

/// How [`train_loop`] runs.
pub struct LoopConfig<'a> {
    /// First step (non-zero when resumed) and total steps.
    pub start: u64,
    pub steps: u64,
    pub base_lr: f32,
    pub schedule: crate::autograd::LrSchedule,
    /// Global gradient-norm clip.
    pub clip: Option<f32>,
    pub quiet: bool,
    /// Items (tokens, images) per step, and their name for the rate ("tok", "img").
    pub items_per_step: usize,
    pub unit: &'static str,
    /// Stop after the step during which this became true (Ctrl-C).
    pub stop: &'a AtomicBool,
    /// Stop when this step is reached (`--stop-at`).
    pub stop_at: Option<u64>,
}

/// What [`train_loop`] did.
pub struct LoopResult {
    pub losses: Vec<f32>,
    pub last_report: Option<StepReport>,
    pub wall_secs: f64,
    pub items_per_sec: f64,
    /// Stopped by Ctrl-C.
    pub interrupted: bool,
}

impl LoopResult {
    /// The step after the last one run.
    pub fn end_step(&self, start: u64) -> u64 {
        start + self.losses.len() as u64
    }
    /// Mean of the last `k` losses.
    pub fn tail_loss(&self, k: usize) -> f32 {
        let k = k.min(self.losses.len()).max(1);
        self.losses.iter().rev().take(k).sum::<f32>() / k as f32
    }
}

/// Steps `cfg.start..cfg.steps`: learning rate from the schedule, `train_step` on
/// `batch(step)`, clip, optimizer step; a progress bar (or, with `quiet`, ten log lines) with
/// loss, throughput and bubble. Stops early after the step during which Ctrl-C was pressed.
pub fn train_loop(
    pipe: &mut Pipeline,
    cfg: &LoopConfig<'_>,
    mut batch: impl FnMut(u64) -> AppResult<(Tensor, Tensor)>,
    loss_fn: &crate::pipeline::LossFn,
) -> AppResult<LoopResult> {
    let pb = progress_bar(cfg.start, cfg.steps, cfg.quiet);
    let clock = std::time::Instant::now();
    let mut r = LoopResult {
        losses: Vec::new(),
        last_report: None,
        wall_secs: 0.0,
        items_per_sec: 0.0,
        interrupted: false,
    };
    let log_every = (cfg.steps / 10).max(1);
    let mut items = 0usize;
    for step in cfg.start..cfg.steps {
        let (x, y) = batch(step)?;
        for o in pipe.optimizers_mut() {
            cfg.schedule.apply(o.as_mut(), cfg.base_lr);
        }
        let report = pipe
            .train_step(&x, &y, loss_fn)
            .context(format!("training step {step}"))?;
        if let Some(c) = cfg.clip {
            pipe.clip_grad_norm(c)?;
        }
        pipe.optimizer_step()
            .context(format!("optimizer step {step}"))?;
        items += cfg.items_per_step;
        r.losses.push(report.loss);
        let elapsed = clock.elapsed().as_secs_f64();
        let msg = format!(
            "loss {:.3}  {:.0} {}/s  bubble {:.0}%{}",
            report.loss,
            items as f64 / elapsed,
            cfg.unit,
            report.bubble_fraction() * 100.0,
            if report.simulated.is_some() {
                " (simulated)"
            } else {
                " (measured)"
            }
        );
        pb.set_message(msg.clone());
        pb.set_position(step + 1);
        if cfg.quiet && ((step + 1) % log_every == 0 || step + 1 == cfg.steps) {
            println!("step {:>5}/{}  {msg}", step + 1, cfg.steps);
        }
        r.last_report = Some(report);
        let why = if cfg.stop.load(Ordering::SeqCst) {
            Some("Ctrl-C")
        } else if cfg.stop_at == Some(step + 1) && step + 1 < cfg.steps {
            Some("--stop-at")
        } else {
            None
        };
        if let Some(why) = why {
            r.interrupted = true;
            pb.abandon();
            eprintln!("stopped by {why} after step {}", step + 1);
            break;
        }
    }
    pb.finish();
    r.wall_secs = clock.elapsed().as_secs_f64();
    if r.wall_secs > 0.0 {
        r.items_per_sec = items as f64 / r.wall_secs;
    }
    Ok(r)
}

/// After training: the per-stage table of the last step, the schedule grid (for M <= 12), and
/// the trace and SVG timeline.
pub fn report_outputs(
    pipe: &Pipeline,
    report: &StepReport,
    label: &str,
    trace: &Path,
    timeline: &Path,
) -> AppResult<()> {
    println!("\nlast step, per stage:\n{}", report.stage_table());
    if pipe.num_micro_batches() <= 12 {
        println!("schedule (one column per clock tick):\n{}", pipe.schedule());
    }
    write_pictures(report, label, trace, timeline)?;
    println!(
        "wrote the Chrome trace of step {} to {} (open it in https://ui.perfetto.dev) and its timeline to {}",
        report.step,
        trace.display(),
        timeline.display()
    );
    Ok(())
}
