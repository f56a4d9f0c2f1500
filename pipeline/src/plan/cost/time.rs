//! Step time: the simulator's replay of a candidate's schedule, and a lower bound of it.

use crate::partition::stage_ranges;
use crate::schedule::{Action, ActionKind, Schedule};
use crate::sim::collectives::{add_to_timeline, holder_devices, replicated_timeline, TiedExchange};
use crate::sim::timeline::{simulate_valid, ActionCost, DeviceSpec, Timeline};

use super::{Candidate, CandidateCosts, CostModel, ScheduleFacts};

impl CostModel<'_> {
    /// Step time and bubble: the simulator's replay of `schedule` (assumed valid) with each
    /// action's predicted FLOPs and bytes, on every replica (`costs`: one per replica), then
    /// each device's ring all-reduce across the replicas as the simulated cluster models it.
    pub fn step_time(
        &self,
        c: &Candidate,
        costs: &[CandidateCosts],
        schedule: &Schedule,
        facts: &ScheduleFacts,
    ) -> crate::Result<(f64, f64)> {
        // The tied exchanges start when their holders' last work ends: that needs the events.
        let ties = !self.profile.ties.is_empty();
        if c.replicas <= 1 {
            let mut t = self.replay(c, &costs[0], schedule, facts, ties)?;
            self.add_tied_exchanges(c, schedule, &mut t);
            return Ok((t.makespan, t.bubble_fraction()));
        }
        let timelines = (0..c.replicas)
            .map(|r| {
                let mut t = self.replay(&c.replica(r), &costs[r], schedule, facts, true)?;
                self.add_tied_exchanges(c, schedule, &mut t);
                Ok(t)
            })
            .collect::<crate::Result<Vec<Timeline>>>()?;
        let parts: Vec<&Timeline> = timelines.iter().collect();
        let t = replicated_timeline(
            &parts,
            c.pipeline_devices(),
            &costs[0].param_bytes,
            &self.link,
        );
        Ok((t.makespan, t.bubble_fraction()))
    }

    /// Adds to one replica's timeline the exchanges of the tie groups that `c`'s balance puts
    /// on more than one device, by the rule the pipeline's own step report uses.
    fn add_tied_exchanges(&self, c: &Candidate, schedule: &Schedule, t: &mut Timeline) {
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
        add_to_timeline(t, schedule, &exchanges, Some(&self.link));
    }

    /// One replica's simulated step (`c` of one replica); its events kept when `record`.
    fn replay(
        &self,
        c: &Candidate,
        costs: &CandidateCosts,
        schedule: &Schedule,
        facts: &ScheduleFacts,
        record: bool,
    ) -> crate::Result<Timeline> {
        let last = c.balance.len() - 1;
        let specs: Vec<DeviceSpec> = c.order.iter().map(|&d| self.specs[d]).collect();
        let timeline = simulate_valid(schedule, &specs, &self.link, record, |_, a: Action| {
            let st = costs.at(a.stage, a.micro_batch);
            let first = || facts.is_first_backward(&a);
            let flops = match a.kind {
                ActionKind::Forward => st.forward + if a.stage == last { st.loss } else { 0.0 },
                ActionKind::Recompute => st.forward,
                ActionKind::Backward if first() => st.backward - st.accumulate,
                ActionKind::Backward => st.backward,
                ActionKind::BackwardInput => st.backward_input,
                ActionKind::BackwardWeight if first() => st.backward_weight - st.accumulate,
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
        (0..c.replicas)
            .map(|r| self.replica_bound(&c.replica(r), &costs[r], placement))
            .fold(0.0, f64::max)
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
