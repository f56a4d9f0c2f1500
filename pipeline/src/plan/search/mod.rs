//! The search: every replica count R (data parallelism: R copies of a K-device pipeline, each
//! on its share of the batch, R x K devices at most), device count K, device order, schedule
//! kind, chunks v and micro-batch count M; for each, balances (all of them on small instances,
//! else the pace-optimal partition by dynamic programming over layer ranges
//! ([`dp`](super::dp): compute and the transfers on the links each boundary crosses), the
//! compute-only and the memory min-max partitions, refined by moving stage boundaries); for
//! each balance, per device the least re-materialization that fits its memory.
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
//!
//! Here: the layouts' loop and the search's state; in `space.rs` the (kind, chunks) pairs,
//! micro-batch counts and device orders, in `balances.rs` a structure's balances, in
//! `remat.rs` each device's re-materialization, in `scoring.rs` a candidate's prediction and
//! the plans kept, in `refine.rs` the boundary moves of repair and refinement.

mod balances;
mod refine;
mod remat;
mod scoring;
mod space;

pub use balances::{compositions, count_compositions, even, weighted_min_max};
pub use space::{device_orders, kinds_and_chunks, micro_batch_counts, replica_orders};

use std::collections::HashMap;
use std::rc::Rc;

use crate::schedule::ScheduleKind;
use crate::schedule::{CheckpointMode, Schedule, SkipLink};

use super::cost::{with_remat, Candidate, CostModel, Prediction, ScheduleFacts};
use super::{NoFit, PlanError, PlanOptions, PlanReport, Planned};

const MODES: [CheckpointMode; 3] = [
    CheckpointMode::Never,
    CheckpointMode::ExceptLast,
    CheckpointMode::Always,
];

/// Schedules generated with every micro-batch re-materialized (with the transfers of the skips
/// that cross stages, as the builder adds them), and their facts per uniform mode.
struct Structure {
    always: Schedule,
    facts: Vec<ScheduleFacts>,
    uniform: Vec<Schedule>,
}

type StructureKey = (usize, usize, usize, usize, Vec<SkipLink>);

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
}
