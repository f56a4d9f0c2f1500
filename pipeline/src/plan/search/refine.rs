//! Moving stage boundaries one layer at a time: toward fitting memory where nothing fits
//! (repair), and toward a shorter step for the best few structures (refinement).

use super::{count_compositions, Search};
use crate::plan::cost::Candidate;

/// Stages beyond which [`memory_moves`] moves a layer only to a stage at most two away.
const FAR_MOVES_UP_TO: usize = 16;

/// The balances one move from `balance`: one layer taken from a stage and given to another,
/// the stages between them each shifted by one layer. Moves between distant stages change
/// which layers a device with several chunks holds where moves between neighbours would first
/// have to grow it; past [`FAR_MOVES_UP_TO`] stages, only moves to a stage at most two away
/// (a boundary moved, or a stage slid by one layer) keep each pass linear in the stages.
fn memory_moves(balance: &[usize]) -> Vec<Vec<usize>> {
    let s = balance.len();
    let reach = if s <= FAR_MOVES_UP_TO { s } else { 2 };
    let mut out = Vec::new();
    for from in (0..s).filter(|&f| balance[f] > 1) {
        for to in from.saturating_sub(reach)..(from + reach + 1).min(s) {
            if to != from {
                let mut b = balance.to_vec();
                b[from] -= 1;
                b[to] += 1;
                out.push(b);
            }
        }
    }
    out
}

/// Whether peak / capacity ratios `a` (largest first) are closer to fitting than `b`.
pub(super) fn closer_to_fitting(a: &[f64], b: &[f64]) -> bool {
    a.iter()
        .zip(b)
        .find(|(x, y)| x != y)
        .is_some_and(|(x, y)| x < y)
}

impl Search<'_, '_> {
    /// The heuristic balances (pace, compute and memory min-max) weigh each stage alone, while
    /// a device's memory holds all its chunks and its schedule's in-flight micro-batches: they
    /// can all overflow a device where another balance fits. For each structure none of whose
    /// balances fit (fastest bound first, while the bound can beat the plans worth showing),
    /// moves one layer across a boundary at a time, the move that brings the devices' peak /
    /// capacity ratios closest to fitting (largest first), until the candidate fits (it is
    /// then evaluated, and refined for time with the rest) or no move helps. Stops after
    /// `refine` structures were repaired.
    pub(super) fn repair_unfit(&mut self) {
        let mut unfit = std::mem::take(&mut self.unfit);
        if !self.found.is_empty() {
            // Only where nothing fits: elsewhere the plans found stand, and on large clusters
            // the descent over many unfit structures costs more than the search itself.
            return;
        }
        unfit.sort_by(|a, b| a.bound.total_cmp(&b.bound));
        let n = self.model.profile.layers.len();
        let mut repaired = 0;
        for u in &unfit {
            if repaired >= self.options.refine || u.bound >= self.bar() {
                break;
            }
            if self.has_plan_like(&u.candidate) {
                continue;
            }
            let (mut c, mut ratios) = (u.candidate.clone(), u.ratios.clone());
            for _ in 0..2 * n {
                let mut best: Option<(Vec<f64>, bool, Candidate)> = None;
                for balance in memory_moves(&c.balance) {
                    let mut moved = Candidate {
                        balance,
                        ..c.clone()
                    };
                    if let Some(f) = self.fit(&mut moved, self.options.layer_remat) {
                        if best
                            .as_ref()
                            .is_none_or(|(r, _, _)| closer_to_fitting(&f.ratios, r))
                        {
                            best = Some((f.ratios, f.fits, moved));
                        }
                    }
                }
                match best {
                    Some((r, fits, moved)) if closer_to_fitting(&r, &ratios) => {
                        (c, ratios) = (moved, r);
                        if fits {
                            repaired += 1;
                            self.evaluate(c);
                            break;
                        }
                    }
                    _ => break,
                }
            }
        }
        // A balance that fits a structure of the same shape (kind, K, chunks, M) on other
        // devices often fits where the descent above stopped short: a device's memory depends
        // on its position in the pipeline more than on which device it is.
        for u in unfit {
            if u.bound >= self.bar() || self.has_plan_like(&u.candidate) {
                continue;
            }
            let shape = |c: &Candidate| (c.kind, c.chunks, c.micro_batches, c.pipeline_devices());
            let mut siblings: Vec<Vec<usize>> = self
                .found
                .iter()
                .filter(|p| shape(&p.candidate) == shape(&u.candidate))
                .map(|p| p.candidate.balance.clone())
                .collect();
            siblings.sort();
            siblings.dedup();
            for balance in siblings {
                self.evaluate(Candidate {
                    balance,
                    ..u.candidate.clone()
                });
            }
        }
    }

    /// Whether a plan of `c`'s structure was found.
    fn has_plan_like(&self, c: &Candidate) -> bool {
        self.found.iter().any(|p| p.candidate.same_structure(c))
    }

    /// Moves stage boundaries one layer at a time while the predicted step gets faster, for the
    /// best few structures (not needed where every balance was tried).
    pub(super) fn refine_best(&mut self) {
        self.found
            .sort_by(|a, b| a.prediction.step_secs.total_cmp(&b.prediction.step_secs));
        let n = self.model.profile.layers.len();
        let mut seeds: Vec<Candidate> = Vec::new();
        for p in &self.found {
            if seeds.len() >= self.options.refine {
                break;
            }
            let c = &p.candidate;
            if count_compositions(n, c.balance.len()) <= self.options.exhaustive_balances as f64 {
                continue;
            }
            if !seeds.iter().any(|s| s.same_structure(c)) {
                seeds.push(c.clone());
            }
        }
        for seed in seeds {
            let mut best = seed.clone();
            let mut best_t = self.time_of(&seed).unwrap_or(f64::INFINITY);
            for _ in 0..self.options.refine_passes {
                let mut improved = false;
                for j in 0..best.balance.len().saturating_sub(1) {
                    for dir in [-1i64, 1] {
                        let mut b = best.balance.clone();
                        let (from, to) = if dir < 0 { (j, j + 1) } else { (j + 1, j) };
                        if b[from] <= 1 {
                            continue;
                        }
                        b[from] -= 1;
                        b[to] += 1;
                        let c = Candidate {
                            balance: b,
                            ..best.clone()
                        };
                        if let Some((p, true)) = self.evaluate(c.clone()) {
                            if p.step_secs < best_t * (1.0 - 1e-9) {
                                best_t = p.step_secs;
                                best = c;
                                improved = true;
                            }
                        }
                    }
                }
                if !improved {
                    break;
                }
            }
        }
    }

    fn time_of(&self, c: &Candidate) -> Option<f64> {
        self.found
            .iter()
            .find(|p| p.candidate.balance == c.balance && p.candidate.same_structure(c))
            .map(|p| p.prediction.step_secs)
    }
}
