//! Step time: the simulator's replay of a candidate's schedule, and a lower bound of it.

use crate::partition::stage_ranges;
use crate::schedule::{Action, ActionKind, Schedule};
use crate::sim::collectives::{
    add_to_timeline, all_reduce_window, holder_devices, position_ring_link, TiedExchange,
};
use crate::sim::timeline::{simulate_with_ends, ActionCost, DeviceSpec, Timeline};
use crate::sim::topology::Topology;

use super::{Candidate, CandidateCosts, CostModel, ScheduleFacts};

impl CostModel<'_> {
    /// Step time and bubble: the simulator's replay of `schedule` (assumed valid) with each
    /// action's predicted FLOPs and bytes, on every replica (`costs`: one per replica), then
    /// each device's ring all-reduce across the replicas as the simulated cluster models it
    /// (`collectives::replicated_timeline`: from when the last replica's device is done, over
    /// the slowest link its ring crosses).
    pub fn step_time(
        &self,
        c: &Candidate,
        costs: &[CandidateCosts],
        schedule: &Schedule,
        facts: &ScheduleFacts,
    ) -> crate::Result<(f64, f64)> {
        // The tied exchanges start when their holders' last work ends: that needs the events.
        let ties = !self.profile.ties.is_empty();
        let rows = self.links.select(&c.order);
        if c.replicas <= 1 {
            let (mut t, _) = self.replay(c, &costs[0], &rows, schedule, facts, ties)?;
            self.add_tied_exchanges(c, schedule, &rows, &mut t);
            return Ok((t.makespan, t.bubble_fraction()));
        }
        let k = c.pipeline_devices();
        // Replicas with the same share on devices of the same specs and links run alike:
        // one replay per kind of replica (a 1024-device cluster has one or two kinds, not
        // hundreds), each with its devices' ends of work.
        let mut kinds: Vec<(usize, f64, f64, Vec<f64>)> = Vec::new();
        let mut kind_of = Vec::with_capacity(c.replicas);
        for r in 0..c.replicas {
            let range = r * k..(r + 1) * k;
            let alike = |&(q, ..): &(usize, f64, f64, Vec<f64>)| {
                costs[q].batch == costs[r].batch
                    && (0..k)
                        .all(|d| self.specs[c.order[q * k + d]] == self.specs[c.order[r * k + d]])
                    && rows.node_pattern(&(q * k..(q + 1) * k).collect::<Vec<_>>())
                        == rows.node_pattern(&range.clone().collect::<Vec<_>>())
            };
            if let Some(i) = kinds.iter().position(alike) {
                kind_of.push(i);
                continue;
            }
            let one = c.replica(r);
            let own = rows.select(&range.collect::<Vec<_>>());
            let (mut t, mut ends) = self.replay(&one, &costs[r], &own, schedule, facts, ties)?;
            if ties {
                // The tied exchanges end some devices' work later.
                self.add_tied_exchanges(&one, schedule, &own, &mut t);
                for e in &t.events {
                    ends[e.device] = ends[e.device].max(e.end);
                }
            }
            kind_of.push(kinds.len());
            kinds.push((r, t.makespan, t.busy.iter().sum(), ends));
        }
        let mut makespan = kinds.iter().map(|x| x.1).fold(0.0, f64::max);
        let busy: f64 = kind_of.iter().map(|&i| kinds[i].2).sum();
        for (d, &bytes) in costs[0].param_bytes.iter().enumerate().take(k) {
            let ready = kind_of.iter().map(|&i| kinds[i].3[d]).fold(0.0, f64::max);
            let link = position_ring_link(&rows, k, c.replicas, d);
            makespan = makespan.max(all_reduce_window(ready, bytes, c.replicas, &link).1);
        }
        let total = (c.replicas * k) as f64 * makespan;
        let bubble = if total <= 0.0 {
            0.0
        } else {
            (total - busy) / total
        };
        Ok((makespan, bubble))
    }

    /// Adds to one replica's timeline the exchanges of the tie groups that `c`'s balance puts
    /// on more than one device, by the rule the pipeline's own step report uses.
    fn add_tied_exchanges(
        &self,
        c: &Candidate,
        schedule: &Schedule,
        links: &Topology,
        t: &mut Timeline,
    ) {
        let ranges = stage_ranges(&c.balance);
        let stage_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer));
        let exchanges: Vec<TiedExchange> = self
            .profile
            .ties
            .iter()
            .filter_map(|tie| {
                let stages = tie.layers.iter().map(|&l| stage_of(l));
                let devices =
                    holder_devices(stages.collect::<Option<Vec<_>>>()?, &schedule.placement);
                (devices.len() > 1).then_some(TiedExchange {
                    devices,
                    bytes: tie.bytes,
                    start: 0.0,
                    end: 0.0,
                })
            })
            .collect();
        add_to_timeline(t, schedule, &exchanges, Some(links));
    }

    /// One replica's simulated step (`c` of one replica, `links` among its devices) and each
    /// device's end of work; its events kept when `record`.
    fn replay(
        &self,
        c: &Candidate,
        costs: &CandidateCosts,
        links: &Topology,
        schedule: &Schedule,
        facts: &ScheduleFacts,
        record: bool,
    ) -> crate::Result<(Timeline, Vec<f64>)> {
        let last = c.balance.len() - 1;
        let specs: Vec<DeviceSpec> = c.order.iter().map(|&d| self.specs[d]).collect();
        let timeline = simulate_with_ends(schedule, &specs, links, record, |_, a: Action| {
            let st = costs.at(a.stage, a.micro_batch);
            let first = || facts.is_first_backward(&a);
            let flops = match a.kind {
                ActionKind::Forward => st.forward + if a.stage == last { st.loss } else { 0.0 },
                ActionKind::Recompute => st.forward,
                ActionKind::Backward if first() => st.backward - st.accumulate,
                ActionKind::Backward => st.backward,
                ActionKind::BackwardInput if facts.is_first_input(&a) => {
                    st.backward_input - st.accumulate_input
                }
                ActionKind::BackwardInput => st.backward_input,
                ActionKind::BackwardWeight if first() => {
                    st.backward_weight - (st.accumulate - st.accumulate_input)
                }
                ActionKind::BackwardWeight => st.backward_weight,
                _ => 0.0,
            };
            let bytes = match a.kind {
                ActionKind::SendActivation => st.output,
                ActionKind::SendGrad => st.input,
                ActionKind::SendSkip | ActionKind::SendSkipGrad => costs.skip_of(&a),
                _ => 0.0,
            };
            ActionCost {
                flops: flops.max(0.0),
                bytes: bytes as u64,
            }
        })?;
        Ok(timeline)
    }

    /// A lower bound of the step: for each device, its compute, plus the forwards of the
    /// stages before its first one (its first input cannot come earlier) and, for one stage
    /// per device and whole backwards (the device's last action is then its stage's last
    /// backward), the backwards of those stages after it.
    /// With replicas, the slowest replica's (the all-reduce comes after).
    pub fn compute_bound(
        &self,
        c: &Candidate,
        costs: &[CandidateCosts],
        placement: &[usize],
    ) -> f64 {
        let k = c.pipeline_devices();
        let devices = |r: usize| c.order[r * k..(r + 1) * k].iter().map(|&d| self.specs[d]);
        (0..c.replicas)
            // A replica like the one before (same share, same devices) has the same bound.
            .filter(|&r| {
                r == 0 || costs[r].batch != costs[r - 1].batch || !devices(r).eq(devices(r - 1))
            })
            .map(|r| self.replica_bound(&c.replica(r), &costs[r], placement))
            .fold(0.0, f64::max)
    }

    /// A lower bound of the step of every candidate with `replicas` replicas of `k` devices
    /// and at most `max_m` micro-batches, whatever its devices, order, schedule and balance:
    /// on average over the devices of the replica with the largest share, a device waits for
    /// its first input, computes its share of the work at the fastest rate, and then takes
    /// part in an all-reduce of its share of the parameters over the fastest link a ring of R
    /// devices can have; the step is at least that average. Cheap
    /// (one pass over the layers), so that the search can order (R, K) layouts by it and stop
    /// before building the candidates of layouts that cannot win.
    pub fn layout_bound(&self, replicas: usize, k: usize, max_m: usize) -> f64 {
        let share = self.batch.div_ceil(replicas.max(1));
        let m = max_m.max(1) as f64;
        // The sum over M micro-batches of max(0, fixed + per_sample · b) is at least this.
        let least = |a: &crate::plan::Affine, other: Option<&crate::plan::Affine>| {
            let (f, p) = match other {
                Some(o) => (a.fixed.min(o.fixed), a.per_sample.min(o.per_sample)),
                None => (a.fixed, a.per_sample),
            };
            (p * share as f64 + if f >= 0.0 { f } else { f * m }).max(0.0)
        };
        let mut work = least(&self.profile.loss.flops, None);
        let mut params = 0.0;
        for l in &self.profile.layers {
            work += least(&l.forward_flops, None)
                + least(&l.backward_flops, Some(&l.backward_flops_from_data))
                - m * l.accumulate_flops;
            params += l.param_bytes as f64;
        }
        let rate = self
            .specs
            .iter()
            .map(|s| s.flops_per_sec)
            .fold(0.0, f64::max);
        // Device d's first stage is stage d in every placement (in order, looped, V), so it
        // waits at least for a forward of stages 0..d: each at least one layer, of the smallest
        // micro-batch. On average over the devices that is (K - 1) / 2 cheapest forwards.
        let smallest = (self.batch / replicas.max(1) / max_m.max(1)).max(1);
        let cheapest = self
            .profile
            .layers
            .iter()
            .map(|l| l.forward_flops.at(smallest))
            .fold(f64::INFINITY, f64::min);
        let ramp = if k > 1 && cheapest.is_finite() {
            cheapest / rate * (k - 1) as f64 / 2.0
        } else {
            0.0
        };
        let compute = work.max(0.0) / (k as f64 * rate) + ramp;
        if replicas <= 1 {
            return compute;
        }
        let link = self.links.fastest_ring(replicas);
        let r = replicas as f64;
        let steps = 2.0 * (r - 1.0);
        compute
            + steps / r * params / (k as f64 * link.bandwidth_bytes_per_sec)
            + steps * link.latency_sec
    }

    fn replica_bound(&self, c: &Candidate, costs: &CandidateCosts, placement: &[usize]) -> f64 {
        let last = c.balance.len() - 1;
        let k = c.order.len();
        let rate = |s: usize| self.specs[c.order[placement[s]]].flops_per_sec;
        let small = costs.sizes.len() - 1;
        let mut busy = vec![0f64; k];
        for (s, &d) in placement.iter().enumerate() {
            for m in 0..costs.sizes.len() {
                let x = costs.at(s, m);
                let loss = if s == last { x.loss } else { 0.0 };
                busy[d] += (x.forward + x.backward - x.accumulate + loss) / rate(s);
            }
        }
        let tail = c.chunks == 1 && c.kind.def().backward_tail;
        // The smallest micro-batch's forwards and backwards of the stages so far.
        let (mut fwd, mut bwd) = (0.0, 0.0);
        let mut bound = 0.0f64;
        let mut seen = vec![false; k];
        for (s, &d) in placement.iter().enumerate() {
            if !seen[d] {
                seen[d] = true;
                bound = bound.max(fwd + busy[d] + if tail { bwd } else { 0.0 });
            }
            let x = costs.at(s, small);
            fwd += x.forward / rate(s);
            bwd += (x.backward - x.accumulate).max(0.0) / rate(s);
        }
        bound
    }
}
