//! The schedule synthesizer's search: every policy of the placer (`schedule::synth`) and every
//! generated schedule that fits the memory cap on the same placement, each replayed by the
//! simulator with the given costs; the fastest is the synthesized schedule. The generators are
//! candidates so that the result is never slower than the best of them; where the placer wins,
//! [`Synthesis::origin`] says so.

pub mod grid;
#[cfg(test)]
mod tests;

use std::collections::HashSet;

use crate::schedule::synth::{place, policies, Policy};
use crate::schedule::{
    Action, ActionKind, CheckpointMode, Placement, Schedule, ScheduleKind, StageCosts, SynthError,
    SynthSpec,
};
use crate::sim::timeline::{simulate_valid, ActionCost, DeviceSpec, LinkSpec, TimelineError};
use crate::sim::Topology;

/// Where the synthesized schedule came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The placer under this policy.
    Placer(Policy),
    /// A generator's schedule was the fastest that fits (renamed, its limit the cap).
    Generator(ScheduleKind),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Placer(p) => write!(f, "placer ({p})"),
            Origin::Generator(kind) => write!(f, "generator {kind}"),
        }
    }
}

/// The synthesized schedule and what the search found.
#[derive(Debug, Clone)]
pub struct Synthesis {
    /// Named "synth", its in-flight limit the cap, no recomputes.
    pub schedule: Schedule,
    /// Its simulated step.
    pub step: f64,
    pub origin: Origin,
    /// The fastest placer candidate's simulated step (the greedy alone, generators aside).
    pub placer_step: f64,
    /// Distinct candidates simulated.
    pub candidates: usize,
}

/// What each action of a schedule on `spec`'s placement costs: forward, input and weight parts
/// as given, a full backward both parts, a recompute a forward; as seconds on a device of one
/// FLOP per second (messages are the link's latency).
fn action_cost(spec: &SynthSpec, a: Action) -> ActionCost {
    let c = &spec.stages[a.stage];
    let flops = match a.kind {
        ActionKind::Forward | ActionKind::Recompute => c.forward,
        ActionKind::BackwardInput => c.input,
        ActionKind::BackwardWeight => c.weight,
        ActionKind::Backward => c.input + c.weight,
        _ => 0.0,
    };
    ActionCost { flops, bytes: 0 }
}

/// The simulated step of `schedule` (valid, on `spec`'s placement) with `spec`'s costs: each
/// device one FLOP per second, every link a delay of `spec.transfer`.
pub fn simulate_spec(schedule: &Schedule, spec: &SynthSpec) -> Result<f64, TimelineError> {
    let devices = vec![
        DeviceSpec {
            flops_per_sec: 1.0,
            memory_bytes: u64::MAX,
        };
        schedule.num_devices()
    ];
    let link = LinkSpec {
        bandwidth_bytes_per_sec: f64::INFINITY,
        latency_sec: spec.transfer,
    };
    let t = simulate_valid(schedule, &devices, &Topology::flat(link), false, |_, a| {
        action_cost(spec, a)
    })?;
    Ok(t.makespan)
}

/// Whether `schedule` holds at most `spec`'s cap on every device (pairs, as its in-flight
/// limit counts them).
pub fn fits_cap(schedule: &Schedule, spec: &SynthSpec) -> bool {
    schedule
        .max_in_flight()
        .iter()
        .zip(spec.cap_pairs())
        .all(|(&held, cap)| held <= cap)
}

/// The synthesized schedule for `spec` (see the module docs), trying every policy of
/// [`policies`].
pub fn synthesize(spec: &SynthSpec) -> Result<Synthesis, SynthError> {
    let chunked = spec.chunks().iter().any(|&v| v > 1);
    synthesize_with(spec, &policies(chunked))
}

/// [`synthesize`] trying only `policies` (at least one) with the placer.
pub fn synthesize_with(spec: &SynthSpec, policies: &[Policy]) -> Result<Synthesis, SynthError> {
    spec.check()?;
    let mut seen: HashSet<Vec<Vec<Action>>> = HashSet::new();
    let mut best: Option<Synthesis> = None;
    let mut last_error = None;
    for &policy in policies {
        let placed = match place(spec, policy) {
            Ok(p) => p,
            Err(e) => {
                last_error = Some(e);
                continue;
            }
        };
        if !seen.insert(placed.compute.clone()) {
            continue;
        }
        let schedule = placed.schedule("synth", spec, CheckpointMode::Never)?;
        let step = simulate_spec(&schedule, spec).map_err(simulation_failed)?;
        if best.as_ref().is_none_or(|b| step < b.step) {
            best = Some(Synthesis {
                schedule,
                step,
                origin: Origin::Placer(policy),
                placer_step: step,
                candidates: 0,
            });
        }
    }
    let Some(mut best) = best else {
        return Err(last_error.unwrap_or(SynthError::NoPolicies));
    };
    let mut candidates = seen.len();
    for (kind, schedule) in generated_on(spec) {
        candidates += 1;
        let step = simulate_spec(&schedule, spec).map_err(simulation_failed)?;
        if step < best.step {
            best.step = step;
            best.origin = Origin::Generator(kind);
            best.schedule = Schedule {
                name: "synth".into(),
                in_flight_limit: Some(spec.cap_pairs()),
                ..schedule
            };
        }
    }
    best.candidates = candidates;
    Ok(best)
}

/// The generators' schedules (default chunks, no recomputes) that have `spec`'s placement and
/// fit its cap.
fn generated_on(spec: &SynthSpec) -> Vec<(ScheduleKind, Schedule)> {
    let k = spec.num_devices();
    ScheduleKind::ALL
        .into_iter()
        .filter(|&kind| kind != ScheduleKind::Synthesized)
        .filter_map(|kind| {
            let s = kind
                .generate(
                    k,
                    kind.default_chunks(),
                    spec.micro_batches,
                    CheckpointMode::Never,
                )
                .ok()?;
            (s.placement == spec.placement && fits_cap(&s, spec)).then_some((kind, s))
        })
        .collect()
}

/// The simulator refused a schedule the placer made (a bug: the spec was checked).
fn simulation_failed(e: TimelineError) -> SynthError {
    match e {
        TimelineError::Schedule(e) => SynthError::Schedule(e),
        other => SynthError::Simulation(other.to_string()),
    }
}

/// The synthesized schedule for K devices with the same costs `device` per micro-batch (split
/// evenly among a device's chunks), messages taking `transfer`, and `memory_cap` on every
/// device: the faster of the one-stage-per-device placement and (K >= 2) the V.
pub fn synthesize_uniform(
    k: usize,
    m: usize,
    device: StageCosts,
    transfer: f64,
    memory_cap: usize,
) -> Result<(Synthesis, SynthSpec), SynthError> {
    let mut placements = vec![Placement::Looped { chunks: 1 }];
    if k >= 2 {
        placements.push(Placement::V);
    }
    let mut best: Option<(Synthesis, SynthSpec)> = None;
    let (mut placer_step, mut candidates) = (f64::INFINITY, 0);
    for placement in placements {
        let spec = SynthSpec::uniform(k, placement, m, device, transfer, memory_cap);
        let s = synthesize(&spec)?;
        placer_step = placer_step.min(s.placer_step);
        candidates += s.candidates;
        if best.as_ref().is_none_or(|(b, _)| s.step < b.step) {
            best = Some((s, spec));
        }
    }
    let (mut s, spec) = best.expect("at least one placement");
    s.placer_step = placer_step;
    s.candidates = candidates;
    Ok((s, spec))
}
