//! wgpipe's own threads: one per stage, named `wgpipe-stage-N`, whose panics are caught and
//! returned as errors that name the stage. A caught panic must not also print Rust's default
//! "thread '...' panicked at ..." message: [`spawn_stage`] installs (once per process) a panic
//! hook that stays quiet for these threads, keeps the panic's location for the error, and hands
//! every other thread's panic to the hook that was there before.

use std::cell::{Cell, RefCell};
use std::sync::{Mutex, Once};
use std::thread::{JoinHandle, Scope, ScopedJoinHandle};

/// What the name of every stage thread starts with.
pub const STAGE_THREAD_PREFIX: &str = "wgpipe-stage-";

/// `wgpipe-stage-N`.
pub fn stage_thread_name(stage: usize) -> String {
    format!("{STAGE_THREAD_PREFIX}{stage}")
}

thread_local! {
    /// Where the last panic of this (stage) thread happened, for [`panic_message`].
    static LAST_PANIC_AT: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Whether this thread is running a stage thread's work for it (see [`run_stage_work`]):
    /// its panics are then as quiet as the stage thread's own.
    static STAGE_WORK: Cell<bool> = const { Cell::new(false) };
}

/// Installs, once per process, a panic hook that is silent for threads named
/// `wgpipe-stage-*` (their panics are caught and come back as errors) and calls the previous
/// hook for every other thread. [`spawn_stage`] calls it; call it yourself before running
/// stage work on threads you name with [`stage_thread_name`].
pub fn install_quiet_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = STAGE_WORK.with(Cell::get)
                || std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with(STAGE_THREAD_PREFIX));
            if ours {
                let at = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()));
                LAST_PANIC_AT.with(|c| *c.borrow_mut() = at);
            } else {
                previous(info);
            }
        }));
    });
}

/// Runs a stage thread's work `f` (a device's actions or steps back to back, a stage's optimizer
/// step) so that its CPU kernels are cheap to issue. Where the thread has the CPU to itself
/// (`alone`: the only stage thread running, on a CPU device) `f` runs on one of the CPU
/// backend's own threads ([`wgpipe_tensor::on_spare_cpu_thread`]): each parallel kernel then
/// shares its work out from inside the pool and runs a part itself. From a thread outside the
/// pool each one was handed to the pool, and the thread slept until it was done: about three
/// thread switches a kernel (`bench_train` of the main job's model on 2 cores: a run of 100
/// plain and 100 1-stage pipeline steps made 82-83k switches, one of the plain steps alone
/// 6-8k, and each pipeline step was 16-19% slower than the plain one). Otherwise, and where
/// that would leave the pool no thread free for the kernels `f` waits for (the caller's loss),
/// the stage threads share the CPU's threads ([`wgpipe_tensor::share_cpu_threads`]).
///
/// The thread blocks until `f` returns. Panics of `f` stay quiet, as on the stage thread;
/// catch them inside `f`, as its thread would.
pub fn run_stage_work<R: Send>(alone: bool, f: impl FnOnce() -> R + Send) -> R {
    if !alone {
        return wgpipe_tensor::share_cpu_threads(f);
    }
    let on_pool = move || {
        struct Quiet(bool);
        impl Drop for Quiet {
            fn drop(&mut self) {
                STAGE_WORK.with(|w| w.set(self.0));
            }
        }
        let _quiet = Quiet(STAGE_WORK.with(|w| w.replace(true)));
        f()
    };
    wgpipe_tensor::on_spare_cpu_thread(on_pool)
        .unwrap_or_else(|on_pool| wgpipe_tensor::share_cpu_threads(on_pool))
}

/// Spawns `f` on a scoped thread named `wgpipe-stage-{stage}`, with the quiet panic hook
/// installed. Catch the thread's panics inside `f` (or at `join`) and turn them into errors.
pub fn spawn_stage<'scope, 'env, T, F>(
    scope: &'scope Scope<'scope, 'env>,
    stage: usize,
    f: F,
) -> std::io::Result<ScopedJoinHandle<'scope, T>>
where
    F: FnOnce() -> T + Send + 'scope,
    T: Send + 'scope,
{
    install_quiet_panic_hook();
    std::thread::Builder::new()
        .name(stage_thread_name(stage))
        .spawn_scoped(scope, f)
}

/// Spawns `f` on a detached thread named `wgpipe-stage-{stage}`, with the quiet panic hook
/// installed: a step's device threads, which a step that timed out leaves to finish.
pub fn spawn_named<T, F>(stage: usize, f: F) -> std::io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    install_quiet_panic_hook();
    std::thread::Builder::new()
        .name(stage_thread_name(stage))
        .spawn(f)
}

/// The message of a caught panic, with its location when the panic happened on this thread
/// under the quiet hook (`"index out of bounds (at layer.rs:12)"`).
pub fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let msg = if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    };
    match LAST_PANIC_AT.with(|c| c.borrow_mut().take()) {
        Some(at) => format!("{msg} (at {at})"),
        None => msg,
    }
}
/// Locks a mutex, also after a panic elsewhere poisoned it (the data is a plain slot).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
