//! Multi-process runs: the `mpi` feature's worker faults and jobs.

use super::*;

/// A fault the MPI worker injects on one rank at one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFault {
    /// The Fault layer (last in the model) returns an error at micro-batch 1.
    Error,
    /// The Fault layer panics at micro-batch 1.
    Panic,
    /// The rank's device has room for nothing more than what lives before the step (plus 192
    /// bytes) during the step: an out-of-memory error.
    OutOfMemory,
    /// The Fault layer ends the process at micro-batch 1 (`std::process::abort`).
    Abort,
    /// The rank's device has no room left during `optimizer_step` (after a good step): the
    /// optimizer fails there.
    Optimizer,
    /// The Fault layer stops the whole process at micro-batch 1 (SIGSTOP): a rank that hangs.
    Stop,
    /// The Fault layer's output overflows at micro-batch 1; the job runs with loss scaling
    /// (see [`MpiJob::cfg`]), so the step is skipped on every rank.
    Overflow,
    /// Every rank saves a sharded checkpoint at that step (besides the job's `save_at`); this
    /// one stops (SIGSTOP) in the middle of it, when the save reads the Fault layer's
    /// parameters.
    StopInSave,
    /// Every rank evaluates the mini-batch before training that step; this one stops (SIGSTOP)
    /// in the forward of its micro-batch 1 of the evaluation.
    StopInEvaluation,
}

impl MpiFault {
    pub const ALL: [MpiFault; 9] = [
        MpiFault::Error,
        MpiFault::Panic,
        MpiFault::OutOfMemory,
        MpiFault::Abort,
        MpiFault::Optimizer,
        MpiFault::Stop,
        MpiFault::Overflow,
        MpiFault::StopInSave,
        MpiFault::StopInEvaluation,
    ];
}

/// One run of the MPI worker: what it trains and which fault it injects. The tests build the
/// in-process reference from the same description.
#[derive(Debug, Clone, PartialEq)]
pub struct MpiJob {
    pub schedule: ScheduleKind,
    pub k: usize,
    pub m: usize,
    pub steps: usize,
    /// R data-parallel replicas (the job has R x K ranks).
    pub replicas: usize,
    /// `(rank, step, fault)`: what goes wrong on that rank at that step.
    pub fault: Option<(usize, usize, MpiFault)>,
    /// After this many steps, gather the stages and save a checkpoint (`ckpt.safetensors` in
    /// the output folder, written by rank 0).
    pub save_at: Option<usize>,
    /// Save at `save_at` as a sharded checkpoint instead (the folder `ckpt` in the output
    /// folder, each rank writing its own stages, no gathering).
    pub sharded: bool,
    /// Load this checkpoint on every rank before training.
    pub resume: Option<std::path::PathBuf>,
}

impl MpiJob {
    pub fn new(schedule: ScheduleKind, k: usize) -> Self {
        MpiJob {
            schedule,
            k,
            m: 4,
            steps: 3,
            replicas: 1,
            fault: None,
            save_at: None,
            sharded: false,
            resume: None,
        }
    }

    /// The worker's command-line arguments.
    pub fn args(&self) -> Vec<String> {
        let mut v = vec![
            format!("{:?}", self.schedule),
            self.k.to_string(),
            self.m.to_string(),
            self.steps.to_string(),
            self.replicas.to_string(),
            // `2s`: a sharded save after 2 steps.
            format!(
                "{}{}",
                self.save_at.unwrap_or(0),
                if self.sharded { "s" } else { "" }
            ),
            self.resume
                .as_ref()
                .map_or("-".into(), |p| p.display().to_string()),
        ];
        if let Some((rank, step, fault)) = self.fault {
            v.extend([rank.to_string(), step.to_string(), format!("{fault:?}")]);
        }
        v
    }

    /// Parses [`MpiJob::args`].
    pub fn from_args(args: &[String]) -> Option<MpiJob> {
        let name = args.first()?;
        let schedule = ScheduleKind::ALL
            .into_iter()
            .find(|s| format!("{s:?}") == *name)?;
        let num = |i: usize| args.get(i)?.parse::<usize>().ok();
        let fault = match args.len() {
            7 => None,
            10 => Some((
                num(7)?,
                num(8)?,
                MpiFault::ALL
                    .into_iter()
                    .find(|f| format!("{f:?}") == args[9])?,
            )),
            _ => return None,
        };
        let (save_at, sharded) = match args.get(5)?.strip_suffix('s') {
            Some(n) => (n.parse::<usize>().ok(), true),
            None => (num(5), false),
        };
        let save_at = save_at.filter(|&s| s > 0);
        let resume = (args[6] != "-").then(|| args[6].clone().into());
        Some(MpiJob {
            schedule,
            k: num(1)?,
            m: num(2)?,
            steps: num(3)?,
            replicas: num(4)?,
            fault,
            save_at,
            sharded,
            resume,
        })
    }

    /// The model (an MLP, then a Fault layer that can be armed) and the state of its Fault.
    pub fn model() -> (Vec<Box<dyn Module>>, Arc<Mutex<FaultState>>) {
        let mut layers = mlp(6, 8, 3, 11);
        let (fault, state) = Fault::new();
        layers.push(Box::new(fault));
        (layers, state)
    }

    /// The mini-batch of every step.
    pub fn data() -> (Tensor, Tensor) {
        (normal_data(&[12, 6], 1), normal_data(&[12, 3], 2))
    }

    pub fn cfg(&self) -> PipeCfg {
        let overflow = matches!(self.fault, Some((_, _, MpiFault::Overflow)));
        PipeCfg {
            // f32 with a power-of-two scale: exact, so the ranks still match one process bit
            // for bit; growth after 2 good steps so that both moves of the scale show.
            loss_scaling: overflow.then_some(Some(LossScaling {
                init_scale: 1024.0,
                growth_interval: 2,
                ..LossScaling::default()
            })),
            ..PipeCfg::new(self.k, self.m, CheckpointMode::ExceptLast, self.schedule)
        }
    }
}
