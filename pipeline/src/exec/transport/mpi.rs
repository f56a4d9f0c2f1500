//! MPI behind the transport seam (feature `mpi`): one communication thread per process owns MPI
//! (it initializes and finalizes it and makes every MPI call), so MPI's threading level does
//! not matter and the workers stay transport-agnostic: they send through a [`LinkSend`] that
//! hands encoded bytes to this thread, and receive from in-process channels that this thread
//! feeds.
//!
//! Every message is one byte buffer in the [`crate::exec::transport::wire`] format; its header, not the MPI tag,
//! says what it is. Each `train_step` is a round: the thread delivers a round's tensors to the
//! receivers registered for that round, keeps messages of later rounds until their round
//! begins (a fast peer may start the next step early), and drops those of rounds that are over
//! (what a failed step left in flight). Receives are probes polled by this thread, so nothing
//! blocks on a dead peer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::Communicator;
use mpi::Threading;

use crate::error::{PipelineError, StageCause};
use crate::exec::threads::lock;
use crate::exec::transport::wire::{self, MsgKind};
use crate::exec::transport::Msg;
use crate::exec::transport::{decode_msg, encode_msg, LinkSend};
use crate::schedule::Link;

/// How long the communication thread waits for work before it looks for incoming messages
/// again: the receive latency it adds, and what keeps it from spinning a core.
const IDLE: Duration = Duration::from_micros(200);

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

struct Inner {
    rank: usize,
    size: usize,
    /// Milliseconds of [`MpiComm::peer_timeout`] (shared with the communication thread).
    peer_timeout_ms: Arc<AtomicU64>,
    out: Mutex<Sender<Out>>,
    routes: Arc<Mutex<Routes>>,
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
    Send { dest: usize, bytes: Vec<u8> },
    Stop,
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
    early: Vec<Vec<u8>>,
    /// Status and reduce messages by (round, kind, source rank).
    control: HashMap<(u64, u8, usize), Vec<u8>>,
    /// When each rank was last heard from (any message, heartbeats included).
    heard: Vec<Instant>,
    /// Ranks that said they stopped communicating (they send nothing more).
    done: Vec<bool>,
    /// Ranks silent past the peer time limit, taken for dead, and why.
    dead: Vec<(usize, String)>,
}

impl Routes {
    fn route(&mut self, bytes: Vec<u8>, src: usize) {
        let Ok((kind, round, link)) = wire::peek(&bytes) else {
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
                    self.control.insert((round, kind as u8, src), bytes);
                }
            }
            _ if round > self.round => self.early.push(bytes),
            _ if round < self.round || self.abort.is_none() => {} // a finished round's
            MsgKind::Abort => self.fail(wire::text_of(&bytes)),
            MsgKind::Activation | MsgKind::Gradient => {
                let Some(tx) = self.links.get(&link) else {
                    return self.fail(format!(
                        "rank {src} sent on {link}, which no stage here receives"
                    ));
                };
                match decode_msg(&bytes, round, link) {
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
    /// before anything else uses MPI; [`MpiComm::finish`] before the process exits.
    pub fn init() -> Result<MpiComm, PipelineError> {
        let timeout = match std::env::var(PEER_TIMEOUT_VAR) {
            Ok(v) => peer_timeout_from(&v).map_err(PipelineError::Config)?,
            Err(_) => PEER_TIMEOUT,
        };
        let peer_timeout_ms = Arc::new(AtomicU64::new(timeout.as_millis() as u64));
        let thread_timeout = peer_timeout_ms.clone();
        let routes = Arc::new(Mutex::new(Routes::default()));
        let (out, out_rx) = channel::<Out>();
        let (ready, ready_rx) = channel::<Result<(usize, usize), String>>();
        let thread_routes = routes.clone();
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
                serve(&world, &out_rx, &thread_routes, &thread_timeout);
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

    /// Stops the communication thread once what was sent has gone out (or after 5 s, for a
    /// peer that is gone), and finalizes MPI. Later sends fail.
    pub fn finish(&self) {
        let _ = lock(&self.inner.out).send(Out::Stop);
        if let Some(h) = lock(&self.inner.thread).take() {
            let _ = h.join();
        }
    }

    fn send(&self, dest: usize, bytes: Vec<u8>) -> Result<(), StageCause> {
        lock(&self.inner.out)
            .send(Out::Send { dest, bytes })
            .map_err(|_| StageCause::Disconnected("the MPI thread has stopped".into()))
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
        for bytes in std::mem::take(&mut r.early) {
            // Source ranks of early messages are only used in error texts.
            r.route(bytes, usize::MAX);
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
        let bytes = wire::encode_abort(round, why);
        for dest in (0..self.size()).filter(|&d| d != self.rank()) {
            let _ = self.send(dest, bytes.clone());
        }
    }

    /// Measures this transport between this rank and `peer` (both must call it, with the same
    /// arguments, outside a step): the median seconds of `reps` swaps of a `bytes`-byte
    /// message through the communication threads, the path a tensor takes. A swap overlaps the
    /// two directions, so it costs one message's latency plus its bytes over the bandwidth.
    pub fn measure_swap(&self, peer: usize, bytes: usize, reps: usize) -> Result<f64, String> {
        let values = vec![0.5f32; bytes.div_ceil(4)];
        let mut times = Vec::with_capacity(reps);
        for i in 0..reps {
            // Rounds far above any step's, so that no step's messages are taken for these.
            let round = u64::MAX / 2 + i as u64;
            let t0 = Instant::now();
            let msg = wire::encode_values(MsgKind::Reduce, round, self.rank(), &values);
            let got = self.exchange(
                round,
                MsgKind::Reduce,
                &msg,
                &[peer],
                Some(Duration::from_secs(60)),
            )?;
            wire::decode(&got[&peer]).map_err(|e| e.to_string())?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Sends `mine` (a message of kind `kind` for `round`) to each of `peers` and waits for
    /// theirs, as long as they live (see [`MpiComm::peer_timeout`]) or at most `limit`; an
    /// error naming the ranks that sent nothing.
    pub(crate) fn exchange(
        &self,
        round: u64,
        kind: MsgKind,
        mine: &[u8],
        peers: &[usize],
        limit: Option<Duration>,
    ) -> Result<HashMap<usize, Vec<u8>>, String> {
        for &p in peers {
            self.send(p, mine.to_vec()).map_err(|e| e.to_string())?;
        }
        let start = Instant::now();
        loop {
            {
                let mut r = lock(&self.inner.routes);
                if peers
                    .iter()
                    .all(|&p| r.control.contains_key(&(round, kind as u8, p)))
                {
                    return Ok(peers
                        .iter()
                        .map(|&p| {
                            (
                                p,
                                r.control
                                    .remove(&(round, kind as u8, p))
                                    .unwrap_or_default(),
                            )
                        })
                        .collect());
                }
                let mut missing = peers
                    .iter()
                    .copied()
                    .filter(|&p| !r.control.contains_key(&(round, kind as u8, p)));
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
            }
            std::thread::sleep(IDLE);
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
        // Reads the tensor back to host memory (from any device) and encodes it.
        let bytes = encode_msg(self.round, self.link, &msg)?;
        self.comm.send(self.dest, bytes)
    }
}

/// A send in flight and its buffer, freed once MPI is done with it.
struct Pending {
    request: Request<'static, [u8], StaticScope>,
    buf: *mut [u8],
    dest: usize,
}

/// The communication thread's loop: sends what the workers hand over (non-blocking, so two
/// ranks sending to each other cannot deadlock), completes sends, and routes what arrives.
fn serve(
    world: &mpi::topology::SimpleCommunicator,
    out: &std::sync::mpsc::Receiver<Out>,
    routes: &Mutex<Routes>,
    peer_timeout_ms: &AtomicU64,
) {
    let (me, size) = (world.rank() as usize, world.size() as usize);
    {
        let mut r = lock(routes);
        r.heard = vec![Instant::now(); size];
        r.done = vec![false; size];
    }
    let mut pending: Vec<Pending> = Vec::new();
    let mut stop: Option<Instant> = None;
    let mut last_beat: Option<Instant> = None;
    let post = |pending: &mut Vec<Pending>, dest: usize, bytes: Vec<u8>| {
        let buf: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let ptr: *mut [u8] = buf;
        let request = world
            .process_at_rank(dest as i32)
            // SAFETY of the 'static borrow: the buffer is freed only after the request
            // completed (below), or never.
            .immediate_send(StaticScope, unsafe { &*ptr });
        pending.push(Pending {
            request,
            buf: ptr,
            dest,
        });
    };
    let peers: Vec<usize> = (0..size).filter(|&p| p != me).collect();
    loop {
        let mut busy = false;
        if stop.is_none() && last_beat.is_none_or(|t| t.elapsed() >= BEAT) {
            for &p in &peers {
                post(&mut pending, p, wire::encode_text(MsgKind::Beat, 0, ""));
            }
            last_beat = Some(Instant::now());
        }
        // Outgoing.
        loop {
            let next = if busy || stop.is_some() {
                out.try_recv().map_err(|_| RecvTimeoutError::Timeout)
            } else {
                out.recv_timeout(IDLE)
            };
            match next {
                Ok(Out::Send { dest, bytes }) => {
                    post(&mut pending, dest, bytes);
                    busy = true;
                }
                Ok(Out::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    if stop.is_none() {
                        // No more heartbeats from here: the others must not wait for them.
                        for &p in &peers {
                            post(&mut pending, p, wire::encode_text(MsgKind::Bye, 0, ""));
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
                    // SAFETY: MPI has finished with the buffer leaked above.
                    drop(unsafe { Box::from_raw(p.buf) });
                    busy = true;
                }
                Err(request) => still.push(Pending { request, ..p }),
            }
        }
        pending = still;
        // Incoming.
        while let Some((msg, status)) = world.any_process().immediate_matched_probe() {
            let src = status.source_rank() as usize;
            let (bytes, _) = (msg, status).matched_receive_vec::<u8>();
            let mut r = lock(routes);
            if let Some(t) = r.heard.get_mut(src) {
                *t = Instant::now();
            }
            r.route(bytes, src);
            busy = true;
        }
        let limit = Duration::from_millis(peer_timeout_ms.load(Ordering::Relaxed));
        lock(routes).check_peers(me, limit);
        if let Some(since) = stop {
            // Sends to a rank taken for dead never complete: nothing to wait for there.
            let undeliverable = {
                let r = lock(routes);
                pending
                    .iter()
                    .all(|p| r.dead.iter().any(|(d, _)| *d == p.dest))
            };
            if undeliverable || since.elapsed() > Duration::from_secs(5) {
                // Sends a dead peer never took: their buffers stay leaked, and the requests
                // are forgotten rather than dropped (dropping an active request panics).
                for p in pending {
                    std::mem::forget(p.request);
                }
                return;
            }
            if !busy {
                std::thread::sleep(IDLE);
            }
        }
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
