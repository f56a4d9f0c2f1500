//! Planning from the builder: profile the layers, search the fastest configuration (see
//! [`crate::plan`]) and set the builder to it.

use wgpipe_tensor::Device;

use crate::error::PipelineError;
use crate::plan::{
    plan, plan_on, profile_layers_timed, PlanError, PlanInputs, PlanReport, Profile, ProfileRun,
};
use crate::sim::timeline::{DeviceSpec, LinkSpec};
use crate::sim::SimCluster;
use crate::skips::SkipRoute;
use crate::train::builder::{Balance, LayerFactory, PipelineBuilder};

/// Measured seconds become FLOPs at this nominal rate when planning real devices.
const MEASURED_RATE: f64 = 1e12;

/// What a plan is for: the simulated cluster (FLOPs over its rates), or real devices (measured
/// times).
#[derive(Clone, Copy)]
enum Target<'a> {
    Sim(&'a SimCluster),
    Devices(&'a [Device]),
}

impl Target<'_> {
    fn devices(&self) -> &[Device] {
        match self {
            Target::Sim(c) => c.devices(),
            Target::Devices(d) => d,
        }
    }
}

impl PipelineBuilder {
    /// Profiles the layers on `plan.inputs`, searches the fastest configuration of one
    /// pipeline (no replicas) that fits `cluster`'s memories, and sets this builder to it: the
    /// chosen devices in the chosen order, the balance, M and the schedule (with each stage's
    /// re-materialization), and the layers checkpointed inside their stages. Call it after `.optimizer(..)`, so that the optimizer's state is
    /// planned for; a later `.sim`, `.balance`, `.micro_batches` or `.schedule` overrides the
    /// plan.
    pub fn plan(
        self,
        cluster: &SimCluster,
        plan_inputs: &PlanInputs<'_>,
    ) -> Result<(PipelineBuilder, PlanReport, Profile), PlanError> {
        self.plan_with(cluster, plan_inputs, None)
    }

    /// As [`PipelineBuilder::plan`], with data-parallel replicas in the search (up to the
    /// options' `max_replicas`): when the plan has R > 1, the builder is set to
    /// `.replicas(R, make_layers)` over the chosen R x K devices.
    pub fn plan_replicated(
        self,
        cluster: &SimCluster,
        plan_inputs: &PlanInputs<'_>,
        make_layers: impl FnMut() -> Vec<Box<dyn wgpipe_autograd::Module>> + 'static,
    ) -> Result<(PipelineBuilder, PlanReport, Profile), PlanError> {
        self.plan_with(cluster, plan_inputs, Some(Box::new(make_layers)))
    }

    /// Plans for real devices (the CPU backend's, or wgpu adapters), whose speed nobody
    /// gave: each layer's forward and backward are timed on `devices[0]`'s backend
    /// (`options.measure_reps` runs, median) and the search predicts with those times instead
    /// of FLOPs over a rate; memories are the devices' capacities (unlimited when unset),
    /// transfers cost nothing (one host or one adapter). The prediction assumes the devices
    /// run in parallel: K devices sharing one GPU or a few CPU cores do not, and the report's
    /// measured step shows by how much. Sets the builder to the chosen devices, balance, M
    /// and schedule (no replicas).
    pub fn plan_devices(
        self,
        devices: &[Device],
        plan_inputs: &PlanInputs<'_>,
    ) -> Result<(PipelineBuilder, PlanReport, Profile), PlanError> {
        self.plan_for(Target::Devices(devices), plan_inputs, None)
    }

    fn plan_with(
        self,
        cluster: &SimCluster,
        plan_inputs: &PlanInputs<'_>,
        make_layers: Option<LayerFactory>,
    ) -> Result<(PipelineBuilder, PlanReport, Profile), PlanError> {
        self.plan_for(Target::Sim(cluster), plan_inputs, make_layers)
    }

    fn plan_for(
        mut self,
        target: Target<'_>,
        plan_inputs: &PlanInputs<'_>,
        make_layers: Option<LayerFactory>,
    ) -> Result<(PipelineBuilder, PlanReport, Profile), PlanError> {
        if self.is_described() {
            return Err(PipelineError::Config(
                "the planner profiles the layers by running them, but a builder from a model \
                 factory holds descriptions: plan with Pipeline::builder over the built layers"
                    .into(),
            )
            .into());
        }
        if self.skip_route != SkipRoute::Direct {
            return Err(PipelineError::Config(
                "the planner models direct skips only (each skip sent straight from its \
                 producer's stage to its consumer's); plan with SkipRoute::Direct, not Relay"
                    .into(),
            )
            .into());
        }
        let backing = target.devices().first().cloned().ok_or_else(|| {
            PipelineError::Config("the cluster to plan for has no devices".into())
        })?;
        let mut options = plan_inputs.options.clone();
        let reps = match target {
            Target::Sim(_) => 0,
            Target::Devices(_) => options.measure_reps.max(1),
        };
        let profile = profile_layers_timed(
            &mut self.layers,
            plan_inputs.inputs,
            plan_inputs.targets,
            plan_inputs.loss,
            self.optimizer.as_deref(),
            &backing,
            ProfileRun {
                reps,
                compute: self.precision,
            },
        )?;
        if make_layers.is_none() {
            options.max_replicas = 1;
        }
        let report = match target {
            Target::Sim(cluster) => plan_on(
                &profile,
                cluster.specs(),
                cluster.topology(),
                plan_inputs.batch,
                &options,
            )?,
            Target::Devices(devices) => {
                let specs: Vec<DeviceSpec> = devices
                    .iter()
                    .map(|d| DeviceSpec {
                        flops_per_sec: MEASURED_RATE,
                        memory_bytes: d.memory().capacity().map_or(u64::MAX, |c| c as u64),
                    })
                    .collect();
                let timed = profile.with_measured_times(MEASURED_RATE)?;
                let mut r = plan(&timed, &specs, LinkSpec::FREE, plan_inputs.batch, &options)?;
                r.basis = format!(
                    "layer times measured on {}, median of {} runs; devices assumed to run in \
                     parallel, transfers free",
                    profile.timed_on, profile.timed_reps
                );
                r
            }
        };
        let best = &report.best;
        let placed = match target {
            Target::Sim(cluster) => self.sim(cluster.select(&best.candidate.order)),
            Target::Devices(devices) => self.devices(
                best.candidate
                    .order
                    .iter()
                    .map(|&d| devices[d].clone())
                    .collect(),
            ),
        };
        let mut builder = placed
            .balance(Balance::Explicit(best.candidate.balance.clone()))
            .micro_batches(best.candidate.micro_batches)
            .checkpoint_layers(best.candidate.checkpoint_layers.clone())
            .schedule(best.schedule.clone());
        if let (r @ 2.., Some(make_layers)) = (best.candidate.replicas, make_layers) {
            builder = builder.replicas(r, make_layers);
        }
        Ok((builder, report, profile))
    }
}
