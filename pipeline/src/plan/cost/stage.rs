//! The sums and peaks of each stage's layers, from the profile, at a micro-batch size.

use crate::partition::stage_ranges;

use super::{CostModel, StageAt};

impl CostModel<'_> {
    /// `[stage][0 or 1]`: the stage at the first micro-batch size and at the other one.
    pub(super) fn stage_table(&self, balance: &[usize], sizes: &[usize]) -> Vec<[StageAt; 2]> {
        let small = *sizes.last().expect("at least one micro-batch");
        let ranges = stage_ranges(balance);
        let last = ranges.len() - 1;
        ranges
            .into_iter()
            .enumerate()
            .map(|(s, r)| {
                if self.profile.skips.is_empty() {
                    // Without skips there is nothing to look up for each pair of stages (which
                    // costs S^2 walks of the ranges).
                    let one = |b: usize| self.stage_at(r.clone(), s == 0, s == last, b);
                    return [one(sizes[0]), one(small)];
                }
                let local = self.skip_bytes_between(balance, s, s);
                let out = |b: usize| {
                    (s + 1..balance.len())
                        .map(|t| self.skip_bytes_between(balance, s, t)(b))
                        .sum::<f64>()
                };
                let one = |b: usize| {
                    let mut st = self.stage_at(r.clone(), s == 0, s == last, b);
                    with_local_skips(&mut st, local(b));
                    st.skip_out = out(b);
                    st
                };
                [one(sizes[0]), one(small)]
            })
            .collect()
    }

    fn stage_at(&self, r: std::ops::Range<usize>, first: bool, last: bool, b: usize) -> StageAt {
        let p = self.profile;
        let mut st = StageAt {
            input: p.input_bytes_of(r.start, b) as f64,
            ..StageAt::default()
        };
        let mut prefix = 0.0;
        let mut in_bytes = 0.0;
        // Per layer: the peak of its input part, and what it keeps for the weight part.
        let mut input_parts = Vec::with_capacity(r.len());
        for (i, l) in p.layers[r.clone()]
            .iter()
            .enumerate()
            .map(|(j, l)| (r.start + j, l))
        {
            let out = l.output_bytes.bytes(b) as f64;
            st.forward += l.forward_flops.at(b);
            st.residue += l.forward_residue_bytes.at(b);
            st.backward += if first && i <= p.first_trainable {
                l.backward_flops_from_data.at(b)
            } else {
                l.backward_flops.at(b)
            };
            st.backward_input += if first && i <= p.first_trainable {
                l.backward_input_flops_from_data.at(b)
            } else {
                l.backward_input_flops.at(b)
            };
            st.backward_weight += l.backward_weight_flops.at(b);
            st.accumulate += l.accumulate_flops;
            prefix += l.stash_bytes.at(b);
            st.forward_peak = st.forward_peak.max(prefix + l.forward_extra_bytes.at(b));
            st.no_grad_peak = st.no_grad_peak.max(in_bytes + l.no_grad_peak_bytes.at(b));
            st.backward_peak = st
                .backward_peak
                .max(prefix + out + l.backward_extra_bytes.at(b));
            // A layer's weight part may need its input, which inside a stage is the output of
            // the layer before (not in that layer's own measured keep); the stage's input is
            // held until the weight part anyway.
            let keep = l.weight_keep_bytes.at(b)
                + if i > r.start && l.param_bytes > 0 {
                    in_bytes
                } else {
                    0.0
                };
            st.keep += keep;
            input_parts.push((prefix + out + l.backward_input_extra_bytes.at(b), keep));
            st.backward_weight_peak += l.backward_weight_extra_bytes.at(b);
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
