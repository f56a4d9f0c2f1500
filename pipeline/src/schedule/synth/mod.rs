//! The schedule synthesizer's placer: a greedy list scheduler that builds one device's action
//! list after another's, in simulated time, from the costs of each stage's forward (F), input
//! part (I, the zero-bubble papers' "B") and weight part (W) of the backward, the time a message
//! between two devices takes, and a memory cap per device. It is the heuristic half of the
//! zero-bubble paper's automatic scheduler (Qi et al., ICLR'24, §3): each device, whenever it
//! is free, runs the most useful action whose inputs have arrived; which is most useful is a
//! [`Policy`] (how deep the warm-up goes, whether input parts or forwards come first, when the
//! weight parts run, which chunk goes first), and the search over policies, with every candidate
//! replayed by the simulator, is `sim::synth`. This module only places (it is pure data, like
//! the rest of `schedule/`): its own clock follows the simulator's rules for links that only
//! delay messages, so its predicted step is the simulated one there.
//!
//! Memory is counted as [`Schedule::max_in_flight`] counts it, a (stage, micro-batch) pair from
//! its forward to the end of its weight part, but in units of a device's whole share of the
//! model: a pair of a device holding v stages (chunks) counts 1/v, so that a cap means the same
//! activation memory whatever the placement (ZB-V's 2K chunk pairs are 1F1B's K).

mod placer;
mod policy;
mod spec;

pub use policy::{policies, quick_policies, Policy, Warmup, Weights};
pub use spec::{StageCosts, SynthError, SynthSpec};

use super::validate::check_counts;
use super::{Action, ActionKind, CheckpointMode, Placement, Schedule, ScheduleError};

/// A placement: each device's compute actions in order, and the step the placer's clock
/// predicts (the simulator's, on links that only delay).
#[derive(Debug, Clone, PartialEq)]
pub struct Placed {
    pub compute: Vec<Vec<Action>>,
    pub predicted: f64,
}

impl Placed {
    /// The schedule: recomputes as `mode` asks (before each input part), transfers inserted,
    /// the cap declared as the in-flight limit, validated.
    pub fn schedule(
        &self,
        name: &str,
        spec: &SynthSpec,
        mode: CheckpointMode,
    ) -> Result<Schedule, ScheduleError> {
        super::generators::finish(
            name,
            spec.micro_batches,
            spec.placement.clone(),
            self.compute.clone(),
            mode,
            Some(spec.cap_pairs()),
        )
    }
}

/// Places every action of `spec` under `policy`.
pub fn place(spec: &SynthSpec, policy: Policy) -> Result<Placed, SynthError> {
    spec.check()?;
    placer::Placer::new(spec, policy).run()
}

/// The registry's synthesized schedule, for when no costs are known: equal costs (F = I = W
/// per device, split evenly among its chunks), free links, a cap of 1F1B's peak, min(K, M),
/// on one stage per device (`chunks` = 1) or two in a V (`chunks` = 2); the best policy by the
/// placer's own clock.
pub fn synthesized(
    k: usize,
    chunks: usize,
    m: usize,
    mode: CheckpointMode,
) -> Result<Schedule, ScheduleError> {
    check_counts(k, m)?;
    let placement = if chunks == 2 {
        Placement::V
    } else {
        Placement::Looped { chunks: 1 }
    };
    let unit = StageCosts {
        forward: 1.0,
        input: 1.0,
        weight: 1.0,
    };
    let spec = SynthSpec::uniform(k, placement, m, unit, 0.0, k.min(m));
    let mut best: Option<Placed> = None;
    let mut last_error = None;
    for policy in policies(chunks > 1) {
        match place(&spec, policy) {
            Ok(p) if best.as_ref().is_none_or(|b| p.predicted < b.predicted) => best = Some(p),
            Ok(_) => {}
            Err(e) => last_error = Some(e),
        }
    }
    match (best, last_error) {
        (Some(p), _) => p.schedule("synth", &spec, mode),
        (None, Some(SynthError::Schedule(e))) => Err(e),
        // The policies with the reserve do not get stuck (a test holds it over many specs);
        // were they all to, this is what it would be.
        (None, Some(SynthError::Stuck { device, action, .. })) => Err(ScheduleError::Deadlock {
            stuck: vec![(device, action)],
        }),
        // The spec is made here from checked K and M, with valid costs and caps, and
        // `policies` is never empty.
        (None, e) => unreachable!("no policy placed a valid spec: {e:?}"),
    }
}

/// `schedule` (without recomputes) with a recompute before each backward or input part whose
/// micro-batch `mode` re-materializes, where the generators put it: before the receive of its
/// gradient when that comes right before, so that the recompute overlaps the wait.
pub fn with_recomputes(schedule: &Schedule, mode: CheckpointMode) -> Schedule {
    let m = schedule.num_micro_batches;
    let is_backward =
        |a: Action| matches!(a.kind, ActionKind::Backward | ActionKind::BackwardInput);
    let mut out = schedule.clone();
    for list in &mut out.devices {
        let mut with = Vec::with_capacity(list.len() + list.len() / 3);
        for (i, &a) in list.iter().enumerate() {
            let next = list.get(i + 1).filter(|b| {
                is_backward(**b) && (b.stage, b.micro_batch) == (a.stage, a.micro_batch)
            });
            let before_receive = a.kind == ActionKind::RecvGrad && next.is_some();
            let prev_is_receive = i > 0
                && list[i - 1].kind == ActionKind::RecvGrad
                && (list[i - 1].stage, list[i - 1].micro_batch) == (a.stage, a.micro_batch);
            let before_backward = is_backward(a) && !prev_is_receive;
            if (before_receive || before_backward) && mode.recomputes(a.micro_batch, m) {
                with.push(Action::new(ActionKind::Recompute, a.stage, a.micro_batch));
            }
            with.push(a);
        }
        *list = with;
    }
    out
}
