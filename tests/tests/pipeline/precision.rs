//! Mixed precision in the pipeline (issue 13): the compute dtype reaches every stage, dynamic
//! loss scaling skips an overflowed step on every stage alike without any extra message, and
//! half tensors halve the bytes on the links.
//!
//! The layers here cast themselves (input and a half copy of their f32 weights to
//! `ctx.compute`), so these tests do not depend on the models' own autocast policy.

use std::sync::{Arc, Mutex};

use wgpipe_autograd::{CostHint, ForwardCtx, Module, Param, Var};
use wgpipe_pipeline::{
    CheckpointMode, LinkSpec, LossScaling, Pipeline, ScheduleKind, StepReport, Transport,
};
use wgpipe_tensor::{DType, Device, Result, Tensor};
use wgpipe_tests::*;

const WIDTH: usize = 8;
const LAYERS: usize = 8;
const K: usize = 2;
const M: usize = 4;
/// The layer whose output overflows when armed (on a later stage than the first under every
/// schedule here: layer 5 of 8 is on stage 1 of 2, or stage 2 of 4 with two chunks).
const BOOSTED: usize = 5;

/// Which micro-batch the boosted layer overflows on (none when `None`).
type Trigger = Arc<Mutex<Option<usize>>>;

/// `tanh(x W^T + b)` computed in `ctx.compute`: the input and half copies of the f32 weights
/// are cast to it and the output stays in it, so half tensors cross stage boundaries. When its
/// trigger names the micro-batch, the output is multiplied by 1e30 twice: an overflow in any
/// dtype.
struct AutocastLinear {
    weight: Param,
    bias: Param,
    trigger: Option<Trigger>,
}

impl AutocastLinear {
    fn new(seed: u64, trigger: Option<Trigger>) -> AutocastLinear {
        let d = Device::cpu();
        let b = 1.0 / (WIDTH as f32).sqrt();
        AutocastLinear {
            weight: Param::new(
                "weight",
                Tensor::rand_uniform(&[WIDTH, WIDTH], -b, b, seed, &d).unwrap(),
            ),
            bias: Param::new(
                "bias",
                Tensor::rand_uniform(&[WIDTH], -b, b, seed + 1000, &d).unwrap(),
            ),
            trigger,
        }
    }
}

impl Module for AutocastLinear {
    fn name(&self) -> String {
        "AutocastLinear".into()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let t = x.tape();
        let x = x.to_dtype(ctx.compute)?;
        let w = t.stored_param(&self.weight).to_dtype(ctx.compute)?;
        let b = t.stored_param(&self.bias).to_dtype(ctx.compute)?;
        let y = x.matmul(&w.t()?)?.add(&b)?.tanh()?;
        let armed = self
            .trigger
            .as_ref()
            .is_some_and(|t| *t.lock().unwrap() == Some(ctx.micro_batch as usize));
        if armed {
            return y.mul_scalar(1e30)?.mul_scalar(1e30);
        }
        Ok(y)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![
            ("weight".into(), self.weight.clone()),
            ("bias".into(), self.bias.clone()),
        ]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        let rows: usize = input_shape[..input_shape.len() - 1].iter().product();
        CostHint {
            param_bytes: 4 * (WIDTH * WIDTH + WIDTH),
            flops: (2 * rows * WIDTH * WIDTH) as f64,
            activation_bytes: 4 * rows * WIDTH,
            output_shape: input_shape.to_vec(),
        }
    }
}

fn model(trigger: &Trigger) -> Vec<Box<dyn Module>> {
    (0..LAYERS)
        .map(|i| {
            let t = (i == BOOSTED).then(|| trigger.clone());
            Box::new(AutocastLinear::new(40 + i as u64, t)) as Box<dyn Module>
        })
        .collect()
}

/// The loss in f32 whatever the output's dtype (as autocast keeps losses).
fn mse_f32(y: &Var, t: &Tensor) -> Result<Var> {
    mse(&y.to_dtype(DType::F32)?, t)
}

fn data() -> (Tensor, Tensor) {
    (normal_data(&[8, WIDTH], 1), normal_data(&[8, WIDTH], 2))
}

fn cfg(schedule: ScheduleKind, mode: CheckpointMode, precision: DType) -> PipeCfg {
    PipeCfg {
        precision,
        ..PipeCfg::new(K, M, mode, schedule)
    }
}

/// An optimizer's step count and its state tensors' bits, by name.
type OptimizerBits = (u64, Vec<(String, Vec<u32>)>);

/// Every optimizer's step count and state, bit for bit.
fn optimizer_snapshot(pipe: &Pipeline) -> Vec<OptimizerBits> {
    pipe.optimizers()
        .iter()
        .map(|o| {
            let state = o
                .state()
                .into_iter()
                .map(|(n, t)| (n, t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()))
                .collect();
            (o.steps(), state)
        })
        .collect()
}

fn step(pipe: &mut Pipeline, x: &Tensor, y: &Tensor) -> StepReport {
    let r = pipe.train_step(x, y, &mse_f32).unwrap();
    pipe.optimizer_step().unwrap();
    r
}

/// The stage that holds `layer`.
fn stage_of(pipe: &Pipeline, layer: usize) -> usize {
    pipe.stages()
        .iter()
        .find(|s| (s.first_layer..s.first_layer + s.layers.len()).contains(&layer))
        .unwrap()
        .index
}

/// An overflow in one micro-batch on one stage, in f16 and bf16 (whose scaling is turned on
/// here) under every schedule, with and without re-materialization: the step is skipped on
/// every stage (parameters and optimizer state bit-unchanged, optimizer steps not counted),
/// the scale halves, and the next steps train at the halved scale.
#[test]
fn an_overflow_on_one_stage_skips_the_step_everywhere_and_halves_the_scale() {
    let (x, y) = data();
    for precision in [DType::F16, DType::BF16] {
        for schedule in ScheduleKind::ALL {
            if !runs(schedule, K, M, LAYERS) {
                continue;
            }
            for mode in [CheckpointMode::ExceptLast, CheckpointMode::Always] {
                let what = format!("{precision:?} {schedule:?} {mode:?}");
                let trigger: Trigger = Arc::new(Mutex::new(None));
                let mut cfg = cfg(schedule, mode, precision);
                if precision == DType::BF16 {
                    cfg.loss_scaling = Some(Some(LossScaling::default()));
                }
                let mut pipe = sim_pipeline(model(&trigger), &cfg);
                let first = step(&mut pipe, &x, &y);
                assert!(first.skipped.is_none(), "{what}: {:?}", first.skipped);
                let scale = pipe.loss_scaler().expect("loss scaling is on").scale;
                assert_eq!(first.loss_scale, Some(65536.0), "{what}");
                let params = snapshot(&pipe.named_parameters());
                let state = optimizer_snapshot(&pipe);

                *trigger.lock().unwrap() = Some(2);
                let r = step(&mut pipe, &x, &y);
                *trigger.lock().unwrap() = None;
                let at = r.skipped.expect("the overflowed step is skipped");
                assert_eq!(
                    (at.stage, at.micro_batch),
                    (stage_of(&pipe, BOOSTED), 2),
                    "{what}: {at:?}"
                );
                assert_eq!(
                    snapshot(&pipe.named_parameters()),
                    params,
                    "{what}: parameters"
                );
                assert_eq!(optimizer_snapshot(&pipe), state, "{what}: optimizer state");
                let s = pipe.loss_scaler().unwrap();
                assert_eq!((s.scale, s.skipped_steps), (scale / 2.0, 1), "{what}");

                for _ in 0..2 {
                    let before = snapshot(&pipe.named_parameters());
                    let r = step(&mut pipe, &x, &y);
                    assert!(r.skipped.is_none(), "{what}: {:?}", r.skipped);
                    assert!(r.loss.is_finite(), "{what}");
                    let after = snapshot(&pipe.named_parameters());
                    // Every stage trains: each parameter moved.
                    for ((name, a), (_, b)) in after.iter().zip(&before) {
                        assert_ne!(a, b, "{what}: {name} did not change");
                    }
                }
                assert_eq!(pipe.loss_scaler().unwrap().scale, scale / 2.0, "{what}");
            }
        }
    }
}

/// A scale too large for f16 makes the backward overflow (the loss gradient rounded to f16 is
/// infinite): the scaler backs off step after step, each skipped step changing nothing, until
/// the gradients fit; then training goes on. The overflow is found in the backward, where the
/// verdict travels toward stage 0, and in the parameter gradients checked at the end of each
/// device's step (which, under split backward, finish after the last gradient sent). Every
/// schedule computes the same values per micro-batch, so all skip the same number of steps.
#[test]
fn a_scale_too_large_for_f16_backs_off_until_the_backward_fits() {
    let (x, y) = data();
    let mut counts = Vec::new();
    for schedule in ScheduleKind::ALL {
        if !runs(schedule, K, M, LAYERS) {
            continue;
        }
        let trigger: Trigger = Arc::new(Mutex::new(None));
        let mut cfg = cfg(schedule, CheckpointMode::ExceptLast, DType::F16);
        cfg.loss_scaling = Some(Some(LossScaling {
            init_scale: 2f32.powi(40),
            ..LossScaling::default()
        }));
        let mut pipe = sim_pipeline(model(&trigger), &cfg);
        let params = snapshot(&pipe.named_parameters());
        let mut skipped = 0u32;
        loop {
            let r = step(&mut pipe, &x, &y);
            if r.skipped.is_none() {
                break;
            }
            skipped += 1;
            assert!(skipped < 40, "{schedule:?}: never fits");
            assert_eq!(snapshot(&pipe.named_parameters()), params, "{schedule:?}");
            assert!(pipe.optimizers().iter().all(|o| o.steps() == 0));
            assert_eq!(
                pipe.loss_scaler().unwrap().scale,
                2f32.powi(40 - skipped as i32),
                "{schedule:?}"
            );
        }
        assert!(skipped >= 20, "{schedule:?}: only {skipped} steps skipped");
        assert_ne!(snapshot(&pipe.named_parameters()), params, "{schedule:?}");
        counts.push((schedule, skipped));
    }
    eprintln!("skipped steps by schedule: {counts:?}");
    assert!(counts.iter().all(|&(_, n)| n == counts[0].1), "{counts:?}");
}

/// The scale grows by the growth factor after `growth_interval` good optimizer steps in a row,
/// and an overflow restarts the count.
#[test]
fn the_scale_grows_after_the_interval_of_good_steps() {
    let (x, y) = data();
    let trigger: Trigger = Arc::new(Mutex::new(None));
    let mut cfg = cfg(ScheduleKind::OneFOneB, CheckpointMode::Never, DType::F16);
    cfg.loss_scaling = Some(Some(LossScaling {
        init_scale: 64.0,
        growth_interval: 2,
        ..LossScaling::default()
    }));
    let mut pipe = sim_pipeline(model(&trigger), &cfg);
    let mut scales = Vec::new();
    for i in 0..7 {
        *trigger.lock().unwrap() = (i == 3).then_some(1);
        let r = step(&mut pipe, &x, &y);
        assert_eq!(r.skipped.is_some(), i == 3);
        scales.push(pipe.loss_scaler().unwrap().scale);
    }
    // Two good steps: x2; one more good step, then an overflow: /2; two good steps: x2; one.
    assert_eq!(scales, [64.0, 128.0, 128.0, 64.0, 64.0, 128.0, 128.0]);
}

/// In f32 with scaling on, a power-of-two scale is exact through every op and so is the
/// unscaling: training with it equals training without it bit for bit, clipping included
/// (unscaling and clipping are one pass), while the scale changes (growth every step).
#[test]
fn scaled_f32_training_equals_unscaled_training() {
    let (x, y) = (normal_data(&[8, 6], 1), normal_data(&[8, 3], 2));
    for schedule in [
        ScheduleKind::GPipe,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
    ] {
        let run = |scaling: Option<LossScaling>| {
            let cfg = PipeCfg {
                loss_scaling: Some(scaling),
                ..PipeCfg::new(K, M, CheckpointMode::ExceptLast, schedule)
            };
            let mut pipe = sim_pipeline(mlp(6, 8, 3, 11), &cfg);
            let mut losses = Vec::new();
            for i in 0..4 {
                let r = pipe.train_step(&x, &y, &mse).unwrap();
                assert!(r.skipped.is_none());
                losses.push(r.loss.to_bits());
                if i % 2 == 1 {
                    // Small enough to clip.
                    pipe.clip_grad_norm(0.05).unwrap();
                }
                pipe.optimizer_step().unwrap();
            }
            (
                losses,
                snapshot(&pipe.named_parameters()),
                pipe.loss_scaler(),
            )
        };
        let (plain_losses, plain, none) = run(None);
        assert!(none.is_none());
        let (losses, scaled, scaler) = run(Some(LossScaling {
            init_scale: 1024.0,
            growth_interval: 1,
            ..LossScaling::default()
        }));
        assert_eq!(scaler.unwrap().scale, 1024.0 * 16.0);
        assert_eq!(losses, plain_losses, "{schedule:?}: losses");
        assert_eq!(scaled, plain, "{schedule:?}: parameters");
    }
}

/// Half links: f16 or bf16 activations and gradients take half the bytes of f32 on every link,
/// in the stages' counters and in the simulated link time (the bandwidth term halves). Over
/// the wire format (Loopback) the half tensors arrive bit-identical.
#[test]
fn half_links_halve_the_bytes_sent_and_the_simulated_link_time() {
    let (x, y) = data();
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e6,
        latency_sec: 0.0,
    };
    let run = |precision: DType, transport: Transport| {
        let trigger: Trigger = Arc::new(Mutex::new(None));
        let cfg = PipeCfg {
            link,
            transport,
            loss_scaling: Some(None),
            ..cfg(
                ScheduleKind::OneFOneB,
                CheckpointMode::ExceptLast,
                precision,
            )
        };
        let mut pipe = sim_pipeline(model(&trigger), &cfg);
        let r = step(&mut pipe, &x, &y);
        let link_secs: f64 = r
            .simulated
            .as_ref()
            .unwrap()
            .timeline
            .events
            .iter()
            .filter(|e| e.peer.is_some())
            .map(|e| e.end - e.start)
            .sum();
        (
            r.bytes_sent(),
            link_secs,
            snapshot(&pipe.named_parameters()),
        )
    };
    let (bytes32, secs32, _) = run(DType::F32, Transport::Channels);
    // 8 rows x 8 floats, each way, per micro-batch... counted, not assumed:
    assert!(bytes32 > 0 && secs32 > 0.0);
    for half in [DType::F16, DType::BF16] {
        let (bytes, secs, params) = run(half, Transport::Channels);
        assert_eq!(bytes * 2, bytes32, "{half:?}");
        assert!(
            (secs * 2.0 - secs32).abs() <= 1e-12 * secs32,
            "{half:?}: {secs} s vs f32 {secs32} s"
        );
        let (wire_bytes, _, wire_params) = run(half, Transport::Loopback);
        assert_eq!(wire_bytes, bytes, "{half:?}");
        assert_eq!(wire_params, params, "{half:?}: the wire changed values");
    }
}

/// Loss scaling adds no message: with it on, every stage sends exactly the messages it sends
/// with it off (one per send action of the schedule), on a good step and on an overflowed one.
#[test]
fn loss_scaling_sends_no_extra_message() {
    let (x, y) = data();
    for schedule in [ScheduleKind::GPipe, ScheduleKind::ZbH1, ScheduleKind::ZbV] {
        let run = |scaling: Option<LossScaling>, overflow: bool| {
            let trigger: Trigger = Arc::new(Mutex::new(None));
            let cfg = PipeCfg {
                loss_scaling: Some(scaling),
                ..cfg(schedule, CheckpointMode::ExceptLast, DType::F16)
            };
            let mut pipe = sim_pipeline(model(&trigger), &cfg);
            if overflow {
                *trigger.lock().unwrap() = Some(0);
            }
            let r = step(&mut pipe, &x, &y);
            assert_eq!(r.skipped.is_some(), overflow);
            let sends: usize = pipe
                .schedule()
                .devices
                .iter()
                .flatten()
                .filter(|a| a.kind.is_send())
                .count();
            let messages: Vec<u64> = r.stages.iter().map(|s| s.messages_sent).collect();
            assert_eq!(messages.iter().sum::<u64>(), sends as u64, "{schedule:?}");
            messages
        };
        let off = run(None, false);
        assert_eq!(
            run(Some(LossScaling::default()), false),
            off,
            "{schedule:?}"
        );
        assert_eq!(run(Some(LossScaling::default()), true), off, "{schedule:?}");
    }
}

/// Data parallelism: an overflow on one replica only (a huge input in its shard, infinite
/// once cast to f16) skips the step on every replica; all stay bit-identical and unchanged, and
/// the one scaler (replica 0's) halves.
#[test]
fn replicas_agree_on_a_skip() {
    let (x, y) = data();
    let make = || {
        let trigger: Trigger = Arc::new(Mutex::new(None));
        model(&trigger)
    };
    let cfg = PipeCfg {
        m: 2,
        ..cfg(ScheduleKind::GPipe, CheckpointMode::ExceptLast, DType::F16)
    };
    let mut pipe = dp_sim_pipeline(2, make, &cfg).unwrap();
    step(&mut pipe, &x, &y);
    let params = snapshot(&pipe.named_parameters());
    let scale = pipe.loss_scaler().unwrap().scale;
    // Row 7 is in replica 1's shard (rows 4..8).
    let mut v = x.to_vec().unwrap();
    v[7 * WIDTH] = 1e6;
    let bad = Tensor::from_vec(v, x.shape(), &Device::cpu()).unwrap();
    let r = step(&mut pipe, &bad, &y);
    assert!(r.skipped.is_some());
    assert_eq!(snapshot(&pipe.named_parameters()), params);
    assert_eq!(snapshot(&pipe.replicas()[1].named_parameters()), params);
    assert_eq!(pipe.loss_scaler().unwrap().scale, scale / 2.0);
    let r = step(&mut pipe, &x, &y);
    assert!(r.skipped.is_none());
    assert_ne!(snapshot(&pipe.named_parameters()), params);
    assert_eq!(
        snapshot(&pipe.replicas()[1].named_parameters()),
        snapshot(&pipe.named_parameters())
    );
}

/// Clipping unscales the gradients; a further `train_step` before the optimizer step would mix
/// scaled and unscaled gradients, and is refused with an error saying what to do.
#[test]
fn accumulating_after_clipping_a_scaled_step_is_refused() {
    let (x, y) = data();
    let trigger: Trigger = Arc::new(Mutex::new(None));
    let mut pipe = sim_pipeline(
        model(&trigger),
        &cfg(ScheduleKind::GPipe, CheckpointMode::Never, DType::F16),
    );
    pipe.train_step(&x, &y, &mse_f32).unwrap();
    // Accumulating at the same scale is fine.
    pipe.train_step(&x, &y, &mse_f32).unwrap();
    pipe.clip_grad_norm(1.0).unwrap();
    let e = pipe.train_step(&x, &y, &mse_f32).unwrap_err().to_string();
    assert!(e.contains("call optimizer_step"), "{e}");
    pipe.optimizer_step().unwrap();
    pipe.train_step(&x, &y, &mse_f32).unwrap();
}

/// The planner profiles the layers in the pipeline's precision: layers that compute in half
/// hand half outputs on, so the cost model's link bytes (and stashes) are half of f32's.
#[test]
fn the_planner_profiles_in_the_pipelines_precision() {
    use wgpipe_pipeline::plan::{profile_layers_timed, ProfileRun};
    let (x, y) = data();
    let profile = |compute: DType| {
        let trigger: Trigger = Arc::new(Mutex::new(None));
        let mut layers = model(&trigger);
        let run = ProfileRun { reps: 0, compute };
        profile_layers_timed(&mut layers, &x, &y, &mse_f32, None, &Device::cpu(), run).unwrap()
    };
    let (full, half) = (profile(DType::F32), profile(DType::F16));
    for (i, (f, h)) in full.layers.iter().zip(&half.layers).enumerate() {
        assert!(f.output_bytes.bytes(4) > 0);
        assert_eq!(
            h.output_bytes.bytes(4) * 2,
            f.output_bytes.bytes(4),
            "layer {i}"
        );
    }
}

/// `y = x + 1e4 w` in `ctx.compute`, with `w` a zero vector: the identity in the forward, but
/// the gradient of `w` is 1e4 x the summed output gradient, which overflows f16 under a loss
/// scale of 2^16 while the input gradient does not.
struct WeightGradBoost {
    w: Param,
}

impl Module for WeightGradBoost {
    fn name(&self) -> String {
        "WeightGradBoost".into()
    }
    fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let w = x.tape().stored_param(&self.w).to_dtype(ctx.compute)?;
        x.to_dtype(ctx.compute)?.add(&w.mul_scalar(1e4)?)
    }
    fn parameters(&self) -> Vec<(String, Param)> {
        vec![("w".into(), self.w.clone())]
    }
    fn cost(&self, input_shape: &[usize]) -> CostHint {
        CostHint {
            param_bytes: 4 * WIDTH,
            flops: input_shape.iter().product::<usize>() as f64,
            activation_bytes: 0,
            output_shape: input_shape.to_vec(),
        }
    }
}

/// An overflow only in a parameter gradient of stage 0: no gradient message leaves stage 0, and
/// under split backward (zero-bubble schedules) its weight gradients finish after every input
/// gradient was sent. The verdict reaches the step through the outcome each device reports at
/// the end of the step: the step is skipped on every stage, naming the parameter.
#[test]
fn an_overflow_in_stage_0s_weight_gradients_alone_skips_the_step() {
    let (x, y) = data();
    for schedule in ScheduleKind::ALL {
        if !runs(schedule, K, M, LAYERS + 1) {
            continue;
        }
        let trigger: Trigger = Arc::new(Mutex::new(None));
        let mut layers = model(&trigger);
        layers.insert(
            0,
            Box::new(WeightGradBoost {
                w: Param::new("w", Tensor::zeros(&[WIDTH], &Device::cpu()).unwrap()),
            }),
        );
        let mut pipe = sim_pipeline(
            layers,
            &cfg(schedule, CheckpointMode::ExceptLast, DType::F16),
        );
        let params = snapshot(&pipe.named_parameters());
        let r = step(&mut pipe, &x, &y);
        let at = r.skipped.expect("the overflowed step is skipped");
        assert_eq!(at.stage, 0, "{schedule:?}: {at:?}");
        assert!(
            at.what.contains("the gradient of w in layer 0"),
            "{schedule:?}: {}",
            at.what
        );
        assert_eq!(snapshot(&pipe.named_parameters()), params, "{schedule:?}");
        assert!(pipe.optimizers().iter().all(|o| o.steps() == 0));
        assert_eq!(pipe.loss_scaler().unwrap().scale, 32768.0, "{schedule:?}");
    }
}

/// A checkpoint keeps the loss scaler's state: training resumed from it at step 4 (after an
/// overflow, a growth and one more good step) continues exactly as the uninterrupted run, scale included.
#[test]
fn a_checkpoint_resumes_the_loss_scale_bit_exactly() {
    use wgpipe_pipeline::{LoadOptions, SaveOptions};
    let (x, y) = data();
    let trigger: Trigger = Arc::new(Mutex::new(None));
    let mut cfg = cfg(
        ScheduleKind::OneFOneB,
        CheckpointMode::ExceptLast,
        DType::F16,
    );
    cfg.loss_scaling = Some(Some(LossScaling {
        init_scale: 256.0,
        growth_interval: 2,
        ..LossScaling::default()
    }));
    let path = std::env::temp_dir().join(format!(
        "wgpipe-precision-{}/scaler.safetensors",
        std::process::id()
    ));
    let mut run = sim_pipeline(model(&trigger), &cfg);
    for i in 0..6 {
        if i == 4 {
            run.save(&path, &SaveOptions::default()).unwrap();
        }
        *trigger.lock().unwrap() = (i == 0).then_some(3);
        step(&mut run, &x, &y);
    }
    // Overflow at step 0 (128), two good steps (256), one more: the state saved before step 4
    // has one good step counted, which the resumed run must know to grow after step 4.
    let end = run.loss_scaler().unwrap();
    assert_eq!((end.scale, end.skipped_steps), (512.0, 1));

    let fresh: Trigger = Arc::new(Mutex::new(None));
    let mut resumed = sim_pipeline(model(&fresh), &cfg);
    resumed.load(&path, &LoadOptions::default()).unwrap();
    let saved = resumed.loss_scaler().unwrap();
    assert_eq!(
        (saved.scale, saved.good_steps, saved.skipped_steps),
        (256.0, 1, 1)
    );
    for _ in 4..6 {
        step(&mut resumed, &x, &y);
    }
    assert_eq!(resumed.loss_scaler(), run.loss_scaler());
    assert_eq!(
        snapshot(&resumed.named_parameters()),
        snapshot(&run.named_parameters())
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// The per-stage report counts memory by dtype: a half run's stages hold f16 (or bf16) bytes
/// and no bytes of the other half dtype; an f32 run holds none in half. The table shows them.
#[test]
fn the_stage_report_shows_memory_by_dtype() {
    let (x, y) = data();
    let run = |precision: DType| {
        let trigger: Trigger = Arc::new(Mutex::new(None));
        let cfg = cfg(ScheduleKind::OneFOneB, CheckpointMode::Never, precision);
        let mut pipe = sim_pipeline(model(&trigger), &cfg);
        step(&mut pipe, &x, &y)
    };
    let r32 = run(DType::F32);
    for st in &r32.stages {
        assert!(
            st.memory.peak_of_dtype(DType::F32) > 0,
            "stage {}",
            st.stage
        );
        assert_eq!(st.memory.peak_of_dtype(DType::F16), 0, "stage {}", st.stage);
        assert_eq!(
            st.memory.peak_of_dtype(DType::BF16),
            0,
            "stage {}",
            st.stage
        );
    }
    for (half, other) in [(DType::F16, DType::BF16), (DType::BF16, DType::F16)] {
        let r = run(half);
        for st in &r.stages {
            assert!(
                st.memory.peak_of_dtype(half) > 0,
                "{half:?} stage {}",
                st.stage
            );
            assert_eq!(
                st.memory.peak_of_dtype(other),
                0,
                "{half:?} stage {}",
                st.stage
            );
            // Master weights and optimizer state stay f32.
            assert!(
                st.memory.peak_of_dtype(DType::F32) > 0,
                "{half:?} stage {}",
                st.stage
            );
        }
        assert!(r.stage_table().contains("peak f32 / f16 / bf16 MiB"));
    }
}
