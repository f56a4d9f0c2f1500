//! Per-thread counters of what a thread's ops did: the FLOPs their front-ends count and the
//! bytes allocated minus freed on this thread. A caller measures one call with them (a layer's
//! cost, `wgpipe_autograd::measured_cost`) while other threads work on the same device, whose
//! own counters (`Device::flops`, `MemoryStats`) sum every thread's.

use std::cell::Cell;

thread_local! {
    static FLOPS: Cell<u64> = const { Cell::new(0) };
    static NET_BYTES: Cell<i64> = const { Cell::new(0) };
}

/// FLOPs counted by ops called from this thread so far (on any device).
pub fn thread_flops() -> u64 {
    FLOPS.with(Cell::get)
}

/// Bytes allocated minus bytes freed on this thread so far (on any device): a tensor made here
/// and dropped on another thread stays counted here.
pub fn thread_net_bytes() -> i64 {
    NET_BYTES.with(Cell::get)
}

pub(crate) fn count_flops(n: u64) {
    FLOPS.with(|f| f.set(f.get().wrapping_add(n)));
}

pub(crate) fn count_bytes(delta: i64) {
    NET_BYTES.with(|b| b.set(b.get().wrapping_add(delta)));
}
