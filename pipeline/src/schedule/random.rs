//! Random valid schedules.

use wgpipe_tensor::rng::SplitMix64;

use super::{Action, ActionKind, Schedule};

/// The test generator: splitmix64 with `below` as an index.
pub(crate) struct Rng(pub SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }
}

/// A random valid schedule, for fuzzing executors and validators (the same seed gives the
/// same schedule): random K, chunks and placement (every device at least one stage),
/// M, split or full backward and recompute per (stage, micro-batch), and a random execution
/// order consistent with the dependencies (each step, a random device runs a random ready
/// action), so it is deadlock-free by construction; transfers are inserted after.
pub fn random_schedule(seed: u64) -> Schedule {
    let rng = &mut Rng::new(seed);
    let k = 1 + rng.below(4);
    let s_total = k * (1 + rng.below(3));
    let mut placement: Vec<usize> = (0..s_total)
        .map(|s| if s < k { s } else { rng.below(k) })
        .collect();
    for i in (1..s_total).rev() {
        let j = rng.below(i + 1);
        placement.swap(i, j);
    }
    let m = 1 + rng.below(5);
    let split: Vec<Vec<bool>> = (0..s_total)
        .map(|_| (0..m).map(|_| rng.below(2) == 0).collect())
        .collect();
    let recompute: Vec<Vec<bool>> = (0..s_total)
        .map(|_| (0..m).map(|_| rng.below(3) == 0).collect())
        .collect();
    // Per (stage, micro-batch): 0 nothing yet, 1 forward done, 2 recomputed (if asked),
    // 3 backward / input done, 4 weight done.
    let mut state = vec![vec![0u8; m]; s_total];
    let mut lists: Vec<Vec<Action>> = vec![Vec::new(); k];
    let last = s_total - 1;
    loop {
        let mut ready: Vec<Action> = Vec::new();
        for s in 0..s_total {
            for mb in 0..m {
                let st = state[s][mb];
                let a = |kind| Action::new(kind, s, mb);
                match st {
                    0 if s == 0 || state[s - 1][mb] >= 1 => ready.push(a(ActionKind::Forward)),
                    1 if recompute[s][mb] => ready.push(a(ActionKind::Recompute)),
                    1 | 2 if s == last || state[s + 1][mb] >= 3 => ready.push(a(if split[s][mb] {
                        ActionKind::BackwardInput
                    } else {
                        ActionKind::Backward
                    })),
                    3 if split[s][mb] => ready.push(a(ActionKind::BackwardWeight)),
                    _ => {}
                }
            }
        }
        if ready.is_empty() {
            break;
        }
        let a = ready[rng.below(ready.len())];
        let st = &mut state[a.stage][a.micro_batch];
        *st = match a.kind {
            ActionKind::Forward => 1,
            ActionKind::Recompute => 2,
            ActionKind::Backward | ActionKind::BackwardInput => 3,
            _ => 4,
        };
        lists[placement[a.stage]].push(a);
    }
    Schedule::from_compute("random", m, placement, lists)
}
