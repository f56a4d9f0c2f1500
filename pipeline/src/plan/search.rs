//! The search: every replica count R (data parallelism: R copies of a K-device pipeline, each
//! on its share of the batch, R x K devices at most), device count K, device order, schedule
//! kind, chunks v and micro-batch count M; for each, balances (all of them on small instances,
//! else the pace-optimal partition by dynamic programming over layer ranges ([`dp`]: compute
//! and the transfers on the links each boundary crosses), the compute-only and the memory
//! min-max partitions, refined by moving stage boundaries); for each balance, per device the
//! least re-materialization that fits its memory.
//!
//! Layouts (R, K) are taken in the order of a bound that holds for all their candidates
//! ([`CostModel::layout_bound`]), and inside a layout candidates in the order of a bound of
//! their own step (the busiest device's compute and the pipeline's ramps); the search stops
//! where a bound passes the plans worth showing, or after `PlanOptions::layout_patience`
//! layouts in a row that found nothing better (on a thousand devices, hundreds of layouts have
//! bounds within the bubble of the best plan; those first in bound order are the ones that
//! use the cluster best). On a cluster of nodes the device orders include both ways of laying
//! out replicas (each replica's stages together, or each stage's replicas together), and
//! orders that cross the same links count once.

use std::collections::HashMap;
use std::rc::Rc;

use crate::schedule::ScheduleKind;
use crate::schedule::{CheckpointMode, Schedule, SkipLink};

use super::cost::{with_remat, Candidate, CandidateCosts, CostModel, Prediction, ScheduleFacts};
use super::dp;
use super::profile::LayerProfile;
use super::{NoFit, PlanError, PlanOptions, PlanReport, Planned};

const MODES: [CheckpointMode; 3] = [
    CheckpointMode::Never,
    CheckpointMode::ExceptLast,
    CheckpointMode::Always,
];

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

/// Schedules generated with every micro-batch re-materialized (with the transfers of the skips
/// that cross stages, as the builder adds them), and their facts per uniform mode.
struct Structure {
    always: Schedule,
    facts: Vec<ScheduleFacts>,
    uniform: Vec<Schedule>,
}

type StructureKey = (usize, usize, usize, usize, Vec<SkipLink>);

/// A candidate's re-materialization chosen and its memory predicted ([`Search::fit`]).
struct Fit {
    st: Rc<Structure>,
    costs: Vec<CandidateCosts>,
    step_peak: Vec<u64>,
    peak: Vec<u64>,
    /// Whether every device's peak fits its memory.
    fits: bool,
    /// Each device's peak / capacity, largest first: compared in that order, a move that
    /// lowers one of two devices at the top counts as progress.
    ratios: Vec<f64>,
}

/// A candidate with some layers checkpointed, its costs per replica, and one device's (step
/// peak, peak) per replica ([`Search::checkpoint_layers_on`]).
type LayerTrial = (Candidate, Vec<CandidateCosts>, Vec<(u64, u64)>);

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
fn closer_to_fitting(a: &[f64], b: &[f64]) -> bool {
    a.iter()
        .zip(b)
        .find(|(x, y)| x != y)
        .is_some_and(|(x, y)| x < y)
}

/// The candidate of a structure closest to fitting, where none of its balances tried fit.
struct Unfit {
    ratios: Vec<f64>,
    /// Its compute bound ([`CostModel::compute_bound`]).
    bound: f64,
    candidate: Candidate,
}

struct Search<'a, 'p> {
    model: &'a CostModel<'p>,
    options: &'a PlanOptions,
    /// By (kind's index in [`ScheduleKind::ALL`], K, v, M, skip links); None when it cannot be
    /// generated.
    structures: HashMap<StructureKey, Option<Rc<Structure>>>,
    /// Feasible results, best first after sorting.
    found: Vec<Planned>,
    evaluated: usize,
    /// The best step times found, ascending, at most `alternatives + 1`.
    best_times: Vec<f64>,
    /// The candidate closest to fitting: (largest peak / capacity, its candidate, prediction).
    closest: Option<(f64, Candidate, Prediction)>,
    /// Per structure whose balances were chosen by heuristics and none fit, the closest.
    unfit: Vec<Unfit>,
}

pub fn search(model: &CostModel<'_>, options: &PlanOptions) -> Result<PlanReport, PlanError> {
    let started = std::time::Instant::now();
    let n = model.profile.layers.len();
    if n == 0 || model.specs.is_empty() || model.batch == 0 {
        return Err(PlanError::Empty(format!(
            "{n} layers, {} devices, batch {}",
            model.specs.len(),
            model.batch
        )));
    }
    let usable = options
        .max_devices
        .unwrap_or(model.specs.len())
        .min(model.specs.len())
        .min(n);
    if options.min_stages > usable {
        return Err(PlanError::Empty(format!(
            "at least {} stages asked (PlanOptions::min_stages), but only {usable} fit: {n} \
             layers on {} devices",
            options.min_stages,
            model.specs.len()
        )));
    }
    let mut s = Search {
        model,
        options,
        structures: HashMap::new(),
        found: Vec::new(),
        evaluated: 0,
        best_times: Vec::new(),
        closest: None,
        unfit: Vec::new(),
    };
    let max_devices = options
        .max_devices
        .unwrap_or(model.specs.len())
        .min(model.specs.len());
    // Layouts (R replicas of K devices) in the order of a bound that holds for all their
    // candidates ([`CostModel::layout_bound`]): once it passes the plans worth showing, no
    // later layout can matter, so a cluster of a thousand devices builds the candidates of a
    // few layouts (those that use most of it), not of every R x K.
    let mut layouts: Vec<(f64, usize, usize)> = Vec::new();
    for r in 1..=options.max_replicas.min(max_devices).min(model.batch) {
        // The smallest replica's share: every micro-batch of it needs its samples.
        let shard = model.batch / r;
        for k in options.min_stages.max(1)..=(max_devices / r).min(n) {
            let most_m = micro_batch_counts(options, k, shard)
                .last()
                .copied()
                .unwrap_or(1);
            layouts.push((model.layout_bound(r, k, most_m), r, k));
        }
    }
    layouts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut fruitless = 0;
    for (layout_bound, r, k) in layouts {
        if layout_bound >= s.bar() || fruitless >= options.layout_patience {
            break;
        }
        let best_before = s.best_times.first().copied().unwrap_or(f64::INFINITY);
        let shard = model.batch / r;
        // This layout's candidates with a lower bound of each step
        // ([`CostModel::compute_bound`]), predicted in that order while they can matter.
        let mut queue: Vec<(f64, Candidate)> = Vec::new();
        for order in replica_orders(model, r, k) {
            for (kind, v) in kinds_and_chunks(options, k) {
                if k * v > n {
                    continue;
                }
                for m in micro_batch_counts(options, k, shard) {
                    queue.extend(s.structure_candidates(&order, r, kind, v, m));
                }
            }
        }
        queue.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (bound, c) in queue {
            if bound >= s.bar() {
                break;
            }
            s.evaluate(c);
        }
        let improved = s.best_times.first().is_some_and(|&t| t < best_before);
        fruitless = if improved { 0 } else { fruitless + 1 };
    }
    s.repair_unfit();
    s.refine_best();
    s.found
        .sort_by(|a, b| a.prediction.step_secs.total_cmp(&b.prediction.step_secs));
    let evaluated = s.evaluated;
    let mut found = s.found.into_iter();
    let Some(best) = found.next() else {
        return Err(match s.closest {
            Some((ratio, c, p)) => {
                let (d, _) = p
                    .peak_bytes
                    .iter()
                    .enumerate()
                    .map(|(d, &b)| (d, b as f64 / model.specs[c.order[d]].memory_bytes as f64))
                    .fold((0, 0.0), |a, x| if x.1 > a.1 { x } else { a });
                PlanError::NoFit(Box::new(NoFit {
                    device: c.order[d],
                    needed: p.peak_bytes[d],
                    available: model.specs[c.order[d]].memory_bytes,
                    smallest_memory: p.peak_bytes.iter().copied().max().unwrap_or(0),
                    scale: ratio,
                    closest: c,
                }))
            }
            None => PlanError::Empty("no configuration could be generated".into()),
        });
    };
    let mut alternatives = Vec::new();
    for p in found {
        if alternatives.len() >= options.alternatives {
            break;
        }
        let same = |q: &Planned| q.candidate.same_structure(&p.candidate);
        if !same(&best) && !alternatives.iter().any(same) {
            alternatives.push(p);
        }
    }
    Ok(PlanReport {
        best,
        alternatives,
        evaluated,
        search_secs: started.elapsed().as_secs_f64(),
        basis: "simulated times".into(),
    })
}

impl Search<'_, '_> {
    fn structure(
        &mut self,
        kind: ScheduleKind,
        k: usize,
        v: usize,
        m: usize,
        skips: &[SkipLink],
    ) -> Option<Rc<Structure>> {
        let index = kind as usize;
        self.structures
            .entry((index, k, v, m, skips.to_vec()))
            .or_insert_with(|| {
                let always = match kind {
                    // Made for the profile's costs rather than generated (plan/cost/synth.rs).
                    ScheduleKind::Synthesized => self.model.synthesized(k, v, m).ok()?,
                    _ => kind.generate(k, v, m, CheckpointMode::Always).ok()?,
                }
                .with_skip_transfers(skips);
                let stages = always.num_stages();
                let uniform: Vec<Schedule> = MODES
                    .iter()
                    .map(|&mode| with_remat(&always, &vec![mode; stages]))
                    .collect();
                let facts = uniform.iter().map(ScheduleFacts::of).collect();
                Some(Rc::new(Structure {
                    always,
                    facts,
                    uniform,
                }))
            })
            .clone()
    }

    /// The time the `alternatives + 1`-th best plan found takes: a candidate that cannot beat
    /// it would not be shown.
    fn bar(&self) -> f64 {
        if self.best_times.len() <= self.options.alternatives {
            return f64::INFINITY;
        }
        self.best_times[self.options.alternatives]
    }

    /// The candidates of one structure (every balance on small instances, else a time and a
    /// memory min-max partition), each with its compute bound.
    fn structure_candidates(
        &self,
        order: &[usize],
        replicas: usize,
        kind: ScheduleKind,
        v: usize,
        m: usize,
    ) -> Vec<(f64, Candidate)> {
        let k = order.len() / replicas;
        let n = self.model.profile.layers.len();
        let stages = k * v;
        let placement = kind.def().chunks.placement(v).devices(k);
        let balances = if count_compositions(n, stages) <= self.options.exhaustive_balances as f64 {
            compositions(n, stages)
        } else {
            // The pace by dynamic programming (transfers on the links they cross included),
            // the compute-only min-max where it differs (it breaks ties differently), and the
            // memory min-max; the refinement moves boundaries from there.
            let mut b = Vec::new();
            for x in [
                self.paced_balance(order, replicas, &placement, m),
                Some(self.time_balance(order, replicas, &placement, m)),
                Some(self.memory_balance(order, replicas, &placement, m)),
            ]
            .into_iter()
            .flatten()
            {
                if !b.contains(&x) {
                    b.push(x);
                }
            }
            b
        };
        balances
            .into_iter()
            .filter_map(|balance| {
                let c = Candidate {
                    order: order.to_vec(),
                    replicas,
                    kind,
                    chunks: v,
                    micro_batches: m,
                    balance,
                    remat: vec![CheckpointMode::Never; stages],
                    checkpoint_layers: Vec::new(),
                };
                let costs = self.model.replica_costs(&c, &placement).ok()?;
                Some((self.model.compute_bound(&c, &costs, &placement), c))
            })
            .collect()
    }

    /// Chooses each stage's re-materialization: per device, the mix of modes that recomputes
    /// least and fits its memory on every replica (or, where none fits, the last mix tried,
    /// which recomputes most). None when the candidate cannot be built.
    fn fit(&mut self, c: &mut Candidate, per_layer: bool) -> Option<Fit> {
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

    /// Chooses each stage's re-materialization ([`Search::fit`]) and predicts the candidate;
    /// keeps it when it fits. Returns its prediction and whether it fits (None when it was
    /// pruned or cannot be built). Where the choice checkpoints layers inside stages, the
    /// candidate with whole stages' modes only is predicted too, and the faster kept: fewer
    /// recomputed FLOPs need not make a shorter step (a stage's Recompute may fill a bubble
    /// where a longer backward lies on the critical path).
    fn evaluate(&mut self, c: Candidate) -> Option<(Prediction, bool)> {
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

    /// The heuristic balances (pace, compute and memory min-max) weigh each stage alone, while
    /// a device's memory holds all its chunks and its schedule's in-flight micro-batches: they
    /// can all overflow a device where another balance fits. For each structure none of whose
    /// balances fit (fastest bound first, while the bound can beat the plans worth showing),
    /// moves one layer across a boundary at a time, the move that brings the devices' peak /
    /// capacity ratios closest to fitting (largest first), until the candidate fits (it is
    /// then evaluated, and refined for time with the rest) or no move helps. Stops after
    /// `refine` structures were repaired.
    fn repair_unfit(&mut self) {
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
    fn refine_best(&mut self) {
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

    /// [`dp::min_max_partition`] of each stage's forward + backward seconds on its device (the
    /// slowest of the replicas' devices at that position) and of the seconds each boundary's
    /// activation (and its gradient, the same bytes back) takes on the link it crosses (the
    /// slowest of the replicas' links there), for the largest micro-batch.
    fn paced_balance(
        &self,
        order: &[usize],
        r: usize,
        placement: &[usize],
        m: usize,
    ) -> Option<Vec<usize>> {
        let model = self.model;
        let b = model.batch.div_ceil(r).div_ceil(m);
        let layers = &model.profile.layers;
        let work: Vec<f64> = layers
            .iter()
            .map(|l| l.forward_flops.at(b) + l.backward_flops.at(b))
            .collect();
        let weights: Vec<f64> = placement
            .iter()
            .map(|&d| 1.0 / self.position_min(order, r, d, |s| s.flops_per_sec))
            .collect();
        let k = order.len() / r;
        // Seconds per byte on the link from position `from` to `to`: the slowest replica's.
        let per_byte: Vec<f64> = placement
            .windows(2)
            .map(|w| {
                if w[0] == w[1] {
                    return 0.0;
                }
                (0..r)
                    .map(|i| {
                        let link = model.links.link(order[i * k + w[0]], order[i * k + w[1]]);
                        1.0 / link.bandwidth_bytes_per_sec
                    })
                    .fold(0.0, f64::max)
            })
            .collect();
        dp::min_max_partition(&work, &weights, |s, j| match per_byte.get(s) {
            Some(&x) if x > 0.0 => layers[j - 1].output_bytes.at(b) * x,
            _ => 0.0,
        })
    }

    /// Min-max of each stage's forward + backward seconds on its device (the slowest of the
    /// replicas' devices at that position).
    fn time_balance(&self, order: &[usize], r: usize, placement: &[usize], m: usize) -> Vec<usize> {
        let b = self.model.batch.div_ceil(r).div_ceil(m);
        self.balance_by(
            placement,
            |l| l.forward_flops.at(b) + l.backward_flops.at(b),
            |d| 1.0 / self.position_min(order, r, d, |s| s.flops_per_sec),
        )
    }

    /// Min-max of each stage's bytes (its static part and M tapes) over its device's memory
    /// (the smallest of the replicas' devices at that position).
    fn memory_balance(
        &self,
        order: &[usize],
        r: usize,
        placement: &[usize],
        m: usize,
    ) -> Vec<usize> {
        let b = self.model.batch.div_ceil(r).div_ceil(m);
        self.balance_by(
            placement,
            |l| {
                (l.param_bytes + l.grad_bytes + l.optimizer_state_bytes) as f64
                    + l.stash_bytes.at(b) * m as f64
            },
            |d| 1.0 / self.position_min(order, r, d, |s| s.memory_bytes as f64),
        )
    }

    /// The least `of` over the replicas' devices at pipeline position `d`.
    fn position_min(
        &self,
        order: &[usize],
        r: usize,
        d: usize,
        of: impl Fn(&crate::sim::timeline::DeviceSpec) -> f64,
    ) -> f64 {
        let k = order.len() / r;
        (0..r)
            .map(|i| of(&self.model.specs[order[i * k + d]]))
            .fold(f64::INFINITY, f64::min)
    }

    /// [`weighted_min_max`] of `cost` per layer, stage s weighing `weight` of its device.
    fn balance_by(
        &self,
        placement: &[usize],
        cost: impl Fn(&LayerProfile) -> f64,
        weight: impl Fn(usize) -> f64,
    ) -> Vec<usize> {
        let costs: Vec<f64> = self.model.profile.layers.iter().map(cost).collect();
        let weights: Vec<f64> = placement.iter().map(|&d| weight(d)).collect();
        weighted_min_max(&costs, &weights)
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

/// Layers per stage minimising the largest `Σ costs × weight` of a stage (stage s weighs
/// `weights[s]`), every stage at least one layer: bisection on the bound, each test a greedy
/// fill, which is exact for a chain with ordered stages.
pub fn weighted_min_max(costs: &[f64], weights: &[f64]) -> Vec<usize> {
    let (n, s) = (costs.len(), weights.len());
    let fill = |bound: f64| -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(s);
        let mut i = 0;
        for (j, &w) in weights.iter().enumerate() {
            let left_after = s - j - 1;
            let mut sum = 0.0;
            let start = i;
            while i < n - left_after && (i == start || (sum + costs[i]) * w <= bound) {
                sum += costs[i];
                i += 1;
            }
            if sum * w > bound {
                return None;
            }
            out.push(i - start);
        }
        (i == n).then_some(out)
    };
    let total: f64 = costs.iter().sum();
    let wmax = weights.iter().copied().fold(0.0, f64::max);
    let (mut lo, mut hi) = (0.0, total * wmax);
    let mut best = fill(hi).unwrap_or_else(|| even(n, s));
    while hi - lo > 1e-6 * hi {
        let mid = 0.5 * (lo + hi);
        match fill(mid) {
            Some(b) => {
                best = b;
                hi = mid;
            }
            None => lo = mid,
        }
    }
    best
}

/// n layers in s stages as evenly as possible (the first n mod s one larger).
pub fn even(n: usize, s: usize) -> Vec<usize> {
    (0..s).map(|i| n / s + usize::from(i < n % s)).collect()
}

/// C(n-1, s-1): how many balances of n layers into s non-empty stages exist.
pub fn count_compositions(n: usize, s: usize) -> f64 {
    if s == 0 || s > n {
        return 0.0;
    }
    let (a, b) = (n - 1, s - 1);
    (0..b).fold(1.0, |acc, i| acc * (a - i) as f64 / (i + 1) as f64)
}

/// Every balance of n layers into s non-empty stages.
pub fn compositions(n: usize, s: usize) -> Vec<Vec<usize>> {
    fn rec(left: usize, parts: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if parts == 1 {
            cur.push(left);
            out.push(cur.clone());
            cur.pop();
            return;
        }
        for first in 1..=left - (parts - 1) {
            cur.push(first);
            rec(left - first, parts - 1, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    if s >= 1 && s <= n {
        rec(n, s, &mut Vec::new(), &mut out);
    }
    out
}

/// The (kind, chunks) pairs to try on k devices.
pub fn kinds_and_chunks(options: &PlanOptions, k: usize) -> Vec<(ScheduleKind, usize)> {
    let mut out = Vec::new();
    for &kind in &options.kinds {
        let choices = kind.def().chunks.planner_choices(k, &options.chunks);
        out.extend(choices.into_iter().map(|v| (kind, v)));
    }
    out
}

/// The micro-batch counts to try: the options' list, or 1, 2, 3, 4, 6, 8, 12, ... and K, 2K, 4K,
/// each leaving every micro-batch of `batch` at least the options' smallest micro-batch.
pub fn micro_batch_counts(options: &PlanOptions, k: usize, batch: usize) -> Vec<usize> {
    let batch = (batch / options.min_micro_batch.max(1)).max(1);
    let mut ms: Vec<usize> = match &options.micro_batches {
        Some(list) => list.clone(),
        None => {
            let mut v = vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];
            v.extend([k, 2 * k, 4 * k]);
            v
        }
    };
    ms.retain(|&m| m >= 1 && m <= batch);
    ms.sort_unstable();
    ms.dedup();
    ms
}

/// Device orders to try for k devices: every distinct arrangement of the chosen devices' kinds
/// when there are few, else the given order, fastest first, slowest first and most memory first.
/// The chosen devices: the first k, the k fastest and the k with most memory.
pub fn device_orders(model: &CostModel<'_>, k: usize) -> Vec<Vec<usize>> {
    let specs = model.specs;
    let all: Vec<usize> = (0..specs.len()).collect();
    let by = |key: &dyn Fn(usize) -> f64| {
        let mut v = all.clone();
        v.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        v
    };
    let fast = by(&|d| specs[d].flops_per_sec);
    let roomy = by(&|d| specs[d].memory_bytes as f64);
    let mut subsets: Vec<Vec<usize>> = Vec::new();
    for s in [all[..k].to_vec(), fast[..k].to_vec(), roomy[..k].to_vec()] {
        let mut sorted = s.clone();
        sorted.sort_unstable();
        if !subsets.iter().any(|x| {
            let mut y = x.clone();
            y.sort_unstable();
            y == sorted
        }) {
            subsets.push(s);
        }
    }
    let mut orders: Vec<Vec<usize>> = Vec::new();
    // Orders of the same device kinds whose devices share nodes alike cost the same.
    let key = |o: &[usize]| -> (Vec<(u64, u64)>, Vec<usize>) {
        let kinds = o
            .iter()
            .map(|&d| (specs[d].flops_per_sec.to_bits(), specs[d].memory_bytes))
            .collect();
        (kinds, model.links.node_pattern(o))
    };
    for subset in subsets {
        for o in arrangements(model, &subset) {
            let key_o = key(&o);
            let dup = orders.iter().any(|x| key(x) == key_o);
            if !dup {
                orders.push(o);
            }
        }
    }
    orders
}

/// Device orders for R replicas of K devices (R x K entries, replica r at rK..(r+1)K): for
/// one replica, [`device_orders`]; for several, the orders of R x K devices, without those
/// that only swap replicas of equal shares, plus for each chosen set the devices dealt out by
/// speed (the R fastest at position 0 of each replica, the next R at position 1, ...). On a
/// cluster of nodes the two differ in the links they cross: the first keeps each replica's
/// stages together (in a node where K fits one), the dealt one keeps the replicas of each
/// stage together (their all-reduce inside a node where R fits one) and sends between stages
/// across nodes; the links decide which is faster.
pub fn replica_orders(model: &CostModel<'_>, r: usize, k: usize) -> Vec<Vec<usize>> {
    let orders = device_orders(model, r * k);
    if r == 1 {
        return orders;
    }
    let specs = model.specs;
    // Each device's kind and node (numbered by first appearance in the whole order, so that
    // rows keep which of them share a node).
    let key = |o: &[usize]| -> Vec<Vec<(u64, u64, usize)>> {
        let nodes = model.links.node_pattern(o);
        let mut rows: Vec<Vec<(u64, u64, usize)>> = o
            .chunks(k)
            .zip(nodes.chunks(k))
            .map(|(row, nodes)| {
                row.iter()
                    .zip(nodes)
                    .map(|(&d, &n)| (specs[d].flops_per_sec.to_bits(), specs[d].memory_bytes, n))
                    .collect()
            })
            .collect();
        // Replicas of equal shares are interchangeable; the first batch % R are larger.
        if model.batch.is_multiple_of(r) {
            rows.sort();
        }
        rows
    };
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut seen: Vec<Vec<Vec<(u64, u64, usize)>>> = Vec::new();
    let mut push = |o: Vec<usize>| {
        let kk = key(&o);
        if !seen.contains(&kk) {
            seen.push(kk);
            out.push(o);
        }
    };
    for o in orders {
        let mut fast = o.clone();
        fast.sort_by(|&a, &b| specs[b].flops_per_sec.total_cmp(&specs[a].flops_per_sec));
        let dealt: Vec<usize> = (0..r)
            .flat_map(|i| (0..k).map(move |d| (i, d)))
            .map(|(i, d)| fast[d * r + i])
            .collect();
        push(o);
        push(dealt);
    }
    out
}

/// Distinct orders of `subset` up to identical devices (at most 24), else four heuristic ones.
fn arrangements(model: &CostModel<'_>, subset: &[usize]) -> Vec<Vec<usize>> {
    let specs = model.specs;
    let same = |a: usize, b: usize| specs[a] == specs[b];
    // Classes of identical devices, each with its members.
    let mut classes: Vec<Vec<usize>> = Vec::new();
    for &d in subset {
        match classes.iter_mut().find(|c| same(c[0], d)) {
            Some(c) => c.push(d),
            None => classes.push(vec![d]),
        }
    }
    let mut count = 1.0;
    let mut placed = 0usize;
    for c in &classes {
        for i in 0..c.len() {
            placed += 1;
            count *= placed as f64 / (i + 1) as f64;
        }
    }
    if count <= 24.0 {
        let mut out = Vec::new();
        let mut left: Vec<usize> = classes.iter().map(Vec::len).collect();
        arrange(&classes, &mut left, &mut Vec::new(), subset.len(), &mut out);
        return out;
    }
    let mut fast = subset.to_vec();
    fast.sort_by(|&a, &b| specs[b].flops_per_sec.total_cmp(&specs[a].flops_per_sec));
    let mut slow = fast.clone();
    slow.reverse();
    let mut roomy = subset.to_vec();
    roomy.sort_by_key(|&d| std::cmp::Reverse(specs[d].memory_bytes));
    vec![subset.to_vec(), fast, slow, roomy]
}

fn arrange(
    classes: &[Vec<usize>],
    left: &mut [usize],
    cur: &mut Vec<usize>,
    k: usize,
    out: &mut Vec<Vec<usize>>,
) {
    if cur.len() == k {
        out.push(cur.clone());
        return;
    }
    for c in 0..classes.len() {
        if left[c] == 0 {
            continue;
        }
        let member = classes[c][classes[c].len() - left[c]];
        left[c] -= 1;
        cur.push(member);
        arrange(classes, left, cur, k, out);
        cur.pop();
        left[c] += 1;
    }
}
