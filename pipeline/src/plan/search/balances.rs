//! Balances (layers per stage) to try for a structure: every one on small instances, else the
//! pace-optimal, compute and memory min-max partitions; and the partition arithmetic behind them.

use crate::schedule::{CheckpointMode, ScheduleKind};

use super::Search;
use crate::plan::cost::Candidate;
use crate::plan::dp;
use crate::plan::profile::LayerProfile;

impl Search<'_, '_> {
    /// The candidates of one structure (every balance on small instances, else a time and a
    /// memory min-max partition), each with its compute bound.
    pub(super) fn structure_candidates(
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
