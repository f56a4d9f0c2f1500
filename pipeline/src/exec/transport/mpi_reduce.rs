//! The gradient reduction across replicas in MPI's own collectives (feature `mpi`), run by the
//! communication thread without blocking it.
//!
//! One communicator per pipeline device, split from the world (rank `r*K + d` is rank r of
//! device d's communicator, so a communicator's rank order is the replica order). A
//! [`Reduction`] is one bucket: a reduce-scatter (`MPI_Ialltoall` of R equal chunks) after
//! which rank i sums chunk i of every replica **in replica order** with the replicas' weights
//! (the sum the in-process reduction computes, bit for bit), then an `MPI_Iallgather` of the
//! summed chunks. MPI's own reduction operators are not used because MPI does not fix the
//! order in which they add, and replicas must stay bit-identical to each other, from run to
//! run, and to in-process replicas. The traffic is the same as a ring all-reduce's:
//! 2 (R-1)/R of the bucket in and out per rank.

use std::sync::mpsc::Sender;
use std::time::Instant;

use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};

use crate::exec::comm::add_weighted;

/// The communicator of this rank's device across the replicas of a K-device pipeline.
pub(crate) fn split_devices(
    world: &SimpleCommunicator,
    k: usize,
) -> Result<SimpleCommunicator, String> {
    let rank = world.rank();
    world
        .split_by_color_with_key(mpi::topology::Color::with_value(rank % k as i32), rank)
        .ok_or_else(|| {
            format!(
                "MPI_Comm_split for device {} gave no communicator",
                rank % k as i32
            )
        })
}

/// Where a bucket's sum goes: the sum and when it was complete, or why there is none.
pub(crate) type SumReply = Sender<Result<(Vec<f32>, Instant), String>>;

enum Phase {
    Waiting,
    Scatter,
    Gather,
    Done,
}

/// One bucket of one rank's gradients on its way to the weighted sum over the replicas.
pub(crate) struct Reduction {
    k: usize,
    /// Its values, padded to R equal chunks at the start.
    values: Vec<f32>,
    len: usize,
    weights: Vec<f32>,
    chunk: usize,
    /// Every replica's copy of this rank's chunk, in replica order.
    parts: Vec<f32>,
    sum: Vec<f32>,
    result: Vec<f32>,
    request: ffi::MPI_Request,
    phase: Phase,
    reply: Option<SumReply>,
}

// SAFETY: the request handle is used by the communication thread only, after the hand-over.
unsafe impl Send for Reduction {}

impl Reduction {
    /// A bucket of `values` of a K-device pipeline, to be summed with `weights` (one per
    /// replica); the sum and when it was complete (or why there is none) go to `reply`.
    pub(crate) fn new(k: usize, values: Vec<f32>, weights: Vec<f32>, reply: SumReply) -> Reduction {
        Reduction {
            k,
            len: values.len(),
            values,
            weights,
            chunk: 0,
            parts: Vec::new(),
            sum: Vec::new(),
            result: Vec::new(),
            // SAFETY: reading an MPI constant.
            request: unsafe { ffi::RSMPI_REQUEST_NULL },
            phase: Phase::Waiting,
            reply: Some(reply),
        }
    }

    pub(crate) fn k(&self) -> usize {
        self.k
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Starts the reduce-scatter on `comm` (this device's communicator).
    pub(crate) fn start(&mut self, comm: &SimpleCommunicator) {
        let r = comm.size() as usize;
        if r != self.weights.len() {
            return self.fail(format!(
                "{} replica weights for a communicator of {r} ranks",
                self.weights.len()
            ));
        }
        self.chunk = self.len.div_ceil(r).max(1);
        self.values.resize(self.chunk * r, 0.0);
        self.parts = vec![0.0; self.chunk * r];
        // SAFETY: both buffers live in this struct until the request completes (or are leaked
        // with it, see `abandon`), and hold R chunks of `chunk` floats.
        let rc = unsafe {
            ffi::MPI_Ialltoall(
                self.values.as_ptr().cast(),
                self.chunk as i32,
                ffi::RSMPI_FLOAT,
                self.parts.as_mut_ptr().cast(),
                self.chunk as i32,
                ffi::RSMPI_FLOAT,
                comm.as_raw(),
                &mut self.request,
            )
        };
        if rc != 0 {
            return self.fail(format!("MPI_Ialltoall failed (code {rc})"));
        }
        self.phase = Phase::Scatter;
    }

    /// Moves on if MPI finished the current phase; whether it did.
    pub(crate) fn advance(&mut self, comm: &SimpleCommunicator) -> bool {
        if !matches!(self.phase, Phase::Scatter | Phase::Gather) {
            return false;
        }
        let mut flag = 0;
        // SAFETY: an active request of this struct.
        let rc = unsafe { ffi::MPI_Test(&mut self.request, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
        if rc != 0 {
            self.fail(format!("MPI_Test failed (code {rc})"));
            return true;
        }
        if flag == 0 {
            return false;
        }
        match self.phase {
            Phase::Scatter => {
                let mut sum = None;
                for (i, &w) in self.weights.iter().enumerate() {
                    add_weighted(
                        &mut sum,
                        &self.parts[i * self.chunk..(i + 1) * self.chunk],
                        w,
                    );
                }
                self.sum = sum.unwrap_or_default();
                self.result = vec![0.0; self.values.len()];
                // SAFETY: as in `start`.
                let rc = unsafe {
                    ffi::MPI_Iallgather(
                        self.sum.as_ptr().cast(),
                        self.chunk as i32,
                        ffi::RSMPI_FLOAT,
                        self.result.as_mut_ptr().cast(),
                        self.chunk as i32,
                        ffi::RSMPI_FLOAT,
                        comm.as_raw(),
                        &mut self.request,
                    )
                };
                if rc != 0 {
                    self.fail(format!("MPI_Iallgather failed (code {rc})"));
                } else {
                    self.phase = Phase::Gather;
                }
            }
            Phase::Gather => {
                let mut result = std::mem::take(&mut self.result);
                result.truncate(self.len);
                self.phase = Phase::Done;
                if let Some(reply) = self.reply.take() {
                    let _ = reply.send(Ok((result, Instant::now())));
                }
            }
            _ => {}
        }
        true
    }

    /// Ends it with `why` (a peer lost, an MPI error). A collective still in flight keeps its
    /// buffers: they are leaked, since MPI may still write them.
    pub(crate) fn fail(&mut self, why: String) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(Err(why));
        }
        self.leak_if_active();
        self.phase = Phase::Done;
    }

    /// Dropped with the communication thread: nothing more will be asked of MPI.
    pub(crate) fn abandon(mut self) {
        self.leak_if_active();
    }

    fn leak_if_active(&mut self) {
        if matches!(self.phase, Phase::Scatter | Phase::Gather) {
            for buf in [
                &mut self.values,
                &mut self.parts,
                &mut self.sum,
                &mut self.result,
            ] {
                std::mem::forget(std::mem::take(buf));
            }
        }
    }
}
