//! The communication thread: what the handles ask of it ([`Out`]), and its loop, which sends
//! without blocking, completes sends, advances collectives and routes what arrives, one phase
//! of each look at a time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::point_to_point::{Destination, Source};
use mpi::raw::AsRawMut;
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::ping_pong::raw_ping_pong;
use super::routes::Routes;
use super::BEAT;
use crate::exec::threads::lock;
use crate::exec::transport::mpi_reduce::{self, Reduction};
use crate::exec::transport::wire::{self, Frame, MsgKind, Outgoing};
use crate::exec::transport::Waiter;

/// How long the communication thread rests between looks for incoming messages while nobody
/// waits for one (what keeps it from spinning a core between steps; heartbeats and messages
/// that arrive early are all it can find then).
const IDLE: Duration = Duration::from_micros(500);

/// The MPI tags of the transport: a whole message (a [`Frame`]); a tensor's values sent apart
/// from their storage ([`Outgoing::Split`]); and the rest of that message, which its sender
/// sends right after the values. The receiver probes for any tag, so MPI's order of two
/// messages from one sender holds: a tail is the next message after its values.
/// [`MpiComm::raw_ping_pong`](super::MpiComm::raw_ping_pong) runs on a communicator of its own.
const TAG: i32 = 0;
const VALUES_TAG: i32 = 2;
const TAIL_TAG: i32 = 3;

/// What the handles ask of the communication thread.
pub(super) enum Out {
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
pub(super) struct Poll {
    pub(super) count: AtomicUsize,
    pub(super) wake: Mutex<Sender<Out>>,
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
            // SAFETY: MPI has finished with the words leaked for it (see `post_frame`).
            drop(unsafe { Box::from_raw(words) });
        }
    }
}

/// What the communication thread shares with the handles.
pub(super) struct Shared<'a> {
    pub(super) routes: &'a Mutex<Routes>,
    pub(super) arrived: &'a Condvar,
    pub(super) waiting: &'a AtomicUsize,
    pub(super) peer_timeout_ms: &'a AtomicU64,
}

/// The communication thread's loop: sends what the workers hand over (non-blocking, so two
/// ranks sending to each other cannot deadlock), completes sends, advances collectives, and
/// routes what arrives. It polls without pause while a receive waits, a send or a collective
/// is in flight, or something just happened; else it rests [`IDLE`] between looks.
pub(super) fn serve(
    world: &SimpleCommunicator,
    out: &std::sync::mpsc::Receiver<Out>,
    sh: &Shared<'_>,
) {
    let mut s = Server::new(world, sh);
    loop {
        let mut busy = false;
        s.beat();
        let hot = s.hot();
        // Outgoing, and requests for MPI work.
        busy |= s.take_requests(out, hot);
        // Completed sends.
        busy |= s.complete_sends();
        // Collectives in flight.
        busy |= s.advance_reductions();
        // Incoming.
        busy |= s.receive();
        s.check_peers();
        if let Some(since) = s.stop {
            // Sends to a rank taken for dead never complete: nothing to wait for there. Under
            // mpirun the first rank to exit with an error (or, with a rank dead, without
            // MPI_Finalize) ends the job: so each rank waits (5 s at most) until every other
            // live rank has ended its run too, so that none is cut short.
            if s.finished() || since.elapsed() > Duration::from_secs(5) {
                s.abandon();
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

/// What the communication thread keeps from one look to the next.
struct Server<'a> {
    world: &'a SimpleCommunicator,
    sh: &'a Shared<'a>,
    me: usize,
    /// Every other rank.
    peers: Vec<usize>,
    /// The raw ping-pong's own communicator, so that its messages never meet the transport's
    /// any-tag probes (made on every rank at once: every rank starts this thread at init).
    raw: SimpleCommunicator,
    /// Values of split messages received, by source rank, waiting for their tails.
    partial: HashMap<usize, Frame>,
    pending: Vec<Pending>,
    reductions: Vec<Reduction>,
    /// The communicators of the gradient reduction, by K.
    devices: HashMap<usize, SimpleCommunicator>,
    /// When the thread was asked to stop.
    stop: Option<Instant>,
    last_beat: Option<Instant>,
}

impl<'a> Server<'a> {
    fn new(world: &'a SimpleCommunicator, sh: &'a Shared<'a>) -> Server<'a> {
        let (me, size) = (world.rank() as usize, world.size() as usize);
        {
            let mut r = lock(sh.routes);
            r.heard = vec![Instant::now(); size];
            r.done = vec![false; size];
        }
        let raw = world.duplicate();
        Server {
            world,
            sh,
            me,
            peers: (0..size).filter(|&p| p != me).collect(),
            raw,
            partial: HashMap::new(),
            pending: Vec::new(),
            reductions: Vec::new(),
            devices: HashMap::new(),
            stop: None,
            last_beat: None,
        }
    }

    /// A heartbeat to every other rank, every [`BEAT`] until the thread stops.
    fn beat(&mut self) {
        if self.stop.is_none() && self.last_beat.is_none_or(|t| t.elapsed() >= BEAT) {
            for &p in &self.peers {
                post(
                    self.world,
                    &mut self.pending,
                    p,
                    Outgoing::Whole(wire::encode_text(MsgKind::Beat, 0, "")),
                    true,
                );
            }
            self.last_beat = Some(Instant::now());
        }
    }

    /// Whether someone waits on this thread: a receive, a collective, or a send that is not a
    /// heartbeat.
    fn hot(&self) -> bool {
        self.sh.waiting.load(Ordering::SeqCst) > 0
            || !self.reductions.is_empty()
            || self.pending.iter().any(|p| !p.beat)
    }

    /// Takes what the handles asked for until nothing is left: without waiting when `hot` or
    /// stopping, else resting up to [`IDLE`] for the first request. Whether any came.
    fn take_requests(&mut self, out: &std::sync::mpsc::Receiver<Out>, hot: bool) -> bool {
        let mut busy = false;
        loop {
            let next = if hot || busy || self.stop.is_some() {
                out.try_recv().map_err(|_| RecvTimeoutError::Timeout)
            } else {
                out.recv_timeout(IDLE)
            };
            match next {
                Ok(Out::Send { dest, msg }) => {
                    post(self.world, &mut self.pending, dest, msg, false);
                    busy = true;
                }
                Ok(Out::Wake) => busy = true,
                Ok(Out::RawPingPong {
                    peer,
                    bytes,
                    reps,
                    reply,
                }) => {
                    let _ = reply.send(raw_ping_pong(&self.raw, peer, bytes, reps));
                    busy = true;
                }
                Ok(Out::Split { k, reply }) => {
                    let made = match self.devices.get(&k) {
                        Some(_) => Ok(()),
                        None => mpi_reduce::split_devices(self.world, k).map(|c| {
                            self.devices.insert(k, c);
                        }),
                    };
                    let _ = reply.send(made);
                    busy = true;
                }
                Ok(Out::Reduce(mut red)) => {
                    match self.devices.get(&red.k()) {
                        Some(c) => red.start(c),
                        None => red.fail(format!(
                            "no reduction communicators for K = {} (made at build)",
                            red.k()
                        )),
                    }
                    if !red.is_done() {
                        self.reductions.push(red);
                    }
                    busy = true;
                }
                Ok(Out::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    if self.stop.is_none() {
                        // No more heartbeats from here: the others must not wait for them.
                        for &p in &self.peers {
                            post(
                                self.world,
                                &mut self.pending,
                                p,
                                Outgoing::Whole(wire::encode_text(MsgKind::Bye, 0, "")),
                                true,
                            );
                        }
                    }
                    self.stop.get_or_insert_with(Instant::now);
                    break;
                }
                Err(RecvTimeoutError::Timeout) => break,
            }
        }
        busy
    }

    /// Frees what the completed sends used; whether any completed.
    fn complete_sends(&mut self) -> bool {
        let mut busy = false;
        let mut still = Vec::with_capacity(self.pending.len());
        for p in std::mem::take(&mut self.pending) {
            match p.request.test() {
                Ok(_) => {
                    p.from.release();
                    busy = true;
                }
                Err(request) => still.push(Pending { request, ..p }),
            }
        }
        self.pending = still;
        busy
    }

    /// Advances the collectives in flight (all fail once a rank is taken for dead); whether
    /// any made progress.
    fn advance_reductions(&mut self) -> bool {
        let mut busy = false;
        if !self.reductions.is_empty() {
            let gone = lock(self.sh.routes)
                .dead
                .first()
                .map(|(_, why)| why.clone());
            for red in &mut self.reductions {
                if let Some(why) = &gone {
                    red.fail(why.clone());
                } else if let Some(c) = self.devices.get(&red.k()) {
                    busy |= red.advance(c);
                }
            }
            self.reductions.retain(|r| !r.is_done());
        }
        busy
    }

    /// Receives and routes every message that has arrived (a tensor's values sent apart wait
    /// for the rest of their frame); whether any arrived.
    fn receive(&mut self) -> bool {
        let mut busy = false;
        while let Some((msg, status)) = self.world.any_process().immediate_matched_probe() {
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
            let mut r = lock(self.sh.routes);
            if let Some(t) = r.heard.get_mut(src) {
                *t = Instant::now();
            }
            match tag {
                VALUES_TAG => {
                    self.partial.insert(src, frame);
                }
                TAIL_TAG => match self.partial.remove(&src) {
                    Some(values) => r.route(values.join(frame), src),
                    None => r.fail(format!(
                        "rank {src} sent the end of a tensor message without its values"
                    )),
                },
                _ => r.route(frame, src),
            }
            drop(r);
            self.sh.arrived.notify_all();
            busy = true;
        }
        busy
    }

    /// Takes the ranks silent past the peer time limit for dead, and wakes whoever waits when
    /// one is.
    fn check_peers(&self) {
        let limit = Duration::from_millis(self.sh.peer_timeout_ms.load(Ordering::Relaxed));
        let mut r = lock(self.sh.routes);
        let dead = r.dead.len();
        r.check_peers(self.me, limit);
        if r.dead.len() != dead {
            self.sh.arrived.notify_all();
        }
    }

    /// Once stopping: whether every send left is to a rank taken for dead, and every other
    /// rank is dead or has ended its run.
    fn finished(&self) -> bool {
        let r = lock(self.sh.routes);
        let is_dead = |p: usize| r.dead.iter().any(|(d, _)| *d == p);
        self.pending.iter().all(|p| is_dead(p.dest))
            && self.peers.iter().all(|&p| is_dead(p) || r.done[p])
    }

    /// The thread's end, with what is still in flight given up.
    fn abandon(self) {
        // Sends a dead peer never took: their buffers stay leaked, and the requests
        // are forgotten rather than dropped (dropping an active request panics).
        for p in self.pending {
            std::mem::forget(p);
        }
        for red in self.reductions {
            red.abandon();
        }
        if !lock(self.sh.routes).dead.is_empty() {
            // A collective with a dead rank never completes, and freeing its
            // communicator may wait for it: the communicators are left to the exit.
            std::mem::forget(self.devices);
        }
    }
}

/// Starts sending `bytes` to `dest` with `tag` (non-blocking), keeping `from`, what they lie
/// in, until the send completes.
fn post_bytes(
    world: &SimpleCommunicator,
    pending: &mut Vec<Pending>,
    dest: usize,
    bytes: &'static [u8],
    tag: i32,
    from: SentFrom,
    beat: bool,
) {
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
}

/// Starts sending `frame` to `dest` with `tag`, from its own words.
fn post_frame(
    world: &SimpleCommunicator,
    pending: &mut Vec<Pending>,
    dest: usize,
    frame: Frame,
    tag: i32,
    beat: bool,
) {
    let (words, len) = frame.into_words();
    let buf: &'static mut [f32] = Box::leak(words.into_boxed_slice());
    let ptr: *mut [f32] = buf;
    // SAFETY of the 'static borrow: the buffer is freed only after the request
    // completed (`SentFrom::release`), or never.
    let bytes: &'static [u8] = &bytemuck::cast_slice(unsafe { &*ptr })[..len];
    post_bytes(world, pending, dest, bytes, tag, SentFrom::Frame(ptr), beat);
}

/// Starts sending `msg` to `dest`: a whole frame, or a tensor's values from its storage and
/// then the rest of its frame.
fn post(
    world: &SimpleCommunicator,
    pending: &mut Vec<Pending>,
    dest: usize,
    msg: Outgoing,
    beat: bool,
) {
    match msg {
        Outgoing::Whole(frame) => post_frame(world, pending, dest, frame, TAG, beat),
        Outgoing::Split { values, tail } => {
            let bytes = values
                .host_bytes()
                .expect("a split tensor lies in host memory");
            // SAFETY of the 'static borrow: the tensor that owns the bytes is kept in the
            // pending send until the request completed, or forgotten (never freed).
            let bytes: &'static [u8] =
                unsafe { std::slice::from_raw_parts(bytes.as_ptr(), bytes.len()) };
            post_bytes(
                world,
                pending,
                dest,
                bytes,
                VALUES_TAG,
                SentFrom::Tensor { _held: values },
                beat,
            );
            post_frame(world, pending, dest, tail, TAIL_TAG, beat);
        }
    }
}
