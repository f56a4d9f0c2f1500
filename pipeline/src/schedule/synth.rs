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

use std::collections::VecDeque;

use super::validate::check_counts;
use super::{Action, ActionKind, CheckpointMode, Placement, Schedule, ScheduleError};

/// What one micro-batch costs on one virtual stage, in any unit of time (the same for all).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageCosts {
    pub forward: f64,
    /// The input part of the backward (I; "B" in the zero-bubble papers).
    pub input: f64,
    /// The weight part of the backward (W).
    pub weight: f64,
}

/// What a schedule is synthesized for.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// The device of each virtual stage, in model order (K = `memory_cap.len()` devices).
    pub placement: Vec<usize>,
    pub micro_batches: usize,
    /// One entry per virtual stage.
    pub stages: Vec<StageCosts>,
    /// The time a message between stages on two devices takes (activations forward, gradients
    /// back); a hand-over between stages of one device is free.
    pub transfer: f64,
    /// Per device, the most activations it may hold, in micro-batches of its whole share of
    /// the model (see the module docs); at least 1.
    pub memory_cap: Vec<usize>,
}

impl SynthSpec {
    /// K devices in `placement`, each micro-batch costing `device` per device and split evenly
    /// among a device's chunks (the costs of one stage per device, the same on every device).
    pub fn uniform(
        k: usize,
        placement: Placement,
        micro_batches: usize,
        device: StageCosts,
        transfer: f64,
        memory_cap: usize,
    ) -> SynthSpec {
        let placement = placement.devices(k);
        let v = placement.len() as f64 / k.max(1) as f64;
        let stage = StageCosts {
            forward: device.forward / v,
            input: device.input / v,
            weight: device.weight / v,
        };
        SynthSpec {
            stages: vec![stage; placement.len()],
            placement,
            micro_batches,
            transfer,
            memory_cap: vec![memory_cap; k],
        }
    }

    /// K, the number of devices.
    pub fn num_devices(&self) -> usize {
        self.memory_cap.len()
    }

    /// Chunks (stages) on each device.
    pub fn chunks(&self) -> Vec<usize> {
        let mut c = vec![0; self.num_devices()];
        for &d in &self.placement {
            if let Some(n) = c.get_mut(d) {
                *n += 1;
            }
        }
        c
    }

    /// Per device, the cap in (stage, micro-batch) pairs: the declared in-flight limit of the
    /// schedules it gives.
    pub fn cap_pairs(&self) -> Vec<usize> {
        self.chunks()
            .iter()
            .zip(&self.memory_cap)
            .map(|(v, cap)| v * cap)
            .collect()
    }

    /// Checks sizes, placement, costs and caps; the errors name what is wrong.
    pub fn check(&self) -> Result<(), SynthError> {
        let k = self.num_devices();
        check_counts(k, self.micro_batches)?;
        if self.placement.is_empty() {
            return Err(ScheduleError::NoStages.into());
        }
        if let Some((stage, &device)) = self.placement.iter().enumerate().find(|(_, &d)| d >= k) {
            return Err(ScheduleError::PlacementOutOfRange {
                stage,
                device,
                num_devices: k,
            }
            .into());
        }
        if let Some(device) = (0..k).find(|d| !self.placement.contains(d)) {
            return Err(ScheduleError::IdleDevice { device }.into());
        }
        if self.stages.len() != self.placement.len() {
            return Err(SynthError::CostCount {
                given: self.stages.len(),
                stages: self.placement.len(),
            });
        }
        let bad = |x: f64| !x.is_finite() || x < 0.0;
        for (stage, c) in self.stages.iter().enumerate() {
            for (what, value) in [
                ("forward", c.forward),
                ("input", c.input),
                ("weight", c.weight),
            ] {
                if bad(value) {
                    return Err(SynthError::InvalidCost { stage, what, value });
                }
            }
        }
        if bad(self.transfer) {
            return Err(SynthError::InvalidTransfer {
                value: self.transfer,
            });
        }
        if let Some((device, &cap)) = self.memory_cap.iter().enumerate().find(|(_, &c)| c < 1) {
            return Err(SynthError::CapBelowMinimum {
                device,
                cap,
                minimum: 1,
            });
        }
        Ok(())
    }
}

/// Why no schedule could be synthesized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("{given} stage costs were given for {stages} stages")]
    CostCount { given: usize, stages: usize },
    #[error("stage {stage}: its {what} cost is {value}; it must be finite and non-negative")]
    InvalidCost {
        stage: usize,
        what: &'static str,
        value: f64,
    },
    #[error("the transfer time is {value}; it must be finite and non-negative")]
    InvalidTransfer { value: f64 },
    #[error(
        "device {device}: a memory cap of {cap} micro-batches' activations is below the minimum \
         of {minimum} (one micro-batch through all of the device's stages)"
    )]
    CapBelowMinimum {
        device: usize,
        cap: usize,
        minimum: usize,
    },
    #[error("no policy to synthesize with was given")]
    NoPolicies,
    #[error("the simulator refused a synthesized schedule: {0}")]
    Simulation(String),
    #[error("the placer got stuck with policy {policy}: device {device} waits at {action}")]
    Stuck {
        policy: Policy,
        device: usize,
        action: Action,
    },
}

/// How deep each device's warm-up goes: how many (stage, micro-batch) pairs it may hold before
/// it admits no new micro-batch (the later chunks of admitted ones may always use the cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Warmup {
    /// Up to the cap on every device.
    Cap,
    /// 1F1B's staircase plus `extra`: v(K - d) + extra pairs on device d (capped), so that the
    /// first devices, which wait longest for their first gradient, warm up deepest.
    Staircase { extra: usize },
}

/// When weight parts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Weights {
    /// Right after their input part (a full backward that sends its gradient early).
    Eager,
    /// When nothing else can run (or memory is full): they fill what would be bubbles.
    Fill,
    /// As `Fill`, but not when the W would still be running when an input known to be on its
    /// way arrives: the device then waits for it (the critical path first).
    FillAhead,
}

/// One variant of the placer's choices (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Policy {
    pub warmup: Warmup,
    /// When a forward and an input part are both ready: the input part first (it frees memory
    /// and feeds the previous stage), or the forward.
    pub backward_first: bool,
    pub weights: Weights,
    /// Among ready forwards of several chunks: the deepest stage first (it is nearer the turn
    /// where its gradient starts), or the oldest micro-batch.
    pub deep_first: bool,
    /// Whether a new micro-batch is admitted only with room left for its later chunks on the
    /// device (which keeps the placer from deadlocking), or whenever one pair fits (as ZB-V does
    /// at the turn of its V; a policy that gets stuck is simply not a candidate).
    pub reserve: bool,
    /// Whether a forward that only memory holds back goes first: the weight part that frees the
    /// memory runs before any ready input part, so that the pipeline keeps its forwards flowing.
    pub free_first: bool,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.warmup {
            Warmup::Cap => f.write_str("warm-up to the cap")?,
            Warmup::Staircase { extra } => write!(f, "warm-up staircase+{extra}")?,
        }
        let first = if self.backward_first { "I" } else { "F" };
        let w = match self.weights {
            Weights::Eager => "eager",
            Weights::Fill => "fill",
            Weights::FillAhead => "fill-ahead",
        };
        let chunk = if self.deep_first { "deep" } else { "oldest" };
        write!(f, ", {first} first, W {w}, {chunk} chunk first")?;
        if !self.reserve {
            f.write_str(", no reserve")?;
        }
        if self.free_first {
            f.write_str(", free for F first")?;
        }
        Ok(())
    }
}

/// The policies worth trying: every combination of the warm-ups (to the cap, and 1F1B's
/// staircase), the two orders, weight parts filling or eager, and where devices hold several
/// stages the two chunk orders and admission with or without the reserve; each with and without
/// freeing memory for a forward first. (Deeper staircases and `FillAhead` never won on issue
/// 33's grid and are left to callers of [`place`].)
pub fn policies(chunked: bool) -> Vec<Policy> {
    let warmups = [Warmup::Cap, Warmup::Staircase { extra: 0 }];
    let deep: &[bool] = if chunked { &[true, false] } else { &[false] };
    let reserve: &[bool] = if chunked { &[true, false] } else { &[true] };
    let mut out = Vec::new();
    for &warmup in &warmups {
        for backward_first in [true, false] {
            for weights in [Weights::Fill, Weights::Eager] {
                for &deep_first in deep {
                    for &reserve in reserve {
                        for free_first in [false, true] {
                            out.push(Policy {
                                warmup,
                                backward_first,
                                weights,
                                deep_first,
                                reserve,
                                free_first,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// The few policies that win most often on issue 33's grid (warm-up to the cap, weight parts
/// filling, with the reserve), for searches that synthesize many schedules (the planner): 4 on
/// one stage per device, 8 with chunks.
pub fn quick_policies(chunked: bool) -> Vec<Policy> {
    let deep: &[bool] = if chunked { &[true, false] } else { &[false] };
    let mut out = Vec::new();
    for backward_first in [true, false] {
        for free_first in [false, true] {
            for &deep_first in deep {
                out.push(Policy {
                    warmup: Warmup::Cap,
                    backward_first,
                    weights: Weights::Fill,
                    deep_first,
                    reserve: true,
                    free_first,
                });
            }
        }
    }
    out
}

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
    Placer::new(spec, policy).run()
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

const NOT_YET: f64 = f64::INFINITY;

/// What a free device does next.
enum Choice {
    Run(Action),
    /// Nothing can run before this time (an input known to be on its way).
    Wait(f64),
    /// Nothing can run until another device places something.
    Blocked,
}

/// The placer's state: the simulated clock of each device and what is done when.
struct Placer<'a> {
    spec: &'a SynthSpec,
    policy: Policy,
    m: usize,
    last: usize,
    /// Each device's stages in model order.
    stages_of: Vec<Vec<usize>>,
    cap: Vec<usize>,
    /// The pairs a device may hold when it admits a new micro-batch.
    admit: Vec<usize>,
    clock: Vec<f64>,
    /// End times by `stage * M + micro_batch` (`NOT_YET` until placed).
    done_f: Vec<f64>,
    done_i: Vec<f64>,
    /// Per stage, the next micro-batch of its forward and of its input part (each stage takes
    /// micro-batches in order, which keeps the admission rule deadlock-free).
    next_f: Vec<usize>,
    next_i: Vec<usize>,
    pending_w: Vec<VecDeque<Action>>,
    held: Vec<usize>,
    left: Vec<usize>,
    lists: Vec<Vec<Action>>,
}

impl<'a> Placer<'a> {
    fn new(spec: &'a SynthSpec, policy: Policy) -> Placer<'a> {
        let k = spec.num_devices();
        let s_total = spec.placement.len();
        let m = spec.micro_batches;
        let mut stages_of = vec![Vec::new(); k];
        for (s, &d) in spec.placement.iter().enumerate() {
            stages_of[d].push(s);
        }
        let cap = spec.cap_pairs();
        let admit = (0..k)
            .map(|d| {
                let v = stages_of[d].len();
                match policy.warmup {
                    Warmup::Cap => cap[d],
                    Warmup::Staircase { extra } => (v * (k - d) + extra).clamp(v, cap[d]),
                }
            })
            .collect();
        Placer {
            spec,
            policy,
            m,
            last: s_total - 1,
            cap,
            admit,
            clock: vec![0.0; k],
            done_f: vec![NOT_YET; s_total * m],
            done_i: vec![NOT_YET; s_total * m],
            next_f: vec![0; s_total],
            next_i: vec![0; s_total],
            pending_w: vec![VecDeque::new(); k],
            held: vec![0; k],
            left: stages_of.iter().map(|s| 3 * m * s.len()).collect(),
            lists: stages_of
                .iter()
                .map(|s| Vec::with_capacity(3 * m * s.len()))
                .collect(),
            stages_of,
        }
    }

    /// When the input of F(s, mb) is (or will be) on its device; `NOT_YET` if unknown.
    fn input_at(&self, s: usize, mb: usize) -> f64 {
        if s == 0 {
            return 0.0;
        }
        self.arrival(self.done_f[(s - 1) * self.m + mb], s - 1, s)
    }

    /// When I(s, mb) can start as far as its data goes: its forward done and the gradient of
    /// its output arrived.
    fn grad_at(&self, s: usize, mb: usize) -> f64 {
        let own = self.done_f[s * self.m + mb];
        if s == self.last {
            return own;
        }
        own.max(self.arrival(self.done_i[(s + 1) * self.m + mb], s + 1, s))
    }

    fn arrival(&self, sent: f64, from: usize, to: usize) -> f64 {
        if self.spec.placement[from] == self.spec.placement[to] {
            sent
        } else {
            sent + self.spec.transfer
        }
    }

    fn cost(&self, a: Action) -> f64 {
        let c = &self.spec.stages[a.stage];
        match a.kind {
            ActionKind::Forward => c.forward,
            ActionKind::BackwardInput => c.input,
            _ => c.weight,
        }
    }

    /// Whether device `d` may run a forward of stage `s` now as far as memory goes: a new
    /// micro-batch (the device's first stage) only within the warm-up bound and leaving room
    /// for its later chunks; a later chunk within the cap.
    fn memory_allows(&self, d: usize, s: usize) -> bool {
        let v = self.stages_of[d].len();
        if s == self.stages_of[d][0] {
            let room = if self.policy.reserve { v } else { 1 };
            self.held[d] + room <= self.admit[d]
        } else {
            self.held[d] < self.cap[d]
        }
    }

    fn choose(&self, d: usize, now: f64) -> Choice {
        let m = self.m;
        let p = self.policy;
        if p.weights == Weights::Eager {
            if let Some(&w) = self.pending_w[d].front() {
                return Choice::Run(w);
            }
        }
        // The ready input part of the oldest micro-batch (the deepest stage on a tie).
        let mut ready_i: Option<Action> = None;
        let mut ready_f: Option<Action> = None;
        let mut memory_blocked = false;
        let mut soonest = NOT_YET;
        for &s in &self.stages_of[d] {
            let mb = self.next_i[s];
            if mb < m {
                let at = self.grad_at(s, mb);
                if at <= now {
                    let better = ready_i.is_none_or(|b| {
                        (mb, usize::MAX - s) < (b.micro_batch, usize::MAX - b.stage)
                    });
                    if better {
                        ready_i = Some(Action::new(ActionKind::BackwardInput, s, mb));
                    }
                } else {
                    soonest = soonest.min(at);
                }
            }
            let mb = self.next_f[s];
            if mb < m {
                let at = self.input_at(s, mb);
                // Memory first: a forward it blocks needs a weight part of this device first,
                // whenever its input comes, so it is not worth waiting for.
                if !self.memory_allows(d, s) {
                    memory_blocked = true;
                } else if at > now {
                    soonest = soonest.min(at);
                } else {
                    let better = ready_f.is_none_or(|b| {
                        if p.deep_first {
                            s > b.stage
                        } else {
                            (mb, s) < (b.micro_batch, b.stage)
                        }
                    });
                    if better {
                        ready_f = Some(Action::new(ActionKind::Forward, s, mb));
                    }
                }
            }
        }
        if p.free_first && memory_blocked {
            if let Some(&w) = self.pending_w[d].front() {
                return Choice::Run(w);
            }
        }
        let pick = if p.backward_first {
            ready_i.or(ready_f)
        } else {
            ready_f.or(ready_i)
        };
        if let Some(a) = pick {
            return Choice::Run(a);
        }
        if let Some(&w) = self.pending_w[d].front() {
            let fits = now + self.cost(w) <= soonest;
            if memory_blocked || p.weights != Weights::FillAhead || fits {
                return Choice::Run(w);
            }
        }
        if soonest < NOT_YET {
            Choice::Wait(soonest)
        } else {
            Choice::Blocked
        }
    }

    fn put(&mut self, d: usize, a: Action, now: f64) {
        let end = now + self.cost(a);
        let at = a.stage * self.m + a.micro_batch;
        match a.kind {
            ActionKind::Forward => {
                self.done_f[at] = end;
                self.next_f[a.stage] += 1;
                self.held[d] += 1;
            }
            ActionKind::BackwardInput => {
                self.done_i[at] = end;
                self.next_i[a.stage] += 1;
                self.pending_w[d].push_back(Action::new(
                    ActionKind::BackwardWeight,
                    a.stage,
                    a.micro_batch,
                ));
            }
            _ => {
                self.pending_w[d].pop_front();
                self.held[d] -= 1;
            }
        }
        self.lists[d].push(a);
        self.left[d] -= 1;
        self.clock[d] = end;
    }

    /// Advances simulated time event by event: at each time, every device that is free
    /// decides (in device order, again until nobody places anything, since a placement can
    /// make work ready elsewhere); then time moves to the next end of an action or the next
    /// arrival a waiting device knows of. A device that waits is asked again at every event,
    /// so it never misses work that became ready meanwhile, and every action starts as early as
    /// its device and its inputs allow, as in the simulator.
    fn run(mut self) -> Result<Placed, SynthError> {
        let k = self.clock.len();
        let mut now = 0.0;
        loop {
            let mut next = NOT_YET;
            let mut placed = true;
            while placed {
                placed = false;
                next = NOT_YET;
                for d in 0..k {
                    if self.left[d] == 0 {
                        continue;
                    }
                    if self.clock[d] <= now {
                        match self.choose(d, now) {
                            Choice::Run(a) => {
                                self.put(d, a, now);
                                placed = true;
                            }
                            Choice::Wait(t) => next = next.min(t),
                            Choice::Blocked => continue,
                        }
                    }
                    if self.clock[d] > now {
                        next = next.min(self.clock[d]);
                    }
                }
            }
            if self.left.iter().all(|&l| l == 0) {
                break;
            }
            if next == NOT_YET {
                let d = (0..k).find(|&d| self.left[d] > 0).unwrap_or(0);
                let stage = self.stages_of[d][0];
                return Err(SynthError::Stuck {
                    policy: self.policy,
                    device: d,
                    action: Action::new(
                        ActionKind::Forward,
                        stage,
                        self.next_f[stage].min(self.m - 1),
                    ),
                });
            }
            now = next;
        }
        let predicted = self.clock.iter().copied().fold(0.0, f64::max);
        Ok(Placed {
            compute: self.lists,
            predicted,
        })
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
