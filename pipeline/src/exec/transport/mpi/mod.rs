//! MPI behind the transport seam (feature `mpi`): one communication thread per process owns MPI
//! (it initializes and finalizes it and makes every MPI call), so MPI's threading level does
//! not matter and the workers stay transport-agnostic: they send through a [`LinkSend`] that
//! hands encoded bytes to this thread, and receive from in-process channels that this thread
//! feeds.
//!
//! Every message is a byte buffer in the [`crate::exec::transport::wire`] format; its header, not the MPI tag,
//! says what it is (a large host tensor leaves as two: its values from its storage, then the
//! rest of its frame, joined again on arrival). Each `train_step` is a round: the thread delivers a round's tensors to the
//! receivers registered for that round, keeps messages of later rounds until their round
//! begins (a fast peer may start the next step early), and drops those of rounds that are over
//! (what a failed step left in flight). Receives are probes polled by this thread, so nothing
//! blocks on a dead peer. Open MPI's shared-memory and TCP transports make progress only
//! when polled (a blocking MPI call spins too), so the thread polls without pause while
//! anyone waits for a message (a worker's receive, an exchange, a send or a collective in
//! flight: see [`crate::exec::transport::Waiter`]) and rests between looks only when nobody
//! does. Messages are [`Frame`]s: a tensor's values are sent from its storage (or, from a
//! GPU or a strided view, read into the vector that is sent), and received into the vector
//! that becomes the tensor.
//!
//! Here: [`MpiComm`], the handle (init, rounds, control messages, the links' senders); in
//! `serve.rs` the communication thread's loop and what it is asked, in `routes.rs` where what
//! arrives goes and what is known of each peer, in `ping_pong.rs` the transport's measurement.

mod ping_pong;
mod routes;
mod serve;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::topology::Communicator;
use mpi::Threading;

use crate::error::{PipelineError, StageCause};
use crate::exec::threads::lock;
use crate::exec::transport::mpi_reduce::Reduction;
use crate::exec::transport::wire::{self, Frame, MsgKind, Outgoing};
use crate::exec::transport::{encode_msg, LinkSend};
use crate::exec::transport::{Msg, Waiting};
use crate::schedule::Link;
use routes::{ended, Routes};
use serve::{serve, Out, Poll, Shared};

/// This process's place in the MPI job and its communication thread. Cheap to clone; the
/// thread stops (and MPI is finalized) when [`MpiComm::finish`] is called.
#[derive(Clone)]
pub struct MpiComm {
    inner: Arc<Inner>,
}

/// The default of [`MpiComm::peer_timeout`].
const PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// How often a communication thread tells the others it is still there.
const BEAT: Duration = Duration::from_millis(250);

/// The environment variable that sets [`MpiComm::peer_timeout`] at [`MpiComm::init`], in
/// seconds.
pub const PEER_TIMEOUT_VAR: &str = "WGPIPE_MPI_PEER_TIMEOUT";

/// The environment variable that turns [`MpiComm::set_overlap_reduction`] off at
/// [`MpiComm::init`] (`0`); `1` or unset: on.
pub const OVERLAP_VAR: &str = "WGPIPE_MPI_OVERLAP";

struct Inner {
    rank: usize,
    size: usize,
    /// Milliseconds of [`MpiComm::peer_timeout`] (shared with the communication thread).
    peer_timeout_ms: Arc<AtomicU64>,
    out: Mutex<Sender<Out>>,
    routes: Arc<Mutex<Routes>>,
    /// Notified when a control message arrives or a peer is lost.
    arrived: Arc<Condvar>,
    /// How many receives wait now (the thread polls without pause while any does).
    waiting: Arc<Poll>,
    /// Whether replicas' gradient buckets start as they become final (see
    /// [`MpiComm::set_overlap_reduction`]).
    overlap: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Exchanges made outside any step so far (see [`MpiComm::next_setup_round`]).
    setups: AtomicU64,
}

impl Drop for Inner {
    /// The last handle gone: the communication thread ends and MPI is finalized (what
    /// [`MpiComm::finish`] does earlier on request).
    fn drop(&mut self) {
        let _ = lock(&self.out).send(Out::Stop);
        if let Some(h) = lock(&self.thread).take() {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank(), self.size())
    }
}

impl PartialEq for MpiComm {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl MpiComm {
    /// Initializes MPI on a new communication thread (`wgpipe-mpi`). Call once per process,
    /// before anything else uses MPI; [`MpiComm::finish`] before the process exits. On glibc it
    /// also keeps freed memory for reuse (see [`keep_freed_memory`]).
    pub fn init() -> Result<MpiComm, PipelineError> {
        keep_freed_memory();
        let timeout = match std::env::var(PEER_TIMEOUT_VAR) {
            Ok(v) => peer_timeout_from(&v).map_err(PipelineError::Config)?,
            Err(_) => PEER_TIMEOUT,
        };
        let overlap = match std::env::var(OVERLAP_VAR).as_deref() {
            Err(_) | Ok("1") => true,
            Ok("0") => false,
            Ok(other) => {
                return Err(PipelineError::Config(format!(
                    "{OVERLAP_VAR}={other:?}: expected 0 (the reduction after the backward) or 1 (overlapping it)"
                )))
            }
        };
        let peer_timeout_ms = Arc::new(AtomicU64::new(timeout.as_millis() as u64));
        let thread_timeout = peer_timeout_ms.clone();
        let routes = Arc::new(Mutex::new(Routes::default()));
        let arrived = Arc::new(Condvar::new());
        let (out, out_rx) = channel::<Out>();
        let waiting = Arc::new(Poll {
            count: AtomicUsize::new(0),
            wake: Mutex::new(out.clone()),
        });
        let (ready, ready_rx) = channel::<Result<(usize, usize), String>>();
        let thread_routes = routes.clone();
        let thread_arrived = arrived.clone();
        let thread_waiting = waiting.clone();
        let thread = std::thread::Builder::new()
            .name("wgpipe-mpi".into())
            .spawn(move || {
                let Some((universe, _)) = mpi::initialize_with_threading(Threading::Serialized)
                else {
                    let _ = ready.send(Err("MPI is initialized already".into()));
                    return;
                };
                let world = universe.world();
                let _ = ready.send(Ok((world.rank() as usize, world.size() as usize)));
                let shared = Shared {
                    routes: &thread_routes,
                    arrived: &thread_arrived,
                    waiting: &thread_waiting.count,
                    peer_timeout_ms: &thread_timeout,
                };
                serve(&world, &out_rx, &shared);
                if lock(&thread_routes).dead.is_empty() {
                    drop(universe);
                } else {
                    // MPI_Finalize waits for every rank, and a dead one never comes: the
                    // process ends without it (mpirun then ends the job).
                    std::mem::forget(universe);
                }
            })
            .map_err(|e| PipelineError::Config(format!("cannot start the MPI thread: {e}")))?;
        let (rank, size) = ready_rx
            .recv()
            .map_err(|_| "the MPI thread ended before MPI was initialized".to_string())
            .and_then(|r| r)
            .map_err(PipelineError::Config)?;
        Ok(MpiComm {
            inner: Arc::new(Inner {
                rank,
                size,
                peer_timeout_ms,
                out: Mutex::new(out),
                routes,
                arrived,
                waiting,
                overlap: AtomicBool::new(overlap),
                thread: Mutex::new(Some(thread)),
                setups: AtomicU64::new(0),
            }),
        })
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// How long a peer may stay silent before it is taken for dead. Every communication
    /// thread sends a heartbeat to every other rank every 250 ms, however long its workers
    /// compute, so silence means a process killed, stopped or cut off: the step in progress
    /// (and every later one, and any exchange with that rank) then fails at once with an error
    /// naming it. 10 s by default, or [`PEER_TIMEOUT_VAR`] (seconds) at init. Open MPI's
    /// `mpirun` itself ends the whole job when a rank dies outright (naming the rank); this
    /// bounds the wait where a launcher does not (and for a rank that hangs without dying).
    pub fn peer_timeout(&self) -> Duration {
        Duration::from_millis(self.inner.peer_timeout_ms.load(Ordering::Relaxed))
    }

    pub fn set_peer_timeout(&self, limit: Duration) {
        self.inner
            .peer_timeout_ms
            .store(limit.as_millis() as u64, Ordering::Relaxed);
    }
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// Whether the gradient reduction across replicas overlaps the backward (the default):
    /// each stage's bucket starts as soon as its gradients are final. Off, every bucket starts
    /// after the step's last action (to measure what the overlap saves); the sums are the same
    /// bits either way.
    pub fn set_overlap_reduction(&self, on: bool) {
        self.inner.overlap.store(on, Ordering::SeqCst);
    }

    pub fn overlap_reduction(&self) -> bool {
        self.inner.overlap.load(Ordering::SeqCst)
    }

    /// Stops the communication thread once what was sent has gone out (or after 5 s, for a
    /// peer that is gone), and finalizes MPI. Later sends fail.
    pub fn finish(&self) {
        let _ = lock(&self.inner.out).send(Out::Stop);
        if let Some(h) = lock(&self.inner.thread).take() {
            let _ = h.join();
        }
    }

    fn send(&self, dest: usize, frame: Frame) -> Result<(), StageCause> {
        self.send_msg(dest, Outgoing::Whole(frame))
    }

    fn send_msg(&self, dest: usize, msg: Outgoing) -> Result<(), StageCause> {
        self.post(Out::Send { dest, msg })
    }

    fn post(&self, what: Out) -> Result<(), StageCause> {
        lock(&self.inner.out)
            .send(what)
            .map_err(|_| StageCause::Disconnected("the MPI thread has stopped".into()))
    }

    /// While the returned guard lives, the communication thread polls without pause.
    pub(crate) fn waiting(&self) -> Waiting<'_> {
        Waiting::on(Some(&*self.inner.waiting))
    }

    /// At build, on every rank at once: the communicators of the gradient reduction of a
    /// K-device pipeline, one per device across the replicas (split from the world; a
    /// collective call over every rank).
    pub(crate) fn split_devices(&self, k: usize) -> Result<(), String> {
        let (reply, answer) = channel();
        self.post(Out::Split { k, reply })
            .map_err(|e| e.to_string())?;
        let _waiting = self.waiting();
        answer
            .recv()
            .map_err(|_| "the MPI thread stopped during the split".to_string())?
    }

    /// Starts `reduction` on the communication thread (non-blocking).
    pub(crate) fn start_reduction(&self, reduction: Reduction) -> Result<(), String> {
        self.post(Out::Reduce(reduction)).map_err(|e| e.to_string())
    }

    /// Starts round `round`: tensors on `links` go to these channels, an abort from a peer
    /// sets `abort`; messages of this round that came early are delivered now.
    pub(crate) fn begin_round(
        &self,
        round: u64,
        links: HashMap<Link, Sender<Msg>>,
        abort: Arc<AtomicBool>,
    ) {
        let mut r = lock(&self.inner.routes);
        r.round = round;
        r.links = links;
        r.abort = Some(abort);
        r.abort_reason = None;
        if let Some((_, why)) = r.dead.first().cloned() {
            r.fail(why);
        }
        if let Some(p) = r.done.iter().position(|&d| d) {
            r.fail(ended(p));
        }
        r.control.retain(|(k, _, _), _| *k >= round);
        for frame in std::mem::take(&mut r.early) {
            // Source ranks of early messages are only used in error texts.
            r.route(frame, usize::MAX);
        }
    }

    /// A round of its own for an exchange outside any step (the settings every rank checks at
    /// build): far above any step's, counted, so that two builds never mix their messages.
    pub(crate) fn next_setup_round(&self) -> u64 {
        u64::MAX / 4 + self.inner.setups.fetch_add(1, Ordering::SeqCst)
    }

    /// Ends the current round: its tensors still in flight will be dropped.
    pub(crate) fn end_round(&self) {
        let mut r = lock(&self.inner.routes);
        r.links.clear();
        r.abort = None;
    }

    /// The sending end of `link` to `dest` during `round`.
    pub(crate) fn link_sender(&self, dest: usize, round: u64, link: Link) -> Box<dyn LinkSend> {
        Box::new(MpiSend {
            comm: self.clone(),
            dest,
            round,
            link,
        })
    }

    /// Tells every other rank that this round failed here.
    pub(crate) fn abort_peers(&self, round: u64, why: &str) {
        let frame = wire::encode_abort(round, why);
        for dest in (0..self.size()).filter(|&d| d != self.rank()) {
            let _ = self.send(dest, frame.clone());
        }
    }

    /// Sends `mine` (a message of kind `kind` for `round`) to each of `peers` and waits for
    /// theirs, as long as they live (see [`MpiComm::peer_timeout`]) or at most `limit`; an
    /// error naming the ranks that sent nothing.
    pub(crate) fn exchange(
        &self,
        round: u64,
        kind: MsgKind,
        mine: &Frame,
        peers: &[usize],
        limit: Option<Duration>,
    ) -> Result<HashMap<usize, Frame>, String> {
        for &p in peers {
            self.send(p, mine.clone()).map_err(|e| e.to_string())?;
        }
        self.collect(round, kind, peers, limit)
    }

    /// Waits for a message of `kind` for `round` from each of `peers` (see
    /// [`MpiComm::exchange`]).
    pub(crate) fn collect(
        &self,
        round: u64,
        kind: MsgKind,
        peers: &[usize],
        limit: Option<Duration>,
    ) -> Result<HashMap<usize, Frame>, String> {
        let _waiting = self.waiting();
        let start = Instant::now();
        let mut r = lock(&self.inner.routes);
        loop {
            let key = |p: usize| (round, kind as u8, p);
            if peers.iter().all(|&p| r.control.contains_key(&key(p))) {
                return Ok(peers
                    .iter()
                    .filter_map(|&p| Some((p, r.control.remove(&key(p))?)))
                    .collect());
            }
            let mut missing = peers
                .iter()
                .copied()
                .filter(|&p| !r.control.contains_key(&key(p)));
            if let Some(why) = missing.clone().find_map(|p| r.gone(p)) {
                return Err(why);
            }
            if let Some(limit) = limit.filter(|&l| start.elapsed() > l) {
                let missing: Vec<String> = missing.by_ref().map(|p| p.to_string()).collect();
                return Err(format!(
                    "rank(s) {} sent nothing for step round {round} within {limit:.1?}: stopped or unreachable",
                    missing.join(", ")
                ));
            }
            // Woken by every arrival and every peer lost; the timeout only bounds `limit`.
            r = self
                .inner
                .arrived
                .wait_timeout(r, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

/// A link whose far end is on another rank.
struct MpiSend {
    comm: MpiComm,
    dest: usize,
    round: u64,
    link: Link,
}

impl LinkSend for MpiSend {
    fn send(&self, msg: Msg) -> Result<(), StageCause> {
        // A host tensor's values leave from its storage; any other's are read back to host
        // memory (from any device) into the frame sent.
        let msg = encode_msg(self.round, self.link, &msg)?;
        self.comm.send_msg(self.dest, msg)
    }
}

/// Every message arrives in a new vector that becomes a tensor, and glibc's malloc gives large
/// blocks back to the kernel when they are freed (blocks over its mmap threshold, and the top
/// of a heap over its trim threshold): each message then lands in fresh pages, a page fault per
/// 4 KiB, which cost more than MPI's own copy (1 MiB messages ran at 17% of plain MPI's
/// bandwidth, 60% with freed memory kept). So a rank keeps what it frees for reuse, as a
/// training process that allocates the same sizes every step wants anyway: its resident size
/// stays at its peak rather than shrinking between steps.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; called before the MPI thread starts.
    unsafe {
        // 32 MiB is glibc's largest mmap threshold on 64-bit; setting it also stops glibc
        // from moving it on its own.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// [`PEER_TIMEOUT_VAR`]'s value as a limit: seconds, positive and finite.
fn peer_timeout_from(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "{PEER_TIMEOUT_VAR}={text:?}: expected a positive number of seconds"
        )),
    }
}

/// The link ends of this rank's device for round `round` of `schedule`: channels between its
/// own chunks, MPI to and from the devices of the other ranks of its replica (rank
/// `replica*K + device`); `abort` is set when a peer reports a failure.
pub(crate) fn wire_links(
    comm: &MpiComm,
    schedule: &crate::schedule::Schedule,
    round: u64,
    abort: &Arc<AtomicBool>,
) -> Vec<crate::exec::transport::DeviceLinks> {
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let base = comm.rank() - me;
    let mut links: Vec<crate::exec::transport::DeviceLinks> =
        (0..k).map(|_| Default::default()).collect();
    let mut incoming = HashMap::new();
    for link in schedule.links() {
        let (from, to) = (schedule.placement[link.from], schedule.placement[link.to]);
        if from == me && to == me {
            let (tx, rx) = channel();
            links[me].tx.insert(link, Box::new(tx));
            links[me].rx.insert(link, rx);
        } else if from == me {
            links[me]
                .tx
                .insert(link, comm.link_sender(base + to, round, link));
        } else if to == me {
            let (tx, rx) = channel();
            incoming.insert(link, tx);
            links[me].rx.insert(link, rx);
        }
    }
    comm.begin_round(round, incoming, abort.clone());
    links[me].waiter = Some(comm.inner.waiting.clone());
    let tell = comm.clone();
    links[me].abort_peers = Some(Box::new(move |why: &str| {
        tell.abort_peers(round, &format!("rank {}: {why}", tell.rank()))
    }));
    links
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_timeout_variable_is_seconds() {
        assert_eq!(peer_timeout_from("2.5"), Ok(Duration::from_millis(2500)));
        assert_eq!(peer_timeout_from(" 30 "), Ok(Duration::from_secs(30)));
        for bad in ["0", "-1", "inf", "NaN", "soon", ""] {
            let e = peer_timeout_from(bad).unwrap_err();
            assert!(
                e.contains(PEER_TIMEOUT_VAR) && e.contains("positive"),
                "{e}"
            );
        }
    }
}
