//! A pool of idle host buffers, keyed by length, that CPU op outputs are taken from.
//!
//! Tensors are immutable, so every op result is a new buffer. Without a pool each one is a fresh
//! allocation: buffers of a few hundred KiB and more are mmap-ed by the allocator, returned to
//! the kernel when freed, and page-faulted back in on first write, page by page, at every op of
//! every step (on a 2-core machine this was a fifth of an MLP training step, and its share moved
//! with what the allocator's adaptive thresholds happened to be, run to run). A training step
//! asks for the same lengths every time, so a freed buffer is kept here and handed to the next
//! op that wants that many values.
//!
//! Idle pooled bytes are host memory no device is charged for (a buffer is charged while it backs
//! a tensor); they are capped by [`POOL_CAP_BYTES`] (or `WGPIPE_HOST_POOL_MIB`; 0 turns the pool
//! off, which is how the benchmarks show the before/after in one binary).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Buffers shorter than this go straight back to the allocator (small sizes come from its
/// per-thread caches without page faults, faster than a lock).
const MIN_POOLED_LEN: usize = 4096;
/// Default cap on idle pooled bytes.
pub(crate) const POOL_CAP_BYTES: usize = 512 << 20;
/// The environment variable overriding the cap, in MiB (0 = no pool).
pub const HOST_POOL_ENV: &str = "WGPIPE_HOST_POOL_MIB";

/// Idle buffers by length, with their total bytes and the cap on them.
struct Pool {
    idle: HashMap<usize, Vec<Vec<f32>>>,
    bytes: usize,
    cap: usize,
}

impl Pool {
    fn new(cap: usize) -> Pool {
        Pool {
            idle: HashMap::new(),
            bytes: 0,
            cap,
        }
    }

    /// An idle buffer of exactly `n` values, if one is kept.
    fn take(&mut self, n: usize) -> Option<Vec<f32>> {
        let v = self.idle.get_mut(&n)?.pop()?;
        self.bytes -= n * 4;
        Some(v)
    }

    /// Keeps `v` unless it is small, has spare capacity, or would overflow the cap.
    fn give(&mut self, v: Vec<f32>) {
        let n = v.len();
        if n < MIN_POOLED_LEN || v.capacity() != n || self.bytes + n * 4 > self.cap {
            return;
        }
        self.bytes += n * 4;
        self.idle.entry(n).or_default().push(v);
    }
}

fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cap = std::env::var(HOST_POOL_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .map_or(POOL_CAP_BYTES, |mib| mib << 20);
        Mutex::new(Pool::new(cap))
    })
}

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    // Every update leaves the pool consistent, so a poisoned lock is safe to use.
    pool().lock().unwrap_or_else(|p| p.into_inner())
}

/// A pooled buffer of exactly `n` values, if one is idle.
fn take_pooled(n: usize) -> Option<Vec<f32>> {
    if n >= MIN_POOLED_LEN {
        lock().take(n)
    } else {
        None
    }
}

/// A buffer of `n` values with arbitrary (stale) contents, for a kernel that writes every one.
/// Debug builds fill it with NaN, so a kernel that leaves a value unwritten fails its tests.
pub(crate) fn take_for_overwrite(n: usize) -> Vec<f32> {
    let fill = if cfg!(debug_assertions) {
        f32::NAN
    } else {
        0.0
    };
    match take_pooled(n) {
        Some(mut v) => {
            if cfg!(debug_assertions) {
                v.fill(fill);
            }
            v
        }
        None => vec![fill; n],
    }
}

/// A zeroed buffer of `n` values.
pub(crate) fn take_zeroed(n: usize) -> Vec<f32> {
    match take_pooled(n) {
        Some(mut v) => {
            v.fill(0.0);
            v
        }
        None => vec![0.0; n],
    }
}

/// Keeps `v` for a later op of its length (or frees it when small or the pool is full).
pub(crate) fn give(v: Vec<f32>) {
    if v.len() >= MIN_POOLED_LEN {
        lock().give(v);
    }
}

/// Bytes held idle in the host pool now.
pub fn pooled_host_bytes() -> usize {
    lock().bytes
}

/// Frees every idle pooled host buffer (their memory goes back to the allocator).
pub fn clear_host_pool() {
    let mut p = lock();
    p.idle.clear();
    p.bytes = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_buffer_goes_to_the_next_request_of_its_length_only() {
        let mut p = Pool::new(1 << 30);
        let n = MIN_POOLED_LEN + 17;
        let v = vec![1.5f32; n];
        let ptr = v.as_ptr();
        p.give(v);
        assert_eq!(p.bytes, 4 * n);
        assert!(p.take(n + 1).is_none());
        let again = p.take(n).expect("the kept buffer");
        assert_eq!((again.as_ptr(), again.len()), (ptr, n));
        assert_eq!(p.bytes, 0);
        assert!(p.take(n).is_none());
    }

    #[test]
    fn small_oversized_and_over_cap_buffers_are_freed() {
        let mut p = Pool::new(8 * MIN_POOLED_LEN);
        p.give(vec![0.0; MIN_POOLED_LEN - 1]);
        let mut spare = Vec::with_capacity(MIN_POOLED_LEN + 8);
        spare.resize(MIN_POOLED_LEN, 0.0);
        p.give(spare);
        assert_eq!(p.bytes, 0);
        p.give(vec![0.0; MIN_POOLED_LEN]);
        p.give(vec![0.0; MIN_POOLED_LEN]);
        assert_eq!(p.bytes, 8 * MIN_POOLED_LEN);
        p.give(vec![0.0; MIN_POOLED_LEN]);
        assert_eq!(p.bytes, 8 * MIN_POOLED_LEN, "the cap holds");
    }

    #[test]
    fn buffers_for_overwrite_have_the_length_asked_and_zeroed_ones_are_zero() {
        let n = MIN_POOLED_LEN + 3;
        give(vec![7.0; n]);
        assert_eq!(take_for_overwrite(n).len(), n);
        give(vec![7.0; n]);
        let z = take_zeroed(n);
        assert!(z.len() == n && z.iter().all(|&x| x == 0.0));
        assert!(take_zeroed(5).iter().all(|&x| x == 0.0));
    }
}
