//! The registry of generated schedules: one [`ScheduleDef`] per schedule, holding everything
//! the builder, the planner, the command line, the reports and the benchmarks know of it (its
//! name, how many chunks it places per device and where, its generator, its closed-form bubble,
//! a one-line summary and its source). Nothing else in the workspace matches on a schedule, so
//! a new schedule is its generator (in `generators.rs` or a file of its own) plus its variant
//! and its entry here.

use std::fmt;
use std::str::FromStr;

use super::synth::synthesized;
use super::{
    dual_pipe_v, gpipe, interleaved_one_f_one_b, looped_bfs, one_f_one_b, zb_h1, zb_h2, zb_v,
    CheckpointMode, Placement, Schedule, ScheduleError,
};

/// Which generated schedule to run (see [`SCHEDULES`] for each one's name, bubble and source).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    GPipe,
    OneFOneB,
    Interleaved1F1B,
    LoopedBfs,
    ZbH1,
    ZbH2,
    ZbV,
    DualPipeV,
    /// Built by the synthesizer (`schedule::synth`, searched with costs by `sim::synth`)
    /// rather than by a fixed construction.
    Synthesized,
}

/// How many chunks (virtual stages) a schedule places on each device, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkRule {
    /// One stage per device (the plain layout).
    One,
    /// Any number v >= 1 of chunks in the looped placement (chunk c of device d is stage
    /// cK + d), `default` when the builder is not told.
    Looped { default: usize },
    /// Two chunks per device in a V (device d holds stages d and 2K-1-d).
    V,
    /// One stage per device, or two in a V: the placements the synthesizer schedules on.
    OneOrV { default: usize },
}

impl ChunkRule {
    /// Chunks per device when the builder is not told.
    pub fn default_chunks(self) -> usize {
        match self {
            ChunkRule::One => 1,
            ChunkRule::Looped { default } => default,
            ChunkRule::V => 2,
            ChunkRule::OneOrV { default } => default,
        }
    }

    /// Where the stages of `chunks` chunks per device go.
    pub fn placement(self, chunks: usize) -> Placement {
        match self {
            ChunkRule::V => Placement::V,
            ChunkRule::OneOrV { .. } if chunks == 2 => Placement::V,
            ChunkRule::One | ChunkRule::Looped { .. } | ChunkRule::OneOrV { .. } => {
                Placement::Looped { chunks }
            }
        }
    }

    /// The chunk counts a planner tries on `k` devices, from the looped counts it was given:
    /// chunks on one device would only add transfers, so only the plain layout runs on one.
    pub fn planner_choices(self, k: usize, looped: &[usize]) -> Vec<usize> {
        match self {
            ChunkRule::One => vec![1],
            ChunkRule::OneOrV { .. } if k <= 1 => vec![1],
            ChunkRule::OneOrV { .. } => vec![1, 2],
            _ if k <= 1 => Vec::new(),
            ChunkRule::Looped { .. } => looped.to_vec(),
            ChunkRule::V => vec![2],
        }
    }

    /// The one check of a chunk count, for every caller (builder, planner, command line).
    pub fn check(self, schedule: &'static str, chunks: usize) -> Result<(), ScheduleError> {
        let allowed = match self {
            ChunkRule::One if chunks != 1 => "exactly 1",
            ChunkRule::V if chunks != 2 => "exactly 2",
            ChunkRule::Looped { .. } if chunks == 0 => "at least 1",
            ChunkRule::OneOrV { .. } if chunks != 1 && chunks != 2 => "1 or 2",
            _ => return Ok(()),
        };
        Err(ScheduleError::ChunkCount {
            schedule,
            allowed,
            asked: chunks,
        })
    }
}

/// Everything known of one generated schedule.
pub struct ScheduleDef {
    pub kind: ScheduleKind,
    /// Its name everywhere a user types or reads it (`--schedule`, reports, traces).
    pub name: &'static str,
    /// One line: what it does and what it costs.
    pub summary: &'static str,
    /// Where it comes from.
    pub source: &'static str,
    pub chunks: ChunkRule,
    /// The generator for (K, chunks per device, M, checkpoint mode); the chunk count has passed
    /// [`ChunkRule::check`].
    pub generate: fn(usize, usize, usize, CheckpointMode) -> Result<Schedule, ScheduleError>,
    /// The bubble with equal costs for (K, M, chunks), and which measure it is ("step": the idle
    /// share of the whole step; "steady": inside each device's span, see `generators`).
    pub bubble: fn(f64, f64, f64) -> (f64, &'static str),
    /// Whether, in the planner's compute bound, each device also waits for the backwards of the
    /// stages before it (the plain fill-drain and 1F1B orders, where nothing fills that tail).
    pub backward_tail: bool,
}

/// The fill-drain bubble (K-1)/(vM+K-1) of GPipe, 1F1B and their looped variants.
fn fill_drain(k: f64, m: f64, v: f64) -> (f64, &'static str) {
    ((k - 1.0) / (v * m + k - 1.0), "step")
}

/// The schedules, in the order they are offered and listed.
pub static SCHEDULES: [ScheduleDef; 9] = [
    ScheduleDef {
        kind: ScheduleKind::GPipe,
        name: "gpipe",
        summary: "fill-drain: all forwards, then all backwards",
        source: "Huang et al. 2019, GPipe; torchgpipe",
        chunks: ChunkRule::One,
        generate: |k, _, m, mode| gpipe(k, m, mode),
        bubble: fill_drain,
        backward_tail: true,
    },
    ScheduleDef {
        kind: ScheduleKind::OneFOneB,
        name: "1f1b",
        summary: "one forward, one backward (PipeDream-Flush): at most K micro-batches alive",
        source: "Narayanan et al. 2021, PipeDream-2BW / PipeDream-Flush",
        chunks: ChunkRule::One,
        generate: |k, _, m, mode| one_f_one_b(k, m, mode),
        bubble: fill_drain,
        backward_tail: true,
    },
    ScheduleDef {
        kind: ScheduleKind::Interleaved1F1B,
        name: "interleaved-1f1b",
        summary: "Megatron's interleaved 1F1B over --chunks virtual stages per device",
        source: "Narayanan et al. SC'21 (Megatron-LM)",
        chunks: ChunkRule::Looped { default: 2 },
        generate: interleaved_one_f_one_b,
        bubble: fill_drain,
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::LoopedBfs,
        name: "looped-bfs",
        summary: "breadth-first over --chunks virtual stages per device",
        source: "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism",
        chunks: ChunkRule::Looped { default: 2 },
        generate: looped_bfs,
        bubble: fill_drain,
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::ZbH1,
        name: "zb-h1",
        summary: "zero bubble H1: split backward, 1F1B memory, a third of 1F1B's bubble",
        source: "Qi et al. ICLR'24, Zero Bubble Pipeline Parallelism",
        chunks: ChunkRule::One,
        generate: |k, _, m, mode| zb_h1(k, m, mode),
        bubble: |k, m, _| ((k - 1.0) / (3.0 * m + k - 1.0), "step"),
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::ZbH2,
        name: "zb-h2",
        summary: "zero bubble H2: split backward, about twice 1F1B's memory, no steady bubble",
        source: "Qi et al. ICLR'24, Zero Bubble Pipeline Parallelism",
        chunks: ChunkRule::One,
        generate: |k, _, m, mode| zb_h2(k, m, mode),
        bubble: |_, _, _| (0.0, "steady"),
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::ZbV,
        name: "zb-v",
        summary: "zero bubble V: two chunks per device in a V, 1F1B memory, no steady bubble",
        source: "Qi et al. 2024, Pipeline Parallelism with Controllable Memory",
        chunks: ChunkRule::V,
        generate: |k, _, m, mode| zb_v(k, m, mode),
        bubble: |_, _, _| (0.0, "steady"),
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::DualPipeV,
        name: "dualpipe-v",
        summary: "DualPipeV: two chunks per device in a V, split backward (needs M >= 2K)",
        source: "DeepSeek-V3 technical report (DualPipe), cut in half",
        chunks: ChunkRule::V,
        generate: |k, _, m, mode| dual_pipe_v(k, m, mode),
        bubble: |_, _, _| (0.0, "steady"),
        backward_tail: false,
    },
    ScheduleDef {
        kind: ScheduleKind::Synthesized,
        name: "synth",
        summary: "synthesized from the costs (greedy F/I/W placement under a memory cap, the \
                  best of many policies and of the generators; equal costs and 1F1B's memory \
                  when no costs are given); one stage per device or two in a V",
        source: "Qi et al. ICLR'24, Zero Bubble Pipeline Parallelism, automatic scheduling",
        chunks: ChunkRule::OneOrV { default: 2 },
        generate: synthesized,
        // With equal costs on the V its step is ZB-V's (a test holds it for K <= 6), though it
        // may leave a little idle inside the spans: it is chosen by its step alone.
        bubble: |k, m, _| ((k - 1.0) / (6.0 * m + k - 1.0), "step"),
        backward_tail: false,
    },
];

impl ScheduleKind {
    /// Every schedule, in the registry's order.
    pub const ALL: [ScheduleKind; SCHEDULES.len()] = {
        let mut all = [ScheduleKind::GPipe; SCHEDULES.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = SCHEDULES[i].kind;
            i += 1;
        }
        all
    };

    /// This schedule's registry entry.
    pub fn def(self) -> &'static ScheduleDef {
        // The registry lists the variants in declaration order (a test holds it).
        &SCHEDULES[self as usize]
    }

    /// Its name (`--schedule`, reports, traces).
    pub fn name(self) -> &'static str {
        self.def().name
    }

    /// Chunks per device this schedule uses when the builder is not told (`chunks(v)`).
    pub fn default_chunks(self) -> usize {
        self.def().chunks.default_chunks()
    }

    /// Generates the schedule for `k` devices, `chunks` per device and `m` micro-batches.
    pub fn generate(
        self,
        k: usize,
        chunks: usize,
        m: usize,
        mode: CheckpointMode,
    ) -> Result<Schedule, ScheduleError> {
        let def = self.def();
        def.chunks.check(def.name, chunks)?;
        (def.generate)(k, chunks, m, mode)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// A schedule by its registry name (as `--schedule` takes it).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SCHEDULES
            .iter()
            .find(|d| d.name == s)
            .map(|d| d.kind)
            .ok_or_else(|| ScheduleError::UnknownKind {
                asked: s.to_string(),
                known: SCHEDULES
                    .iter()
                    .map(|d| d.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_lists_every_variant_once_in_declaration_order() {
        for (i, def) in SCHEDULES.iter().enumerate() {
            assert_eq!(def.kind as usize, i, "{}", def.name);
            assert_eq!(def.name.parse::<ScheduleKind>().unwrap(), def.kind);
        }
        let e = "zb-w".parse::<ScheduleKind>().unwrap_err().to_string();
        assert!(e.contains("zb-w") && e.contains("dualpipe-v"), "{e}");
    }

    #[test]
    fn chunk_counts_are_checked_by_the_rule() {
        let e = ScheduleKind::GPipe
            .generate(2, 2, 4, CheckpointMode::Never)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "the gpipe schedule places exactly 1 chunk(s) per device; 2 were asked for"
        );
        let e = ScheduleKind::LoopedBfs
            .generate(2, 0, 4, CheckpointMode::Never)
            .unwrap_err();
        assert!(e.to_string().contains("at least 1"), "{e}");
        for kind in ScheduleKind::ALL {
            let v = kind.default_chunks();
            let s = kind.generate(3, v, 6, CheckpointMode::Never).unwrap();
            assert_eq!(s.num_stages(), 3 * v, "{kind}");
            assert_eq!(s.placement, kind.def().chunks.placement(v).devices(3));
        }
    }
}
