//! Caught panics of wgpipe's stage threads do not print the default panic message (the error
//! carries it, with its location); every other thread's panics still reach the hook that was
//! installed before. One test in its own binary: the panic hook is process-wide.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use wgpipe_pipeline::exec::threads::{
    install_quiet_panic_hook, panic_message, spawn_stage, stage_thread_name,
};

#[test]
fn stage_thread_panics_are_quiet_and_others_are_not() {
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    std::panic::set_hook(Box::new(move |_| {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    install_quiet_panic_hook();
    install_quiet_panic_hook(); // idempotent

    let msg = std::thread::scope(|s| {
        let h = spawn_stage(s, 3, || {
            assert_eq!(std::thread::current().name(), Some("wgpipe-stage-3"));
            std::panic::catch_unwind(|| panic!("boom in a layer"))
                .map_err(panic_message)
                .unwrap_err()
        })
        .unwrap();
        h.join().unwrap()
    });
    assert!(msg.starts_with("boom in a layer (at "), "{msg}");
    assert!(msg.contains("quiet_panics.rs"), "{msg}");
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "the stage thread's panic was printed"
    );

    let r = std::thread::Builder::new()
        .name("someone-else".into())
        .spawn(|| panic!("not ours"))
        .unwrap()
        .join();
    assert!(r.is_err());
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "another thread's panic was swallowed"
    );
    assert_eq!(stage_thread_name(12), "wgpipe-stage-12");
}
