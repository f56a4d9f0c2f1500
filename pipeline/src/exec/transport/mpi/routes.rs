//! Where the communication thread puts what arrives: the round's receivers, messages of later
//! rounds kept until theirs begins, control messages by (round, kind, rank), and what is known
//! of each peer (last heard from, said goodbye, taken for dead).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{BEAT, PEER_TIMEOUT_VAR};
use crate::exec::transport::decode_msg;
use crate::exec::transport::wire::{self, Frame, MsgKind};
use crate::exec::transport::Msg;
use crate::schedule::Link;

/// Where incoming messages go.
#[derive(Default)]
pub(super) struct Routes {
    pub(super) round: u64,
    pub(super) links: HashMap<Link, Sender<Msg>>,
    pub(super) abort: Option<Arc<AtomicBool>>,
    /// Why the round was aborted from elsewhere (the first reason).
    pub(super) abort_reason: Option<String>,
    /// Tensor and abort messages of later rounds.
    pub(super) early: Vec<Frame>,
    /// Status and reduce messages by (round, kind, source rank).
    pub(super) control: HashMap<(u64, u8, usize), Frame>,
    /// When each rank was last heard from (any message, heartbeats included).
    pub(super) heard: Vec<Instant>,
    /// Ranks that said they stopped communicating (they send nothing more).
    pub(super) done: Vec<bool>,
    /// Ranks silent past the peer time limit, taken for dead, and why.
    pub(super) dead: Vec<(usize, String)>,
}

impl Routes {
    pub(super) fn route(&mut self, frame: Frame, src: usize) {
        let Ok((kind, round, link)) = wire::peek(frame.bytes()) else {
            return; // not ours: nothing in this job sends such bytes
        };
        match kind {
            MsgKind::Beat => {}
            MsgKind::Bye => {
                if let Some(d) = self.done.get_mut(src) {
                    *d = true;
                }
                // Every step involves every rank: one that has ended cannot take part in the
                // step in progress (nor in any later one, see `begin_round`).
                if self.abort.is_some() {
                    self.fail(ended(src));
                }
            }
            MsgKind::Status | MsgKind::Reduce | MsgKind::Norm | MsgKind::Tied => {
                if round >= self.round {
                    self.control.insert((round, kind as u8, src), frame);
                }
            }
            _ if round > self.round => self.early.push(frame),
            _ if round < self.round || self.abort.is_none() => {} // a finished round's
            MsgKind::Abort => self.fail(wire::text_of(frame.bytes())),
            MsgKind::Activation | MsgKind::Gradient => {
                let Some(tx) = self.links.get(&link) else {
                    return self.fail(format!(
                        "rank {src} sent on {link}, which no stage here receives"
                    ));
                };
                match decode_msg(frame, round, link) {
                    Ok(msg) => {
                        let _ = tx.send(msg);
                    }
                    Err(e) => self.fail(format!("rank {src}: {e}")),
                }
            }
        }
    }

    /// Takes the ranks silent for longer than `limit` for dead (once each) and fails the
    /// round in progress.
    pub(super) fn check_peers(&mut self, me: usize, limit: Duration) {
        for p in 0..self.heard.len() {
            let silent = self.heard[p].elapsed();
            if p == me || self.done[p] || silent <= limit || self.dead.iter().any(|(d, _)| *d == p)
            {
                continue;
            }
            let why = format!(
                "rank {p} has sent nothing for {silent:.1?}, not even the heartbeat its \
                 communication thread sends every {BEAT:?}: taken for dead (killed, stopped or \
                 unreachable; the limit is {PEER_TIMEOUT_VAR}={:.1})",
                limit.as_secs_f64()
            );
            self.dead.push((p, why.clone()));
            self.fail(why);
        }
    }

    /// Why a peer cannot answer any more (dead, or done communicating), if so.
    pub(super) fn gone(&self, p: usize) -> Option<String> {
        if let Some((_, why)) = self.dead.iter().find(|(d, _)| *d == p) {
            return Some(why.clone());
        }
        self.done.get(p).copied().unwrap_or(false).then(|| ended(p))
    }

    pub(super) fn fail(&mut self, why: String) {
        self.abort_reason.get_or_insert(why);
        if let Some(a) = &self.abort {
            a.store(true, Ordering::SeqCst);
        }
    }
}

/// Why rank `p` cannot answer: it said goodbye.
pub(super) fn ended(p: usize) -> String {
    format!(
        "rank {p} has ended (it finished its run, failed or exited) and sends nothing more: \
         every rank must run the same steps"
    )
}
