//! One device's share of a step, as both drivers run it (`train/workers.rs` one step at a time,
//! `train/back_to_back/` steps back to back): the thread that runs it, started before its
//! stages are handed over; its action list under `run_device` with a panic caught, the step
//! aborted and the peers told on a failure, and its links closed after; and a failure named by
//! the stage, device, action and layer where it happened.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver};

use crate::error::{PipelineError, StageCause};
use crate::exec::threads;
use crate::exec::transport::DeviceLinks;
use crate::exec::worker::{run_device, Position, StageOutcome, StepInputs};
use crate::exec::Stage;
use crate::schedule::Action;

/// Where a device's run of a step ended, and how.
pub(crate) type DeviceRun = (Position, std::result::Result<StageOutcome, StageCause>);

/// Starts a device's thread with `spawn`, which gets the receiving end that `lent` (its stages,
/// and what else the thread owns) arrives on once the thread exists: a thread that cannot be
/// started does not take `lent` with it, it comes back with the reason.
pub(crate) fn start_device<L, H>(
    lent: L,
    spawn: impl FnOnce(Receiver<L>) -> std::io::Result<H>,
) -> std::result::Result<H, (L, std::io::Error)> {
    let (give, take) = channel::<L>();
    match spawn(take) {
        Ok(handle) => {
            let _ = give.send(lent);
            Ok(handle)
        }
        Err(e) => Err((lent, e)),
    }
}

/// Whether a device thread has the CPU's threads to itself: it is the only one running
/// (`only_thread`) and its stages are on the CPU.
pub(crate) fn owns_the_cpu(only_thread: bool, stages: &[Stage]) -> bool {
    only_thread && stages.first().is_some_and(|s| s.device.is_cpu())
}

/// Runs one step's actions on the device holding `stages`. A failure (a panic included) stops
/// the step's other devices and, under a transport across processes, tells the peers; the links
/// are dropped at the end, which closes this device's channels and wakes a neighbour blocked
/// on them.
pub(crate) fn run_device_step(stages: &[Stage], io: &StepInputs, links: DeviceLinks) -> DeviceRun {
    let refs: Vec<&Stage> = stages.iter().collect();
    let mut pos = Position::default();
    let r = catch_unwind(AssertUnwindSafe(|| run_device(&refs, &links, io, &mut pos)))
        .unwrap_or_else(|p| Err(StageCause::Panic(threads::panic_message(p))));
    if let Err(cause) = &r {
        io.abort.store(true, Ordering::SeqCst);
        if let Some(tell) = &links.abort_peers {
            tell(&cause.to_string());
        }
    }
    drop(links);
    (pos, r)
}

/// The root cause among the devices' results (`devices[d]` is device d's first stage): a
/// device's own failure wins over the "stopped because another stage failed" of the others. The
/// error names the virtual stage of the failing action (the device's first stage before any).
pub(crate) fn first_error(
    stages: &[Stage],
    devices: &[&Stage],
    results: Vec<DeviceRun>,
) -> std::result::Result<Vec<StageOutcome>, PipelineError> {
    let mut errors = Vec::new();
    let mut ok = Vec::new();
    for (first, (pos, r)) in devices.iter().zip(results) {
        match r {
            Ok(o) => ok.push(o),
            Err(cause) => errors.push(device_error(
                stages,
                first.index,
                first.device.name(),
                pos,
                cause,
            )),
        }
    }
    match root_cause(errors) {
        Some(e) => Err(e),
        None => Ok(ok),
    }
}

/// The root cause among the devices' errors (in device order): the first that is a device's
/// own failure, not a "stopped because another stage failed".
pub(crate) fn root_cause(errors: Vec<PipelineError>) -> Option<PipelineError> {
    let root = errors
        .iter()
        .position(|e| !matches!(e.cause(), Some(StageCause::Disconnected(_))))
        .unwrap_or(0);
    errors.into_iter().nth(root)
}

/// A device's failure as an error: the virtual stage of the failing action (`first_stage`, the
/// device's first, before any), and the layer when one was running (named from `stages`).
pub(crate) fn device_error(
    stages: &[Stage],
    first_stage: usize,
    device: &str,
    pos: Position,
    cause: StageCause,
) -> PipelineError {
    let (stage, mut action) = match pos.action {
        Some(a) => (a.stage, describe(a)),
        None => (first_stage, "start".to_string()),
    };
    if let Some(index) = pos.layer {
        let layer = stages
            .iter()
            .find(|s| (s.first_layer..s.first_layer + s.layers.len()).contains(&index))
            .map(|s| s.layers[index - s.first_layer].name())
            .unwrap_or_default();
        action = format!("{action} in layer {index} ({layer})");
    }
    PipelineError::Stage {
        stage,
        device: device.to_string(),
        micro_batch: pos.micro_batch,
        action,
        cause: Box::new(cause),
    }
}

/// An action as error messages name it: `Forward (2F3)`.
pub(crate) fn describe(a: Action) -> String {
    format!("{:?} ({a})", a.kind)
}
