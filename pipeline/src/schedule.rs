//! Pipeline schedules as data.
//!
//! A schedule is, for each of K stages, the ordered list of actions that stage performs in one
//! training step over M micro-batches. The executor only walks these lists, so everything that
//! can go wrong with ordering (a missing send, a receive that can never be satisfied, a deadlock)
//! is caught here, by [`Schedule::validate`], before any device does work.
//!
//! Two generators are provided: [`gpipe`] (fill-drain, as in GPipe and torchgpipe) and
//! [`one_f_one_b`] (PipeDream-Flush), both with torchgpipe's checkpoint modes.

use std::collections::VecDeque;
use std::fmt;

/// Which micro-batches are re-materialized (torchgpipe's `checkpoint` argument).
///
/// A checkpointed micro-batch keeps only its stage input during the forward pass and re-runs the
/// forward with recording ([`Action::Recompute`]) before its backward, trading compute for memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CheckpointMode {
    /// Every micro-batch is re-materialized.
    Always,
    /// Every micro-batch except the last: the last one's backward starts right after its forward
    /// in fill-drain order, so recomputing it would only cost time.
    ExceptLast,
    /// No micro-batch is re-materialized; every forward keeps its tape.
    Never,
}

impl CheckpointMode {
    /// Whether `micro_batch` (of `num_micro_batches`) is re-materialized under this mode.
    pub fn recomputes(self, micro_batch: usize, num_micro_batches: usize) -> bool {
        match self {
            CheckpointMode::Always => true,
            CheckpointMode::ExceptLast => micro_batch + 1 < num_micro_batches,
            CheckpointMode::Never => false,
        }
    }
}

impl fmt::Display for CheckpointMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CheckpointMode::Always => "always",
            CheckpointMode::ExceptLast => "except_last",
            CheckpointMode::Never => "never",
        })
    }
}

/// One step of one stage; the `usize` is the micro-batch index.
///
/// For stage j of K: `RecvActivation` comes from j-1 (absent on stage 0), `SendActivation` goes
/// to j+1 (absent on the last stage, whose `Forward` includes the loss), `RecvGrad` comes from j+1
/// (absent on the last stage), `SendGrad` goes to j-1 (absent on stage 0). `Recompute` appears
/// only for checkpointed micro-batches, before `RecvGrad` so that it overlaps the wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Forward(usize),
    Backward(usize),
    Recompute(usize),
    SendActivation(usize),
    RecvActivation(usize),
    SendGrad(usize),
    RecvGrad(usize),
}

impl Action {
    /// The micro-batch this action works on.
    pub fn micro_batch(self) -> usize {
        match self {
            Action::Forward(m)
            | Action::Backward(m)
            | Action::Recompute(m)
            | Action::SendActivation(m)
            | Action::RecvActivation(m)
            | Action::SendGrad(m)
            | Action::RecvGrad(m) => m,
        }
    }

    /// Whether the action occupies the stage's device (as opposed to moving data).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            Action::Forward(_) | Action::Backward(_) | Action::Recompute(_)
        )
    }

    fn kind(self) -> Kind {
        match self {
            Action::Forward(_) => Kind::Forward,
            Action::Backward(_) => Kind::Backward,
            Action::Recompute(_) => Kind::Recompute,
            Action::SendActivation(_) => Kind::SendActivation,
            Action::RecvActivation(_) => Kind::RecvActivation,
            Action::SendGrad(_) => Kind::SendGrad,
            Action::RecvGrad(_) => Kind::RecvGrad,
        }
    }
}

/// The action variants without their micro-batch, so counts can be kept per (kind, micro-batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Forward,
    Backward,
    Recompute,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad,
}

const ALL_KINDS: [Kind; 7] = [
    Kind::Forward,
    Kind::Backward,
    Kind::Recompute,
    Kind::SendActivation,
    Kind::RecvActivation,
    Kind::SendGrad,
    Kind::RecvGrad,
];

impl Kind {
    fn with(self, m: usize) -> Action {
        match self {
            Kind::Forward => Action::Forward(m),
            Kind::Backward => Action::Backward(m),
            Kind::Recompute => Action::Recompute(m),
            Kind::SendActivation => Action::SendActivation(m),
            Kind::RecvActivation => Action::RecvActivation(m),
            Kind::SendGrad => Action::SendGrad(m),
            Kind::RecvGrad => Action::RecvGrad(m),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One compute slot of the clock grid (see [`Schedule::clock_grid`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cell {
    Forward(usize),
    Backward(usize),
    Recompute(usize),
}

impl Cell {
    /// The grid cell of a compute action; `None` for transfers, which take no clock.
    pub fn from_action(action: Action) -> Option<Cell> {
        match action {
            Action::Forward(m) => Some(Cell::Forward(m)),
            Action::Backward(m) => Some(Cell::Backward(m)),
            Action::Recompute(m) => Some(Cell::Recompute(m)),
            _ => None,
        }
    }
}

impl fmt::Display for Cell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (letter, m) = match self {
            Cell::Forward(m) => ('F', m),
            Cell::Backward(m) => ('B', m),
            Cell::Recompute(m) => ('R', m),
        };
        write!(f, "{letter}{m}")
    }
}

/// Why a schedule was rejected. Every variant names the stage and action concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScheduleError {
    /// K = 0.
    NoStages,
    /// M = 0.
    NoMicroBatches,
    /// `stages.len()` differs from `num_stages`.
    StageCount { declared: usize, found: usize },
    /// An action names a micro-batch index ≥ M.
    MicroBatchOutOfRange {
        stage: usize,
        action: Action,
        num_micro_batches: usize,
    },
    /// An action occurs `found` times on a stage where it must occur `expected` times.
    ActionCount {
        stage: usize,
        action: Action,
        found: usize,
        expected: usize,
    },
    /// On `stage`, `earlier` must come before `later` but does not.
    Order {
        stage: usize,
        earlier: Action,
        later: Action,
    },
    /// The sends on one side of a link and the receives on the other differ in order.
    UnmatchedTransfer {
        what: &'static str,
        from_stage: usize,
        to_stage: usize,
        sent: Vec<usize>,
        received: Vec<usize>,
    },
    /// No stage can make progress; each stuck stage with the action it waits at.
    Deadlock { stuck: Vec<(usize, Action)> },
}

impl fmt::Display for ScheduleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleError::NoStages => write!(f, "a schedule needs at least one stage (K = 0)"),
            ScheduleError::NoMicroBatches => {
                write!(f, "a schedule needs at least one micro-batch (M = 0)")
            }
            ScheduleError::StageCount { declared, found } => write!(
                f,
                "schedule declares {declared} stages but lists actions for {found}"
            ),
            ScheduleError::MicroBatchOutOfRange {
                stage,
                action,
                num_micro_batches,
            } => write!(
                f,
                "stage {stage}: {action:?} names a micro-batch outside 0..{num_micro_batches}"
            ),
            ScheduleError::ActionCount {
                stage,
                action,
                found,
                expected,
            } => write!(
                f,
                "stage {stage}: {action:?} occurs {found} times, expected {expected}"
            ),
            ScheduleError::Order {
                stage,
                earlier,
                later,
            } => write!(f, "stage {stage}: {earlier:?} must come before {later:?}"),
            ScheduleError::UnmatchedTransfer {
                what,
                from_stage,
                to_stage,
                sent,
                received,
            } => write!(
                f,
                "{what} link {from_stage}->{to_stage}: stage {from_stage} sends micro-batches \
                 {sent:?} but stage {to_stage} receives {received:?}"
            ),
            ScheduleError::Deadlock { stuck } => {
                write!(f, "schedule deadlocks, no stage can progress:")?;
                for (i, (stage, action)) in stuck.iter().enumerate() {
                    let sep = if i == 0 { " " } else { ", " };
                    write!(f, "{sep}stage {stage} waits at {action:?}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ScheduleError {}

/// Per-stage action lists for one training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub num_stages: usize,
    pub num_micro_batches: usize,
    pub checkpoint: CheckpointMode,
    pub stages: Vec<Vec<Action>>,
    pub name: String,
}

fn check_sizes(k: usize, m: usize) -> Result<(), ScheduleError> {
    if k == 0 {
        return Err(ScheduleError::NoStages);
    }
    if m == 0 {
        return Err(ScheduleError::NoMicroBatches);
    }
    Ok(())
}

/// Appends micro-batch `m`'s forward on `stage`, with its boundary transfers.
fn push_forward(list: &mut Vec<Action>, stage: usize, k: usize, m: usize) {
    if stage > 0 {
        list.push(Action::RecvActivation(m));
    }
    list.push(Action::Forward(m));
    if stage + 1 < k {
        list.push(Action::SendActivation(m));
    }
}

/// Appends micro-batch `m`'s backward on `stage`: the recompute goes before the gradient receive
/// so that it overlaps with waiting for the gradient.
fn push_backward(list: &mut Vec<Action>, stage: usize, k: usize, m: usize, recompute: bool) {
    if recompute {
        list.push(Action::Recompute(m));
    }
    if stage + 1 < k {
        list.push(Action::RecvGrad(m));
    }
    list.push(Action::Backward(m));
    if stage > 0 {
        list.push(Action::SendGrad(m));
    }
}

/// GPipe fill-drain: every stage runs all forwards in order 0..M, then all backwards in reverse
/// order M-1..0, as torchgpipe does. Micro-batch m reaches stage j at clock m + j.
pub fn gpipe(k: usize, m: usize, checkpoint: CheckpointMode) -> Result<Schedule, ScheduleError> {
    check_sizes(k, m)?;
    let stages = (0..k)
        .map(|j| {
            let mut list = Vec::new();
            for mb in 0..m {
                push_forward(&mut list, j, k, mb);
            }
            for mb in (0..m).rev() {
                push_backward(&mut list, j, k, mb, checkpoint.recomputes(mb, m));
            }
            list
        })
        .collect();
    Ok(Schedule {
        num_stages: k,
        num_micro_batches: m,
        checkpoint,
        stages,
        name: "gpipe".to_string(),
    })
}

/// 1F1B (PipeDream-Flush): stage j runs a warm-up of min(K-j-1, M) forwards, then alternates one
/// forward and one backward, then drains the remaining backwards. Same bubble as GPipe, but at
/// most K-j micro-batches are in flight on stage j instead of M, which bounds activation memory.
pub fn one_f_one_b(
    k: usize,
    m: usize,
    checkpoint: CheckpointMode,
) -> Result<Schedule, ScheduleError> {
    check_sizes(k, m)?;
    let stages = (0..k)
        .map(|j| {
            let warmup = (k - j - 1).min(m);
            let mut list = Vec::new();
            for mb in 0..warmup {
                push_forward(&mut list, j, k, mb);
            }
            for i in 0..m - warmup {
                push_forward(&mut list, j, k, warmup + i);
                push_backward(&mut list, j, k, i, checkpoint.recomputes(i, m));
            }
            for mb in m - warmup..m {
                push_backward(&mut list, j, k, mb, checkpoint.recomputes(mb, m));
            }
            list
        })
        .collect();
    Ok(Schedule {
        num_stages: k,
        num_micro_batches: m,
        checkpoint,
        stages,
        name: "1f1b".to_string(),
    })
}

/// Index of the FIFO channel an action uses, if it is a transfer that has a peer on this stage.
/// Channels are numbered 2·i (activations i → i+1) and 2·i+1 (gradients i+1 → i).
fn channel_of(action: Action, stage: usize, k: usize) -> Option<usize> {
    match action {
        Action::SendActivation(_) if stage + 1 < k => Some(2 * stage),
        Action::RecvActivation(_) if stage > 0 => Some(2 * (stage - 1)),
        Action::SendGrad(_) if stage > 0 => Some(2 * (stage - 1) + 1),
        Action::RecvGrad(_) if stage + 1 < k => Some(2 * stage + 1),
        _ => None,
    }
}

impl Schedule {
    /// Checks that the schedule is complete, consistent and cannot deadlock.
    ///
    /// In order: sizes; micro-batch indices in range; per stage exactly one Forward and Backward
    /// per micro-batch, Recompute exactly where the checkpoint mode asks, transfers exactly where
    /// a neighbour exists; Forward before Backward with transfers and Recompute in between as
    /// described on [`Action`]; sends and receives on each link in the same order; and finally a
    /// simulation with non-blocking sends and blocking receives that must run to completion.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        check_sizes(self.num_stages, self.num_micro_batches)?;
        if self.stages.len() != self.num_stages {
            return Err(ScheduleError::StageCount {
                declared: self.num_stages,
                found: self.stages.len(),
            });
        }
        for stage in 0..self.num_stages {
            self.check_stage(stage)?;
        }
        self.check_links()?;
        self.drive(|_, _, _: Option<()>| ())
    }

    /// How often `kind` must appear for micro-batch `m` on `stage`.
    fn expected_count(&self, kind: Kind, stage: usize, m: usize) -> usize {
        let first = stage == 0;
        let last = stage + 1 == self.num_stages;
        let needed = match kind {
            Kind::Forward | Kind::Backward => true,
            Kind::Recompute => self.checkpoint.recomputes(m, self.num_micro_batches),
            Kind::RecvActivation | Kind::SendGrad => !first,
            Kind::SendActivation | Kind::RecvGrad => !last,
        };
        usize::from(needed)
    }

    /// Counts and per-micro-batch ordering on one stage.
    fn check_stage(&self, stage: usize) -> Result<(), ScheduleError> {
        let m_total = self.num_micro_batches;
        // positions[kind][m] = indices in the stage's list where that action occurs.
        let mut positions = vec![vec![Vec::new(); m_total]; ALL_KINDS.len()];
        for (pos, &action) in self.stages[stage].iter().enumerate() {
            let m = action.micro_batch();
            if m >= m_total {
                return Err(ScheduleError::MicroBatchOutOfRange {
                    stage,
                    action,
                    num_micro_batches: m_total,
                });
            }
            positions[action.kind().index()][m].push(pos);
        }
        for kind in ALL_KINDS {
            for (m, at) in positions[kind.index()].iter().enumerate() {
                let found = at.len();
                let expected = self.expected_count(kind, stage, m);
                if found != expected {
                    let action = kind.with(m);
                    return Err(ScheduleError::ActionCount {
                        stage,
                        action,
                        found,
                        expected,
                    });
                }
            }
        }
        for m in 0..m_total {
            check_order(stage, m, &positions)?;
        }
        Ok(())
    }

    /// Sends on each link must be received in the same micro-batch order on the other side.
    fn check_links(&self) -> Result<(), ScheduleError> {
        let of_kind = |stage: usize, kind: Kind| -> Vec<usize> {
            self.stages[stage]
                .iter()
                .filter(|a| a.kind() == kind)
                .map(|a| a.micro_batch())
                .collect()
        };
        for lo in 0..self.num_stages.saturating_sub(1) {
            let hi = lo + 1;
            let links = [
                (
                    "activation",
                    lo,
                    hi,
                    Kind::SendActivation,
                    Kind::RecvActivation,
                ),
                ("gradient", hi, lo, Kind::SendGrad, Kind::RecvGrad),
            ];
            for (what, from_stage, to_stage, send, recv) in links {
                let sent = of_kind(from_stage, send);
                let received = of_kind(to_stage, recv);
                if sent != received {
                    return Err(ScheduleError::UnmatchedTransfer {
                        what,
                        from_stage,
                        to_stage,
                        sent,
                        received,
                    });
                }
            }
        }
        Ok(())
    }

    /// Runs the stages as K in-order programs joined by unbounded FIFO channels (sends never
    /// block, receives block until their message is at the head of the channel).
    ///
    /// `step(stage, action, incoming)` is called once per executed action in each stage's order;
    /// `incoming` is the payload of the received message for receives, `None` otherwise. Its
    /// return value is the payload sent by a send action and ignored for the others. Shared by
    /// deadlock checking, the clock grid and the simulated timeline, so all three agree on what
    /// can run when. Fails with [`ScheduleError::Deadlock`] if the programs get stuck; a receive
    /// whose channel head is another micro-batch (or that has no peer) counts as stuck.
    pub(crate) fn drive<T, F>(&self, mut step: F) -> Result<(), ScheduleError>
    where
        F: FnMut(usize, Action, Option<T>) -> T,
    {
        let k = self.stages.len();
        let mut channels: Vec<VecDeque<(usize, T)>> = (0..2 * k.saturating_sub(1))
            .map(|_| VecDeque::new())
            .collect();
        let mut next = vec![0usize; k];
        loop {
            let mut progressed = false;
            for (stage, pc) in next.iter_mut().enumerate() {
                while let Some(&action) = self.stages[stage].get(*pc) {
                    if !self.try_step(stage, action, &mut channels, &mut step) {
                        break;
                    }
                    *pc += 1;
                    progressed = true;
                }
            }
            let stuck: Vec<(usize, Action)> = (0..k)
                .filter_map(|s| self.stages[s].get(next[s]).map(|&a| (s, a)))
                .collect();
            if stuck.is_empty() {
                return Ok(());
            }
            if !progressed {
                return Err(ScheduleError::Deadlock { stuck });
            }
        }
    }

    /// Executes one action if it can run now; returns whether it did.
    fn try_step<T, F>(
        &self,
        stage: usize,
        action: Action,
        channels: &mut [VecDeque<(usize, T)>],
        step: &mut F,
    ) -> bool
    where
        F: FnMut(usize, Action, Option<T>) -> T,
    {
        let k = self.stages.len();
        let m = action.micro_batch();
        match action {
            Action::RecvActivation(_) | Action::RecvGrad(_) => {
                let Some(ch) = channel_of(action, stage, k) else {
                    return false;
                };
                if channels[ch].front().map(|(mb, _)| *mb) != Some(m) {
                    return false;
                }
                let payload = channels[ch].pop_front().map(|(_, p)| p);
                step(stage, action, payload);
            }
            Action::SendActivation(_) | Action::SendGrad(_) => {
                let Some(ch) = channel_of(action, stage, k) else {
                    return false;
                };
                let payload = step(stage, action, None);
                channels[ch].push_back((m, payload));
            }
            _ => {
                step(stage, action, None);
            }
        }
        true
    }

    /// Per stage, the largest number of micro-batches whose Forward has run and whose Backward
    /// has not: the number of stashed stage inputs (or tapes), which bounds activation memory.
    pub fn max_in_flight(&self) -> Vec<usize> {
        self.stages
            .iter()
            .map(|actions| {
                let mut live = 0usize;
                let mut peak = 0usize;
                for action in actions {
                    match action {
                        Action::Forward(_) => {
                            live += 1;
                            peak = peak.max(live);
                        }
                        Action::Backward(_) => live = live.saturating_sub(1),
                        _ => {}
                    }
                }
                peak
            })
            .collect()
    }

    /// Unit-time picture of the schedule: `grid[stage][tick]` is the compute action that starts at
    /// that tick. Every compute action takes one tick and transfers take none, so a receive waits
    /// exactly for its producer's compute. A schedule that deadlocks is drawn up to where it stops.
    pub fn clock_grid(&self) -> Vec<Vec<Option<Cell>>> {
        let k = self.stages.len();
        let mut clock = vec![0usize; k];
        let mut placed: Vec<Vec<(usize, Cell)>> = vec![Vec::new(); k];
        // A deadlocking schedule still gets the part of the grid that could run.
        let _ = self.drive(|stage, action, incoming: Option<usize>| {
            if let Some(arrival) = incoming {
                clock[stage] = clock[stage].max(arrival);
            }
            if let Some(cell) = Cell::from_action(action) {
                placed[stage].push((clock[stage], cell));
                clock[stage] += 1;
            }
            clock[stage]
        });
        let width = clock.iter().copied().max().unwrap_or(0);
        placed
            .into_iter()
            .map(|cells| {
                let mut row = vec![None; width];
                for (tick, cell) in cells {
                    row[tick] = Some(cell);
                }
                row
            })
            .collect()
    }
}

/// Checks the within-stage order of micro-batch `m`'s actions, given each action's positions.
/// Absent actions (e.g. no receive on stage 0) impose no constraint.
fn check_order(stage: usize, m: usize, positions: &[Vec<Vec<usize>>]) -> Result<(), ScheduleError> {
    use Kind::*;
    const RULES: [(Kind, Kind); 7] = [
        (RecvActivation, Forward),
        (Forward, SendActivation),
        (Forward, Backward),
        (Forward, Recompute),
        (Recompute, Backward),
        (RecvGrad, Backward),
        (Backward, SendGrad),
    ];
    for (earlier, later) in RULES {
        let a = positions[earlier.index()][m].first();
        let b = positions[later.index()][m].first();
        if let (Some(a), Some(b)) = (a, b) {
            if a > b {
                return Err(ScheduleError::Order {
                    stage,
                    earlier: earlier.with(m),
                    later: later.with(m),
                });
            }
        }
    }
    Ok(())
}

impl fmt::Display for Schedule {
    /// A header line, then one row per stage with one column per unit clock tick
    /// (`F`/`B`/`R` + micro-batch, `..` when idle).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: K={} stages, M={} micro-batches, checkpoint={}",
            self.name, self.num_stages, self.num_micro_batches, self.checkpoint
        )?;
        let grid = self.clock_grid();
        let labels: Vec<Vec<String>> = grid
            .iter()
            .map(|row| {
                row.iter()
                    .map(|c| c.map_or_else(|| "..".to_string(), |c| c.to_string()))
                    .collect()
            })
            .collect();
        let width = labels.iter().flatten().map(String::len).max().unwrap_or(2);
        let stage_width = grid.len().saturating_sub(1).to_string().len();
        for (stage, row) in labels.iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|l| format!("{l:<width$}")).collect();
            let line = format!("stage {stage:>stage_width$} | {}", cells.join(" "));
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODES: [CheckpointMode; 3] = [
        CheckpointMode::Always,
        CheckpointMode::ExceptLast,
        CheckpointMode::Never,
    ];

    type Generator = fn(usize, usize, CheckpointMode) -> Result<Schedule, ScheduleError>;
    const GENERATORS: [Generator; 2] = [gpipe, one_f_one_b];

    fn each_schedule(mut f: impl FnMut(&Schedule)) {
        for generator in GENERATORS {
            for k in 1..=6 {
                for m in 1..=9 {
                    for mode in MODES {
                        f(&generator(k, m, mode).unwrap());
                    }
                }
            }
        }
    }

    #[test]
    fn generators_reject_empty_sizes() {
        for generator in GENERATORS {
            let never = CheckpointMode::Never;
            assert_eq!(generator(0, 4, never), Err(ScheduleError::NoStages));
            assert_eq!(generator(4, 0, never), Err(ScheduleError::NoMicroBatches));
        }
    }

    #[test]
    fn generated_schedules_validate() {
        each_schedule(|s| {
            if let Err(e) = s.validate() {
                panic!(
                    "{} K={} M={}: {e}",
                    s.name, s.num_stages, s.num_micro_batches
                );
            }
        });
    }

    #[test]
    fn gpipe_two_stages_exact_lists() {
        let s = gpipe(2, 2, CheckpointMode::ExceptLast).unwrap();
        use Action::*;
        assert_eq!(
            s.stages[0],
            vec![
                Forward(0),
                SendActivation(0),
                Forward(1),
                SendActivation(1),
                RecvGrad(1),
                Backward(1),
                Recompute(0),
                RecvGrad(0),
                Backward(0),
            ]
        );
        assert_eq!(
            s.stages[1],
            vec![
                RecvActivation(0),
                Forward(0),
                RecvActivation(1),
                Forward(1),
                Backward(1),
                SendGrad(1),
                Recompute(0),
                Backward(0),
                SendGrad(0),
            ]
        );
    }

    #[test]
    fn one_f_one_b_three_stages_exact_order() {
        let s = one_f_one_b(3, 4, CheckpointMode::Never).unwrap();
        let computes = |j: usize| -> Vec<Cell> {
            s.stages[j]
                .iter()
                .filter_map(|&a| Cell::from_action(a))
                .collect()
        };
        use Cell::{Backward as B, Forward as F};
        assert_eq!(
            computes(0),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        assert_eq!(
            computes(1),
            vec![F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)]
        );
        assert_eq!(
            computes(2),
            vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]
        );
    }

    #[test]
    fn recompute_precedes_recv_grad() {
        each_schedule(|s| {
            for list in &s.stages {
                for (i, a) in list.iter().enumerate() {
                    if let Action::RecvGrad(m) = a {
                        if s.checkpoint.recomputes(*m, s.num_micro_batches) {
                            assert_eq!(list[i - 1], Action::Recompute(*m));
                        }
                    }
                }
            }
        });
    }

    #[test]
    fn checkpoint_modes_select_micro_batches() {
        let count = |mode| {
            gpipe(1, 5, mode).unwrap().stages[0]
                .iter()
                .filter(|a| matches!(a, Action::Recompute(_)))
                .count()
        };
        assert_eq!(count(CheckpointMode::Always), 5);
        assert_eq!(count(CheckpointMode::ExceptLast), 4);
        assert_eq!(count(CheckpointMode::Never), 0);
    }

    #[test]
    fn gpipe_forward_lands_at_m_plus_j() {
        for k in 1..=6 {
            for m in 1..=9 {
                for mode in MODES {
                    let grid = gpipe(k, m, mode).unwrap().clock_grid();
                    for (j, row) in grid.iter().enumerate() {
                        for mb in 0..m {
                            assert_eq!(row[mb + j], Some(Cell::Forward(mb)), "K={k} M={m} j={j}");
                        }
                    }
                    // The forward phase spans M + K - 1 clocks: the last stage's last forward
                    // is at tick M + K - 2, and nothing before it on any stage is a backward.
                    let last_forward = m + k - 2;
                    assert_eq!(grid[k - 1][last_forward], Some(Cell::Forward(m - 1)));
                    for row in &grid {
                        assert!(row[..=last_forward]
                            .iter()
                            .all(|c| !matches!(c, Some(Cell::Backward(_)))));
                    }
                }
            }
        }
    }

    #[test]
    fn gpipe_without_recompute_takes_two_phases_of_m_plus_k_minus_1() {
        for k in 1..=6 {
            for m in 1..=9 {
                let grid = gpipe(k, m, CheckpointMode::Never).unwrap().clock_grid();
                assert_eq!(grid[0].len(), 2 * (m + k - 1));
                // Backward mirrors forward: B(mb) on stage j at 2(M+K-1) - 1 - (mb + j).
                for (j, row) in grid.iter().enumerate() {
                    for mb in 0..m {
                        let tick = 2 * (m + k - 1) - 1 - (mb + j);
                        assert_eq!(row[tick], Some(Cell::Backward(mb)));
                    }
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_matches_gpipe_length_without_recompute() {
        for k in 1..=6 {
            for m in 1..=9 {
                let a = gpipe(k, m, CheckpointMode::Never).unwrap().clock_grid();
                let b = one_f_one_b(k, m, CheckpointMode::Never)
                    .unwrap()
                    .clock_grid();
                assert_eq!(a[0].len(), b[0].len(), "K={k} M={m}");
            }
        }
    }

    #[test]
    fn grid_holds_every_compute_action_once() {
        each_schedule(|s| {
            let grid = s.clock_grid();
            for (j, row) in grid.iter().enumerate() {
                let placed: Vec<Cell> = row.iter().flatten().copied().collect();
                let listed: Vec<Cell> = s.stages[j]
                    .iter()
                    .filter_map(|&a| Cell::from_action(a))
                    .collect();
                assert_eq!(placed, listed);
            }
        });
    }

    #[test]
    fn in_flight_gpipe_is_m_and_one_f_one_b_is_k_minus_j() {
        for k in 1..=6 {
            for m in 1..=9 {
                let g = gpipe(k, m, CheckpointMode::Never).unwrap();
                assert_eq!(g.max_in_flight(), vec![m; k]);
                let o = one_f_one_b(k, m, CheckpointMode::Never).unwrap();
                let expected: Vec<usize> = (0..k).map(|j| (k - j).min(m)).collect();
                assert_eq!(o.max_in_flight(), expected, "K={k} M={m}");
            }
        }
    }

    #[test]
    fn display_prints_grid() {
        let text = gpipe(2, 3, CheckpointMode::Never).unwrap().to_string();
        let expected = "gpipe: K=2 stages, M=3 micro-batches, checkpoint=never\n\
                        stage 0 | F0 F1 F2 .. .. B2 B1 B0\n\
                        stage 1 | .. F0 F1 F2 B2 B1 B0 ..\n";
        assert_eq!(text, expected);
        let text = gpipe(1, 2, CheckpointMode::Always).unwrap().to_string();
        assert!(text.ends_with("stage 0 | F0 F1 R1 B1 R0 B0\n"), "{text}");
    }

    fn two_stage() -> Schedule {
        gpipe(2, 2, CheckpointMode::Never).unwrap()
    }

    #[test]
    fn rejects_wrong_stage_count() {
        let mut s = two_stage();
        s.stages.pop();
        let e = s.validate().unwrap_err();
        assert_eq!(
            e,
            ScheduleError::StageCount {
                declared: 2,
                found: 1
            }
        );
        assert!(e.to_string().contains("declares 2 stages"));
    }

    #[test]
    fn rejects_out_of_range_micro_batch() {
        let mut s = two_stage();
        s.stages[0].push(Action::Forward(7));
        let e = s.validate().unwrap_err();
        assert!(matches!(
            e,
            ScheduleError::MicroBatchOutOfRange { stage: 0, .. }
        ));
        assert!(e.to_string().contains("Forward(7)"), "{e}");
    }

    #[test]
    fn rejects_missing_and_duplicate_actions() {
        let mut s = two_stage();
        s.stages[1].retain(|a| *a != Action::Backward(0));
        assert_eq!(
            s.validate(),
            Err(ScheduleError::ActionCount {
                stage: 1,
                action: Action::Backward(0),
                found: 0,
                expected: 1
            })
        );
        let mut s = two_stage();
        s.stages[0].insert(0, Action::Forward(1));
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("Forward(1) occurs 2 times"), "{e}");
    }

    #[test]
    fn rejects_recompute_not_asked_for() {
        let mut s = two_stage();
        s.stages[0].insert(3, Action::Recompute(0));
        assert!(matches!(
            s.validate(),
            Err(ScheduleError::ActionCount {
                action: Action::Recompute(0),
                expected: 0,
                ..
            })
        ));
    }

    #[test]
    fn rejects_transfer_on_edge_stage() {
        let mut s = two_stage();
        s.stages[0].insert(0, Action::RecvActivation(0));
        let e = s.validate().unwrap_err();
        assert!(e.to_string().contains("stage 0: RecvActivation(0)"), "{e}");
    }

    #[test]
    fn rejects_backward_before_forward() {
        let mut s = gpipe(1, 1, CheckpointMode::Never).unwrap();
        s.stages[0].reverse();
        let e = s.validate().unwrap_err();
        assert_eq!(
            e,
            ScheduleError::Order {
                stage: 0,
                earlier: Action::Forward(0),
                later: Action::Backward(0)
            }
        );
        assert_eq!(
            e.to_string(),
            "stage 0: Forward(0) must come before Backward(0)"
        );
    }

    #[test]
    fn rejects_recompute_after_backward() {
        let mut s = gpipe(1, 1, CheckpointMode::Always).unwrap();
        s.stages[0] = vec![
            Action::Forward(0),
            Action::Backward(0),
            Action::Recompute(0),
        ];
        assert!(matches!(
            s.validate(),
            Err(ScheduleError::Order {
                earlier: Action::Recompute(0),
                later: Action::Backward(0),
                ..
            })
        ));
    }

    #[test]
    fn rejects_mismatched_link_order() {
        let mut s = two_stage();
        // Stage 1 receives micro-batch 1 before 0 (and runs its forwards in that order too).
        s.stages[1].swap(0, 2);
        s.stages[1].swap(1, 3);
        let e = s.validate().unwrap_err();
        assert_eq!(
            e,
            ScheduleError::UnmatchedTransfer {
                what: "activation",
                from_stage: 0,
                to_stage: 1,
                sent: vec![0, 1],
                received: vec![1, 0]
            }
        );
        assert!(e.to_string().contains("sends micro-batches [0, 1]"), "{e}");
    }

    #[test]
    fn detects_deadlock_and_names_stuck_stages() {
        use Action::*;
        // Stage 0 waits for the gradient of micro-batch 0 before sending micro-batch 1, but stage 1
        // only starts backward after both forwards.
        let s = Schedule {
            num_stages: 2,
            num_micro_batches: 2,
            checkpoint: CheckpointMode::Never,
            name: "bad".into(),
            stages: vec![
                vec![
                    Forward(0),
                    SendActivation(0),
                    RecvGrad(0),
                    Backward(0),
                    Forward(1),
                    SendActivation(1),
                    RecvGrad(1),
                    Backward(1),
                ],
                vec![
                    RecvActivation(0),
                    Forward(0),
                    RecvActivation(1),
                    Forward(1),
                    Backward(0),
                    SendGrad(0),
                    Backward(1),
                    SendGrad(1),
                ],
            ],
        };
        let e = s.validate().unwrap_err();
        assert_eq!(
            e,
            ScheduleError::Deadlock {
                stuck: vec![(0, RecvGrad(0)), (1, RecvActivation(1))]
            }
        );
        let msg = e.to_string();
        assert!(msg.contains("stage 0 waits at RecvGrad(0)"), "{msg}");
        assert!(msg.contains("stage 1 waits at RecvActivation(1)"), "{msg}");
        // The grid shows what could run before the deadlock.
        let grid = s.clock_grid();
        assert_eq!(grid[0].iter().flatten().count(), 1);
        assert_eq!(grid[1].iter().flatten().count(), 1);
    }

    #[test]
    fn errors_are_std_errors() {
        fn takes(_: &dyn std::error::Error) {}
        takes(&ScheduleError::NoStages);
        assert!(ScheduleError::NoMicroBatches.to_string().contains("M = 0"));
    }
}
