//! Pipeline schedules as data.
//!
//! The model is cut into S virtual stages (model pieces, in model order); `placement[s]` is the
//! device that holds stage s, and a device may hold several (its chunks: v per device for the
//! looped placement of interleaved schedules, 2 in a V for ZB-V and DualPipeV). A schedule is, for
//! each device, the ordered list of [`Action`]s it performs in one training step over M
//! micro-batches. The executor only walks these lists, so everything that can go wrong with
//! ordering (a missing send, a receive that can never be satisfied, a deadlock) is caught by
//! [`Schedule::validate`] before any device does work.
//!
//! One vocabulary serves every schedule: forward, recompute, full backward, or a backward split
//! into its input part (I) and its deferred weight part (W), and sends and receives of
//! activations and gradients, each naming its virtual stage and micro-batch. The peer of a
//! transfer is the neighbouring stage (s+1 for activations, s-1 for gradients), wherever it is
//! placed: a [`Link`] names the channel. Generators (`generators`) build the usual schedules;
//! users can build their own, from compute-only lists ([`Schedule::from_compute`]) or from a
//! text listing ([`Schedule::parse`]).

mod generators;
mod kind;
pub mod random;
mod skips;
pub mod synth;
mod text;
mod validate;

#[cfg(test)]
mod tests;

use std::fmt;

pub use generators::{
    dual_pipe_v, gpipe, interleaved_one_f_one_b, looped_bfs, one_f_one_b, zb_h1, zb_h2, zb_v,
    Placement,
};
pub use kind::{ChunkRule, ScheduleDef, ScheduleKind, SCHEDULES};
pub use skips::SkipLink;
pub use synth::{StageCosts, SynthError, SynthSpec};

pub use validate::ScheduleError;

/// Which micro-batches are re-materialized (torchgpipe's `checkpoint` argument).
///
/// A checkpointed micro-batch keeps only its stage input during the forward pass and re-runs the
/// forward with recording ([`ActionKind::Recompute`]) before its backward, trading compute for
/// memory. The executor reads this from the schedule's `Recompute` actions, not from the mode.
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

impl CheckpointMode {
    pub const ALL: [CheckpointMode; 3] = [
        CheckpointMode::Always,
        CheckpointMode::ExceptLast,
        CheckpointMode::Never,
    ];

    /// Its name (`--checkpoint`, reports).
    pub fn name(self) -> &'static str {
        match self {
            CheckpointMode::Always => "always",
            CheckpointMode::ExceptLast => "except-last",
            CheckpointMode::Never => "never",
        }
    }

    /// What it does, in one line (`--help`).
    pub fn summary(self) -> &'static str {
        match self {
            CheckpointMode::Always => "every micro-batch is re-materialized",
            CheckpointMode::ExceptLast => {
                "every micro-batch but the last (which keeps its tape) is re-materialized"
            }
            CheckpointMode::Never => "no re-materialization: every forward keeps its tape",
        }
    }
}

impl fmt::Display for CheckpointMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CheckpointMode {
    type Err = ScheduleError;

    /// A mode by its name (torchgpipe's `except_last` is taken too).
    fn from_str(s: &str) -> Result<Self, ScheduleError> {
        let s = s.replace('_', "-");
        CheckpointMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or(ScheduleError::UnknownCheckpointMode { asked: s })
    }
}

/// What an action does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Runs the stage on the micro-batch; records a tape unless a `Recompute` of the same stage
    /// and micro-batch follows in the device's list, in which case only the input is kept.
    Forward,
    /// Re-runs a checkpointed forward with recording, before its backward.
    Recompute,
    /// The whole backward: input gradient (sent to the previous stage) and parameter gradients.
    Backward,
    /// The input part of a split backward ("B" in Qi et al., "I" in torch): the input gradient
    /// only; what the weight part needs is kept.
    BackwardInput,
    /// The weight part of a split backward ("W"): the parameter gradients of an earlier
    /// `BackwardInput`.
    BackwardWeight,
    /// Sends the stage output to stage s+1.
    SendActivation,
    /// Receives the stage input from stage s-1.
    RecvActivation,
    /// Sends the gradient of the stage input to stage s-1.
    SendGrad,
    /// Receives the gradient of the stage output from stage s+1.
    RecvGrad,
    /// Sends a skip this stage stashed to the stage that pops it (the action's `skip` names
    /// both), right after the forward that made it.
    SendSkip,
    /// Receives a skip from the stage that stashed it, before the forward that pops it.
    RecvSkip,
    /// Sends the gradient of a popped skip back to the stage that stashed it, after the
    /// backward (or its input part).
    SendSkipGrad,
    /// Receives the gradient of a stashed skip, before the backward (or its input part).
    RecvSkipGrad,
    /// Timelines and traces only (no schedule holds it): the exchange that sums the gradients
    /// of tied parameters across the devices holding copies, after the step's last backward.
    ExchangeTied,
}

impl ActionKind {
    /// The kinds of a chain (every stage has them, for every micro-batch); skip transfers
    /// ([`ActionKind::SKIPS`]) come on top where the model has skips.
    pub const ALL: [ActionKind; 9] = [
        ActionKind::Forward,
        ActionKind::Recompute,
        ActionKind::Backward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::SendActivation,
        ActionKind::RecvActivation,
        ActionKind::SendGrad,
        ActionKind::RecvGrad,
    ];

    /// The transfers of skips (see [`SkipLink`]).
    pub const SKIPS: [ActionKind; 4] = [
        ActionKind::SendSkip,
        ActionKind::RecvSkip,
        ActionKind::SendSkipGrad,
        ActionKind::RecvSkipGrad,
    ];

    /// The token used in listings, as torch's pipelining writes them (`F`, `R`, `B`, `I`, `W`,
    /// `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`).
    pub fn token(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Recompute => "R",
            ActionKind::Backward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendActivation => "SEND_F",
            ActionKind::RecvActivation => "RECV_F",
            ActionKind::SendGrad => "SEND_B",
            ActionKind::RecvGrad => "RECV_B",
            ActionKind::SendSkip => "SEND_S",
            ActionKind::RecvSkip => "RECV_S",
            ActionKind::SendSkipGrad => "SEND_SB",
            ActionKind::RecvSkipGrad => "RECV_SB",
            ActionKind::ExchangeTied => "TIED",
        }
    }

    /// Whether the action occupies the device (as opposed to moving data).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::Recompute
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }

    /// The category of the action in traces and timelines: the compute kinds by name
    /// (`forward`, `recompute`, `backward`, `backward-input`, `backward-weight`), every send
    /// and receive `transfer`.
    pub fn category(self) -> &'static str {
        match self {
            ActionKind::Forward => "forward",
            ActionKind::Recompute => "recompute",
            ActionKind::Backward => "backward",
            ActionKind::BackwardInput => "backward-input",
            ActionKind::BackwardWeight => "backward-weight",
            ActionKind::ExchangeTied => "tied-exchange",
            _ => "transfer",
        }
    }

    /// One letter as in the grid: `F`, `R`, `B`, `I`, `W`, and `T` for transfers.
    pub fn letter(self) -> char {
        match self {
            ActionKind::Forward => 'F',
            ActionKind::Recompute => 'R',
            ActionKind::Backward => 'B',
            ActionKind::BackwardInput => 'I',
            ActionKind::BackwardWeight => 'W',
            ActionKind::ExchangeTied => 'X',
            _ => 'T',
        }
    }

    /// The send that carries what this receive waits for (a send itself for sends).
    pub fn as_send(self) -> ActionKind {
        match self {
            ActionKind::RecvActivation => ActionKind::SendActivation,
            ActionKind::RecvGrad => ActionKind::SendGrad,
            ActionKind::RecvSkip => ActionKind::SendSkip,
            ActionKind::RecvSkipGrad => ActionKind::SendSkipGrad,
            other => other,
        }
    }

    /// Whether the action sends a message (never blocks).
    pub fn is_send(self) -> bool {
        matches!(
            self,
            ActionKind::SendActivation
                | ActionKind::SendGrad
                | ActionKind::SendSkip
                | ActionKind::SendSkipGrad
        )
    }

    /// Whether the action waits for a message.
    pub fn is_recv(self) -> bool {
        matches!(
            self,
            ActionKind::RecvActivation
                | ActionKind::RecvGrad
                | ActionKind::RecvSkip
                | ActionKind::RecvSkipGrad
        )
    }

    /// Whether the action moves a gradient (as opposed to a forward value).
    pub fn carries_grad(self) -> bool {
        matches!(
            self,
            ActionKind::SendGrad
                | ActionKind::RecvGrad
                | ActionKind::SendSkipGrad
                | ActionKind::RecvSkipGrad
        )
    }

    /// Whether the action belongs to the backward pass (for memory tags and colours).
    pub fn is_backward(self) -> bool {
        matches!(
            self,
            ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
                | ActionKind::SendGrad
                | ActionKind::RecvGrad
                | ActionKind::SendSkipGrad
                | ActionKind::RecvSkipGrad
        )
    }
}

/// One step of one device: `kind` on virtual stage `stage` for micro-batch `micro_batch`.
/// Displayed as torch's pipelining writes actions: stage, token, micro-batch (`2F0`, `1SEND_B3`);
/// a skip transfer adds its skip and the other stage (`0SEND_S3[skip 1 -> 2]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    pub kind: ActionKind,
    pub stage: usize,
    pub micro_batch: usize,
    /// The skip a skip transfer moves (`None` for every other action).
    pub skip: Option<SkipPort>,
}

/// The skip of a skip transfer: its id (an index into the pipeline's skip links) and the stage
/// at the other end (the consumer for sends of the skip, the producer for its gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SkipPort {
    pub id: usize,
    pub peer: usize,
}

impl Action {
    pub const fn new(kind: ActionKind, stage: usize, micro_batch: usize) -> Action {
        Action {
            kind,
            stage,
            micro_batch,
            skip: None,
        }
    }

    /// A skip transfer (`kind` one of [`ActionKind::SKIPS`]) of skip `id` between `stage` and
    /// `peer`.
    pub const fn skip_transfer(
        kind: ActionKind,
        stage: usize,
        micro_batch: usize,
        id: usize,
        peer: usize,
    ) -> Action {
        Action {
            kind,
            stage,
            micro_batch,
            skip: Some(SkipPort { id, peer }),
        }
    }

    pub fn is_compute(self) -> bool {
        self.kind.is_compute()
    }

    /// The channel a transfer uses; `None` for compute actions. Stages at the ends of the model
    /// have no peer on one side: the link is then `None` too.
    pub fn link(self, num_stages: usize) -> Option<Link> {
        let s = self.stage;
        if let Some(SkipPort { id, peer }) = self.skip {
            let grad = self.kind.carries_grad();
            let (from, to) = match self.kind {
                ActionKind::SendSkip | ActionKind::SendSkipGrad => (s, peer),
                ActionKind::RecvSkip | ActionKind::RecvSkipGrad => (peer, s),
                _ => return None,
            };
            return (peer < num_stages).then_some(Link {
                from,
                to,
                grad,
                skip: Some(id),
            });
        }
        let (from, to, grad) = match self.kind {
            ActionKind::SendActivation if s + 1 < num_stages => (s, s + 1, false),
            ActionKind::RecvActivation if s > 0 => (s - 1, s, false),
            ActionKind::SendGrad if s > 0 => (s, s - 1, true),
            ActionKind::RecvGrad if s + 1 < num_stages => (s + 1, s, true),
            _ => return None,
        };
        Some(Link {
            from,
            to,
            grad,
            skip: None,
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.token(), self.micro_batch)?;
        match self.skip {
            Some(SkipPort { id, peer }) => write!(f, "[skip {id} <-> {peer}]"),
            None => Ok(()),
        }
    }
}

/// A directed channel between two virtual stages: activations go from s to s+1, gradients from
/// s+1 to s; a skip goes from the stage that stashes it to the one that pops it (any later
/// stage), its gradient back. The executor opens exactly the links a schedule's transfers name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Link {
    pub from: usize,
    pub to: usize,
    /// Gradients (backward) rather than activations (forward).
    pub grad: bool,
    /// The skip this link carries (its id), `None` for the chain's activations and gradients.
    pub skip: Option<usize>,
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = if self.grad {
            "gradients"
        } else {
            "activations"
        };
        write!(f, "stage {}->{} ", self.from, self.to)?;
        if let Some(id) = self.skip {
            write!(f, "skip {id} ")?;
        }
        f.write_str(what)
    }
}

/// Per-device action lists for one training step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub name: String,
    pub num_micro_batches: usize,
    /// The device of each virtual stage, in model order.
    pub placement: Vec<usize>,
    /// Each device's actions, in the order it runs them.
    pub devices: Vec<Vec<Action>>,
    /// A declared bound on each device's micro-batches in flight (see
    /// [`Schedule::max_in_flight`]); `validate` rejects a schedule that exceeds it.
    pub in_flight_limit: Option<Vec<usize>>,
}

impl Schedule {
    /// A schedule from compute-only lists (F, R, B, I, W per device): the sends and receives
    /// are inserted as the executor needs them, like torch's pipelining runtime does: a receive
    /// of the input right before each forward, of the output gradient right before each backward
    /// (after a recompute, so that the recompute overlaps the wait), and a send right after the
    /// action that produced the tensor. The result still has to pass [`Schedule::validate`].
    pub fn from_compute(
        name: impl Into<String>,
        num_micro_batches: usize,
        placement: Vec<usize>,
        compute: Vec<Vec<Action>>,
    ) -> Schedule {
        let last = placement.len().saturating_sub(1);
        let devices = compute
            .into_iter()
            .map(|list| {
                let mut out = Vec::with_capacity(list.len() * 2);
                for a in list {
                    let (s, m) = (a.stage, a.micro_batch);
                    let with = |kind| Action::new(kind, s, m);
                    match a.kind {
                        ActionKind::Forward => {
                            if s > 0 {
                                out.push(with(ActionKind::RecvActivation));
                            }
                            out.push(a);
                            if s < last {
                                out.push(with(ActionKind::SendActivation));
                            }
                        }
                        ActionKind::Backward | ActionKind::BackwardInput => {
                            if s < last {
                                out.push(with(ActionKind::RecvGrad));
                            }
                            out.push(a);
                            if s > 0 {
                                out.push(with(ActionKind::SendGrad));
                            }
                        }
                        _ => out.push(a),
                    }
                }
                out
            })
            .collect();
        Schedule {
            name: name.into(),
            num_micro_batches,
            placement,
            devices,
            in_flight_limit: None,
        }
    }

    /// K: the number of devices.
    pub fn num_devices(&self) -> usize {
        self.devices.len()
    }

    /// S: the number of virtual stages (K × chunks per device for the usual placements).
    pub fn num_stages(&self) -> usize {
        self.placement.len()
    }

    /// The forwards of this schedule alone (evaluation, generation): every device keeps its
    /// forwards, activation and skip transfers in their order and drops the rest (recomputes,
    /// backwards, gradient transfers). Each kept action waits only on kept actions that came
    /// before it in a run of the whole schedule, so a schedule that passed [`Schedule::validate`]
    /// gives one that cannot deadlock, whatever its kind (GPipe to ZB-V).
    pub fn forward_only(&self) -> Schedule {
        let keep = |a: &Action| {
            matches!(
                a.kind,
                ActionKind::Forward
                    | ActionKind::SendActivation
                    | ActionKind::RecvActivation
                    | ActionKind::SendSkip
                    | ActionKind::RecvSkip
            )
        };
        Schedule {
            name: format!("{} (forward only)", self.name),
            num_micro_batches: self.num_micro_batches,
            placement: self.placement.clone(),
            devices: self
                .devices
                .iter()
                .map(|list| list.iter().copied().filter(keep).collect())
                .collect(),
            // Nothing is kept between a forward and a backward: nothing stays in flight.
            in_flight_limit: None,
        }
    }

    /// The virtual stages device `device` holds, in model order (its chunks).
    pub fn stages_of(&self, device: usize) -> Vec<usize> {
        (0..self.num_stages())
            .filter(|&s| self.placement[s] == device)
            .collect()
    }

    /// The chunk index of stage `stage` on its device (its rank among the device's stages).
    pub fn chunk_of(&self, stage: usize) -> usize {
        let d = self.placement[stage];
        self.placement[..stage].iter().filter(|&&p| p == d).count()
    }

    /// The largest number of chunks any device holds.
    pub fn max_chunks(&self) -> usize {
        (0..self.num_devices())
            .map(|d| self.stages_of(d).len())
            .max()
            .unwrap_or(0)
    }

    /// Whether any backward is split into input and weight parts.
    pub fn splits_backward(&self) -> bool {
        self.actions()
            .any(|(_, a)| a.kind == ActionKind::BackwardInput)
    }

    /// Every action with its device.
    pub fn actions(&self) -> impl Iterator<Item = (usize, Action)> + '_ {
        self.devices
            .iter()
            .enumerate()
            .flat_map(|(d, list)| list.iter().map(move |&a| (d, a)))
    }

    /// The links the schedule's transfers use (each once, sorted).
    pub fn links(&self) -> Vec<Link> {
        let s = self.num_stages();
        let mut links: Vec<Link> = self.actions().filter_map(|(_, a)| a.link(s)).collect();
        links.sort();
        links.dedup();
        links
    }

    /// Per device, the largest number of (stage, micro-batch) pairs whose forward has run and
    /// whose backward has not finished (the end of `Backward`, or of `BackwardWeight` when split):
    /// the stashed inputs or tapes that bound activation memory. A pair of a chunk counts once,
    /// though a chunk holds only its share of the device's layers.
    pub fn max_in_flight(&self) -> Vec<usize> {
        self.devices
            .iter()
            .map(|actions| {
                let mut live = 0usize;
                let mut peak = 0usize;
                for a in actions {
                    match a.kind {
                        ActionKind::Forward => {
                            live += 1;
                            peak = peak.max(live);
                        }
                        ActionKind::Backward | ActionKind::BackwardWeight => {
                            live = live.saturating_sub(1)
                        }
                        _ => {}
                    }
                }
                peak
            })
            .collect()
    }

    /// Unit-time picture of the schedule: `grid[device][tick]` is the compute action that starts
    /// at that tick. Every compute action takes one tick and transfers take none, so a receive
    /// waits exactly for its producer's compute. A schedule that deadlocks is drawn up to where
    /// it stops.
    pub fn clock_grid(&self) -> Vec<Vec<Option<Action>>> {
        let k = self.num_devices();
        let mut clock = vec![0usize; k];
        let mut placed: Vec<Vec<(usize, Action)>> = vec![Vec::new(); k];
        let _ = self.drive(|device, action, incoming: Option<usize>| {
            if let Some(arrival) = incoming {
                clock[device] = clock[device].max(arrival);
            }
            if action.is_compute() {
                placed[device].push((clock[device], action));
                clock[device] += 1;
            }
            clock[device]
        });
        let width = clock.iter().copied().max().unwrap_or(0);
        placed
            .into_iter()
            .map(|cells| {
                let mut row = vec![None; width];
                for (tick, a) in cells {
                    row[tick] = Some(a);
                }
                row
            })
            .collect()
    }

    /// The grid label of a compute action: its letter and micro-batch, and the chunk (`c1`) when
    /// a device holds several stages.
    pub fn cell_label(&self, a: Action) -> String {
        if self.max_chunks() > 1 {
            format!(
                "{}{}c{}",
                a.kind.token(),
                a.micro_batch,
                self.chunk_of(a.stage)
            )
        } else {
            format!("{}{}", a.kind.token(), a.micro_batch)
        }
    }
}

impl fmt::Display for Schedule {
    /// A header line, then one row per device with one column per unit clock tick (`F`orward,
    /// `B`ackward, `I`nput / `W`eight backward, `R`ecompute + micro-batch, `c`hunk when devices
    /// hold several stages; `..` when idle).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let recomputes = self
            .actions()
            .filter(|(_, a)| a.kind == ActionKind::Recompute)
            .count();
        writeln!(
            f,
            "{}: K={} devices, {} stages, M={} micro-batches, {recomputes} recomputes",
            self.name,
            self.num_devices(),
            self.num_stages(),
            self.num_micro_batches,
        )?;
        let grid = self.clock_grid();
        let labels: Vec<Vec<String>> = grid
            .iter()
            .map(|row| {
                row.iter()
                    .map(|c| c.map_or_else(|| "..".to_string(), |a| self.cell_label(a)))
                    .collect()
            })
            .collect();
        let width = labels.iter().flatten().map(String::len).max().unwrap_or(2);
        let dev_width = grid.len().saturating_sub(1).to_string().len();
        for (device, row) in labels.iter().enumerate() {
            let cells: Vec<String> = row.iter().map(|l| format!("{l:<width$}")).collect();
            let line = format!("device {device:>dev_width$} | {}", cells.join(" "));
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}
