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
    /// (its input is the output the layer before keeps, or the stage's input), runs again
    /// before the stage's backward (its forward added there), computes its weight gradients in
    /// the input part of a split backward, and once run again holds what it would have held
    /// without re-materialization.
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
        // The stash as if nothing were re-materialized: what the backward holds after the
        // runs ran again.
        let mut full_prefix = 0.0;
        // The runs' outputs of their first forward: held on the stage's tape beside their
        // re-run's record during the backward.
        let mut run_outputs = 0.0;
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
            full_prefix += l.stash_bytes.at(b);
            let keep = if ck(i) {
                // Run again, then its whole backward (a plain one, weight gradients included)
                // in the input part.
                st.backward += forward + backward;
                st.backward_input += forward + backward;
                st.accumulate_input += l.accumulate_flops;
                if !ck(i + 1) || i + 1 == r.end {
                    prefix += out; // the run's output, on the stage's tape
                    run_outputs += out;
                }
                // Run again before the backward, with what the layers before it kept.
                st.backward_peak = st
                    .backward_peak
                    .max(full_prefix + l.forward_extra_bytes.at(b));
                // Run without recording: the layer's input is live (kept by the layer before).
                st.forward_peak = st.forward_peak.max(prefix + l.no_grad_peak_bytes.at(b));
                0.0
            } else {
                st.backward += backward;
                st.backward_input += backward_input;
                st.backward_weight += l.backward_weight_flops.at(b);
                prefix += l.stash_bytes.at(b);
                st.forward_peak = st.forward_peak.max(prefix + l.forward_extra_bytes.at(b));
                // A layer's weight part may need its input, which inside a stage is the
                // output of the layer before (not in that layer's own measured keep); the
                // stage's input is held until the weight part anyway.
                l.weight_keep_bytes.at(b)
                    + if i > r.start && l.param_bytes > 0 {
                        in_bytes
                    } else {
                        0.0
                    }
            };
            st.no_grad_peak = st.no_grad_peak.max(in_bytes + l.no_grad_peak_bytes.at(b));
            st.backward_peak = st
                .backward_peak
                .max(full_prefix + out + l.backward_extra_bytes.at(b));
            st.keep += keep;
            // A re-run layer's whole backward (its weight gradients too) runs in the input part.
            let extra = if ck(i) {
                l.backward_extra_bytes.at(b)
            } else {
                st.backward_weight_peak += l.backward_weight_extra_bytes.at(b);
                l.backward_input_extra_bytes.at(b)
            };
            input_parts.push((full_prefix + out + extra, keep));
            in_bytes = out;
            st.output = out;
        }
        st.stash = prefix;
        st.backward_peak += run_outputs;
        // The input parts run from the last layer back; what the later layers kept is alive.
        let mut kept_after = 0.0;
        for &(peak, keep) in input_parts.iter().rev() {
            st.backward_input_peak = st.backward_input_peak.max(peak + kept_after);
            kept_after += keep;
        }
        st.backward_input_peak += run_outputs;
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
