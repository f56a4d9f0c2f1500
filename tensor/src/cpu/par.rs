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
/// resumed on the caller): a training loop on the CPU run the way PyTorch's runs on its OpenMP
/// threads. Its kernels are issued from inside the pool, so a parallel op pushes work onto the
/// calling thread's own queue for the other threads to steal and runs its share itself, rather
/// than handing the whole op to the pool and sleeping until it is done. Results are
/// bit-identical either way.
///
/// Between ops the other pool threads wait as rayon's do (a short spin, then sleep). Keeping
/// them spinning through the loop (OpenMP's spin-wait, as this did before) gained a few percent
/// on a quiet 2-core machine and lost up to 2.8x when another process wanted a core: a spinning
/// thread competes with it for whole time slices, holding a stolen share of an op while it
/// waits to be scheduled, where a sleeping one is woken straight onto the core. Two spinning
/// threads were also seen sharing one core for seconds (`bench_train`'s LM then ran 1.6x
/// slower). docs/speed-history.md (2026-12-02, just after midnight) has the figures.
///
/// Run one such loop at a time, and do not wait in `f` for another thread that runs CPU
/// kernels (a pipeline's device threads, say): `f` holds one of the pool's threads, and the
/// other thread's kernels may find none free ([`on_spare_cpu_thread`] leaves one). With a
/// one-thread pool, or when already on a pool thread, `f` simply runs here.
pub fn on_cpu_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_num_threads() <= 1 || rayon::current_thread_index().is_some() {
        return f();
    }
    HELD.fetch_add(1, Ordering::SeqCst);
    run_on_pool(f)
}

/// [`on_cpu_pool`] where that leaves a pool thread free for the kernels of other threads, so
/// that `f` may wait for them (a pipeline's lone stage thread waits for the loss its caller's
/// thread computes); `Err(f)`, not run, where it would not (a one-thread pool, or every other
/// pool thread held by such closures) or where this thread is already on the pool.
pub fn on_spare_cpu_thread<R: Send, F: FnOnce() -> R + Send>(f: F) -> std::result::Result<R, F> {
    let pool = rayon::current_num_threads();
    if rayon::current_thread_index().is_some() {
        return Err(f);
    }
    // Reserved before it is checked, so that two callers cannot both take the last one.
    if HELD.fetch_add(1, Ordering::SeqCst) + 1 >= pool {
        HELD.fetch_sub(1, Ordering::SeqCst);
        return Err(f);
    }
    Ok(run_on_pool(f))
}

/// Pool threads held by the closures of [`on_cpu_pool`] and [`on_spare_cpu_thread`], running
/// or about to run.
static HELD: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` on a pool thread for [`on_cpu_pool`], whose count in [`HELD`] it gives back.
fn run_on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    struct Release;
    impl Drop for Release {
        fn drop(&mut self) {
            HELD.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let _release = Release;
    // The caller's per-thread settings go with it: its share of the threads (inside
    // `share_cpu_threads`) and the memory tag its allocations get.
    let sharing = SHARING.with(Cell::get);
    let tag = crate::memory::current_tag();
    // Called from outside the pool, `rayon::scope` runs its closure on a pool thread.
    rayon::scope(move |_| {
        // Undone on every way out of `f`, a panic included.
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
        let _one_loop = LOOPS.lock().unwrap_or_else(|e| e.into_inner());
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
    fn loops_side_by_side_both_finish() {
        let _one_loop = LOOPS.lock().unwrap_or_else(|e| e.into_inner());
        let (tx, rx) = std::sync::mpsc::channel();
        for id in 0..2u64 {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let sum = on_cpu_pool(|| {
                    (0..50u64)
                        .map(|i| {
                            let mut v = vec![(id + i) as f32; 64 * 1024];
                            for_rows(&mut v, 64, |_, c| c.iter_mut().for_each(|x| *x += 1.0));
                            v[0] as u64
                        })
                        .sum::<u64>()
                });
                tx.send((id, sum)).unwrap();
            });
        }
        let mut got: Vec<(u64, u64)> = (0..2)
            .map(|_| {
                rx.recv_timeout(std::time::Duration::from_secs(60))
                    .expect("a loop hung")
            })
            .collect();
        got.sort();
        assert_eq!(
            got,
            vec![
                (0, (0..50).map(|i| i + 1).sum()),
                (1, (0..50).map(|i| i + 2).sum())
            ]
        );
    }

    #[test]
    fn a_spare_pool_thread_is_lent_only_while_another_stays_free() {
        let _one_loop = LOOPS.lock().unwrap_or_else(|e| e.into_inner());
        let pool = rayon::current_num_threads();
        if pool == 1 {
            assert!(
                on_spare_cpu_thread(|| ()).is_err(),
                "a one-thread pool lent its thread"
            );
            return;
        }
        // Lent while every other thread is free: `f` runs on the pool.
        let on_pool = on_spare_cpu_thread(|| rayon::current_thread_index().is_some());
        assert_eq!(on_pool.ok(), Some(true));
        // Every pool thread but one held by loops: none is lent, and `f` is given back.
        let (inside, release) = (std::sync::Barrier::new(pool), std::sync::Barrier::new(pool));
        std::thread::scope(|s| {
            for _ in 1..pool {
                s.spawn(|| {
                    on_cpu_pool(|| {
                        inside.wait();
                        release.wait();
                    })
                });
            }
            inside.wait();
            let refused = on_spare_cpu_thread(|| 7);
            release.wait();
            assert_eq!(
                refused.err().map(|f| f()),
                Some(7),
                "the last free thread was lent"
            );
        });
        // Once they are done, it is lent again.
        assert!(on_spare_cpu_thread(|| ()).is_ok());
    }

    /// The tests of pool-wide state (the sharing count, the pool's threads) run one at a time.
    static LOOPS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn on_cpu_pool_keeps_the_callers_memory_tag() {
        let _one_loop = LOOPS.lock().unwrap_or_else(|e| e.into_inner());
        use crate::memory::{current_tag, Tag, TagGuard};
        let _g = TagGuard::new(Tag::Activations);
        assert_eq!(on_cpu_pool(current_tag), Tag::Activations);
        // and the pool thread's own tag is restored afterwards
        let after = rayon::scope(|_| current_tag());
        assert_eq!(after, Tag::Other);
    }
}
