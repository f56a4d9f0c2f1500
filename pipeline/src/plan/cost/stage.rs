//! The sums and peaks of each stage's layers, from the profile, at a micro-batch size.

use super::{CostModel, StageAt};

impl CostModel<'_> {
    /// `[stage][0 or 1]`: the stage at the first micro-batch size and at the other one, with
    /// `checkpointed` layers (global indices, ascending) re-materialized inside the stages.
    pub(super) fn stage_table(
        &self,
        balance: &[usize],
        checkpointed: &[usize],
        sizes: &[usize],
    ) -> Vec<[StageAt; 2]> {
        (0..balance.len())
            .map(|s| self.stage_entry(balance, checkpointed, sizes, s))
            .collect()
    }

    /// Stage `s`'s row of [`CostModel::stage_table`].
    pub(super) fn stage_entry(
        &self,
        balance: &[usize],
        checkpointed: &[usize],
        sizes: &[usize],
        s: usize,
    ) -> [StageAt; 2] {
        let small = *sizes.last().expect("at least one micro-batch");
        let start: usize = balance[..s].iter().sum();
        let r = start..start + balance[s];
        let last = balance.len() - 1;
        let ck = |i: usize| checkpointed.binary_search(&i).is_ok();
        if self.profile.skips.is_empty() {
            // Without skips there is nothing to look up for each pair of stages (which costs
            // S^2 walks of the ranges).
            let one = |b: usize| self.stage_at(r.clone(), s == 0, s == last, b, &ck);
            return [one(sizes[0]), one(small)];
        }
        let local = self.skip_bytes_between(balance, s, s);
        let out = |b: usize| {
            (s + 1..balance.len())
                .map(|t| self.skip_bytes_between(balance, s, t)(b))
                .sum::<f64>()
        };
        let one = |b: usize| {
            let mut st = self.stage_at(r.clone(), s == 0, s == last, b, &ck);
            with_local_skips(&mut st, local(b));
            st.skip_out = out(b);
            st
        };
        [one(sizes[0]), one(small)]
    }

    /// One stage at micro-batch size `b`; `ck(i)` tells whether layer `i` is re-materialized
    /// inside it (the executor's `Stage::checkpointed` runs): such a run keeps only its output
    /// (its input is the output the layer before keeps, or the stage's input), runs again when
    /// the backward reaches it (its forward added to the backward), computes its weight
    /// gradients in the input part of a split backward, and while its backward runs holds its
    /// whole record beside what the layers before it keep.
    fn stage_at(
        &self,
        r: std::ops::Range<usize>,
        first: bool,
        last: bool,
        b: usize,
        ck: &dyn Fn(usize) -> bool,
    ) -> StageAt {
        let p = self.profile;
        let mut st = StageAt {
            input: p.input_bytes_of(r.start, b) as f64,
            ..StageAt::default()
        };
        let mut prefix = 0.0;
        // The checkpointed run being walked: the stash before it, its layers' stashes (its
        // record once run again) and, per layer, the peaks of its backward above that record
        // (full, and input part: the same, its weight gradients come there).
        let mut run_base = 0.0;
        let mut run_stash = 0.0;
        let mut run_layers: Vec<f64> = Vec::new();
        let mut in_bytes = 0.0;
        // Per layer: the peak of its input part, and what it keeps for the weight part.
        let mut input_parts = Vec::with_capacity(r.len());
        for (i, l) in p.layers[r.clone()]
            .iter()
            .enumerate()
            .map(|(j, l)| (r.start + j, l))
        {
            let out = l.output_bytes.bytes(b) as f64;
            let forward = l.forward_flops.at(b);
            let from_data = first && i <= p.first_trainable;
            let backward = if from_data {
                l.backward_flops_from_data.at(b)
            } else {
                l.backward_flops.at(b)
            };
            let backward_input = if from_data {
                l.backward_input_flops_from_data.at(b)
            } else {
                l.backward_input_flops.at(b)
            };
            st.forward += forward;
            st.residue += l.forward_residue_bytes.at(b);
            st.accumulate += l.accumulate_flops;
            st.no_grad_peak = st.no_grad_peak.max(in_bytes + l.no_grad_peak_bytes.at(b));
            if ck(i) {
                if i == r.start || !ck(i - 1) {
                    run_base = prefix;
                    run_stash = 0.0;
                    run_layers.clear();
                }
                // Run again when the backward reaches the run, then its whole backward (a
                // plain one, weight gradients included) in the input part.
                st.backward += forward + backward;
                st.backward_input += forward + backward;
                st.accumulate_input += l.accumulate_flops;
                run_stash += l.stash_bytes.at(b);
                // Run without recording: its input is live (kept by the layer before).
                st.forward_peak = st.forward_peak.max(prefix + l.no_grad_peak_bytes.at(b));
                // Run again: what the layers before it keep, its record so far.
                st.backward_peak = st
                    .backward_peak
                    .max(run_base + run_stash + l.forward_extra_bytes.at(b));
                run_layers.push(out + l.backward_extra_bytes.at(b));
                if i + 1 == r.end || !ck(i + 1) {
                    // The run's record is alive during its backward, beside its first output
                    // (on the stage's tape); the runs after it are gone by then, those before
                    // it still keep only their outputs.
                    let held = run_base + run_stash + out;
                    for &above in &run_layers {
                        st.backward_peak = st.backward_peak.max(held + above);
                        input_parts.push((held + above, 0.0));
                    }
                    prefix += out;
                }
            } else {
                st.backward += backward;
                st.backward_input += backward_input;
                st.backward_weight += l.backward_weight_flops.at(b);
                prefix += l.stash_bytes.at(b);
                st.forward_peak = st.forward_peak.max(prefix + l.forward_extra_bytes.at(b));
                st.backward_peak = st
                    .backward_peak
                    .max(prefix + out + l.backward_extra_bytes.at(b));
                // A layer's weight part may need its input, which inside a stage is the
                // output of the layer before (not in that layer's own measured keep); the
                // stage's input is held until the weight part anyway.
                let keep = l.weight_keep_bytes.at(b)
                    + if i > r.start && l.param_bytes > 0 {
                        in_bytes
                    } else {
                        0.0
                    };
                st.keep += keep;
                st.backward_weight_peak += l.backward_weight_extra_bytes.at(b);
                input_parts.push((prefix + out + l.backward_input_extra_bytes.at(b), keep));
            }
            in_bytes = out;
            st.output = out;
        }
        st.stash = prefix;
        // The input parts run from the last layer back; what the later layers kept is alive.
        let mut kept_after = 0.0;
        for &(peak, keep) in input_parts.iter().rev() {
            st.backward_input_peak = st.backward_input_peak.max(peak + kept_after);
            kept_after += keep;
        }
        if last {
            st.loss = p.loss.flops.at(b);
            st.loss_peak = p.loss.peak_bytes.at(b);
            st.loss_kept = p.loss.kept_bytes.at(b);
        }
        st
    }
}

/// A skip inside a stage is held from its producer's forward to its consumer's backward, with
/// its gradient during the backward: charged to the whole stage's tape (an upper bound).
fn with_local_skips(st: &mut StageAt, bytes: f64) {
    if bytes == 0.0 {
        return;
    }
    st.stash += bytes;
    st.forward_peak += bytes;
    st.no_grad_peak += bytes;
    st.backward_peak += 2.0 * bytes;
    st.backward_input_peak += 2.0 * bytes;
    st.keep += bytes;
}
