//! The greedy list scheduler itself: simulated time, event by event, and at each free device
//! the choice its [`Policy`] makes.

use std::collections::VecDeque;

use super::super::{Action, ActionKind};
use super::{Placed, Policy, SynthError, SynthSpec, Warmup, Weights};

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
pub(super) struct Placer<'a> {
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
    pub(super) fn new(spec: &'a SynthSpec, policy: Policy) -> Placer<'a> {
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
    pub(super) fn run(mut self) -> Result<Placed, SynthError> {
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
