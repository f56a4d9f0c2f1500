//! The synthesized schedule the planner tries: made for the profile's costs, not generated.

use crate::schedule::synth::{quick_policies, with_recomputes};
use crate::schedule::{CheckpointMode, Schedule, ScheduleKind, StageCosts, SynthSpec};
use crate::sim::synth::synthesize_with;

use super::{Candidate, CostModel};

impl CostModel<'_> {
    /// The synthesized schedule (`sim::synth`, its quick policies) for K devices, v chunks (1, or 2 in a V) and
    /// M micro-batches, from this profile's costs of each stage of an even balance at the
    /// first micro-batch size on the first K devices (its forward with the loss on the last
    /// stage, input and weight parts), a message costing the link's time for the average stage
    /// output, and a cap of 1F1B's peak, min(K, M) micro-batches per device; every micro-batch
    /// re-materialized, as the search wants its structures (it keeps what each device needs).
    /// The search caches it per (K, v, M): the balance it is made for is the even one, whatever
    /// balance a candidate then runs it with.
    pub fn synthesized(&self, k: usize, v: usize, m: usize) -> crate::Result<Schedule> {
        let kind = ScheduleKind::Synthesized;
        kind.def().chunks.check(kind.name(), v)?;
        let placement = kind.def().chunks.placement(v).devices(k);
        let stages = placement.len();
        let n = self.profile.layers.len();
        let balance: Vec<usize> = (0..stages)
            .map(|i| n / stages + usize::from(i < n % stages))
            .collect();
        let c = Candidate {
            order: (0..k).collect(),
            replicas: 1,
            kind,
            chunks: v,
            micro_batches: m,
            balance,
            remat: vec![CheckpointMode::Never; stages],
            checkpoint_layers: Vec::new(),
        };
        let costs = self.costs(&c, &placement)?;
        let last = stages - 1;
        let rate = |s: usize| self.specs[placement[s]].flops_per_sec;
        let stage_costs = (0..stages)
            .map(|s| {
                let st = costs.at(s, 0);
                let loss = if s == last { st.loss } else { 0.0 };
                StageCosts {
                    forward: (st.forward + loss) / rate(s),
                    input: st.backward_input / rate(s),
                    weight: st.backward_weight / rate(s),
                }
            })
            .collect();
        // One delay for every message (the synthesizer's model): the mean over the stage
        // boundaries, each priced on the link it crosses.
        let transfer = (0..last)
            .map(|s| {
                let link = self.links.link(placement[s], placement[s + 1]);
                costs.at(s, 0).output / link.bandwidth_bytes_per_sec + link.latency_sec
            })
            .sum::<f64>()
            / last.max(1) as f64;
        let spec = SynthSpec {
            placement,
            micro_batches: m,
            stages: stage_costs,
            transfer,
            memory_cap: vec![k.min(m); k],
        };
        // The quick policies: the search may synthesize a schedule for each (K, v, M) it tries.
        let synthesis = synthesize_with(&spec, &quick_policies(v > 1))
            .map_err(|e| crate::PipelineError::Config(e.to_string()))?;
        let schedule = with_recomputes(&synthesis.schedule, CheckpointMode::Always);
        schedule.validate()?;
        Ok(schedule)
    }
}
