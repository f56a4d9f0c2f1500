//! Steps back to back (issue 33): `Pipeline::train_steps` lets a device start the next step as
//! soon as it has applied its own update, validates the step afterwards and rolls a violation
//! back. Each test trains two pipelines built alike for 20 steps, one with `train_steps`, one
//! with the plain loop written out here (`train_step`, `clip_grad_norm`, `optimizer_step`), and
//! asks for the same parameters, buffers, optimizer state, loss scale and losses, bit for bit,
//! and for as many rollbacks as the plain loop met violations (steps that clipped, overflowed or
//! held non-finite values).
//!
//! The pipelines run on real CPU devices (one per stage device, no simulated cluster: that runs
//! one step at a time), so the steps truly overlap on threads.

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use wgpipe_autograd::optim::{clip_factor, AdamW, Optimizer};
use wgpipe_autograd::{CostHint, ForwardCtx, LrSchedule, Module, Param, Var};
use wgpipe_models::{BatchNorm2d, Dropout, Flatten, Linear, Relu};
use wgpipe_pipeline::{
    Balance, CheckpointMode, LinkSpec, LossScaling, NonFinite, Pipeline, PipelineError,
    ScheduleKind, SimCluster, StepPhase, StepsOptions, StepsPath, StepsReport,
};
use wgpipe_tensor::{DType, Device, Result, Tensor};
use wgpipe_tests::*;

const STEPS: u64 = 20;
const M: usize = 4;
const WIDTH: usize = 8;
const HIDDEN: usize = 16;
/// The layer that overflows on its steps (on the second device under every schedule here).
const BOOSTED: usize = 7;

/// Makes its input infinite (x 1e30 twice) in micro-batch 1 of the steps it names: a fault
/// keyed by the step counter, so that a step run again overflows again.
struct Boost {
    steps: BTreeSet<u64>,
}

impl Module for Boost {
    fn name(&self) -> String {
        "Boost".into()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        if ctx.train && ctx.micro_batch == 1 && self.steps.contains(&ctx.step) {
            return x.mul_scalar(1e30)?.mul_scalar(1e30);
        }
        Ok(x.clone())
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        Vec::new()
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint::pass_through(input_shape)
    }
}

/// Ten layers: a batch norm (buffers to roll back; a Flatten in half precision instead), a
/// dropout (masks keyed by the step), three Linear and the boost on the second device.
fn model(boost: &[u64], norm: bool) -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    let first: Box<dyn Module> = if norm {
        Box::new(BatchNorm2d::new(WIDTH, &d).unwrap())
    } else {
        Box::new(Flatten::default())
    };
    let layers: Vec<Box<dyn Module>> = vec![
        first,
        Box::new(Flatten::default()),
        Box::new(Linear::new(WIDTH, HIDDEN, 11, &d).unwrap()),
        Box::new(Relu),
        Box::new(Dropout::new(0.2, 1).unwrap()),
        Box::new(Linear::new(HIDDEN, HIDDEN, 12, &d).unwrap()),
        Box::new(Relu),
        Box::new(Boost {
            steps: boost.iter().copied().collect(),
        }),
        Box::new(Linear::new(HIDDEN, HIDDEN, 13, &d).unwrap()),
        Box::new(Linear::new(HIDDEN, WIDTH, 14, &d).unwrap()),
    ];
    assert_eq!(layers[BOOSTED].name(), "Boost");
    layers
}

struct Setup {
    schedule: ScheduleKind,
    optimizer: fn() -> Box<dyn Optimizer>,
    precision: DType,
    scaling: Option<LossScaling>,
    non_finite: NonFinite,
    boost: Vec<u64>,
    sim: bool,
}

impl Setup {
    fn new(schedule: ScheduleKind) -> Setup {
        Setup {
            schedule,
            optimizer: sgd,
            precision: DType::F32,
            scaling: None,
            non_finite: NonFinite::Error,
            boost: Vec::new(),
            sim: false,
        }
    }

    fn build(&self) -> Pipeline {
        let norm = self.precision == DType::F32;
        let balance = if self.schedule.default_chunks() == 2 {
            vec![3, 2, 2, 3]
        } else {
            vec![5, 5]
        };
        let b = Pipeline::builder(model(&self.boost, norm))
            .balance(Balance::Explicit(balance))
            .micro_batches(M)
            .checkpoint(CheckpointMode::Never)
            .schedule(self.schedule)
            .precision(self.precision)
            .loss_scaling(self.scaling)
            .seed(SEED)
            .optimizer(self.optimizer);
        let b = if self.sim {
            b.sim(SimCluster::uniform(
                &Device::cpu(),
                2,
                u64::MAX,
                1e12,
                LinkSpec::FREE,
            ))
        } else {
            b.devices(vec![Device::new_cpu("b2b-0"), Device::new_cpu("b2b-1")])
        };
        let mut pipe = b.build().unwrap();
        pipe.set_non_finite(self.non_finite);
        pipe
    }
}

fn adamw() -> Box<dyn Optimizer> {
    Box::new(AdamW::new(0.01))
}

/// Step i's mini-batch: 16 samples; every third step's targets are five times larger (larger
/// gradients, so that a clip norm between the two kinds clips some steps and not others).
fn batch(i: u64) -> (Tensor, Tensor) {
    let x = normal_data(&[16, WIDTH, 1, 1], 100 + i);
    let y = normal_data(&[16, WIDTH], 200 + i);
    let y = if i.is_multiple_of(3) {
        y.mul_scalar(5.0).unwrap()
    } else {
        y
    };
    (x, y)
}

/// The loss in f32 whatever the output's dtype.
fn loss(y: &Var, t: &Tensor) -> Result<Var> {
    mse(&y.to_dtype(DType::F32)?, t)
}

fn lr_schedule(done: u64) -> f32 {
    LrSchedule::WarmupCosine {
        warmup_steps: 3,
        total_steps: STEPS,
        min_lr: 0.001,
    }
    .lr_at(0.02, done)
}

/// Everything training leaves, bit for bit: parameters and buffers, every optimizer's step
/// count and state (moments, counters, learning rate), the loss scaler, the step counter.
fn state(pipe: &Pipeline) -> Vec<(String, Vec<u32>)> {
    let bits =
        |t: &Tensor| -> Vec<u32> { t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect() };
    let mut out: Vec<(String, Vec<u32>)> = pipe
        .named_parameters()
        .into_iter()
        .chain(pipe.named_buffers())
        .map(|(n, p)| (n, bits(&p.value())))
        .collect();
    for (i, o) in pipe.optimizers().iter().enumerate() {
        out.push((format!("optimizer {i} steps"), vec![o.steps() as u32]));
        for (n, t) in o.state() {
            out.push((format!("optimizer {i} {n}"), bits(&t)));
        }
    }
    if let Some(s) = pipe.loss_scaler() {
        out.push((
            "scaler".into(),
            vec![s.scale.to_bits(), s.good_steps, s.skipped_steps as u32],
        ));
    }
    out.push(("step".into(), vec![pipe.step_count() as u32]));
    out
}

/// How many steps of the plain loop violated what back to back assumes.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Violations {
    /// Skipped: non-finite values, or an overflow under loss scaling.
    skipped: u64,
    /// Clipped: a clip factor other than 1.
    clipped: u64,
}

impl Violations {
    fn total(&self) -> u64 {
        self.skipped + self.clipped
    }
}

/// The plain loop, written out: learning rate, train_step, clip, optimizer step; a skipped
/// step updates nothing (loss scaling's optimizer_step skips it). Each step's loss bits and
/// the violations.
fn plain_loop(pipe: &mut Pipeline, clip: Option<f32>, lr: bool) -> (Vec<u32>, Violations) {
    let mut losses = Vec::new();
    let mut violations = Violations {
        skipped: 0,
        clipped: 0,
    };
    for i in 0..STEPS {
        if let (true, Some(done)) = (lr, pipe.optimizers().first().map(|o| o.steps())) {
            pipe.set_lr(lr_schedule(done));
        }
        let (x, y) = batch(i);
        let r = pipe.train_step(&x, &y, &loss).unwrap();
        losses.push(r.loss.to_bits());
        if r.skipped.is_some() {
            violations.skipped += 1;
            if pipe.loss_scaler().is_some() {
                pipe.optimizer_step().unwrap();
            } else {
                pipe.zero_grad();
            }
            continue;
        }
        if let Some(c) = clip {
            let norm = pipe.clip_grad_norm(c).unwrap();
            if clip_factor(norm, c) != 1.0 {
                violations.clipped += 1;
            }
        }
        pipe.optimizer_step().unwrap();
    }
    (losses, violations)
}

/// `train_steps` over the same steps: its report and each step's loss bits.
fn steps_loop(
    pipe: &mut Pipeline,
    clip: Option<f32>,
    lr: bool,
    at_a_time: bool,
) -> (StepsReport, Vec<u32>) {
    let mut losses = Vec::new();
    let opts = StepsOptions {
        steps: STEPS,
        clip,
        lr: lr.then_some(&lr_schedule as &dyn Fn(u64) -> f32),
        step_at_a_time: at_a_time,
    };
    let report = pipe
        .train_steps(
            &opts,
            |i| Ok(batch(i)),
            &loss,
            |r| {
                losses.push(r.loss.to_bits());
                ControlFlow::Continue(())
            },
        )
        .unwrap();
    (report, losses)
}

/// Trains `setup` both ways and compares; the plain loop's violation count.
fn compare(setup: &Setup, clip: Option<f32>, lr: bool) -> (StepsReport, Violations) {
    let what = format!("{:?} {:?} clip {clip:?}", setup.schedule, setup.precision);
    let mut plain = setup.build();
    let (plain_losses, violations) = plain_loop(&mut plain, clip, lr);
    let mut b2b = setup.build();
    let (report, losses) = steps_loop(&mut b2b, clip, lr, false);
    assert_eq!(report.steps, STEPS, "{what}");
    assert_eq!(losses, plain_losses, "{what}: losses");
    let (a, b) = (state(&b2b), state(&plain));
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x, y, "{what}: {} differs", x.0);
    }
    if !setup.sim {
        assert_eq!(report.path, StepsPath::BackToBack, "{what}");
        assert_eq!(report.rollbacks, violations.total(), "{what}: rollbacks");
    }
    (report, violations)
}

const SCHEDULES: [ScheduleKind; 3] = [
    ScheduleKind::OneFOneB,
    ScheduleKind::ZbH1,
    ScheduleKind::ZbV,
];

#[test]
fn back_to_back_equals_step_at_a_time_with_sgd_and_adamw() {
    for schedule in SCHEDULES {
        let (r, violations) = compare(&Setup::new(schedule), None, false);
        assert_eq!((r.rollbacks, violations.total()), (0, 0), "{schedule:?}");
        let adam = Setup {
            optimizer: adamw,
            ..Setup::new(schedule)
        };
        compare(&adam, None, true);
    }
}

#[test]
fn clipped_steps_are_rolled_back_and_redone_bit_exactly() {
    for schedule in SCHEDULES {
        let setup = Setup {
            optimizer: adamw,
            ..Setup::new(schedule)
        };
        let (r, violations) = compare(&setup, Some(CLIP), true);
        // Some steps clip (rolled back and redone), others do not (kept as made).
        assert!(
            violations.clipped > 0 && violations.clipped < STEPS,
            "{schedule:?}: {violations:?} of {STEPS} steps at {CLIP}"
        );
        assert_eq!(r.rollbacks, violations.clipped);
    }
}

/// A max-norm between the gradient norms of ordinary steps and those of every third step.
const CLIP: f32 = 1.0;

#[test]
fn f16_loss_scaling_with_an_overflow_matches_step_at_a_time() {
    for schedule in SCHEDULES {
        let setup = Setup {
            precision: DType::F16,
            scaling: Some(LossScaling {
                init_scale: 1024.0,
                growth_interval: 3,
                ..LossScaling::default()
            }),
            boost: vec![5, 12],
            ..Setup::new(schedule)
        };
        let (r, violations) = compare(&setup, None, false);
        // The two injected overflows at least (a scale grown too large may add some).
        assert!(violations.skipped >= 2, "{schedule:?}: {violations:?}");
        assert_eq!(r.rollbacks, violations.skipped);
        // And with clipping of the unscaled gradients.
        let clipped = Setup {
            optimizer: adamw,
            ..setup
        };
        let (_, with_clip) = compare(&clipped, Some(CLIP), true);
        assert!(
            with_clip.skipped >= 2 && with_clip.clipped > 0,
            "{schedule:?}: {with_clip:?}"
        );
    }
}

#[test]
fn an_injected_non_finite_step_is_skipped_alike() {
    for schedule in SCHEDULES {
        let setup = Setup {
            non_finite: NonFinite::SkipStep,
            boost: vec![7],
            ..Setup::new(schedule)
        };
        let (r, violations) = compare(&setup, None, false);
        assert_eq!(
            violations,
            Violations {
                skipped: 1,
                clipped: 0
            },
            "{schedule:?}"
        );
        assert_eq!(r.rollbacks, 1, "{schedule:?}");
    }
}

/// ZB-V on two devices with light stages 0 and 3 on device 0 and heavy stages 1 and 2 on
/// device 1: at the end of a step device 1 still runs its deferred weight parts (Linear(512))
/// when device 0 has done its last action and applied its update.
fn v_model() -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    vec![
        Box::new(Flatten::default()),
        Box::new(Linear::new(WIDTH, 512, 21, &d).unwrap()),
        Box::new(Linear::new(512, 512, 22, &d).unwrap()),
        Box::new(Relu),
        Box::new(Linear::new(512, 512, 23, &d).unwrap()),
        Box::new(Linear::new(512, WIDTH, 24, &d).unwrap()),
    ]
}

/// The clock records show what only back to back does: a device begins a step before another
/// has ended the step before (here device 0, whose last action comes before device 1's
/// deferred weight parts). One step at a time, never. (1F1B cannot overlap so: device 0 both
/// ends a step, with the last backward, and begins the next.)
#[test]
fn steps_overlap_only_back_to_back() {
    let build = || {
        Pipeline::builder(v_model())
            .balance(Balance::Explicit(vec![2, 2, 1, 1]))
            .micro_batches(M)
            .checkpoint(CheckpointMode::Never)
            .schedule(ScheduleKind::ZbV)
            .optimizer(sgd)
            .devices(vec![Device::new_cpu("v-0"), Device::new_cpu("v-1")])
            .build()
            .unwrap()
    };
    let opts = |step_at_a_time| StepsOptions {
        steps: STEPS,
        step_at_a_time,
        ..StepsOptions::default()
    };
    let run = |step_at_a_time| {
        let mut pipe = build();
        let r = pipe
            .train_steps(
                &opts(step_at_a_time),
                |i| {
                    Ok((
                        normal_data(&[64, WIDTH, 1, 1], 300 + i),
                        normal_data(&[64, WIDTH], 400 + i),
                    ))
                },
                &loss,
                |_| ControlFlow::Continue(()),
            )
            .unwrap();
        (r, state(&pipe))
    };
    let (b2b, b2b_state) = run(false);
    let (one, one_state) = run(true);
    assert_eq!(b2b.path, StepsPath::BackToBack);
    assert!(
        b2b.overlapped_steps() >= (STEPS as usize - 1) / 2,
        "{} of {} steps began before the one before them ended: {:?}",
        b2b.overlapped_steps(),
        STEPS - 1,
        b2b.spans
    );
    assert_eq!(
        one.path,
        StepsPath::StepAtATime("asked for (StepsOptions::step_at_a_time)".into())
    );
    assert_eq!(one.overlapped_steps(), 0, "{:?}", one.spans);
    assert!(b2b_state == one_state);
    for r in [&b2b, &one] {
        assert_eq!((r.spans.len(), r.rollbacks), (STEPS as usize, 0));
        assert!(r.bubble_fraction() > 0.0 && r.bubble_fraction() < 1.0);
    }
}

/// Where back to back cannot run (here a simulated cluster) the same call runs one step at a
/// time, says why, and gives the plain loop's results.
#[test]
fn without_back_to_back_the_loop_runs_one_step_at_a_time() {
    let setup = Setup {
        optimizer: adamw,
        sim: true,
        ..Setup::new(ScheduleKind::OneFOneB)
    };
    let (r, _) = compare(&setup, Some(CLIP), true);
    assert_eq!(r.path, StepsPath::StepAtATime("a simulated cluster".into()));
    assert_eq!(r.rollbacks, 0);
}

/// A stop asked by the callback after step 7 (with step 8 in flight) and a mini-batch that
/// cannot be had at step 12 leave the model as the plain loop leaves it after 8 and 12 steps.
#[test]
fn a_stop_and_an_error_leave_the_plain_loops_state() {
    for schedule in SCHEDULES {
        let setup = Setup {
            optimizer: adamw,
            ..Setup::new(schedule)
        };
        let plain_after = |n: u64| {
            let mut p = setup.build();
            for i in 0..n {
                let (x, y) = batch(i);
                p.train_step(&x, &y, &loss).unwrap();
                p.clip_grad_norm(CLIP).unwrap();
                p.optimizer_step().unwrap();
            }
            state(&p)
        };
        let opts = StepsOptions {
            steps: STEPS,
            clip: Some(CLIP),
            ..StepsOptions::default()
        };
        let mut pipe = setup.build();
        let r = pipe
            .train_steps(
                &opts,
                |i| Ok(batch(i)),
                &loss,
                |r| {
                    if r.step == 7 {
                        ControlFlow::Break(())
                    } else {
                        ControlFlow::Continue(())
                    }
                },
            )
            .unwrap();
        assert!(r.stopped && r.steps == 8, "{schedule:?}: {r:?}");
        assert!(state(&pipe) == plain_after(8), "{schedule:?}: stopped");

        let mut pipe = setup.build();
        let e = pipe
            .train_steps(
                &opts,
                |i| {
                    if i == 12 {
                        Err(PipelineError::Config("no batch 12".into()))
                    } else {
                        Ok(batch(i))
                    }
                },
                &loss,
                |_| ControlFlow::Continue(()),
            )
            .unwrap_err();
        assert_eq!((e.index, e.phase), (12, StepPhase::Batch), "{e}");
        assert_eq!(
            e.to_string(),
            "the mini-batch of step 12: pipeline configuration: no batch 12"
        );
        assert!(state(&pipe) == plain_after(12), "{schedule:?}: failed");
    }
}
