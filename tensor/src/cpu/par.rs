//! Work splitting: big outputs are cut into chunks of whole rows that rayon runs in parallel;
//! small ones stay on the calling thread (spawning costs more than the work).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Sets the number of threads of the CPU backend (the process-wide rayon pool) to `n`; 0 means
/// one per core. Call it once at start-up, before the first CPU op: the pool is built on first
/// use (from `RAYON_NUM_THREADS` when set, else one thread per core) and cannot be resized
/// afterwards, which is an error here.
pub fn set_cpu_threads(n: usize) -> Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| {
            Error::invalid(
                "set_cpu_threads",
                format!(
                    "cannot set {n} threads: {e} (the CPU pool already runs {} threads; call \
                     set_cpu_threads before the first CPU op)",
                    rayon::current_num_threads()
                ),
            )
        })
}

/// The number of threads the CPU backend runs on.
pub fn cpu_threads() -> usize {
    rayon::current_num_threads()
}

static SHARING_THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Whether this thread is inside [`share_cpu_threads`].
    static SHARING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` as one of several threads that issue CPU kernels side by side (a pipeline's device
/// threads): while `n` such threads run, the kernels each calls split their work over
/// `pool threads / n` threads (at least 1, which runs them on the calling thread) instead of
/// every pool thread. Without it, four device threads on two cores each hand every mid-sized op
/// to the rayon pool and block until it is done: the cores are already busy with the other
/// devices' work, so the split buys nothing and costs a sleep and a wake-up per op (the main
/// job spent a quarter of its CPU time switching threads). The split never changes a result:
/// it only decides how rows and independent products are shared out.
pub fn share_cpu_threads<R>(f: impl FnOnce() -> R) -> R {
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            SHARING_THREADS.fetch_sub(1, Ordering::SeqCst);
            SHARING.with(|s| s.set(self.0));
        }
    }
    let was = SHARING.with(|s| s.replace(true));
    SHARING_THREADS.fetch_add(1, Ordering::SeqCst);
    let _leave = Leave(was);
    f()
}

/// Runs `f` on one of the CPU backend's own threads and returns its result (a panic in `f` is
/// resumed on the caller). A training loop run this way issues its kernels from inside the pool,
/// as an OpenMP program's main thread does: a parallel op pushes work onto the calling thread's
/// own queue for the other threads to steal and runs its share itself, rather than handing the
/// whole op to the pool and sleeping until it is done (a wake-up on each side of every op).
/// Results are bit-identical either way.
///
/// `f` must not wait for another thread that runs CPU kernels (a pipeline's device threads, say):
/// while it waits it holds one of the pool's threads. With a one-thread pool, or when already on
/// a pool thread, `f` simply runs here.
pub fn on_cpu_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_num_threads() <= 1 || rayon::current_thread_index().is_some() {
        return f();
    }
    // The caller's per-thread settings go with it: its share of the threads (inside
    // `share_cpu_threads`) and the memory tag its allocations get.
    let sharing = SHARING.with(Cell::get);
    let tag = crate::memory::current_tag();
    rayon::scope(move |_| {
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                SHARING.with(|s| s.set(self.0));
            }
        }
        let _restore = Restore(SHARING.with(|s| s.replace(sharing)));
        let _tag = crate::memory::TagGuard::new(tag);
        f()
    })
}

/// The threads a kernel called on this thread may split its work over (see
/// [`share_cpu_threads`]).
pub(crate) fn kernel_threads() -> usize {
    let pool = rayon::current_num_threads();
    if !SHARING.with(Cell::get) {
        return pool;
    }
    let sharing = SHARING_THREADS.load(Ordering::SeqCst).max(1);
    (pool / sharing).max(1)
}

/// Below this many output elements a kernel runs single-threaded.
pub(crate) const PAR_THRESHOLD: usize = 32 * 1024;
/// The smallest chunk handed to one rayon task.
const MIN_CHUNK: usize = 8 * 1024;

/// Rows per parallel chunk for `rows` rows of `work_per_row` elements each, or `None` when the
/// job is small enough to run in one go.
pub(crate) fn rows_per_chunk(rows: usize, work_per_row: usize) -> Option<usize> {
    let work_per_row = work_per_row.max(1);
    let threads = kernel_threads();
    if threads <= 1 || rows <= 1 || rows.saturating_mul(work_per_row) < PAR_THRESHOLD {
        return None;
    }
    let by_threads = rows.div_ceil(threads * 4);
    let by_size = MIN_CHUNK.div_ceil(work_per_row);
    Some(by_threads.max(by_size).max(1))
}

/// Runs `f(first_row, chunk)` over `out` cut into chunks of whole rows of `row` elements
/// (`row = 1` for plain elementwise work), in parallel when `out` is big.
pub(crate) fn for_rows<T, F>(out: &mut [T], row: usize, f: F)
where
    T: Send,
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    if out.is_empty() || row == 0 {
        return;
    }
    match rows_per_chunk(out.len() / row, row) {
        None => f(0, out),
        Some(rpc) => out
            .par_chunks_mut(rpc * row)
            .enumerate()
            .for_each(|(c, chunk)| f(c * rpc, chunk)),
    }
}

/// Runs `f(first_row, parts)` over `outs` cut into chunks of whole rows, output `k` holding
/// `widths[k]` values per row (`rows` rows of `work_per_row` elements of work), in parallel when
/// the job is big: for kernels with several outputs per row (a value row and per-row statistics).
pub(crate) fn for_row_chunks<const N: usize>(
    outs: [&mut [f32]; N],
    widths: [usize; N],
    rows: usize,
    work_per_row: usize,
    f: impl Fn(usize, [&mut [f32]; N]) + Sync + Send,
) {
    let Some(rpc) = rows_per_chunk(rows, work_per_row) else {
        return f(0, outs);
    };
    let mut chunks: Vec<Vec<&mut [f32]>> = Vec::new();
    for (out, w) in outs.into_iter().zip(widths) {
        for (c, part) in out.chunks_mut(rpc * w).enumerate() {
            if chunks.len() <= c {
                chunks.push(Vec::with_capacity(N));
            }
            chunks[c].push(part);
        }
    }
    chunks.into_par_iter().enumerate().for_each(|(c, parts)| {
        let parts: [&mut [f32]; N] = parts
            .try_into()
            .unwrap_or_else(|_| unreachable!("every output has the same number of row chunks"));
        f(c * rpc, parts)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_cpu_pool_keeps_the_callers_share_of_the_threads() {
        let pool = rayon::current_num_threads();
        let (outside, inside) = share_cpu_threads(|| {
            share_cpu_threads(|| (kernel_threads(), on_cpu_pool(kernel_threads)))
        });
        // Two sharing threads (nested calls count as two) leave each half the pool.
        assert_eq!(outside, (pool / 2).max(1));
        assert_eq!(inside, outside, "the share was lost on the pool thread");
        assert_eq!(on_cpu_pool(kernel_threads), pool);
    }

    #[test]
    fn on_cpu_pool_keeps_the_callers_memory_tag() {
        use crate::memory::{current_tag, Tag, TagGuard};
        let _g = TagGuard::new(Tag::Activations);
        assert_eq!(on_cpu_pool(current_tag), Tag::Activations);
        // and the pool thread's own tag is restored afterwards
        let after = rayon::scope(|_| current_tag());
        assert_eq!(after, Tag::Other);
    }
}
