//! Fault injection: a layer that panics or errors (in forward or backward) at stage k,
//! micro-batch m, and a stage that runs out of memory. Each must come back as one `Err` naming
//! the stage, micro-batch and cause, well under a second after the fault; every worker thread is
//! joined (`train_step` runs them in a thread scope, so returning at all proves it); parameters
//! and gradients are as before the step; and the next step succeeds.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wgpipe_autograd::Module;
use wgpipe_models::{Linear, Relu};
use wgpipe_pipeline::{CheckpointMode, Pipeline, PipelineError, ScheduleKind, StageCause};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

const K: usize = 3;
const WIDTH: usize = 8;

/// Layers, their balance, and the trigger of their `Fault` layer.
type FaultyModel = (Vec<Box<dyn Module>>, Vec<usize>, Arc<Mutex<FaultState>>);

/// Schedules the fault tests run: the classic ones, one with split backward (a fault can hit an
/// I or a W action) and one with two chunks per device.
const FAULT_SCHEDULES: [ScheduleKind; 4] = [
    ScheduleKind::GPipe,
    ScheduleKind::OneFOneB,
    ScheduleKind::ZbH1,
    ScheduleKind::ZbV,
];

/// K x chunks stages of [Linear, ReLU], with a `Fault` layer appended to stage `fault_stage`.
fn faulty_model(fault_stage: usize, schedule: ScheduleKind) -> FaultyModel {
    let d = Device::cpu();
    let (fault, state) = Fault::new();
    let mut fault = Some(fault);
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    let mut balance = Vec::new();
    for s in 0..K * schedule.default_chunks() {
        layers.push(Box::new(
            Linear::new(WIDTH, WIDTH, 100 + s as u64, &d).unwrap(),
        ));
        layers.push(Box::new(Relu));
        let mut n = 2;
        if s == fault_stage {
            layers.push(Box::new(fault.take().unwrap()));
            n += 1;
        }
        balance.push(n);
    }
    (layers, balance, state)
}

fn data() -> (Tensor, Tensor) {
    (normal_data(&[8, WIDTH], 21), normal_data(&[8, WIDTH], 22))
}

/// Runs one failing step on a pipeline that already holds gradients from a good step, checks
/// the error and the state, then disarms the fault and checks that training continues exactly
/// as if the failure had never happened.
#[allow(clippy::too_many_arguments)]
fn check_fault(
    pipe: &mut Pipeline,
    arm: &dyn Fn(),
    disarm: &dyn Fn(&mut Pipeline),
    fired_at: &dyn Fn() -> Option<Instant>,
    stages: &[usize],
    micro_batch: Option<usize>,
    cause: &dyn Fn(&StageCause) -> bool,
    what: &str,
    reference: &dyn Fn() -> Pipeline,
) {
    let (x, y) = data();
    // A good step first, so there are gradients to restore (accumulation across mini-batches).
    pipe.train_step(&x, &y, &mse).unwrap();
    let params = snapshot(&pipe.named_parameters());
    let grads = grad_snapshot(&pipe.named_parameters());
    assert!(grads.iter().all(|(_, g)| g.is_some()));
    arm();

    let t0 = Instant::now();
    let err = pipe.train_step(&x, &y, &mse).unwrap_err();
    let returned = Instant::now();
    let total = returned - t0;
    let since_fault = fired_at().map(|t| returned.saturating_duration_since(t));
    eprintln!("{what}: Err after {total:?} ({since_fault:?} after the fault): {err}");
    assert!(total < Duration::from_secs(1), "{what}: took {total:?}");
    if let Some(d) = since_fault {
        assert!(d < Duration::from_secs(1), "{what}: {d:?} after the fault");
    }
    match &err {
        PipelineError::Stage {
            stage: s,
            micro_batch: m,
            cause: c,
            ..
        } => {
            assert!(stages.contains(s), "{what}: wrong stage in {err}");
            if let Some(mb) = micro_batch {
                assert_eq!(*m, mb, "{what}: wrong micro-batch in {err}");
            }
            assert!(cause(c.as_ref()), "{what}: wrong cause in {err}");
        }
        other => panic!("{what}: not a stage error: {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("stage {}", err.stage().unwrap())),
        "{msg}"
    );
    if let Some(mb) = micro_batch {
        assert!(msg.contains(&format!("micro-batch {mb}")), "{msg}");
    }
    assert_eq!(
        snapshot(&pipe.named_parameters()),
        params,
        "{what}: parameters changed"
    );
    assert_eq!(
        grad_snapshot(&pipe.named_parameters()),
        grads,
        "{what}: gradients changed"
    );
    for d in pipe.devices() {
        // Nothing of the failed step is left alive on any device.
        assert_eq!(
            d.memory_stats().live_of(wgpipe_tensor::Tag::Activations),
            0,
            "{what}: activations leaked on {d}"
        );
    }

    // Remove the fault: the next step runs, and training continues as if nothing happened.
    disarm(pipe);
    pipe.train_step(&x, &y, &mse).unwrap();
    pipe.optimizer_step().unwrap();
    pipe.train_step(&x, &y, &mse).unwrap();
    let mut clean = reference();
    clean.train_step(&x, &y, &mse).unwrap();
    clean.train_step(&x, &y, &mse).unwrap();
    clean.optimizer_step().unwrap();
    clean.train_step(&x, &y, &mse).unwrap();
    assert_eq!(
        snapshot(&pipe.named_parameters()),
        snapshot(&clean.named_parameters())
    );
    assert_eq!(
        grad_snapshot(&pipe.named_parameters()),
        grad_snapshot(&clean.named_parameters())
    );
}

#[test]
fn layer_panics_and_errors_stop_every_stage_and_leave_the_model_as_it_was() {
    let kinds = [
        (FaultKind::Panic, "panic"),
        (FaultKind::Error, "error"),
        (FaultKind::BackwardError, "backward error"),
        (FaultKind::BackwardPanic, "backward panic"),
        (FaultKind::WeightBackwardError, "weight-gradient error"),
    ];
    for (kind, label) in kinds {
        for schedule in FAULT_SCHEDULES {
            for mode in [CheckpointMode::Always, CheckpointMode::Never] {
                // With two chunks per device, stage 4 is device 1's second chunk.
                let last = K * schedule.default_chunks() - 1;
                for (stage, mb) in [(0, 0), (1, 2), (2, 3), (last, 1)] {
                    let (layers, balance, state) = faulty_model(stage, schedule);
                    let cfg = PipeCfg::new(K, 4, mode, schedule).balance(balance.clone());
                    let mut pipe = sim_pipeline(layers, &cfg);
                    let st0 = state.clone();
                    let st = state.clone();
                    let st2 = state.clone();
                    let reference = || {
                        let (layers, _, _) = faulty_model(stage, schedule);
                        sim_pipeline(layers, &cfg)
                    };
                    let is_cause = |c: &StageCause| match (kind, c) {
                        (FaultKind::Panic | FaultKind::BackwardPanic, StageCause::Panic(m)) => {
                            m.contains("injected") && m.contains(&format!("micro-batch {mb}"))
                        }
                        (
                            FaultKind::Error
                            | FaultKind::BackwardError
                            | FaultKind::WeightBackwardError,
                            StageCause::Tensor(e),
                        ) => e.to_string().contains("injected"),
                        _ => false,
                    };
                    check_fault(
                        &mut pipe,
                        &move || st0.lock().unwrap().armed = Some((kind, mb as u64)),
                        &move |_| st.lock().unwrap().armed = None,
                        &move || st2.lock().unwrap().fired_at,
                        &[stage],
                        Some(mb),
                        &is_cause,
                        &format!("{label} at stage {stage} micro-batch {mb} {mode} {schedule:?}"),
                        &reference,
                    );
                }
            }
        }
    }
}

#[test]
fn a_stage_out_of_memory_is_a_clean_error() {
    for schedule in FAULT_SCHEDULES {
        for device in 0..K {
            let make = |cap: u64| {
                let (layers, balance, _) = faulty_model(usize::MAX, schedule); // no fault layer
                let mut cfg = PipeCfg::new(K, 4, CheckpointMode::Never, schedule).balance(balance);
                cfg.memory[device] = cap;
                sim_pipeline(layers, &cfg)
            };
            // Armed after a good step: room for what lives (parameters, gradients) plus 192
            // bytes, fewer than the activations of 4 micro-batches of 2 samples need.
            let mut pipe = make(u64::MAX);
            let is_oom = |c: &StageCause| {
                matches!(
                    c,
                    StageCause::Tensor(wgpipe_tensor::Error::OutOfMemory { .. })
                )
            };
            let stages = pipe.schedule().stages_of(device);
            let dev = pipe.devices()[stages[0]].clone();
            let (d1, d2) = (dev.clone(), dev.clone());
            check_fault(
                &mut pipe,
                &move || d1.memory().set_capacity(Some(d1.memory_stats().live + 192)),
                &move |_| d2.memory().set_capacity(None),
                &|| None,
                &stages,
                None,
                &is_oom,
                &format!("out of memory on device {device} {schedule:?}"),
                &|| make(u64::MAX),
            );
        }
    }
}

/// Batch norm defers its running statistics to `finish_step`; the micro-batches that ran
/// before a failure must not leak their statistics into the next step.
#[test]
fn a_failed_step_leaves_no_deferred_batch_norm_statistics() {
    use wgpipe_models::BatchNorm2d;
    let make = || {
        let d = Device::cpu();
        let (fault, state) = Fault::new();
        let layers: Vec<Box<dyn Module>> = vec![
            Box::new(Linear::new(WIDTH, WIDTH, 1, &d).unwrap()),
            Box::new(BatchNorm2d::new(WIDTH, &d).unwrap()),
            Box::new(Relu),
            Box::new(Linear::new(WIDTH, WIDTH, 2, &d).unwrap()),
            Box::new(fault),
        ];
        (layers, state)
    };
    let (x, y) = data();
    for schedule in CLASSIC_SCHEDULES.into_iter().chain([ScheduleKind::ZbH1]) {
        for mode in ALL_MODES {
            let cfg = PipeCfg::new(2, 4, mode, schedule).balance(vec![3, 2]);
            let (layers, state) = make();
            let mut pipe = sim_pipeline(layers, &cfg);
            pipe.train_step(&x, &y, &mse).unwrap();
            pipe.optimizer_step().unwrap();
            // Stage 1 fails at micro-batch 2: stage 0 has run batch norm on micro-batches 0..=2
            // (GPipe: all 4) by then.
            state.lock().unwrap().armed = Some((FaultKind::Error, 2));
            let buffers = snapshot(&pipe.named_buffers());
            pipe.train_step(&x, &y, &mse).unwrap_err();
            assert_eq!(
                snapshot(&pipe.named_buffers()),
                buffers,
                "{cfg:?}: buffers changed"
            );
            state.lock().unwrap().armed = None;
            pipe.train_step(&x, &y, &mse).unwrap();

            let (layers, _) = make();
            let mut clean = sim_pipeline(layers, &cfg);
            clean.train_step(&x, &y, &mse).unwrap();
            clean.optimizer_step().unwrap();
            clean.train_step(&x, &y, &mse).unwrap();
            assert_eq!(
                snapshot(&pipe.named_buffers()),
                snapshot(&clean.named_buffers()),
                "{cfg:?}: statistics of the failed step leaked into the next one"
            );
        }
    }
}

/// A NaN in a target or an input, or an infinity made inside a stage, is an error naming the
/// stage and micro-batch where it first appeared (default policy), with nothing changed; under
/// `NonFinite::SkipStep` the step runs, its gradients are dropped and the report says where.
#[test]
fn non_finite_values_are_caught_where_they_first_appear() {
    use wgpipe_pipeline::NonFinite;
    let (x, y) = data();
    let with_nan = |t: &Tensor, row: usize| {
        let mut v = t.to_vec().unwrap();
        v[row * WIDTH + 1] = f32::NAN;
        Tensor::from_vec(v, t.shape(), &Device::cpu()).unwrap()
    };
    for schedule in FAULT_SCHEDULES {
        let last = K * schedule.default_chunks() - 1;
        let make = |policy| {
            let (layers, balance, _) = faulty_model(usize::MAX, schedule);
            let mut pipe = sim_pipeline(
                layers,
                &PipeCfg::new(K, 4, CheckpointMode::ExceptLast, schedule).balance(balance),
            );
            pipe.set_non_finite(policy);
            pipe
        };
        let mut pipe = make(NonFinite::Error);
        pipe.train_step(&x, &y, &mse).unwrap();
        let grads = grad_snapshot(&pipe.named_parameters());
        // Row 5 is in micro-batch 2 (4 micro-batches of 2 rows).
        let e = pipe.train_step(&x, &with_nan(&y, 5), &mse).unwrap_err();
        assert_eq!(
            (e.stage(), e.micro_batch()),
            (Some(last), Some(2)),
            "{schedule:?}: {e}"
        );
        assert!(
            e.to_string()
                .contains("the loss of micro-batch 2 holds NaN or infinity"),
            "{e}"
        );
        let e = pipe.train_step(&with_nan(&x, 0), &y, &mse).unwrap_err();
        assert_eq!(
            (e.stage(), e.micro_batch()),
            (Some(0), Some(0)),
            "{schedule:?}: {e}"
        );
        assert!(
            e.to_string()
                .contains("the input of micro-batch 0 holds NaN"),
            "{e}"
        );
        assert_eq!(
            grad_snapshot(&pipe.named_parameters()),
            grads,
            "{schedule:?}: gradients changed"
        );

        // Skip: the step runs to its end, names the origin, and leaves the gradients as they were.
        let mut pipe = make(NonFinite::SkipStep);
        pipe.train_step(&x, &y, &mse).unwrap();
        let grads = grad_snapshot(&pipe.named_parameters());
        let r = pipe.train_step(&x, &with_nan(&y, 7), &mse).unwrap();
        let at = r.skipped.expect("the step is skipped");
        assert_eq!(
            (at.stage, at.micro_batch),
            (last, 3),
            "{schedule:?}: {at:?}"
        );
        assert_eq!(grad_snapshot(&pipe.named_parameters()), grads);
        let r = pipe.train_step(&x, &y, &mse).unwrap();
        assert!(r.skipped.is_none());
    }
}

/// A shape error inside a stage names the layer, by global index and name.
#[test]
fn a_shape_error_names_the_layer() {
    let d = Device::cpu();
    let layers: Vec<Box<dyn Module>> = vec![
        Box::new(Linear::new(WIDTH, WIDTH, 1, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(WIDTH + 1, WIDTH, 2, &d).unwrap()),
    ];
    let mut pipe = sim_pipeline(
        layers,
        &PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe).balance(vec![2, 1]),
    );
    let (x, y) = data();
    let e = pipe.train_step(&x, &y, &mse).unwrap_err();
    let msg = e.to_string();
    assert_eq!(e.stage(), Some(1), "{msg}");
    assert!(msg.contains("in layer 2 (Linear("), "{msg}");
}

/// An action past the time limit: `train_step` returns an error naming the stage and action
/// well within a second, the stuck thread finishes on its own, the pipeline refuses to step
/// until it has, and then discards its late results and trains as if the step never ran.
#[test]
fn a_stuck_layer_times_out_and_the_pipeline_recovers() {
    use std::time::Duration;
    let (x, y) = data();
    for schedule in [ScheduleKind::GPipe, ScheduleKind::ZbV] {
        let stage = 1;
        let cfg = PipeCfg::new(K, 4, CheckpointMode::Never, schedule);
        let make = || {
            let (layers, balance, state) = faulty_model(stage, schedule);
            let mut pipe = sim_pipeline(layers, &cfg.clone().balance(balance));
            pipe.set_action_timeout(Some(Duration::from_millis(500)));
            (pipe, state)
        };
        let (mut pipe, state) = make();
        pipe.train_step(&x, &y, &mse).unwrap();
        let params = snapshot(&pipe.named_parameters());
        let grads = grad_snapshot(&pipe.named_parameters());
        state.lock().unwrap().armed = Some((FaultKind::Slow(Duration::from_secs(3)), 2));
        let t0 = Instant::now();
        let e = pipe.train_step(&x, &y, &mse).unwrap_err();
        let took = t0.elapsed();
        let msg = e.to_string();
        eprintln!("{schedule:?}: Err after {took:?}: {msg}");
        assert!(took < Duration::from_secs(1), "{schedule:?}: took {took:?}");
        assert_eq!(
            (e.stage(), e.micro_batch()),
            (Some(stage), Some(2)),
            "{msg}"
        );
        assert!(
            msg.contains("Forward") && msg.contains("past the limit of 500"),
            "{msg}"
        );
        // While the stuck layer sleeps, stepping is refused, saying why.
        let e = pipe.train_step(&x, &y, &mse).unwrap_err();
        assert!(matches!(e, PipelineError::Stuck(_)), "{e}");
        assert!(e.to_string().contains("still running"), "{e}");
        assert!(pipe.optimizer_step().is_err());
        state.lock().unwrap().armed = None;
        let fired = state.lock().unwrap().fired_at.unwrap();
        std::thread::sleep(
            (fired + Duration::from_millis(3300)).saturating_duration_since(Instant::now()),
        );
        pipe.settle().unwrap();
        assert_eq!(
            snapshot(&pipe.named_parameters()),
            params,
            "{schedule:?}: parameters changed"
        );
        assert_eq!(
            grad_snapshot(&pipe.named_parameters()),
            grads,
            "{schedule:?}: late results kept"
        );
        pipe.train_step(&x, &y, &mse).unwrap();
        pipe.optimizer_step().unwrap();
        let (mut clean, _) = make();
        clean.train_step(&x, &y, &mse).unwrap();
        clean.train_step(&x, &y, &mse).unwrap();
        clean.optimizer_step().unwrap();
        assert_eq!(
            snapshot(&pipe.named_parameters()),
            snapshot(&clean.named_parameters())
        );
    }
}

/// One stage fails while another's action runs past the time limit: the error is the failure
/// (the first in time, with its own cause), and it names the action still running; the failed
/// action is never taken for a stuck one.
#[test]
fn the_watchdog_reports_the_first_failure_and_the_action_still_running() {
    let d = Device::cpu();
    // Stage 0 fails 200 ms into its micro-batch 1 (a pause, then an error), while stage 1 has
    // been in its 3 s micro-batch 0 since stage 0 sent it.
    let (pause, pause_state) = Fault::new();
    let (bad, bad_state) = Fault::new();
    let (slow, slow_state) = Fault::new();
    let layers: Vec<Box<dyn Module>> = vec![
        Box::new(Linear::new(WIDTH, WIDTH, 1, &d).unwrap()),
        Box::new(pause),
        Box::new(bad),
        Box::new(Linear::new(WIDTH, WIDTH, 2, &d).unwrap()),
        Box::new(slow),
    ];
    let cfg = PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe).balance(vec![3, 2]);
    let mut pipe = sim_pipeline(layers, &cfg);
    pipe.set_action_timeout(Some(Duration::from_secs(1)));
    let (x, y) = data();
    slow_state.lock().unwrap().armed = Some((FaultKind::Slow(Duration::from_secs(3)), 0));
    pause_state.lock().unwrap().armed = Some((FaultKind::Slow(Duration::from_millis(200)), 1));
    bad_state.lock().unwrap().armed = Some((FaultKind::Error, 1));
    let e = pipe.train_step(&x, &y, &mse).unwrap_err();
    let msg = e.to_string();
    assert_eq!((e.stage(), e.micro_batch()), (Some(0), Some(1)), "{msg}");
    assert!(msg.contains("injected error at micro-batch 1"), "{msg}");
    assert!(msg.contains("in layer 2 (Fault)"), "{msg}");
    assert!(
        msg.contains("stage 1's Forward (1F0) ran on past the action time limit"),
        "{msg}"
    );
    // The slow action's thread still holds stage 1 until its sleep ends; then the pipeline
    // trains again.
    for state in [&pause_state, &bad_state, &slow_state] {
        state.lock().unwrap().armed = None;
    }
    let fired = slow_state.lock().unwrap().fired_at.unwrap();
    std::thread::sleep(
        (fired + Duration::from_millis(3300)).saturating_duration_since(Instant::now()),
    );
    pipe.settle().unwrap();
    pipe.train_step(&x, &y, &mse).unwrap();
}
