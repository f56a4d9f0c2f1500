//! How the links of a step carry tensors. The worker sends through a `LinkSend` and receives
//! from a channel; which transport is behind them is decided here, when the executor wires a
//! step's links, and the worker never knows.

#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_reduce;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use crate::error::StageCause;
use crate::schedule::{Link, Schedule};
use wgpipe_tensor::Tensor;
use wire::MsgKind;

/// A tensor in flight between two stages, with whether it (and everything it came from) is
/// finite, so the receiver knows a non-finite input is not its own doing.
pub(crate) struct Msg {
    pub micro_batch: usize,
    pub tensor: Tensor,
    pub finite: bool,
}

/// The ends of the links a device's actions use: senders of the links it sends on (whatever
/// the transport, see [`crate::exec::transport`]), receivers of those it receives on (a link between
/// two chunks of one device has both ends here).
#[derive(Default)]
pub(crate) struct DeviceLinks {
    pub tx: HashMap<Link, Box<dyn LinkSend>>,
    pub rx: HashMap<Link, Receiver<Msg>>,
    /// Tells the other processes of a step that it failed here (set by transports that cross
    /// processes).
    pub abort_peers: Option<AbortPeers>,
    /// Told while a receive waits (set by transports that poll, MPI), so that they poll
    /// without pause then, and rest when nobody waits.
    pub waiter: Option<Arc<dyn Waiter>>,
}

/// A transport that polls for what arrives, told when someone waits for a message.
pub(crate) trait Waiter: Send + Sync {
    fn begin(&self);
    fn end(&self);
}

/// A receive waiting on `waiter`'s transport, from its creation to its drop.
pub(crate) struct Waiting<'a>(Option<&'a dyn Waiter>);

impl<'a> Waiting<'a> {
    pub(crate) fn on(waiter: Option<&'a dyn Waiter>) -> Waiting<'a> {
        if let Some(w) = waiter {
            w.begin();
        }
        Waiting(waiter)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.0 {
            w.end();
        }
    }
}

/// Tells the other processes of a step why it failed here.
pub(crate) type AbortPeers = Box<dyn Fn(&str) + Send>;

/// What carries the tensors between stages.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Transport {
    /// In-process channels: tensors are handed over as they are (the default; what the
    /// simulated cluster uses).
    #[default]
    Channels,
    /// In-process, but every message is encoded to the wire format and decoded again, as it
    /// is between processes: host read-back, header checks and byte layout, without MPI.
    Loopback,
    /// Several processes (`mpirun -np R*K`): each rank runs device `rank % K` of replica
    /// `rank / K`; links to other ranks are MPI messages in the wire format (see
    /// [`crate::exec::transport::mpi`]).
    #[cfg(feature = "mpi")]
    Mpi(crate::exec::transport::mpi::MpiComm),
}

impl Transport {
    /// Whether the devices of a step are spread over processes.
    pub(crate) fn crosses_processes(&self) -> bool {
        match self {
            Transport::Channels | Transport::Loopback => false,
            #[cfg(feature = "mpi")]
            Transport::Mpi(_) => true,
        }
    }

    /// Whether this process runs device `device` of a K-device pipeline.
    pub(crate) fn runs_device(&self, device: usize, k: usize) -> bool {
        self.holder_rank(device, k).is_none()
    }

    /// The rank that holds device `device` of this process's replica of a K-device pipeline
    /// when it is another process; `None` when this process holds it.
    pub(crate) fn holder_rank(&self, device: usize, k: usize) -> Option<usize> {
        match self {
            Transport::Channels | Transport::Loopback => {
                let _ = (device, k);
                None
            }
            #[cfg(feature = "mpi")]
            Transport::Mpi(comm) => {
                let rank = comm.rank() / k * k + device;
                (rank != comm.rank()).then_some(rank)
            }
        }
    }
}

/// The sending end of one link.
pub(crate) trait LinkSend: Send {
    fn send(&self, msg: Msg) -> Result<(), StageCause>;
}

impl LinkSend for Sender<Msg> {
    fn send(&self, msg: Msg) -> Result<(), StageCause> {
        Sender::send(self, msg)
            .map_err(|_| StageCause::Disconnected("the receiving neighbour stopped".into()))
    }
}

/// A link whose messages go through the wire format, delivered to an in-process channel.
struct LoopbackSend {
    step: u64,
    link: Link,
    tx: Sender<Msg>,
}

impl LinkSend for LoopbackSend {
    fn send(&self, msg: Msg) -> Result<(), StageCause> {
        let frame = encode_msg(self.step, self.link, &msg)?.received();
        let received = decode_msg(frame, self.step, self.link)?;
        LinkSend::send(&self.tx, received)
    }
}

/// `msg` as sent on `link` during `step`.
pub(crate) fn encode_msg(step: u64, link: Link, msg: &Msg) -> Result<wire::Outgoing, StageCause> {
    let kind = if link.grad {
        MsgKind::Gradient
    } else {
        MsgKind::Activation
    };
    Ok(wire::encode_tensor(
        kind,
        step,
        link,
        msg.micro_batch,
        msg.finite,
        &msg.tensor,
    )?)
}

/// The message in `bytes`, which must belong to `step` and `link` (a message of another step
/// or link is an error naming both, never a tensor taken for the wrong one).
pub(crate) fn decode_msg(frame: wire::Frame, step: u64, link: Link) -> Result<Msg, StageCause> {
    if let Ok((MsgKind::Abort, ..)) = wire::peek(frame.bytes()) {
        return Err(StageCause::Disconnected(wire::text_of(frame.bytes())));
    }
    let (header, values) = wire::decode_frame(frame)
        .map_err(|e| StageCause::Disconnected(format!("a message on {link}: {e}")))?;
    if header.step != step || header.link != link {
        return Err(StageCause::Disconnected(format!(
            "a message of step {} on {} arrived on {link} during step {step}",
            header.step, header.link
        )));
    }
    Ok(Msg {
        micro_batch: header.micro_batch,
        finite: header.finite,
        tensor: wire::tensor_of(&header, values)?,
    })
}

/// The link ends of every device for one step (`round`: one per `train_step` call) of
/// `schedule`; a peer's failure sets `abort`.
pub(crate) fn wire_links(
    transport: &Transport,
    schedule: &Schedule,
    round: u64,
    abort: &Arc<AtomicBool>,
) -> Vec<DeviceLinks> {
    #[cfg(feature = "mpi")]
    if let Transport::Mpi(comm) = transport {
        return crate::exec::transport::mpi::wire_links(comm, schedule, round, abort);
    }
    let _ = abort;
    let step = round;
    let k = schedule.num_devices();
    let mut links: Vec<DeviceLinks> = (0..k).map(|_| DeviceLinks::default()).collect();
    for link in schedule.links() {
        let (tx, rx) = channel();
        let send: Box<dyn LinkSend> = match transport {
            Transport::Channels => Box::new(tx),
            Transport::Loopback => Box::new(LoopbackSend { step, link, tx }),
            #[cfg(feature = "mpi")]
            Transport::Mpi(_) => unreachable!("wired by mpi_comm::wire_links"),
        };
        links[schedule.placement[link.from]].tx.insert(link, send);
        links[schedule.placement[link.to]].rx.insert(link, rx);
    }
    links
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpipe_tensor::{Device, Tensor};

    fn msg() -> Msg {
        Msg {
            micro_batch: 3,
            tensor: Tensor::from_vec(vec![1.5, -2.0, 0.25, 8.0], &[2, 2], &Device::cpu()).unwrap(),
            finite: true,
        }
    }

    const LINK: Link = Link {
        from: 1,
        to: 2,
        grad: false,
        skip: None,
    };

    #[test]
    fn a_message_comes_back_whole() {
        let frame = encode_msg(4, LINK, &msg()).unwrap().received();
        let got = decode_msg(frame, 4, LINK).unwrap();
        assert_eq!((got.micro_batch, got.finite), (3, true));
        assert_eq!(got.tensor.shape(), &[2, 2]);
        assert_eq!(got.tensor.to_vec().unwrap(), vec![1.5, -2.0, 0.25, 8.0]);
    }

    #[test]
    fn a_message_of_another_step_or_link_is_refused() {
        let frame = encode_msg(4, LINK, &msg()).unwrap().received();
        let e = decode_msg(frame.clone(), 5, LINK)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("of step 4") && e.contains("during step 5"),
            "{e}"
        );
        let grads = Link { grad: true, ..LINK };
        let e = decode_msg(frame, 4, grads).err().unwrap().to_string();
        assert!(
            e.contains("stage 1->2 activations arrived on stage 1->2 gradients"),
            "{e}"
        );
    }

    #[test]
    fn an_abort_message_is_the_peer_error() {
        let frame = wire::encode_abort(4, "rank 3 failed");
        let e = decode_msg(frame, 4, LINK).err().unwrap().to_string();
        assert_eq!(e, "rank 3 failed");
    }
}
