//! Simulated time: the timeline of a schedule replayed against a cost model, the simulated
//! cluster of virtual devices and the links between them (nodes of devices), the cost of collectives, and the pictures (Chrome trace, SVG).
//! The runtime reports and the planner predicts with these same functions.

pub mod cluster;
pub mod collectives;
pub mod synth;
pub mod timeline;
pub mod topology;
pub mod trace;

#[cfg(test)]
mod schedule_timelines;

pub use cluster::SimCluster;
pub use topology::{Topology, TopologyError};

use wgpipe_tensor::Tensor;

/// Bytes a tensor takes on a link: its elements at the size of its dtype (half tensors travel
/// as their 16-bit patterns).
pub fn wire_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.dtype().size_of()) as u64
}
