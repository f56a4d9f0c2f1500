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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::raw::AsRawMut;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::Threading;

use crate::error::{PipelineError, StageCause};
use crate::exec::threads::lock;
use crate::exec::transport::mpi_reduce::{self, Reduction};
use crate::exec::transport::wire::{self, Frame, MsgKind, Outgoing};
use crate::exec::transport::{decode_msg, encode_msg, LinkSend};
use crate::exec::transport::{Msg, Waiter, Waiting};
use crate::schedule::Link;

/// How long the communication thread rests between looks for incoming messages while nobody
/// waits for one (what keeps it from spinning a core between steps; heartbeats and messages
/// that arrive early are all it can find then).
const IDLE: Duration = Duration::from_micros(500);

/// The MPI tags of the transport: a whole message (a [`Frame`]); a tensor's values sent apart
/// from their storage ([`Outgoing::Split`]); and the rest of that message, which its sender
/// sends right after the values. The receiver probes for any tag, so MPI's order of two
/// messages from one sender holds: a tail is the next message after its values.
/// [`MpiComm::raw_ping_pong`] runs on a communicator of its own.
const TAG: i32 = 0;
const VALUES_TAG: i32 = 2;
const TAIL_TAG: i32 = 3;

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

enum Out {
    Send {
        dest: usize,
        msg: Outgoing,
    },
    /// Someone began to wait: poll without pause from now on.
    Wake,
    /// Times `reps` round trips of `bytes` bytes with `peer` in plain blocking MPI calls.
    RawPingPong {
        peer: usize,
        bytes: usize,
        reps: usize,
        reply: Sender<Vec<f64>>,
    },
    /// Makes the communicators of the gradient reduction of a K-device pipeline (collective
    /// over every rank).
    Split {
        k: usize,
        reply: Sender<Result<(), String>>,
    },
    /// Starts a reduction (see [`crate::exec::transport::mpi_reduce`]).
    Reduce(Reduction),
    Stop,
}

/// The count of receives waiting, and the thread's wake-up.
struct Poll {
    count: AtomicUsize,
    wake: Mutex<Sender<Out>>,
}

impl Waiter for Poll {
    fn begin(&self) {
        if self.count.fetch_add(1, Ordering::SeqCst) == 0 {
            let _ = lock(&self.wake).send(Out::Wake);
        }
    }
    fn end(&self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Where incoming messages go.
#[derive(Default)]
struct Routes {
    round: u64,
    links: HashMap<Link, Sender<Msg>>,
    abort: Option<Arc<AtomicBool>>,
    /// Why the round was aborted from elsewhere (the first reason).
    abort_reason: Option<String>,
    /// Tensor and abort messages of later rounds.
    early: Vec<Frame>,
    /// Status and reduce messages by (round, kind, source rank).
    control: HashMap<(u64, u8, usize), Frame>,
    /// When each rank was last heard from (any message, heartbeats included).
    heard: Vec<Instant>,
    /// Ranks that said they stopped communicating (they send nothing more).
    done: Vec<bool>,
    /// Ranks silent past the peer time limit, taken for dead, and why.
    dead: Vec<(usize, String)>,
}

impl Routes {
    fn route(&mut self, frame: Frame, src: usize) {
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
    fn check_peers(&mut self, me: usize, limit: Duration) {
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
    fn gone(&self, p: usize) -> Option<String> {
        if let Some((_, why)) = self.dead.iter().find(|(d, _)| *d == p) {
            return Some(why.clone());
        }
        self.done.get(p).copied().unwrap_or(false).then(|| ended(p))
    }

    fn fail(&mut self, why: String) {
        self.abort_reason.get_or_insert(why);
        if let Some(a) = &self.abort {
            a.store(true, Ordering::SeqCst);
        }
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

    /// Measures this transport between this rank and `peer` (both must call it, with the same
    /// arguments, outside a step): the seconds of each of `reps` round trips of a `bytes`-byte
    /// f32 tensor, the path a tensor takes (read into a frame, sent by the communication
    /// thread, received into the vector that becomes the tensor), half of which is one
    /// message's latency plus its bytes over the bandwidth. The lower rank sends first.
    pub fn measure_ping_pong(
        &self,
        peer: usize,
        bytes: usize,
        reps: usize,
    ) -> Result<Vec<f64>, String> {
        let n = bytes.div_ceil(4);
        let tensor = wgpipe_tensor::Tensor::full(&[n], 0.5, &wgpipe_tensor::Device::cpu())
            .map_err(|e| e.to_string())?;
        let link = Link {
            from: self.rank(),
            to: peer,
            grad: false,
            skip: None,
        };
        let mut times = Vec::with_capacity(reps);
        for i in 0..reps {
            // Rounds far above any step's, so that no step's messages are taken for these.
            let round = u64::MAX / 2 + i as u64;
            let t0 = Instant::now();
            let send = || -> Result<(), String> {
                let msg = wire::encode_tensor(MsgKind::Reduce, round, link, 0, true, &tensor)
                    .map_err(|e| e.to_string())?;
                self.send_msg(peer, msg).map_err(|e| e.to_string())
            };
            let take = || -> Result<(), String> {
                let mut got = self.collect(round, MsgKind::Reduce, &[peer], None)?;
                let frame = got
                    .remove(&peer)
                    .ok_or_else(|| format!("rank {peer} sent nothing"))?;
                let (h, v) = wire::decode_frame(frame).map_err(|e| e.to_string())?;
                wire::tensor_of(&h, v).map_err(|e| e.to_string())?;
                Ok(())
            };
            if self.rank() < peer {
                send()?;
                take()?;
            } else {
                take()?;
                send()?;
            }
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    }

    /// The same round trips as [`MpiComm::measure_ping_pong`] in plain blocking MPI calls
    /// (`MPI_Send`/`MPI_Recv` of `bytes` bytes from and into buffers allocated once), on the
    /// communication thread: what MPI itself gives on this machine, to set the transport's
    /// figures beside.
    pub fn raw_ping_pong(
        &self,
        peer: usize,
        bytes: usize,
        reps: usize,
    ) -> Result<Vec<f64>, String> {
        let (reply, answer) = channel();
        self.post(Out::RawPingPong {
            peer,
            bytes,
            reps,
            reply,
        })
        .map_err(|e| e.to_string())?;
        answer
            .recv()
            .map_err(|_| "the MPI thread stopped during the ping-pong".to_string())
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

/// A send in flight and what it sends from, kept until MPI is done with it.
struct Pending {
    request: Request<'static, [u8], StaticScope>,
    from: SentFrom,
    dest: usize,
    /// A heartbeat's (nobody waits for it).
    beat: bool,
}

/// The memory of a send in flight.
enum SentFrom {
    /// A frame's words, leaked for the send and freed when it completes.
    Frame(*mut [f32]),
    /// A tensor whose storage's bytes are sent: held, never read (a clone: the storage cannot
    /// change or go while it lives).
    Tensor { _held: wgpipe_tensor::Tensor },
}

impl SentFrom {
    /// Frees what the completed send used.
    fn release(self) {
        if let SentFrom::Frame(words) = self {
            // SAFETY: MPI has finished with the words leaked for it (see `serve`'s `post`).
            drop(unsafe { Box::from_raw(words) });
        }
    }
}

/// What the communication thread shares with the handles.
struct Shared<'a> {
    routes: &'a Mutex<Routes>,
    arrived: &'a Condvar,
    waiting: &'a AtomicUsize,
    peer_timeout_ms: &'a AtomicU64,
}

/// The communication thread's loop: sends what the workers hand over (non-blocking, so two
/// ranks sending to each other cannot deadlock), completes sends, advances collectives, and
/// routes what arrives. It polls without pause while a receive waits, a send or a collective
/// is in flight, or something just happened; else it rests [`IDLE`] between looks.
fn serve(world: &SimpleCommunicator, out: &std::sync::mpsc::Receiver<Out>, sh: &Shared<'_>) {
    let (me, size) = (world.rank() as usize, world.size() as usize);
    {
        let mut r = lock(sh.routes);
        r.heard = vec![Instant::now(); size];
        r.done = vec![false; size];
    }
    let mut pending: Vec<Pending> = Vec::new();
    let mut reductions: Vec<Reduction> = Vec::new();
    let mut devices: HashMap<usize, SimpleCommunicator> = HashMap::new();
    let mut stop: Option<Instant> = None;
    let mut last_beat: Option<Instant> = None;
    // The raw ping-pong's own communicator, so that its messages never meet the transport's
    // any-tag probes (made on every rank at once: every rank starts this thread at init).
    let raw = world.duplicate();
    // Values of split messages received, by source rank, waiting for their tails.
    let mut partial: HashMap<usize, Frame> = HashMap::new();
    let post_bytes =
        |pending: &mut Vec<Pending>, dest: usize, bytes: &'static [u8], tag, from, beat| {
            let request =
                world
                    .process_at_rank(dest as i32)
                    .immediate_send_with_tag(StaticScope, bytes, tag);
            pending.push(Pending {
                request,
                from,
                dest,
                beat,
            });
        };
    let post_frame = |pending: &mut Vec<Pending>, dest: usize, frame: Frame, tag, beat| {
        let (words, len) = frame.into_words();
        let buf: &'static mut [f32] = Box::leak(words.into_boxed_slice());
        let ptr: *mut [f32] = buf;
        // SAFETY of the 'static borrow: the buffer is freed only after the request
        // completed (`SentFrom::release`), or never.
        let bytes: &'static [u8] = &bytemuck::cast_slice(unsafe { &*ptr })[..len];
        post_bytes(pending, dest, bytes, tag, SentFrom::Frame(ptr), beat);
    };
    let post = |pending: &mut Vec<Pending>, dest: usize, msg: Outgoing, beat: bool| match msg {
        Outgoing::Whole(frame) => post_frame(pending, dest, frame, TAG, beat),
        Outgoing::Split { values, tail } => {
            let bytes = values
                .host_bytes()
                .expect("a split tensor lies in host memory");
            // SAFETY of the 'static borrow: the tensor that owns the bytes is kept in the
            // pending send until the request completed, or forgotten (never freed).
            let bytes: &'static [u8] =
                unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
            post_bytes(
                pending,
                dest,
                bytes,
                VALUES_TAG,
                SentFrom::Tensor { _held: values },
                beat,
            );
            post_frame(pending, dest, tail, TAIL_TAG, beat);
        }
    };
    let peers: Vec<usize> = (0..size).filter(|&p| p != me).collect();
    loop {
        let mut busy = false;
        if stop.is_none() && last_beat.is_none_or(|t| t.elapsed() >= BEAT) {
            for &p in &peers {
                post(
                    &mut pending,
                    p,
                    Outgoing::Whole(wire::encode_text(MsgKind::Beat, 0, "")),
                    true,
                );
            }
            last_beat = Some(Instant::now());
        }
        let hot = sh.waiting.load(Ordering::SeqCst) > 0
            || !reductions.is_empty()
            || pending.iter().any(|p| !p.beat);
        // Outgoing, and requests for MPI work.
        loop {
            let next = if hot || busy || stop.is_some() {
                out.try_recv().map_err(|_| RecvTimeoutError::Timeout)
            } else {
                out.recv_timeout(IDLE)
            };
            match next {
                Ok(Out::Send { dest, msg }) => {
                    post(&mut pending, dest, msg, false);
                    busy = true;
                }
                Ok(Out::Wake) => busy = true,
                Ok(Out::RawPingPong {
                    peer,
                    bytes,
                    reps,
                    reply,
                }) => {
                    let _ = reply.send(raw_ping_pong(&raw, peer, bytes, reps));
                    busy = true;
                }
                Ok(Out::Split { k, reply }) => {
                    let made = match devices.get(&k) {
                        Some(_) => Ok(()),
                        None => mpi_reduce::split_devices(world, k).map(|c| {
                            devices.insert(k, c);
                        }),
                    };
                    let _ = reply.send(made);
                    busy = true;
                }
                Ok(Out::Reduce(mut red)) => {
                    match devices.get(&red.k()) {
                        Some(c) => red.start(c),
                        None => red.fail(format!(
                            "no reduction communicators for K = {} (made at build)",
                            red.k()
                        )),
                    }
                    if !red.is_done() {
                        reductions.push(red);
                    }
                    busy = true;
                }
                Ok(Out::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    if stop.is_none() {
                        // No more heartbeats from here: the others must not wait for them.
                        for &p in &peers {
                            post(
                                &mut pending,
                                p,
                                Outgoing::Whole(wire::encode_text(MsgKind::Bye, 0, "")),
                                true,
                            );
                        }
                    }
                    stop.get_or_insert_with(Instant::now);
                    break;
                }
                Err(RecvTimeoutError::Timeout) => break,
            }
        }
        // Completed sends.
        let mut still = Vec::with_capacity(pending.len());
        for p in pending {
            match p.request.test() {
                Ok(_) => {
                    p.from.release();
                    busy = true;
                }
                Err(request) => still.push(Pending { request, ..p }),
            }
        }
        pending = still;
        // Collectives in flight.
        if !reductions.is_empty() {
            let gone = lock(sh.routes).dead.first().map(|(_, why)| why.clone());
            for red in &mut reductions {
                if let Some(why) = &gone {
                    red.fail(why.clone());
                } else if let Some(c) = devices.get(&red.k()) {
                    busy |= red.advance(c);
                }
            }
            reductions.retain(|r| !r.is_done());
        }
        // Incoming.
        while let Some((msg, status)) = world.any_process().immediate_matched_probe() {
            let src = status.source_rank() as usize;
            let len = status.count(u8::equivalent_datatype()).max(0) as usize;
            let tag = status.tag();
            // Values received apart keep room for their tail, which joins them in place.
            let room = if tag == VALUES_TAG {
                wire::TAIL_ROOM
            } else {
                0
            };
            let mut msg = msg;
            // SAFETY: MPI_Mrecv writes the message's `len` bytes (the probed count) at `at`
            // before it returns, and consumes the message handle.
            let frame = unsafe {
                Frame::received_with_room(len, room, |at| {
                    let mut st = std::mem::MaybeUninit::<mpi::ffi::MPI_Status>::uninit();
                    mpi::ffi::MPI_Mrecv(
                        at.cast(),
                        len as i32,
                        mpi::ffi::RSMPI_UINT8_T,
                        msg.as_raw_mut(),
                        st.as_mut_ptr(),
                    );
                })
            };
            drop(msg);
            let mut r = lock(sh.routes);
            if let Some(t) = r.heard.get_mut(src) {
                *t = Instant::now();
            }
            match tag {
                VALUES_TAG => {
                    partial.insert(src, frame);
                }
                TAIL_TAG => match partial.remove(&src) {
                    Some(values) => r.route(values.join(frame), src),
                    None => r.fail(format!(
                        "rank {src} sent the end of a tensor message without its values"
                    )),
                },
                _ => r.route(frame, src),
            }
            drop(r);
            sh.arrived.notify_all();
            busy = true;
        }
        let limit = Duration::from_millis(sh.peer_timeout_ms.load(Ordering::Relaxed));
        {
            let mut r = lock(sh.routes);
            let dead = r.dead.len();
            r.check_peers(me, limit);
            if r.dead.len() != dead {
                sh.arrived.notify_all();
            }
        }
        if let Some(since) = stop {
            // Sends to a rank taken for dead never complete: nothing to wait for there. Under
            // mpirun the first rank to exit with an error (or, with a rank dead, without
            // MPI_Finalize) ends the job: so each rank waits (5 s at most) until every other
            // live rank has ended its run too, so that none is cut short.
            let finished = {
                let r = lock(sh.routes);
                let is_dead = |p: usize| r.dead.iter().any(|(d, _)| *d == p);
                pending.iter().all(|p| is_dead(p.dest))
                    && peers.iter().all(|&p| is_dead(p) || r.done[p])
            };
            if finished || since.elapsed() > Duration::from_secs(5) {
                // Sends a dead peer never took: their buffers stay leaked, and the requests
                // are forgotten rather than dropped (dropping an active request panics).
                for p in pending {
                    std::mem::forget(p);
                }
                for red in reductions {
                    red.abandon();
                }
                if !lock(sh.routes).dead.is_empty() {
                    // A collective with a dead rank never completes, and freeing its
                    // communicator may wait for it: the communicators are left to the exit.
                    std::mem::forget(devices);
                }
                return;
            }
            if !busy {
                std::thread::sleep(IDLE);
            }
        } else if hot && !busy {
            // Someone waits: look again at once, letting a thread with work run first.
            std::thread::yield_now();
        }
    }
}

/// [`MpiComm::raw_ping_pong`] on the communication thread: blocking sends and receives on the
/// raw ping-pong's own communicator, buffers allocated once.
fn raw_ping_pong(raw: &SimpleCommunicator, peer: usize, bytes: usize, reps: usize) -> Vec<f64> {
    let out = vec![7u8; bytes];
    let mut back = vec![0u8; bytes];
    let other = raw.process_at_rank(peer as i32);
    let first = raw.rank() < peer as i32;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        if first {
            other.send(&out[..]);
            other.receive_into(&mut back[..]);
        } else {
            other.receive_into(&mut back[..]);
            other.send(&out[..]);
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    times
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

/// Why rank `p` cannot answer: it said goodbye.
fn ended(p: usize) -> String {
    format!(
        "rank {p} has ended (it finished its run, failed or exited) and sends nothing more: \
         every rank must run the same steps"
    )
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
