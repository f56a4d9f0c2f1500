//! Re-materialization per device: the least recomputation (whole stages' modes, mixed per
//! stage on devices of few stages, or single layers checkpointed inside them) that fits each
//! device's memory on every replica, and the peaks that choice leaves.

use std::rc::Rc;

use crate::schedule::CheckpointMode;

use super::{Search, Structure, MODES};
use crate::plan::cost::{with_remat, Candidate, CandidateCosts, ScheduleFacts};

/// Devices with more stages than this choose one mode for all of them (3^n mixes to walk).
const MAX_MIXED_STAGES: usize = 3;

/// The re-materialization mixes to try for a device holding `stages`, least recomputation
/// first (the forwards' seconds each mix runs again, in `costs`): every combination of
/// [`MODES`] over its stages (up to [`MAX_MIXED_STAGES`]), else the uniform modes. A device
/// of one stage gets [`MODES`] in their order.
fn remat_mixes(stages: &[usize], costs: &CandidateCosts) -> Vec<Vec<CheckpointMode>> {
    let uniform = || MODES.iter().map(|&m| vec![m; stages.len()]).collect();
    if stages.len() <= 1 || stages.len() > MAX_MIXED_STAGES {
        return uniform();
    }
    let mut mixes: Vec<Vec<CheckpointMode>> = vec![Vec::new()];
    for _ in stages {
        mixes = mixes
            .into_iter()
            .flat_map(|mix| {
                MODES.iter().map(move |&m| {
                    let mut next = mix.clone();
                    next.push(m);
                    next
                })
            })
            .collect();
    }
    let secs = |mix: &Vec<CheckpointMode>| -> f64 {
        stages
            .iter()
            .zip(mix)
            .map(|(&s, &m)| costs.recompute_secs(s, m))
            .sum()
    };
    // Stable: mixes of equal cost stay in the order made (Never before ExceptLast before
    // Always, the first stage varying slowest).
    mixes.sort_by(|a, b| secs(a).total_cmp(&secs(b)));
    mixes
}

/// A candidate's re-materialization chosen and its memory predicted ([`Search::fit`]).
pub(super) struct Fit {
    pub(super) st: Rc<Structure>,
    pub(super) costs: Vec<CandidateCosts>,
    pub(super) step_peak: Vec<u64>,
    pub(super) peak: Vec<u64>,
    /// Whether every device's peak fits its memory.
    pub(super) fits: bool,
    /// Each device's peak / capacity, largest first: compared in that order, a move that
    /// lowers one of two devices at the top counts as progress.
    pub(super) ratios: Vec<f64>,
}

/// A candidate with some layers checkpointed, its costs per replica, and one device's (step
/// peak, peak) per replica ([`Search::checkpoint_layers_on`]).
type LayerTrial = (Candidate, Vec<CandidateCosts>, Vec<(u64, u64)>);

impl Search<'_, '_> {
    /// Chooses each stage's re-materialization: per device, the mix of modes that recomputes
    /// least and fits its memory on every replica (or, where none fits, the last mix tried,
    /// which recomputes most). None when the candidate cannot be built.
    pub(super) fn fit(&mut self, c: &mut Candidate, per_layer: bool) -> Option<Fit> {
        let k = c.pipeline_devices();
        let model = self.model;
        let skips = model.skip_links(&c.balance);
        let st = self.structure(c.kind, k, c.chunks, c.micro_batches, &skips)?;
        let placement = &st.always.placement;
        c.checkpoint_layers.clear();
        let mut costs = model.replica_costs(c, placement).ok()?;
        let mut step_peak = vec![0; c.order.len()];
        let mut peak = vec![0; c.order.len()];
        let mut fits = true;
        // Every replica runs the same schedule: device d's stages get the mix of modes that
        // recomputes least (in the forwards' seconds) among those that fit on each replica's
        // device d.
        for d in 0..k {
            let mine: Vec<usize> = (0..placement.len())
                .filter(|&s| placement[s] == d)
                .collect();
            let mixes = remat_mixes(&mine, &costs[0]);
            let mut mix_fits = false;
            for mix in &mixes {
                let made;
                let (schedule, facts) =
                    match MODES.iter().position(|&m| mix.iter().all(|&x| x == m)) {
                        // One mode for all of the device's stages: the structure's schedule.
                        Some(u) => (&st.uniform[u], &st.facts[u]),
                        // A mix: d's list with each stage's recomputes as its mode asks (the other
                        // devices' lists do not change d's memory).
                        None => {
                            let mut remat = c.remat.clone();
                            for (&s, &m) in mine.iter().zip(mix) {
                                remat[s] = m;
                            }
                            let schedule = with_remat(&st.always, &remat);
                            let facts = ScheduleFacts::of_device(&schedule, d);
                            made = (schedule, facts);
                            (&made.0, &made.1)
                        }
                    };
                let mut all_fit = true;
                let mut last: Option<(usize, (u64, u64))> = None;
                for (r, rc) in costs.iter().enumerate() {
                    // Replicas of the same share hold the same bytes.
                    let (s, p) = match last {
                        Some((b, m)) if b == rc.batch() => m,
                        _ => model.device_memory(rc, schedule, facts, d),
                    };
                    last = Some((rc.batch(), (s, p)));
                    all_fit &= p <= model.specs[c.order[r * k + d]].memory_bytes;
                    step_peak[r * k + d] = s;
                    peak[r * k + d] = p;
                }
                for (&s, &m) in mine.iter().zip(mix) {
                    c.remat[s] = m;
                }
                if all_fit {
                    mix_fits = true;
                    break;
                }
            }
            if per_layer && mine.iter().any(|&s| c.remat[s] != CheckpointMode::Never) {
                // The mix recomputes whole stages: checkpointing some layers may fit with less.
                let budget = if mix_fits {
                    mine.iter()
                        .map(|&s| costs[0].recompute_secs(s, c.remat[s]))
                        .sum()
                } else {
                    f64::INFINITY
                };
                if let Some(peaks) = self.checkpoint_layers_on(c, &mut costs, &st, d, &mine, budget)
                {
                    for (r, (s, p)) in peaks.into_iter().enumerate() {
                        step_peak[r * k + d] = s;
                        peak[r * k + d] = p;
                    }
                    mix_fits = true;
                }
            }
            fits &= mix_fits;
        }
        let mut ratios: Vec<f64> = peak
            .iter()
            .zip(&c.order)
            .map(|(&b, &d)| b as f64 / model.specs[d].memory_bytes as f64)
            .collect();
        ratios.sort_by(|a, b| b.total_cmp(a));
        Some(Fit {
            st,
            costs,
            step_peak,
            peak,
            fits,
            ratios,
        })
    }

    /// Per-layer re-materialization on pipeline device `d` (holding stages `mine`), for a
    /// device whose stages need a recomputing mode to fit: the first layers of its stages
    /// (those without skips), as few as make `d` fit on every replica with every
    /// micro-batch's forward recorded. Taken when that recomputes less than
    /// `budget` (the chosen mix's recomputed forwards): `c` (its `checkpoint_layers`, `Never`
    /// for `mine`) and `costs` are updated and d's (step peak, peak) per replica returned.
    fn checkpoint_layers_on(
        &self,
        c: &mut Candidate,
        costs: &mut [CandidateCosts],
        st: &Structure,
        d: usize,
        mine: &[usize],
        budget: f64,
    ) -> Option<Vec<(u64, u64)>> {
        let model = self.model;
        let k = c.pipeline_devices();
        let ranges = crate::partition::stage_ranges(&c.balance);
        let with_skips = |i: usize| {
            model
                .profile
                .skips
                .iter()
                .any(|s| s.edge.producer == i || s.edge.consumer == i)
        };
        // Each stage's first layers first, one position at a time across d's stages
        // (Megatron's "block" re-computation: the first n layers of each stage): a run from
        // a stage's start keeps only the stage's input, which the stage holds anyway, and
        // its last output, so the run saves all its layers keep but that output; layers
        // chosen one by one for their own bytes would each keep their output.
        let longest = mine.iter().map(|&s| ranges[s].len()).max().unwrap_or(0);
        let order: Vec<usize> = (0..longest)
            .flat_map(|n| mine.iter().map(move |&s| (s, n)))
            .filter(|&(s, n)| n < ranges[s].len())
            .map(|(s, n)| ranges[s].start + n)
            .filter(|&i| !with_skips(i))
            .collect();
        if order.is_empty() {
            return None;
        }
        // The peaks of `d` with the first `n` of `order` checkpointed (None: over a memory).
        let trial = |n: usize| -> Option<LayerTrial> {
            let mut tried = c.clone();
            tried.checkpoint_layers.extend_from_slice(&order[..n]);
            tried.checkpoint_layers.sort_unstable();
            for &s in mine {
                tried.remat[s] = CheckpointMode::Never;
            }
            let mut tried_costs = costs.to_vec();
            let mut peaks = Vec::with_capacity(tried_costs.len());
            for (r, rc) in tried_costs.iter_mut().enumerate() {
                for &s in mine {
                    rc.restage(model, &tried, s);
                }
                let (sp, p) = model.device_memory(rc, &st.uniform[0], &st.facts[0], d);
                if p > model.specs[c.order[r * k + d]].memory_bytes {
                    return None;
                }
                peaks.push((sp, p));
            }
            Some((tried, tried_costs, peaks))
        };
        // Fewest layers that fit: more checkpointed layers keep less, so bisect.
        // `fitting` is the trial of `hi` layers, the fewest known to fit.
        let (mut lo, mut hi) = (1, order.len());
        let mut fitting = trial(hi)?;
        while lo < hi {
            let mid = (lo + hi) / 2;
            match trial(mid) {
                Some(t) => (hi, fitting) = (mid, t),
                None => lo = mid + 1,
            }
        }
        if costs[0].layer_recompute(model, &order[..hi]) >= budget {
            return None;
        }
        let (tried, tried_costs, peaks) = fitting;
        *c = tried;
        costs.clone_from_slice(&tried_costs);
        Some(peaks)
    }
}
