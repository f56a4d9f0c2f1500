//! What crosses a device's links: tensors sent, messages received (those that arrive before
//! the receive that wants them kept aside), the skips a stage pops, and the loss gradient the
//! last stage asks the caller's thread for.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

use wgpipe_tensor::Tensor;

use super::{internal, LossRequest, Worker};
use crate::error::StageCause;
use crate::exec::stage::Stage;
use crate::exec::transport::Msg;
use crate::schedule::{Action, Link};

const POLL: Duration = Duration::from_millis(5);

impl Worker<'_, '_> {
    pub(super) fn send(
        &mut self,
        link: Link,
        m: usize,
        tensor: Tensor,
        finite: bool,
    ) -> Result<(), StageCause> {
        self.out.messages_sent += 1;
        let tx = self
            .links
            .tx
            .get(&link)
            .ok_or_else(|| internal(format!("no sender for {link}")))?;
        tx.send(Msg {
            micro_batch: m,
            tensor,
            finite,
        })
    }

    /// The skips stage `s` pops for micro-batch `m`, as received, and whether all are finite.
    pub(super) fn take_skips_in(
        &mut self,
        stage: &Stage,
        m: usize,
    ) -> Result<(Vec<Tensor>, bool), StageCause> {
        let mut finite = true;
        let mut out = Vec::with_capacity(stage.skips.incoming.len());
        for (id, name) in &stage.skips.incoming {
            let (t, f) = self.skips_in.remove(&(*id, m, false)).ok_or_else(|| {
                internal(format!(
                    "skip '{name}' for stage {} micro-batch {m} was not received",
                    stage.index
                ))
            })?;
            finite &= f;
            out.push(t);
        }
        Ok((out, finite))
    }

    pub(super) fn link(&self, action: Action) -> Result<Link, StageCause> {
        action
            .link(self.io.num_stages)
            .ok_or_else(|| internal(format!("{action} has no peer")))
    }

    /// The message `action` waits for: taken from the early arrivals, or read from its link
    /// (keeping messages for other micro-batches), polling the abort flag.
    pub(super) fn recv(&mut self, action: Action) -> Result<Msg, StageCause> {
        let link = self.link(action)?;
        let m = action.micro_batch;
        if let Some(msg) = self.early.remove(&(link, m)) {
            return Ok(msg);
        }
        let rx = self
            .links
            .rx
            .get(&link)
            .ok_or_else(|| internal(format!("no receiver for {link}")))?;
        let _waiting = crate::exec::transport::Waiting::on(self.links.waiter.as_deref());
        loop {
            match rx.recv_timeout(POLL) {
                Ok(msg) if msg.micro_batch == m => return Ok(msg),
                Ok(msg) => {
                    self.early.insert((link, msg.micro_batch), msg);
                }
                Err(RecvTimeoutError::Timeout) => {
                    if self.io.abort.load(Ordering::SeqCst) {
                        return Err(StageCause::Disconnected(
                            "stopped because another stage failed".into(),
                        ));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(StageCause::Disconnected(format!(
                        "the neighbour sending on {link} stopped"
                    )))
                }
            }
        }
    }

    /// Asks the calling thread for the gradient of micro-batch `m`'s loss with respect to the
    /// last stage's `output`, waiting as a receive does (polling the abort flag).
    pub(super) fn loss_gradient(
        &mut self,
        m: usize,
        output: Tensor,
    ) -> Result<(Tensor, bool), StageCause> {
        let (reply, answer) = channel();
        self.io
            .loss
            .send(LossRequest {
                step: self.io.step,
                micro_batch: m,
                output,
                reply,
            })
            .map_err(|_| StageCause::Disconnected("the step's caller stopped".into()))?;
        loop {
            match answer.recv_timeout(POLL) {
                Ok(r) => return r,
                Err(RecvTimeoutError::Timeout) => {
                    if self.io.abort.load(Ordering::SeqCst) {
                        return Err(StageCause::Disconnected(
                            "stopped because another stage failed".into(),
                        ));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(StageCause::Disconnected("the step's caller stopped".into()))
                }
            }
        }
    }
}
