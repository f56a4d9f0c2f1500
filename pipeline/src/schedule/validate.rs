//! Checking a schedule before it runs, and driving it as K in-order programs joined by channels
//! (the deadlock check, the clock grid and the simulated timeline all use the same driver, so
//! they agree on what can run when).

use super::{Action, ActionKind, Link, Schedule};
use crate::fast_hash::FastMap;

/// Why a schedule was rejected. Every variant names the device and action concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error(
        "the {schedule} schedule places {allowed} chunk(s) per device; {asked} were asked for"
    )]
    ChunkCount {
        schedule: &'static str,
        allowed: &'static str,
        asked: usize,
    },
    #[error("no schedule is called '{asked}' (the schedules: {known})")]
    UnknownKind { asked: String, known: String },
    #[error("no re-materialization mode is called '{asked}' (always, except-last, never)")]
    UnknownCheckpointMode { asked: String },
    #[error("a schedule needs at least one device (K = 0)")]
    NoDevices,
    #[error("a schedule needs at least one micro-batch (M = 0)")]
    NoMicroBatches,
    #[error("a schedule needs at least one stage (empty placement)")]
    NoStages,
    #[error(
        "stage {stage} is placed on device {device}, but there are only {num_devices} devices"
    )]
    PlacementOutOfRange {
        stage: usize,
        device: usize,
        num_devices: usize,
    },
    #[error("device {device} holds no stage: every device needs at least one")]
    IdleDevice { device: usize },
    #[error(
        "device {device}: {action} names a stage or micro-batch outside {num_stages} stages x \
         {num_micro_batches} micro-batches"
    )]
    OutOfRange {
        device: usize,
        action: Action,
        num_stages: usize,
        num_micro_batches: usize,
    },
    #[error("device {device}: {action} belongs to stage {}, which is placed on device {placed_on}", action.stage)]
    WrongDevice {
        device: usize,
        action: Action,
        placed_on: usize,
    },
    #[error("device {device}: {action} has no peer (stage {} is at the end of the model)", action.stage)]
    NoPeer { device: usize, action: Action },
    #[error("device {device}: {action} occurs {found} times, expected {expected}")]
    ActionCount {
        device: usize,
        action: Action,
        found: usize,
        expected: usize,
    },
    #[error(
        "device {device}: stage {stage} micro-batch {micro_batch} has both a full backward (B) \
         and a split one (I/W); use one or the other"
    )]
    MixedBackward {
        device: usize,
        stage: usize,
        micro_batch: usize,
    },
    #[error("device {device}: {earlier} must come before {later}")]
    Order {
        device: usize,
        earlier: Action,
        later: Action,
    },
    #[error(
        "device {device} holds up to {found} micro-batches in flight, above the declared limit \
         of {limit}"
    )]
    InFlight {
        device: usize,
        found: usize,
        limit: usize,
    },
    #[error("in_flight_limit has {found} entries for {devices} devices")]
    LimitCount { found: usize, devices: usize },
    #[error("schedule deadlocks, no device can progress: {}", stuck_list(stuck))]
    Deadlock { stuck: Vec<(usize, Action)> },
    #[error("{schedule} needs at least {needed} micro-batches, got {found} ({why})")]
    NeedsMicroBatches {
        schedule: &'static str,
        needed: usize,
        found: usize,
        why: &'static str,
    },
    #[error("line {line}: {msg}")]
    Parse { line: usize, msg: String },
    #[error(
        "skip {id} goes from stage {from} to stage {to}: it must go to a later stage of the \
         {num_stages}"
    )]
    SkipStages {
        id: usize,
        from: usize,
        to: usize,
        num_stages: usize,
    },
}

fn stuck_list(stuck: &[(usize, Action)]) -> String {
    stuck
        .iter()
        .map(|(d, a)| format!("device {d} waits at {a}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Within one device, for each (stage, micro-batch): `earlier` must precede `later` where both
/// occur.
const ORDER_RULES: [(ActionKind, ActionKind); 12] = {
    use ActionKind::*;
    [
        (RecvActivation, Forward),
        (Forward, SendActivation),
        (Forward, Recompute),
        (Forward, Backward),
        (Forward, BackwardInput),
        (Recompute, Backward),
        (Recompute, BackwardInput),
        (RecvGrad, Backward),
        (RecvGrad, BackwardInput),
        (Backward, SendGrad),
        (BackwardInput, SendGrad),
        (BackwardInput, BackwardWeight),
    ]
};

/// A schedule's K and M: at least one device and one micro-batch (the one place the rule is
/// checked, by the validator and by the generators before they lay anything out).
pub(crate) fn check_counts(k: usize, m: usize) -> Result<(), ScheduleError> {
    if k == 0 {
        return Err(ScheduleError::NoDevices);
    }
    if m == 0 {
        return Err(ScheduleError::NoMicroBatches);
    }
    Ok(())
}

/// How often an action occurs (on the device its stage is placed on: checked first) and its
/// first position in that device's list.
#[derive(Clone, Copy, Default)]
struct Seen {
    count: usize,
    first: usize,
}

/// Where each action was seen: actions without a skip in a table by (kind, stage,
/// micro-batch), skip transfers in a map (hashing every action was a third of the planner's
/// time on large clusters, where it validates every schedule it generates).
struct Positions {
    stages: usize,
    micro_batches: usize,
    dense: Vec<Seen>,
    skips: FastMap<Action, Seen>,
}

impl Positions {
    fn new(stages: usize, micro_batches: usize) -> Positions {
        Positions {
            stages,
            micro_batches,
            // Every kind has a row, so that no action (however malformed) falls outside.
            dense: vec![
                Seen::default();
                (ActionKind::ExchangeTied as usize + 1) * stages * micro_batches
            ],
            skips: FastMap::default(),
        }
    }

    /// The table's index of `a` (stage and micro-batch in range: checked before it is
    /// recorded).
    fn index(&self, a: &Action) -> usize {
        (a.kind as usize * self.stages + a.stage) * self.micro_batches + a.micro_batch
    }

    /// The table's slot of `a`, or `None` for the map (skip transfers, a kind without a row).
    fn slot(&self, a: &Action) -> Option<usize> {
        let i = self.index(a);
        (a.skip.is_none() && i < self.dense.len()).then_some(i)
    }

    fn record(&mut self, action: Action, pos: usize) {
        let seen = match self.slot(&action) {
            Some(i) => &mut self.dense[i],
            None => self.skips.entry(action).or_default(),
        };
        if seen.count == 0 {
            seen.first = pos;
        }
        seen.count += 1;
    }

    fn get(&self, a: &Action) -> Option<&Seen> {
        match self.slot(a) {
            Some(i) => Some(&self.dense[i]).filter(|seen| seen.count > 0),
            None => self.skips.get(a),
        }
    }
}

impl Schedule {
    /// Checks that the schedule is complete, consistent and cannot deadlock, in this order:
    /// sizes and placement; every action in range and on the device its stage is placed on, and
    /// transfers only where a peer exists; per (stage, micro-batch) exactly one forward, either
    /// one full backward or one input and one weight part, at most one recompute, and a
    /// receive/send on each side that has a neighbour; the order of those on the device
    /// (receive, forward, send; forward, recompute, backward; receive gradient, backward, send
    /// gradient; input part before weight part); the declared in-flight limit; and finally a
    /// run of the devices as in-order programs with non-blocking sends and blocking receives
    /// (matched by link and micro-batch), which must complete.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        self.check_shape()?;
        let positions = self.check_actions()?;
        self.check_counts_and_order(&positions)?;
        self.check_in_flight()?;
        self.drive(|_, _, _: Option<()>| ())
    }

    fn check_shape(&self) -> Result<(), ScheduleError> {
        let k = self.num_devices();
        check_counts(k, self.num_micro_batches)?;
        if self.placement.is_empty() {
            return Err(ScheduleError::NoStages);
        }
        if let Some((stage, &device)) = self.placement.iter().enumerate().find(|(_, &d)| d >= k) {
            return Err(ScheduleError::PlacementOutOfRange {
                stage,
                device,
                num_devices: k,
            });
        }
        if let Some(device) = (0..k).find(|d| !self.placement.contains(d)) {
            return Err(ScheduleError::IdleDevice { device });
        }
        Ok(())
    }

    /// Range, placement and peer checks; returns each action's count and first position in
    /// its device's list.
    fn check_actions(&self) -> Result<Positions, ScheduleError> {
        let (s_total, m_total) = (self.num_stages(), self.num_micro_batches);
        let mut positions = Positions::new(s_total, m_total);
        for (device, list) in self.devices.iter().enumerate() {
            for (pos, &action) in list.iter().enumerate() {
                if action.stage >= s_total || action.micro_batch >= m_total {
                    return Err(ScheduleError::OutOfRange {
                        device,
                        action,
                        num_stages: s_total,
                        num_micro_batches: m_total,
                    });
                }
                let placed_on = self.placement[action.stage];
                if placed_on != device {
                    return Err(ScheduleError::WrongDevice {
                        device,
                        action,
                        placed_on,
                    });
                }
                if !action.is_compute() && action.link(s_total).is_none() {
                    return Err(ScheduleError::NoPeer { device, action });
                }
                positions.record(action, pos);
            }
        }
        Ok(positions)
    }

    fn check_counts_and_order(&self, positions: &Positions) -> Result<(), ScheduleError> {
        use ActionKind::*;
        let last = self.num_stages() - 1;
        let count = |a: Action| positions.get(&a).map_or(0, |seen| seen.count);
        for s in 0..=last {
            let device = self.placement[s];
            for m in 0..self.num_micro_batches {
                let at = |kind| Action::new(kind, s, m);
                let split = count(at(BackwardInput)) + count(at(BackwardWeight)) > 0;
                if split && count(at(Backward)) > 0 {
                    return Err(ScheduleError::MixedBackward {
                        device,
                        stage: s,
                        micro_batch: m,
                    });
                }
                for kind in ActionKind::ALL {
                    let expected = match kind {
                        Forward => 1,
                        Recompute => count(at(Recompute)).min(1),
                        Backward => usize::from(!split),
                        BackwardInput | BackwardWeight => usize::from(split),
                        RecvActivation | SendGrad => usize::from(s > 0),
                        SendActivation | RecvGrad => usize::from(s < last),
                        // Not in `ALL`: checked by `validate_skips`.
                        SendSkip | RecvSkip | SendSkipGrad | RecvSkipGrad => continue,
                        ExchangeTied => 0,
                    };
                    let found = count(at(kind));
                    if found != expected {
                        return Err(ScheduleError::ActionCount {
                            device,
                            action: at(kind),
                            found,
                            expected,
                        });
                    }
                }
                for (earlier, later) in ORDER_RULES {
                    let first = |kind| positions.get(&at(kind)).map(|seen| seen.first);
                    if let (Some(a), Some(b)) = (first(earlier), first(later)) {
                        if a > b {
                            return Err(ScheduleError::Order {
                                device,
                                earlier: at(earlier),
                                later: at(later),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn check_in_flight(&self) -> Result<(), ScheduleError> {
        let Some(limit) = &self.in_flight_limit else {
            return Ok(());
        };
        if limit.len() != self.num_devices() {
            return Err(ScheduleError::LimitCount {
                found: limit.len(),
                devices: self.num_devices(),
            });
        }
        for (device, (&found, &limit)) in self.max_in_flight().iter().zip(limit).enumerate() {
            if found > limit {
                return Err(ScheduleError::InFlight {
                    device,
                    found,
                    limit,
                });
            }
        }
        Ok(())
    }

    /// Runs the devices as in-order programs joined by channels keyed by (link, micro-batch):
    /// sends never block, a receive blocks until its message was sent.
    ///
    /// `step(device, action, incoming)` is called once per executed action in each device's
    /// order; `incoming` is the payload of the received message for receives, `None` otherwise.
    /// Its return value is the payload of a send and ignored for the others. Fails with
    /// [`ScheduleError::Deadlock`] if the programs get stuck.
    pub(crate) fn drive<T, F>(&self, mut step: F) -> Result<(), ScheduleError>
    where
        F: FnMut(usize, Action, Option<T>) -> T,
    {
        let k = self.num_devices();
        let s_total = self.num_stages();
        let mut pending: FastMap<(Link, usize), T> = FastMap::default();
        let mut next = vec![0usize; k];
        loop {
            let mut progressed = false;
            for (device, pc) in next.iter_mut().enumerate() {
                while let Some(&action) = self.devices[device].get(*pc) {
                    let link = action.link(s_total);
                    let key = link.map(|l| (l, action.micro_batch));
                    match action.kind {
                        kind if kind.is_recv() => {
                            let Some(payload) = key.and_then(|key| pending.remove(&key)) else {
                                break;
                            };
                            step(device, action, Some(payload));
                        }
                        kind if kind.is_send() => {
                            let Some(key) = key else { break };
                            let payload = step(device, action, None);
                            pending.insert(key, payload);
                        }
                        _ => {
                            step(device, action, None);
                        }
                    }
                    *pc += 1;
                    progressed = true;
                }
            }
            let stuck: Vec<(usize, Action)> = (0..k)
                .filter_map(|d| self.devices[d].get(next[d]).map(|&a| (d, a)))
                .collect();
            if stuck.is_empty() {
                return Ok(());
            }
            if !progressed {
                return Err(ScheduleError::Deadlock { stuck });
            }
        }
    }
}
