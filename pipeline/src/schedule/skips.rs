//! Skip transfers in a schedule: a skip stashed on stage `from` and popped on a later stage `to`
//! travels straight between them (no stage in between sees it), and its gradient comes back.
//! A relayed skip ([`crate::SkipRoute::Relay`]) is one link per hop, so the same rules apply.
//!
//! They are attached to the chain's compute: the skip is sent right after the producer's
//! forward and received right before the consumer's; its gradient is sent right after the
//! consumer's backward (or input part) and received right before the producer's. Any valid
//! chain schedule stays deadlock-free with them: the consumer's forward already waits (through
//! the activations of the stages between) for the producer's forward, and the producer's
//! backward (through the gradients) for the consumer's, so each skip receive waits for a send
//! that has happened or will without waiting on anything else.

use super::{Action, ActionKind, Schedule, ScheduleError};

/// A skip between two different virtual stages: `id` keys its link, `from` stashes it, `to`
/// (later in model order) pops it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SkipLink {
    pub id: usize,
    pub from: usize,
    pub to: usize,
}

impl Schedule {
    /// This schedule with the transfers of `skips` (see the module docs); any skip transfers it
    /// had are replaced. Checked with [`Schedule::validate_skips`].
    pub fn with_skip_transfers(&self, skips: &[SkipLink]) -> Schedule {
        use ActionKind::*;
        let devices =
            self.devices
                .iter()
                .map(|list| {
                    let mut out = Vec::with_capacity(list.len());
                    for &a in list.iter().filter(|a| a.skip.is_none()) {
                        let (s, m) = (a.stage, a.micro_batch);
                        let produced = skips.iter().filter(|k| k.from == s);
                        let consumed = skips.iter().filter(|k| k.to == s);
                        match a.kind {
                            Forward => {
                                out.extend(
                                    consumed.map(|k| {
                                        Action::skip_transfer(RecvSkip, s, m, k.id, k.from)
                                    }),
                                );
                                out.push(a);
                                out.extend(
                                    produced
                                        .map(|k| Action::skip_transfer(SendSkip, s, m, k.id, k.to)),
                                );
                            }
                            Backward | BackwardInput => {
                                out.extend(produced.map(|k| {
                                    Action::skip_transfer(RecvSkipGrad, s, m, k.id, k.to)
                                }));
                                out.push(a);
                                out.extend(consumed.map(|k| {
                                    Action::skip_transfer(SendSkipGrad, s, m, k.id, k.from)
                                }));
                            }
                            _ => out.push(a),
                        }
                    }
                    out
                })
                .collect();
        Schedule {
            devices,
            ..self.clone()
        }
    }

    /// Checks the skip transfers against `skips`: each skip goes forward (from < to, both
    /// stages of this schedule), and for every micro-batch its four transfers occur once each,
    /// on the devices of their stages, in order with the compute they belong to (send after
    /// the producer's forward, receive before the consumer's; gradient sent after the
    /// consumer's backward, received before the producer's). The rest is [`Schedule::validate`].
    pub fn validate_skips(&self, skips: &[SkipLink]) -> Result<(), ScheduleError> {
        use ActionKind::*;
        let position = |a: Action| -> Vec<usize> {
            let list = &self.devices[self.placement[a.stage]];
            (0..list.len()).filter(|&i| list[i] == a).collect()
        };
        let first_backward = |s: usize, m: usize| {
            let b = position(Action::new(Backward, s, m));
            if b.is_empty() {
                position(Action::new(BackwardInput, s, m))
            } else {
                b
            }
        };
        for k in skips {
            if k.from >= k.to || k.to >= self.num_stages() {
                return Err(ScheduleError::SkipStages {
                    id: k.id,
                    from: k.from,
                    to: k.to,
                    num_stages: self.num_stages(),
                });
            }
            for m in 0..self.num_micro_batches {
                let send = Action::skip_transfer(SendSkip, k.from, m, k.id, k.to);
                let recv = Action::skip_transfer(RecvSkip, k.to, m, k.id, k.from);
                let send_grad = Action::skip_transfer(SendSkipGrad, k.to, m, k.id, k.from);
                let recv_grad = Action::skip_transfer(RecvSkipGrad, k.from, m, k.id, k.to);
                let pairs = [
                    (position(Action::new(Forward, k.from, m)), send, true),
                    (position(Action::new(Forward, k.to, m)), recv, false),
                    (first_backward(k.to, m), send_grad, true),
                    (first_backward(k.from, m), recv_grad, false),
                ];
                for (compute, transfer, after) in pairs {
                    let at = position(transfer);
                    if at.len() != 1 {
                        return Err(ScheduleError::ActionCount {
                            device: self.placement[transfer.stage],
                            action: transfer,
                            found: at.len(),
                            expected: 1,
                        });
                    }
                    let Some(&c) = compute.first() else { continue };
                    let ok = if after { c < at[0] } else { at[0] < c };
                    if !ok {
                        let device = self.placement[transfer.stage];
                        let compute = self.devices[device][c];
                        let (earlier, later) = if after {
                            (compute, transfer)
                        } else {
                            (transfer, compute)
                        };
                        return Err(ScheduleError::Order {
                            device,
                            earlier,
                            later,
                        });
                    }
                }
            }
        }
        let extra = self
            .actions()
            .find(|(_, a)| a.skip.is_some_and(|p| !skips.iter().any(|k| k.id == p.id)));
        if let Some((device, action)) = extra {
            return Err(ScheduleError::ActionCount {
                device,
                action,
                found: 1,
                expected: 0,
            });
        }
        Ok(())
    }
}
