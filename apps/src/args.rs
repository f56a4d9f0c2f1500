//! The flags every training example shares (devices, pipeline, checkpoint files, outputs), and
//! building the pipeline from them. Rules the library checks (M >= 1, a mini-batch splits into
//! M, a balance fits the model) are not checked again here: the library's typed errors are
//! mapped to the flags that caused them.

use std::error::Error as _;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};

use crate::autograd::optim::Optimizer;
use crate::autograd::{ModelFactory, Module};
use crate::bail;
use crate::error::{AppError, AppResult};
use crate::limits::{check_positive, check_range};
use crate::pipeline::microbatch::{micro_batch_sizes, MicroBatchError};
use crate::pipeline::partition::{balance_by_cost, validate_balance_for, PartitionError};
use crate::pipeline::{Balance, CheckpointMode, Pipeline, PipelineError, ScheduleKind};
use crate::placement::{place, place_rank, DeviceChoice, Placement, SimSpec};
use crate::tensor::{DType, Tensor};

/// `--plan`: whether the planner chooses the pipeline's shape (the `plan` module does it).
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlanArg {
    /// Plan when the stages are simulated and none of --stages, --micro-batches, --balance,
    /// --schedule, --chunks, --checkpoint, --checkpoint-layers, --replicas is given.
    Auto,
    /// Plan: on the simulated cluster (--stages is then the number of devices it may use, for
    /// R replicas of a K-stage pipeline, R x K <= --stages); on real devices (a GPU, --device
    /// cpu) from each layer's forward and backward timed there (K <= --stages, no replicas).
    On,
    /// The pipeline the flags describe.
    Off,
}

/// A flag whose values are a library type's own names (`--help` lists them with their
/// one-line descriptions), parsed by the type's `FromStr`: the library's registry is the one
/// list, with no mirror enum here to keep in step.
fn library_values<T>(
    values: impl IntoIterator<Item = (&'static str, &'static str)>,
) -> impl TypedValueParser<Value = T>
where
    T: FromStr + Clone + Send + Sync + 'static,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    let values = values
        .into_iter()
        .map(|(name, help)| PossibleValue::new(name).help(help));
    PossibleValuesParser::new(values).try_map(|s| s.parse::<T>())
}

/// `--schedule`: every schedule of the registry, by its name.
fn schedule_values() -> impl TypedValueParser<Value = ScheduleKind> {
    library_values(ScheduleKind::ALL.map(|k| (k.name(), k.def().summary)))
}

/// `--checkpoint`: the re-materialization modes.
fn checkpoint_values() -> impl TypedValueParser<Value = CheckpointMode> {
    library_values(CheckpointMode::ALL.map(|m| (m.name(), m.summary())))
}

/// `--precision`: the dtypes the layers can compute in.
fn precision_values() -> impl TypedValueParser<Value = DType> {
    library_values(DType::ALL.map(|d| {
        let what = match d {
            DType::F32 => "single precision throughout",
            DType::F16 => "half precision with dynamic loss scaling",
            DType::BF16 => "bfloat16 (f32's range: no loss scaling)",
        };
        (d.name(), what)
    }))
}

/// `--transport`: what carries tensors between stages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// One process, a thread per device.
    Channels,
    /// One process per device under mpirun (-np K, or R x K with --replicas); needs a build
    /// with --features mpi.
    Mpi,
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

/// Most stages the examples accept.
pub const MAX_STAGES: usize = 256;

/// The flags every training example has: devices, pipeline, checkpoint files and outputs.
#[derive(Args, Clone, Debug)]
pub struct PipelineArgs {
    /// Where the stages run: auto (GPU if any, else a simulated cluster on the CPU), cpu, gpu, sim.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Number of pipeline stages K (one device each; 1..=256).
    #[arg(long, default_value_t = 4)]
    pub stages: usize,
    /// Micro-batches M per mini-batch (1..=the mini-batch size).
    #[arg(long, default_value_t = 8)]
    pub micro_batches: usize,
    /// Which micro-batches re-compute their forward in the backward instead of keeping it.
    #[arg(long, value_parser = checkpoint_values(), default_value = "except-last")]
    pub checkpoint: CheckpointMode,
    /// Layers (global indices, e.g. 1,2,5) re-computed inside their stage in every backward,
    /// whatever --checkpoint says: each run of consecutive ones keeps only its input and output.
    #[arg(long, value_delimiter = ',')]
    pub checkpoint_layers: Vec<usize>,
    /// Pipeline schedule.
    #[arg(long, value_parser = schedule_values(), default_value = "gpipe")]
    pub schedule: ScheduleKind,
    /// Virtual stages per device for interleaved-1f1b and looped-bfs (default 2; zb-v and
    /// dualpipe-v always use 2, the others 1; 1..=64). The model is cut into stages x chunks
    /// pieces.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Layers per stage (e.g. 3,3,2,2) or a balancing rule: time, params, flops, memory.
    #[arg(long, default_value = "flops")]
    pub balance: BalanceArg,
    /// Seed of the initialisation, the data order and dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save a checkpoint (parameters, buffers, every stage's optimizer state, step) here at the
    /// end, and on Ctrl-C. A file: one safetensors file (under MPI, rank 0 writes it after
    /// gathering the stages). A folder (a path ending in `/`): a sharded checkpoint, one file
    /// per device written by the rank that trains it, plus `model.safetensors.index.json`,
    /// written last.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save, a file or a sharded folder, saved with any
    /// --stages (bit-exact continuation; --steps is the total).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Write the sharded checkpoint in FOLDER as the one checkpoint file FILE, then exit (no
    /// training; in one process).
    #[arg(long, num_args = 2, value_names = ["FOLDER", "FILE"])]
    pub consolidate: Option<Vec<PathBuf>>,
    /// Split the checkpoint file FILE into a sharded checkpoint in FOLDER of --stages files
    /// (whole layers each), then exit (no training; in one process).
    #[arg(long, num_args = 2, value_names = ["FILE", "FOLDER"])]
    pub split: Option<Vec<PathBuf>>,
    /// With --resume: continue although the checkpoint was written under other settings that
    /// change the arithmetic (--precision, loss scaling, --replicas, --micro-batches,
    /// --schedule); the run says which.
    #[arg(long)]
    pub resume_other_settings: bool,
    /// Stop at this step as Ctrl-C would (then save with --save); the learning-rate schedule
    /// still spans --steps, so a later --resume with the same flags continues bit-exactly.
    #[arg(long)]
    pub stop_at: Option<u64>,
    /// Chrome trace of the last step (open in Perfetto or chrome://tracing).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// SVG timeline of the last step (devices as rows). The loss curve (`loss.svg`) is
    /// written beside it.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Every step's figures as JSON Lines (step, loss, held-out figure when evaluated, items
    /// per second, bubble, learning rate, loss scale, skipped).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// No progress bar (plain log lines instead).
    #[arg(long)]
    pub quiet: bool,
    /// --device sim: compute rate of each virtual device, in GFLOP/s (up to 1e9).
    #[arg(long, default_value_t = 100.0)]
    pub sim_gflops: f64,
    /// --device sim: memory of each virtual device, in GiB (up to 1048576; an allocation past
    /// it is an out-of-memory error of that stage).
    #[arg(long, default_value_t = 16.0)]
    pub sim_memory_gib: f64,
    /// --device sim: link bandwidth between neighbouring devices, in GB/s (up to 1e6; latency
    /// 10 µs).
    #[arg(long, default_value_t = 10.0)]
    pub sim_link_gbs: f64,
    /// Choose K, the device order, schedule, chunks, M, balance and re-materialization by the
    /// planner, on the simulated cluster or on real devices from measured layer times (auto:
    /// when none of --stages, --micro-batches, --replicas, --balance, --schedule, --chunks,
    /// --checkpoint, --checkpoint-layers is given, and not on real devices under --transport mpi; --stages is then
    /// the most devices it may use).
    #[arg(long, value_enum, default_value_t = PlanArg::Auto)]
    pub plan: PlanArg,
    /// Whether the shape flags of `--plan auto` were given (set from the command line by the
    /// examples; a caller that builds the flags otherwise gets no automatic plan).
    #[arg(skip = true)]
    pub shape_given: bool,
    /// Settings of the run besides the pipeline's (flag, value) that every rank of an MPI job
    /// must share (set by the examples; see `PipelineBuilder::agree_on`).
    #[arg(skip)]
    pub run_settings: Vec<(String, String)>,
    /// Data parallelism: R replicas of the K-stage pipeline (R x K devices), each on its share
    /// of every mini-batch, gradients averaged across replicas before each optimizer step
    /// (1..=64).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// What carries tensors between stages: channels (one process) or mpi (run under
    /// `mpirun -np K`, or R x K with --replicas; rank 0 prints and writes the files).
    #[arg(long, value_enum, default_value_t = TransportArg::Channels)]
    pub transport: TransportArg,
    /// The dtype layers that allow it compute in (matmul-like layers; norms and losses stay
    /// f32, weights and optimizer state stay f32). f16 adds dynamic loss scaling (the scale
    /// and the skipped steps are printed at the end).
    #[arg(long, value_parser = precision_values(), default_value = "f32")]
    pub precision: DType,
}

impl PipelineArgs {
    /// `--consolidate FOLDER FILE` / `--split FILE FOLDER`: converts and returns true (the program
    /// then ends without training); false when neither flag is given.
    pub fn convert_checkpoint(&self) -> AppResult<bool> {
        let p = self;
        let (flag, paths) = match (&p.consolidate, &p.split) {
            (Some(c), None) => ("consolidate", c),
            (None, Some(s)) => ("split", s),
            (None, None) => return Ok(false),
            (Some(_), Some(_)) => bail!("--consolidate and --split: give one of them"),
        };
        if p.transport == TransportArg::Mpi {
            bail!("--{flag}: run it in one process (without --transport mpi)");
        }
        let [from, to] = paths.as_slice() else {
            bail!("--{flag} takes two paths");
        };
        let done = if flag == "consolidate" {
            crate::pipeline::consolidate(from, to)
        } else {
            crate::pipeline::split(from, to, p.stages)
        };
        done.map_err(|e| AppError(format!("--{flag} {} {}: {e}", from.display(), to.display())))?;
        crate::say!("wrote {} from {}", to.display(), from.display());
        Ok(true)
    }

    /// The stage devices of the flags: `place`, or `place_rank` under `--transport mpi`.
    pub fn placement(&self) -> AppResult<Placement> {
        match self.transport {
            TransportArg::Mpi => place_rank(self.device, self.num_devices(), self.sim_spec()),
            TransportArg::Channels => place(self.device, self.num_devices(), self.sim_spec()),
        }
    }

    pub fn sim_spec(&self) -> SimSpec {
        SimSpec {
            gflops: self.sim_gflops,
            memory_gib: self.sim_memory_gib,
            link_gbs: self.sim_link_gbs,
        }
    }

    /// Checks the flags against their ranges, and against the model (`num_layers` layers,
    /// described by `what`) and the mini-batch (`batch` `items`, e.g. "sequences") through the
    /// library's own rules, naming the flags. Output paths are checked too, so that a bad
    /// `--save` is found before training rather than after.
    /// Virtual stages per device: `--chunks`, or the schedule's own count.
    pub fn chunks(&self) -> usize {
        self.chunks
            .unwrap_or_else(|| self.schedule.default_chunks())
    }

    /// Whether each rank builds only the layers of its own stages (from a factory of layer
    /// ranges): under MPI, except for `--balance time`, which runs every layer.
    pub fn builds_rank_local(&self) -> bool {
        self.transport == TransportArg::Mpi && !matches!(self.balance, BalanceArg::Time)
    }

    /// Replicas held by this process: R in one process, 1 under MPI (the others are ranks).
    pub fn local_replicas(&self) -> usize {
        match self.transport {
            TransportArg::Channels => self.replicas,
            TransportArg::Mpi => 1,
        }
    }

    /// The devices this process places: R x K in one process, K on each rank under MPI
    /// (which runs one of them).
    pub fn num_devices(&self) -> usize {
        match self.transport {
            TransportArg::Channels => self.replicas * self.stages,
            TransportArg::Mpi => self.stages,
        }
    }

    /// K x chunks: the pieces the model is cut into.
    pub fn pieces(&self) -> usize {
        self.stages * self.chunks()
    }

    pub fn validate(
        &self,
        num_layers: usize,
        what: &str,
        batch: usize,
        items: &str,
    ) -> AppResult<()> {
        check_range("stages", self.stages, 1, MAX_STAGES)?;
        check_range("replicas", self.replicas, 1, 64)?;
        if batch < self.replicas * self.micro_batches {
            return Err(AppError(format!(
                "--batch {batch} cannot be shared by --replicas {} with --micro-batches {} each: every micro-batch of every replica needs at least one of the {items}",
                self.replicas, self.micro_batches
            )));
        }
        if let Some(v) = self.chunks {
            check_range("chunks", v, 1, 64)?;
        }
        check_positive("sim-gflops", self.sim_gflops, 1e9)?;
        check_positive("sim-memory-gib", self.sim_memory_gib, 1048576.0)?;
        check_positive("sim-link-gbs", self.sim_link_gbs, 1e6)?;
        if let Some(s) = self.stop_at {
            check_range("stop-at", s, 1, u64::MAX)?;
        }
        match micro_batch_sizes(batch, self.micro_batches) {
            Ok(_) => {}
            Err(MicroBatchError::NoMicroBatches) => {
                return Err(AppError(format!(
                    "--micro-batches 0: {}",
                    MicroBatchError::NoMicroBatches
                )))
            }
            Err(MicroBatchError::TooFewSamples { .. }) => {
                return Err(AppError(format!(
                    "--batch {batch} cannot be split into --micro-batches {}: every micro-batch needs at least one of the {items}",
                    self.micro_batches
                )))
            }
        }
        let check = match &self.balance {
            BalanceArg::Explicit(b) => validate_balance_for(b, self.pieces(), num_layers),
            // The library's own rule for balancing by cost (what the builder runs).
            _ => balance_by_cost(&vec![1.0; num_layers], self.pieces()).map(|_| ()),
        };
        if let Err(e) = check {
            return Err(self.partition_error(&e, num_layers, what));
        }
        if let Some(p) = self.save.as_ref().filter(|p| p.is_dir()) {
            if !crate::files::is_folder_path(p) {
                return Err(AppError(format!(
                    "--save {}: a folder, not a file (end the path with / to write a sharded checkpoint into it)",
                    p.display()
                )));
            }
        }
        if let Some(p) = self
            .save
            .as_ref()
            .filter(|p| crate::files::is_folder_path(p))
        {
            // A sharded checkpoint: a folder that can be created and written in.
            crate::output::check_writable("save", &p.join(crate::pipeline::INDEX_FILE))?;
        }
        let one_file_save = self
            .save
            .as_ref()
            .filter(|p| !crate::files::is_folder_path(p));
        for (flag, path) in [
            ("save", &one_file_save.cloned()),
            ("trace", &self.trace),
            ("timeline", &self.timeline),
            ("metrics", &self.metrics),
        ] {
            if let Some(p) = path {
                crate::output::check_writable(flag, p)?;
            }
        }
        if let Some(p) = self.resume.as_ref().filter(|p| !p.is_dir()) {
            // A folder is a sharded checkpoint: the loader names what it lacks.
            crate::files::check_readable("resume", p)?;
        }
        Ok(())
    }

    /// A partition error of the library, said with the flags.
    fn partition_error(&self, e: &PartitionError, num_layers: usize, what: &str) -> AppError {
        match (e, &self.balance) {
            (PartitionError::StageCountMismatch { given, stages }, _) => AppError(format!(
                "--balance {} has {given} entries but --stages x chunks is {stages} ({} x {})",
                self.balance,
                self.stages,
                self.chunks()
            )),
            (_, BalanceArg::Explicit(_)) => AppError(format!(
                "--balance {} must give every stage at least one layer and sum to the {num_layers} layers of the model ({what}): {e}",
                self.balance
            )),
            (PartitionError::TooManyStages { .. }, _) => AppError(format!(
                "--stages {} x {} chunk(s) = {} pieces is more than the {num_layers} layers of the model ({what}): every piece needs at least one layer; use fewer stages or chunks, or more layers",
                self.stages,
                self.chunks(),
                self.pieces()
            )),
            _ => AppError(format!("--stages {}: {e}", self.stages)),
        }
    }
}

/// The model a pipeline is built over: its layers, or a factory of layer ranges from which the
/// pipeline builds only the stages this process holds (under `--transport mpi`, so that no
/// rank holds the whole model; see `Pipeline::builder_from`).
pub enum Model {
    Layers(Vec<Box<dyn Module>>),
    Factory(Arc<dyn ModelFactory>),
}

impl Model {
    /// The number of layers of the whole model.
    pub fn num_layers(&self) -> usize {
        match self {
            Model::Layers(l) => l.len(),
            Model::Factory(f) => f.num_layers(),
        }
    }

    /// The whole model's layers (a factory builds them all).
    pub fn into_layers(self) -> AppResult<Vec<Box<dyn Module>>> {
        match self {
            Model::Layers(l) => Ok(l),
            Model::Factory(f) => f
                .build_range(0..f.num_layers())
                .map_err(|e| AppError(format!("building the model: {e}"))),
        }
    }

    /// A pipeline builder over the model.
    fn builder(self) -> AppResult<crate::pipeline::PipelineBuilder> {
        match self {
            Model::Layers(l) => Ok(Pipeline::builder(l)),
            Model::Factory(f) => Pipeline::builder_from(f)
                .map_err(|e| AppError(format!("describing the model: {e}"))),
        }
    }
}

/// Builds the pipeline from the flags. `sample` is one micro-batch of inputs (for
/// `--balance time`), `input_shape` its shape (for `flops` and `memory`). `copies` are the
/// layers of replicas 1..R (`--replicas`; their values are replaced by replica 0's).
pub fn build_pipeline(
    model: Model,
    mut copies: Vec<Vec<Box<dyn Module>>>,
    args: &PipelineArgs,
    placement: &Placement,
    sample: &Tensor,
    optimizer: impl Fn() -> Box<dyn Optimizer> + 'static,
) -> AppResult<Pipeline> {
    let input_shape = sample.shape().to_vec();
    let num_layers = model.num_layers();
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
    let mut b = model
        .builder()?
        .balance(balance)
        .micro_batches(args.micro_batches)
        .checkpoint(args.checkpoint)
        .checkpoint_layers(args.checkpoint_layers.clone())
        .schedule(args.schedule)
        .chunks(args.chunks())
        .seed(args.seed)
        .precision(args.precision)
        .optimizer(optimizer);
    b = match &placement.sim {
        Some(c) => b.sim(c.clone()),
        None => b.devices(placement.devices.clone()),
    };
    for (flag, value) in &args.run_settings {
        b = b.agree_on(flag, value);
    }
    if args.transport == TransportArg::Mpi {
        b = b.transport(mpi_transport(args)?);
    } else if args.replicas > 1 {
        // A copy too few comes out as an empty model, which the builder names.
        b = b.replicas(args.replicas, move || copies.pop().unwrap_or_default());
    }
    b.build().map_err(|e| match &e {
        PipelineError::Partition(p) => args.partition_error(p, num_layers, "as built"),
        _ => AppError(format!("building the pipeline: {e}")),
    })
}

/// This process's place in the MPI job, which must have --replicas x --stages ranks; ranks
/// other than 0 go silent.
#[cfg(feature = "mpi")]
fn mpi_transport(args: &PipelineArgs) -> AppResult<crate::pipeline::Transport> {
    let comm =
        crate::pipeline::MpiComm::init().map_err(|e| AppError(format!("--transport mpi: {e}")))?;
    let want = args.replicas * args.stages;
    if comm.size() != want {
        return Err(AppError(format!(
            "--transport mpi: the job has {} ranks but --replicas {} x --stages {} needs {want} (mpirun -np {want})",
            comm.size(),
            args.replicas,
            args.stages
        )));
    }
    crate::output::set_root(comm.rank() == 0);
    Ok(crate::pipeline::Transport::Mpi(comm))
}

#[cfg(not(feature = "mpi"))]
fn mpi_transport(_: &PipelineArgs) -> AppResult<crate::pipeline::Transport> {
    Err(AppError(
        "--transport mpi needs the examples built with --features mpi (and Open MPI installed; see docs/mpi.md)".into(),
    ))
}

/// With `--replicas R > 1`, one line saying how the replicas share the work.
pub fn describe_replicas(args: &PipelineArgs) -> String {
    if args.replicas <= 1 {
        return String::new();
    }
    format!(
        "data parallelism: {} replicas of the {}-stage pipeline above (devices rK..(r+1)K), each on its share of every mini-batch; gradients averaged across replicas before each optimizer step\n",
        args.replicas, args.stages
    )
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

/// A command-line error of clap in one line naming the flag and, for a bad value, the accepted
/// ones (clap's own message takes three, with a hint), without the leading `error: `.
pub fn one_line(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let text = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) => Some(v.join(", ")),
        _ => None,
    };
    let flag = text(ContextKind::InvalidArg).map(|f| f.split(' ').next().unwrap_or("").to_string());
    match (e.kind(), flag, text(ContextKind::InvalidValue)) {
        (clap::error::ErrorKind::InvalidValue, Some(flag), Some(value)) => {
            match text(ContextKind::ValidValue) {
                Some(valid) => format!("{flag} {value:?}: not one of {valid}"),
                None => format!("{flag} {value:?}: invalid value"),
            }
        }
        (clap::error::ErrorKind::ValueValidation, Some(flag), Some(value)) => {
            let why = e.source().map(|s| s.to_string()).unwrap_or_default();
            format!("{flag} {value:?}: {why}")
        }
        _ => {
            // Clap's first line, which names the flag.
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            first.strip_prefix("error: ").unwrap_or(first).to_string()
        }
    }
}

/// `program`'s flags parsed from `args` (without the program name); a bad flag is an error of one
/// line ([`one_line`]).
pub fn parse_args<T, I, S>(program: &str, args: I) -> AppResult<T>
where
    T: clap::Parser,
    I: IntoIterator<Item = S>,
    S: Into<std::ffi::OsString> + Clone,
{
    let argv =
        std::iter::once(std::ffi::OsString::from(program)).chain(args.into_iter().map(Into::into));
    T::try_parse_from(argv).map_err(|e| AppError(one_line(&e)))
}

/// The flags of this process's command line as `T`, with the matches they came from (to ask
/// which flags were given); exits as [`command_line`] does on bad flags.
pub fn from_command_line<T: clap::Parser>() -> (T, clap::ArgMatches) {
    let matches = command_line(T::command());
    let args = T::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (args, matches)
}

/// The matches of this process's command line for `cmd`: `--help` and `--version` print as
/// clap prints them; any other problem is one line naming the flag, and exit status 2.
pub fn command_line(cmd: clap::Command) -> clap::ArgMatches {
    cmd.try_get_matches().unwrap_or_else(|e| {
        use clap::error::ErrorKind;
        if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
            || matches!(
                e.kind(),
                ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            )
        {
            e.exit()
        }
        eprintln!("error: {}", one_line(&e));
        std::process::exit(2)
    })
}
