//! Measuring the transport between two ranks: round trips of a tensor the way steps send
//! them, and the same round trips in plain blocking MPI calls, for comparison.

use std::sync::mpsc::channel;
use std::time::Instant;

use mpi::point_to_point::{Destination, Source};
use mpi::topology::{Communicator, SimpleCommunicator};

use super::serve::Out;
use super::MpiComm;
use crate::exec::transport::wire::{self, MsgKind};
use crate::schedule::Link;

impl MpiComm {
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
}

/// [`MpiComm::raw_ping_pong`] on the communication thread: blocking sends and receives on the
/// raw ping-pong's own communicator, buffers allocated once.
pub(super) fn raw_ping_pong(
    raw: &SimpleCommunicator,
    peer: usize,
    bytes: usize,
    reps: usize,
) -> Vec<f64> {
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
