//! MPI behind the transport seam (feature `mpi`): one communication thread per process owns MPI
//! (it initializes and finalizes it and makes every MPI call), so MPI's threading level does
//! not matter and the workers stay transport-agnostic: they send through a [`LinkSend`] that
//! hands encoded bytes to this thread, and receive from in-process channels that this thread
//! feeds.
//!
//! Every message is one byte buffer in the [`crate::wire`] format; its header, not the MPI tag,
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
use crate::schedule::Link;
use crate::transport::{decode_msg, encode_msg, LinkSend};
use crate::wire::{self, MsgKind};
use crate::worker::{lock, Msg};

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
const PEER_TIMEOUT: Duration = Duration::from_secs(60);

/// The environment variable that sets [`MpiComm::peer_timeout`] at [`MpiComm::init`], in
/// seconds.
pub const PEER_TIMEOUT_VAR: &str = "WGPIPE_MPI_PEER_TIMEOUT";

struct Inner {
    rank: usize,
    size: usize,
    /// Milliseconds of [`MpiComm::peer_timeout`].
    peer_timeout_ms: AtomicU64,
    out: Mutex<Sender<Out>>,
    routes: Arc<Mutex<Routes>>,
    thread: Mutex<Option<JoinHandle<()>>>,
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
}

impl Routes {
    fn route(&mut self, bytes: Vec<u8>, src: usize) {
        let Ok((kind, round, link)) = wire::peek(&bytes) else {
            return; // not ours: nothing in this job sends such bytes
        };
        match kind {
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
                serve(&world, &out_rx, &thread_routes);
                drop(universe);
            })
            .map_err(|e| PipelineError::Config(format!("cannot start the MPI thread: {e}")))?;
        let (rank, size) = ready_rx
            .recv()
            .map_err(|_| "the MPI thread ended before MPI was initialized".to_string())
            .and_then(|r| r)
            .map_err(PipelineError::Config)?;
        let timeout = match std::env::var(PEER_TIMEOUT_VAR) {
            Ok(v) => peer_timeout_from(&v).map_err(PipelineError::Config)?,
            Err(_) => PEER_TIMEOUT,
        };
        Ok(MpiComm {
            inner: Arc::new(Inner {
                rank,
                size,
                peer_timeout_ms: AtomicU64::new(timeout.as_millis() as u64),
                out: Mutex::new(out),
                routes,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// How long a rank waits, after its own part of a step, for the others' outcome (and for
    /// the gradients of an all-reduce or a gather): a peer still computing is normal, one that
    /// sends nothing for this long is taken for dead and the step fails naming it. 60 s by
    /// default, or [`PEER_TIMEOUT_VAR`] (seconds) at init. Open MPI's `mpirun` itself ends the
    /// whole job when a rank dies outright (within about a second, naming the rank); this limit
    /// bounds the wait where a launcher does not.
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
        r.control.retain(|(k, _, _), _| *k >= round);
        for bytes in std::mem::take(&mut r.early) {
            // Source ranks of early messages are only used in error texts.
            r.route(bytes, usize::MAX);
        }
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
            let header = wire::Header {
                kind: MsgKind::Reduce,
                step: round,
                link: Link {
                    from: self.rank(),
                    to: peer,
                    grad: false,
                    skip: None,
                },
                micro_batch: 0,
                finite: true,
                dtype: wire::WireDtype::F32,
                shape: vec![values.len()],
            };
            let t0 = Instant::now();
            let msg = wire::encode(&header, &values);
            let got = self.exchange(
                round,
                MsgKind::Reduce,
                &msg,
                &[peer],
                Duration::from_secs(60),
            )?;
            wire::decode(&got[&peer]).map_err(|e| e.to_string())?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Sends `mine` (a message of kind `kind` for `round`) to each of `peers` and waits for
    /// theirs; an error naming the ranks that sent nothing within `limit`.
    pub(crate) fn exchange(
        &self,
        round: u64,
        kind: MsgKind,
        mine: &[u8],
        peers: &[usize],
        limit: Duration,
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
                if start.elapsed() > limit {
                    let missing: Vec<String> = peers
                        .iter()
                        .filter(|&&p| !r.control.contains_key(&(round, kind as u8, p)))
                        .map(|p| p.to_string())
                        .collect();
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
}

/// The communication thread's loop: sends what the workers hand over (non-blocking, so two
/// ranks sending to each other cannot deadlock), completes sends, and routes what arrives.
fn serve(
    world: &mpi::topology::SimpleCommunicator,
    out: &std::sync::mpsc::Receiver<Out>,
    routes: &Mutex<Routes>,
) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut stop: Option<Instant> = None;
    loop {
        let mut busy = false;
        // Outgoing.
        loop {
            let next = if busy || stop.is_some() {
                out.try_recv().map_err(|_| RecvTimeoutError::Timeout)
            } else {
                out.recv_timeout(IDLE)
            };
            match next {
                Ok(Out::Send { dest, bytes }) => {
                    let buf: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
                    let ptr: *mut [u8] = buf;
                    let request = world
                        .process_at_rank(dest as i32)
                        // SAFETY of the 'static borrow: the buffer is freed only after the
                        // request completed (below), or never.
                        .immediate_send(StaticScope, unsafe { &*ptr });
                    pending.push(Pending { request, buf: ptr });
                    busy = true;
                }
                Ok(Out::Stop) | Err(RecvTimeoutError::Disconnected) => {
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
            lock(routes).route(bytes, src);
            busy = true;
        }
        if let Some(since) = stop {
            if pending.is_empty() || since.elapsed() > Duration::from_secs(5) {
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
) -> Vec<crate::worker::DeviceLinks> {
    let k = schedule.num_devices();
    let me = comm.rank() % k;
    let base = comm.rank() - me;
    let mut links: Vec<crate::worker::DeviceLinks> = (0..k).map(|_| Default::default()).collect();
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
