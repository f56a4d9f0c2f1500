//! The placer's choices: one [`Policy`] per variant, and the lists of them a search tries.

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
/// 33's grid and are left to callers of [`super::place`].)
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
