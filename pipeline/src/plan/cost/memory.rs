//! Peak memory: each device's action list walked in order (see the module above).

use crate::schedule::{ActionKind, Schedule};

use super::{CandidateCosts, CostModel, ScheduleFacts};

impl CostModel<'_> {
    /// (step peak, peak with the optimizer step) of pipeline device `d`. A device's walk reads
    /// its own list only (and positions of transfers in its peers'), so the device's
    /// re-materialization alone decides it.
    pub fn device_memory(
        &self,
        costs: &CandidateCosts,
        schedule: &Schedule,
        facts: &ScheduleFacts,
        d: usize,
    ) -> (u64, u64) {
        let last = costs.stages.len() - 1;
        let walk = walk_memory(schedule, facts, d, last, costs, costs.largest_param[d]);
        let step = costs.static_bytes[d] as f64 + walk;
        let with_optimizer = step.max(costs.static_bytes[d] as f64 + costs.optimizer_extra[d]);
        (step.ceil() as u64, with_optimizer.ceil() as u64)
    }
}

/// A non-finite check of a tensor makes a temporary of its size, then sums it to a scalar.
const CHECK_SCALAR: f64 = 4.0;

/// What one (stage, micro-batch) holds on its device.
#[derive(Default, Clone, Copy)]
struct Held {
    input: f64,
    stash: f64,
    seed: f64,
    keep: f64,
    /// Skips received from earlier stages (held until the backward that returns their
    /// gradients is complete).
    skips_in: f64,
    /// Gradients of this stage's stashed skips, received from later stages.
    skip_grads: f64,
}

/// The largest bytes above parameters, gradients and state device `d` holds during a step.
fn walk_memory(
    schedule: &Schedule,
    facts: &ScheduleFacts,
    d: usize,
    last: usize,
    costs: &CandidateCosts,
    param_check: f64,
) -> f64 {
    let list = &schedule.devices[d];
    let mut held = 0.0f64;
    let mut peak = 0.0f64;
    let m_count = facts.micro_batches;
    let mut items = vec![Held::default(); schedule.num_stages() * m_count];
    // Bytes of messages by the index after which they leave the sender.
    let mut leaving = vec![0.0f64; list.len() + 1];
    // Bytes made by the last compute action that its send hands on (0 when a tape holds them).
    let mut outgoing = 0.0;
    for (i, a) in list.iter().enumerate() {
        let (s, m) = (a.stage, a.micro_batch);
        let st = costs.at(s, m);
        let it = &mut items[s * m_count + m];
        match a.kind {
            ActionKind::RecvActivation => {
                it.input = st.input;
                held += st.input;
            }
            ActionKind::RecvGrad => {
                it.seed = st.output;
                held += st.output;
            }
            ActionKind::RecvSkip => {
                let b = costs.skip_of(a);
                it.skips_in += b;
                held += b;
            }
            ActionKind::RecvSkipGrad => {
                let b = costs.skip_of(a);
                it.skip_grads += b;
                held += b;
            }
            ActionKind::Forward => {
                if s == 0 {
                    it.input = st.input;
                    held += st.input;
                    // The non-finite check of the input.
                    peak = peak.max(held + st.input + CHECK_SCALAR);
                }
                // The stashed skips as messages, until their receivers surely took them.
                held += st.skip_out;
                if facts.checkpointed[s * m_count + m] {
                    peak = peak.max(held + st.no_grad_peak);
                    outgoing = if s == last { 0.0 } else { st.output };
                    held += st.output;
                    if s == last {
                        // Until the loss is done with it.
                        peak = peak.max(held + st.loss_peak);
                        held -= st.output;
                    }
                } else {
                    peak = peak.max(held + st.forward_peak + st.skip_out);
                    // The stashed skips are roots of the tape until the backward.
                    it.stash = st.stash + st.skip_out;
                    held += it.stash;
                    outgoing = 0.0;
                    if s == last {
                        peak = peak.max(held + st.loss_peak);
                    }
                }
                held += st.residue;
                // The non-finite check of the output.
                peak = peak.max(held + st.output + CHECK_SCALAR);
                if s == last {
                    it.seed = st.output;
                    held += st.output + st.loss_kept;
                }
            }
            ActionKind::Recompute => {
                // It makes the stashed skips again, as roots of its tape (not sent again).
                peak = peak.max(held + st.forward_peak + st.skip_out);
                it.stash = st.stash + st.skip_out;
                held += it.stash;
            }
            ActionKind::Backward | ActionKind::BackwardInput => {
                let stash = it.stash;
                let rest = held - stash - it.seed;
                // The popped skips' gradients (sent back) and their non-finite checks.
                let grads = it.skips_in;
                let (top, after) = if a.kind == ActionKind::Backward {
                    (st.backward_peak, it.input + it.skips_in)
                } else {
                    (st.backward_input_peak, 0.0)
                };
                let skip_top = if grads > 0.0 {
                    2.0 * grads + CHECK_SCALAR
                } else {
                    0.0
                };
                peak = peak.max(rest + top + skip_top);
                held = rest - after - it.skip_grads + grads;
                it.skip_grads = 0.0;
                if a.kind == ActionKind::Backward {
                    it.skips_in = 0.0;
                }
                if a.kind == ActionKind::BackwardInput {
                    it.keep = st.keep;
                    held += st.keep;
                } else {
                    it.input = 0.0;
                }
                it.stash = 0.0;
                it.seed = 0.0;
                outgoing = if s > 0 { st.input } else { 0.0 };
                if s > 0 {
                    // The check of the input gradient runs before the tape is dropped: the
                    // input (in `rest`), the tape's stash, output, seed, the input gradient and
                    // the check's temporary.
                    peak = peak.max(
                        rest + stash + 2.0 * st.output + 2.0 * st.input + skip_top + CHECK_SCALAR,
                    );
                }
                held += outgoing;
            }
            ActionKind::BackwardWeight => {
                peak = peak.max(held + st.backward_weight_peak);
                held -= it.keep + it.input + it.skips_in;
                it.keep = 0.0;
                it.input = 0.0;
                it.skips_in = 0.0;
            }
            ActionKind::SendActivation | ActionKind::SendGrad => {
                if outgoing > 0.0 {
                    leaving[facts.release[d][i]] += outgoing;
                }
                outgoing = 0.0;
            }
            ActionKind::SendSkip | ActionKind::SendSkipGrad => {
                leaving[facts.release[d][i]] += costs.skip_of(a);
            }
            // Tied exchanges are events of the timeline, never actions.
            ActionKind::ExchangeTied => {}
        }
        peak = peak.max(held);
        held -= leaving[i];
    }
    // The end-of-step check of each parameter gradient (a temporary of its size).
    peak.max(held + param_check + CHECK_SCALAR)
}
