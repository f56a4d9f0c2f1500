//! `--plan`: the examples' pipeline chosen by the planner (data-parallel replicas R, K, device
//! order, schedule, chunks, M, balance, re-materialization per stage) on the simulated cluster
//! or, from measured layer times, on real devices, printed with its alternatives, and after
//! training its prediction against what was measured.

use clap::parser::ValueSource;
use clap::ArgMatches;

use crate::args::{build_pipeline, Model, PipelineArgs, PlanArg};
use crate::autograd::optim::Optimizer;
use crate::autograd::Module;
use crate::error::{AppError, AppResult};
use crate::pipeline::plan::PlanOptions;
use crate::pipeline::{LossFn, Pipeline, PlanInputs, PlanReport, StepReport};
use crate::placement::Placement;
use crate::tensor::Tensor;

/// The flags that fix the pipeline's shape: given on the command line, `--plan auto` does not
/// plan.
const SHAPE_FLAGS: [&str; 8] = [
    "stages",
    "micro_batches",
    "balance",
    "schedule",
    "chunks",
    "checkpoint",
    "checkpoint_layers",
    "replicas",
];

/// Whether any shape flag was given on the command line (not left at its default).
pub fn shape_given(matches: &ArgMatches) -> bool {
    SHAPE_FLAGS
        .iter()
        .any(|id| matches.value_source(id) == Some(ValueSource::CommandLine))
}

/// Whether to plan: `--plan on`, or `auto` with no shape flag given, on the simulated cluster
/// or on real devices (from measured layer times) in one process. Ranks of an MPI job do not
/// plan real devices on their own: each would time the layers differently and choose its own
/// plan, which the ranks' agreement at build would refuse; they take the flags' shape.
pub fn wants_plan(
    plan: PlanArg,
    shape_given: bool,
    placement: &Placement,
    multi_process: bool,
) -> bool {
    match plan {
        PlanArg::On => true,
        PlanArg::Auto => !shape_given && (placement.sim.is_some() || !multi_process),
        PlanArg::Off => false,
    }
}

/// What `plan_pipeline` needs of a run.
pub struct PlanRun<'a> {
    /// A sample mini-batch (its first rows are profiled).
    pub inputs: &'a Tensor,
    pub targets: &'a Tensor,
    pub loss: &'a LossFn,
    pub batch: usize,
    /// The fewest samples a micro-batch may hold (batch norm needs a few).
    pub min_micro_batch: usize,
    pub seed: u64,
}

/// Makes the layers of one more replica (the same model; values are copied from replica 0).
pub type MakeCopy = Box<dyn FnMut() -> Vec<Box<dyn Module>>>;

/// The pipeline of the flags, or the planned one when [`wants_plan`] (with its plan).
/// `copies` are the replicas the flags ask for; `make_copy` makes those the plan asks for.
/// Planning builds a factory's whole model (the planner runs every layer).
#[allow(clippy::too_many_arguments)]
pub fn build_or_plan(
    model: Model,
    copies: Vec<Vec<Box<dyn Module>>>,
    make_copy: MakeCopy,
    args: &PipelineArgs,
    placement: &Placement,
    sample: &Tensor,
    run: &PlanRun<'_>,
    optimizer: impl Fn() -> Box<dyn Optimizer> + 'static,
) -> AppResult<(Pipeline, Option<PlanReport>)> {
    let multi_process = args.transport == crate::args::TransportArg::Mpi;
    let wanted = wants_plan(args.plan, args.shape_given, placement, multi_process);
    if wanted {
        if args.replicas > 1 {
            return Err(AppError(format!(
                "--plan on chooses the replicas itself (R x K within --stages devices), but \
                 --replicas {} was given: drop --replicas, or use --plan off",
                args.replicas
            )));
        }
        // The planner profiles every layer: it needs the whole model here.
        let layers = model.into_layers()?;
        let (pipe, report) =
            plan_pipeline(layers, make_copy, placement, run, args.precision, optimizer)?;
        Ok((pipe, Some(report)))
    } else {
        Ok((
            build_pipeline(model, copies, args, placement, sample, optimizer)?,
            None,
        ))
    }
}

/// Plans `layers` on the placement's simulated cluster (data-parallel replicas made by
/// `make_copy` included), or on its real devices from measured layer times; prints the plan
/// table, and builds it. The layers are profiled in `precision`, so the plan sees its half
/// activations and links.
pub fn plan_pipeline(
    layers: Vec<Box<dyn Module>>,
    make_copy: MakeCopy,
    placement: &Placement,
    run: &PlanRun<'_>,
    precision: crate::tensor::DType,
    optimizer: impl Fn() -> Box<dyn Optimizer> + 'static,
) -> AppResult<(Pipeline, PlanReport)> {
    let options = PlanOptions {
        micro_batches: Some(vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]),
        min_micro_batch: run.min_micro_batch,
        // The examples show pipelining: pure data parallelism (K = 1) may be faster for a model
        // this small, but it is not what they are for.
        min_stages: placement.devices.len().min(2),
        ..PlanOptions::default()
    };
    let inputs = PlanInputs {
        inputs: run.inputs,
        targets: run.targets,
        loss: run.loss,
        batch: run.batch,
        options,
    };
    let started = std::time::Instant::now();
    let builder = Pipeline::builder(layers)
        .precision(precision)
        .optimizer(optimizer);
    let planned = match &placement.sim {
        Some(cluster) => builder.plan_replicated(cluster, &inputs, make_copy),
        None => builder.plan_devices(&placement.devices, &inputs),
    };
    let (builder, report, _) = planned.map_err(|e| AppError(format!("--plan: {e}")))?;
    crate::say!(
        "planned in {:.2} s (profile and search; --plan off and the shape flags choose by hand):",
        started.elapsed().as_secs_f64()
    );
    crate::say_part!("{report}");
    let pipe = builder
        .seed(run.seed)
        .build()
        .map_err(|e| AppError(format!("building the planned pipeline: {e}")))?;
    Ok((pipe, report))
}

/// The plan's predicted step time and per-device peak memory beside the last step's simulated
/// ones.
pub fn print_predicted_vs_measured(plan: &PlanReport, last: &StepReport) {
    let p = &plan.best.prediction;
    let Some(sim) = &last.simulated else {
        crate::say!(
            "plan: predicted step {:.4e} s (from measured layer times), measured wall {:.4e} s ({:.2}x the prediction: threads, messages and checks the layer times leave out, and devices that share cores)",
            p.step_secs,
            last.wall_secs,
            last.wall_secs / p.step_secs
        );
        return;
    };
    crate::say!(
        "plan: predicted step {:.4e} s, simulated {:.4e} s ({:+.2}%); bubble predicted {:.1}%, simulated {:.1}%",
        p.step_secs,
        sim.makespan_secs,
        (p.step_secs / sim.makespan_secs - 1.0) * 100.0,
        p.bubble_fraction * 100.0,
        sim.bubble_fraction * 100.0
    );
    for (d, s) in last.stages.iter().enumerate() {
        crate::say!(
            "  device {d} ({}): peak {} bytes, predicted at most {}",
            s.device,
            s.memory.peak,
            p.step_peak_bytes.get(d).copied().unwrap_or(0)
        );
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;
    use crate::train_transformer::TransformerArgs;

    fn given(flags: &[&str]) -> bool {
        let argv = std::iter::once("train_transformer").chain(flags.iter().copied());
        shape_given(&TransformerArgs::command().get_matches_from(argv))
    }

    /// `--plan auto` plans the simulated cluster, and real devices in one process (from
    /// measured layer times), but not real devices of an MPI rank (each would time its own).
    #[test]
    fn auto_planning_takes_real_devices_in_one_process() {
        let sim = crate::placement::place(
            crate::placement::DeviceChoice::Sim,
            2,
            crate::placement::SimSpec {
                gflops: 100.0,
                memory_gib: 1.0,
                link_gbs: 10.0,
            },
        )
        .unwrap();
        let real = Placement {
            devices: vec![
                crate::tensor::Device::new_cpu("a"),
                crate::tensor::Device::new_cpu("b"),
            ],
            sim: None,
            description: String::new(),
        };
        for (placement, mpi, want) in [
            (&sim, false, true),
            (&sim, true, true),
            (&real, false, true),
            (&real, true, false),
        ] {
            let what = format!("sim {} mpi {mpi}", placement.sim.is_some());
            assert_eq!(
                wants_plan(PlanArg::Auto, false, placement, mpi),
                want,
                "{what}"
            );
            assert!(!wants_plan(PlanArg::Auto, true, placement, mpi), "{what}");
            assert!(wants_plan(PlanArg::On, true, placement, mpi), "{what}");
            assert!(!wants_plan(PlanArg::Off, false, placement, mpi), "{what}");
        }
    }

    #[test]
    fn any_shape_flag_on_the_command_line_turns_auto_planning_off() {
        assert!(!given(&[]));
        assert!(!given(&[
            "--steps", "3", "--device", "sim", "--plan", "auto"
        ]));
        for flag in [
            ["--stages", "2"],
            ["--micro-batches", "4"],
            ["--balance", "params"],
            ["--schedule", "1f1b"],
            ["--chunks", "2"],
            ["--checkpoint", "never"],
            ["--checkpoint-layers", "1,2"],
            ["--replicas", "2"],
        ] {
            assert!(given(&flag), "{flag:?}");
        }
    }
}
