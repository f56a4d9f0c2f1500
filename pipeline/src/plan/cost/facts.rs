//! The facts of a schedule the cost model reads, and a schedule's recomputes as a candidate's
//! re-materialization keeps them.

use crate::schedule::{Action, ActionKind, CheckpointMode, Schedule};

/// Facts of a schedule the cost model needs: which forwards are checkpointed, when each sent
/// message is surely off its sender, and which backward of a stage comes first. Removing
/// recomputes does not change the release points (they compare positions of transfers within
/// one device's list) nor the first backwards, so the facts of a uniform mode serve every mix.
pub struct ScheduleFacts {
    pub(super) micro_batches: usize,
    /// By `stage * M + micro_batch`.
    pub(super) checkpointed: Vec<bool>,
    /// Per device, per index of a send: the index after which the message is gone from the
    /// sender (the list's length: the end of the step).
    pub(super) release: Vec<Vec<usize>>,
    /// The first backward (full or weight part) of each stage: it stores the parameter
    /// gradients, later ones add to them.
    first_backward: Vec<Option<Action>>,
    /// The first input part of a split backward of each stage: layers re-materialized inside
    /// the stage store their parameter gradients there.
    first_input: Vec<Option<Action>>,
}

/// Where a transfer of `link`'s `from` stage, direction and micro-batch sits: by
/// `(from * 2 + grad) * M + micro_batch` for the chain, after those by
/// `(skip id * 2 + grad) * M + micro_batch` for skips.
fn transfer_slot(a: &Action, stages: usize, m: usize) -> Option<usize> {
    a.link(stages).map(|l| {
        let grad = usize::from(l.grad);
        match l.skip {
            None => (l.from * 2 + grad) * m + a.micro_batch,
            Some(id) => (stages + id) * 2 * m + grad * m + a.micro_batch,
        }
    })
}

fn is_send(kind: ActionKind) -> bool {
    use ActionKind::*;
    matches!(kind, SendActivation | SendGrad | SendSkip | SendSkipGrad)
}

fn is_recv(kind: ActionKind) -> bool {
    use ActionKind::*;
    matches!(kind, RecvActivation | RecvGrad | RecvSkip | RecvSkipGrad)
}

impl ScheduleFacts {
    pub fn of(schedule: &Schedule) -> ScheduleFacts {
        ScheduleFacts::of_devices(schedule, None)
    }

    /// The facts device `d`'s memory walk reads (the release points of its sends only): what
    /// a schedule that differs from another in `d`'s list alone needs, at 1/K of the work.
    pub fn of_device(schedule: &Schedule, d: usize) -> ScheduleFacts {
        ScheduleFacts::of_devices(schedule, Some(d))
    }

    /// Release points of every device's sends, or of `only`'s (the others left empty).
    fn of_devices(schedule: &Schedule, only: Option<usize>) -> ScheduleFacts {
        let wanted = |d: usize| only.is_none_or(|o| o == d);
        let stages = schedule.num_stages();
        let m = schedule.num_micro_batches;
        let none = (usize::MAX, usize::MAX);
        let skips = schedule
            .actions()
            .filter_map(|(_, a)| a.skip.map(|p| p.id + 1))
            .max()
            .unwrap_or(0);
        let mut sends = vec![none; (stages + skips) * 2 * m];
        let mut recvs = vec![none; (stages + skips) * 2 * m];
        let mut checkpointed = vec![false; stages * m];
        let mut first_backward = vec![None; stages];
        let mut first_input = vec![None; stages];
        for (d, list) in schedule.devices.iter().enumerate() {
            for (i, a) in list.iter().enumerate() {
                match a.kind {
                    k if is_send(k) => {
                        if let Some(slot) = transfer_slot(a, stages, m) {
                            sends[slot] = (d, i);
                        }
                    }
                    k if is_recv(k) => {
                        if let Some(slot) = transfer_slot(a, stages, m) {
                            recvs[slot] = (d, i);
                        }
                    }
                    ActionKind::Recompute => checkpointed[a.stage * m + a.micro_batch] = true,
                    ActionKind::Backward | ActionKind::BackwardWeight => {
                        first_backward[a.stage].get_or_insert(*a);
                    }
                    ActionKind::BackwardInput => {
                        first_input[a.stage].get_or_insert(*a);
                    }
                    _ => {}
                }
            }
        }
        let release = schedule
            .devices
            .iter()
            .enumerate()
            .map(|(d, list)| {
                if !wanted(d) {
                    return Vec::new();
                }
                // d's receives in list order: (index, sending device, index of the send
                // there); a send's release looks up the first of these after it (a scan of the
                // whole list per send made this quadratic in the actions: the planner's
                // largest cost at a thousand devices).
                let on: Vec<(usize, usize, usize)> = list
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| is_recv(b.kind))
                    .filter_map(|(j, b)| {
                        transfer_slot(b, stages, m).map(|x| (j, sends[x].0, sends[x].1))
                    })
                    .collect();
                list.iter()
                    .enumerate()
                    .map(|(i, a)| {
                        let Some(slot) = transfer_slot(a, stages, m) else {
                            return list.len();
                        };
                        if !is_send(a.kind) {
                            return list.len();
                        }
                        let (p, r) = recvs[slot];
                        if p == usize::MAX {
                            return list.len();
                        }
                        if p == d {
                            return r;
                        }
                        // The first later receive on d of something p sent after it took the
                        // message: p's list is sequential, so p had taken it by then.
                        on[on.partition_point(|&(j, _, _)| j <= i)..]
                            .iter()
                            .find(|&&(_, q, sent)| q == p && sent > r)
                            .map_or(list.len(), |&(j, _, _)| j)
                    })
                    .collect()
            })
            .collect();
        ScheduleFacts {
            micro_batches: m,
            checkpointed,
            release,
            first_backward,
            first_input,
        }
    }

    pub(super) fn is_first_backward(&self, a: &Action) -> bool {
        self.first_backward[a.stage] == Some(*a)
    }

    pub(super) fn is_first_input(&self, a: &Action) -> bool {
        self.first_input[a.stage] == Some(*a)
    }
}

/// `schedule` with each stage's recomputes kept only where its mode (`remat`, by stage) asks
/// for them (the schedule must have been generated with [`CheckpointMode::Always`]).
pub fn with_remat(schedule: &Schedule, remat: &[CheckpointMode]) -> Schedule {
    debug_assert_eq!(remat.len(), schedule.num_stages());
    let m = schedule.num_micro_batches;
    let mut s = schedule.clone();
    for list in &mut s.devices {
        list.retain(|a| {
            a.kind != ActionKind::Recompute || remat[a.stage].recomputes(a.micro_batch, m)
        });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    /// One device's facts equal that device's part of the whole schedule's, on schedules whose
    /// devices re-materialize differently (the mixes the search builds).
    #[test]
    fn one_devices_facts_equal_its_part_of_the_whole() {
        let (mut tried, mut early) = (0, 0);
        for kind in ScheduleKind::ALL {
            for (k, m) in [(2, 4), (4, 8)] {
                let Ok(always) = kind.generate(k, kind.default_chunks(), m, CheckpointMode::Always)
                else {
                    continue;
                };
                let stages = always.num_stages();
                let modes = [
                    CheckpointMode::Never,
                    CheckpointMode::ExceptLast,
                    CheckpointMode::Always,
                ];
                let remat: Vec<CheckpointMode> = (0..stages).map(|s| modes[s % 3]).collect();
                let schedule = with_remat(&always, &remat);
                let whole = ScheduleFacts::of(&schedule);
                for d in 0..k {
                    let one = ScheduleFacts::of_device(&schedule, d);
                    assert_eq!(
                        one.release[d], whole.release[d],
                        "{kind:?} K={k} device {d}"
                    );
                    assert_eq!(one.checkpointed, whole.checkpointed);
                    early += whole.release[d]
                        .iter()
                        .filter(|&&r| r < schedule.devices[d].len())
                        .count();
                }
                tried += 1;
            }
        }
        assert!(tried >= 8, "only {tried} schedules generated");
        // Sends released before the end of the step: the comparison covers real lookups.
        assert!(early > 100, "{early} sends released before the end");
    }
}
