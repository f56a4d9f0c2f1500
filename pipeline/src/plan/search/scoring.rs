//! Scoring a candidate: its re-materialization chosen, its step predicted, and the plan kept
//! among the best found, or noted as the closest to fitting when it does not fit.

use super::refine::closer_to_fitting;
use super::remat::Fit;
use super::{count_compositions, Search, Unfit};
use crate::plan::cost::{with_remat, Candidate, CandidateCosts, Prediction};
use crate::plan::Planned;

impl Search<'_, '_> {
    /// Chooses each stage's re-materialization ([`Search::fit`]) and predicts the candidate;
    /// keeps it when it fits. Returns its prediction and whether it fits (None when it was
    /// pruned or cannot be built). Where the choice checkpoints layers inside stages, the
    /// candidate with whole stages' modes only is predicted too, and the faster kept: fewer
    /// recomputed FLOPs need not make a shorter step (a stage's Recompute may fill a bubble
    /// where a longer backward lies on the critical path).
    pub(super) fn evaluate(&mut self, c: Candidate) -> Option<(Prediction, bool)> {
        let (with_layers, used) = self.evaluate_as(c.clone(), self.options.layer_remat);
        if !used {
            return with_layers;
        }
        let (whole, _) = self.evaluate_as(c, false);
        let rank = |r: &(Prediction, bool)| (!r.1, r.0.step_secs);
        match (with_layers, whole) {
            (Some(a), Some(b)) => Some(if rank(&b) < rank(&a) { b } else { a }),
            (a, b) => a.or(b),
        }
    }

    /// [`Search::evaluate`] of one way to choose: with per-layer re-materialization or
    /// without; also whether the choice checkpointed layers.
    fn evaluate_as(
        &mut self,
        mut c: Candidate,
        per_layer: bool,
    ) -> (Option<(Prediction, bool)>, bool) {
        let Some(fit) = self.fit(&mut c, per_layer) else {
            return (None, false);
        };
        let used = !c.checkpoint_layers.is_empty();
        (self.evaluate_fitted(c, fit), used)
    }

    fn evaluate_fitted(&mut self, c: Candidate, fit: Fit) -> Option<(Prediction, bool)> {
        let model = self.model;
        let Fit {
            st,
            costs,
            step_peak,
            peak,
            fits,
            ratios,
        } = fit;
        let ratio = ratios[0];
        let placement = &st.always.placement;
        if !fits {
            // Repairs are only for a search where nothing fits ([`Search::repair_unfit`]): the
            // bound is not computed once something does.
            if self.found.is_empty() {
                self.note_unfit(&ratios, &c, model.compute_bound(&c, &costs, placement));
            }
            // Kept for the error when nothing fits: the configuration closest to fitting.
            if self.closest.as_ref().is_none_or(|(r, _, _)| ratio < *r) {
                let timed = model.step_time(&c, &costs, &st.uniform[2], &st.facts[2]);
                let p = prediction(timed.ok()?, step_peak, peak, &costs);
                self.closest = Some((ratio, c, p));
            }
            return None;
        }
        if model.compute_bound(&c, &costs, placement) >= self.bar() {
            return None;
        }
        let schedule = with_remat(&st.always, &c.remat);
        // Recomputes removed change neither release points nor first backwards.
        let timed = model.step_time(&c, &costs, &schedule, &st.facts[2]).ok()?;
        self.evaluated += 1;
        let p = prediction(timed, step_peak, peak, &costs);
        let t = p.step_secs;
        let keep = self.options.alternatives + 1;
        let at = self.best_times.partition_point(|&x| x <= t);
        if at < keep {
            self.best_times.insert(at, t);
            self.best_times.truncate(keep);
        }
        self.found.push(Planned {
            candidate: c,
            prediction: p.clone(),
            schedule,
        });
        Some((p, true))
    }

    /// Keeps `c` as its structure's closest to fitting when its balances were chosen by
    /// heuristics (where every balance is tried, there is nothing to repair) and nothing fits
    /// yet.
    fn note_unfit(&mut self, ratios: &[f64], c: &Candidate, bound: f64) {
        let n = self.model.profile.layers.len();
        if count_compositions(n, c.balance.len()) <= self.options.exhaustive_balances as f64 {
            return;
        }
        let unfit = Unfit {
            ratios: ratios.to_vec(),
            bound,
            candidate: c.clone(),
        };
        match self
            .unfit
            .iter_mut()
            .find(|u| u.candidate.same_structure(c))
        {
            Some(u) if closer_to_fitting(ratios, &u.ratios) => *u = unfit,
            Some(_) => {}
            None => self.unfit.push(unfit),
        }
    }
}

/// A prediction from the step's (time, bubble) and the devices' peaks.
fn prediction(
    (step_secs, bubble_fraction): (f64, f64),
    step_peak_bytes: Vec<u64>,
    peak_bytes: Vec<u64>,
    costs: &[CandidateCosts],
) -> Prediction {
    Prediction {
        step_secs,
        bubble_fraction,
        step_peak_bytes,
        peak_bytes,
        static_bytes: costs
            .iter()
            .flat_map(|c| c.static_bytes().to_vec())
            .collect(),
    }
}
