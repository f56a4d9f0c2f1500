//! Optimizers against hand-computed updates and an independent f64 reference, gradient
//! clipping, learning-rate schedules and the loss-scaling rule of gradient accumulation.

use wgpipe_autograd::optim::{
    clip_factor, clip_grad_norm, grad_norm_sq, loss_scale, scale_grads, zero_grad, Adam,
    AdamConfig, AdamW, LrSchedule, Optimizer, Sgd, SgdConfig,
};
use wgpipe_autograd::{Param, Tape};
use wgpipe_tensor::{Device, Result, Tag, Tensor};

fn named(name: &str, values: &[f32], shape: &[usize], dev: &Device) -> (String, Param) {
    let t = Tensor::from_slice(values, shape, dev).unwrap();
    (name.to_string(), Param::new(name, t))
}

fn set_grad(p: &Param, g: &[f32]) {
    let t = Tensor::from_slice(g, &p.shape(), &p.device()).unwrap();
    p.set_grad(Some(t));
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (error {err:e})\n got {got:?}\nwant {want:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Three steps against values computed by hand (in f64, from the PyTorch update rules).
// ---------------------------------------------------------------------------------------------

const W0: [f32; 3] = [1.0, -2.0, 0.5];
const G: [[f32; 3]; 3] = [[0.5, -1.0, 2.0], [0.1, 0.3, -0.4], [-0.2, 0.0, 1.0]];

fn three_steps(opt: &mut dyn Optimizer) -> Vec<Vec<f32>> {
    let dev = Device::new_cpu("hand");
    let params = vec![named("w", &W0, &[3], &dev)];
    let mut out = Vec::new();
    for g in G {
        zero_grad(&params);
        set_grad(&params[0].1, &g);
        opt.step(&params).unwrap();
        out.push(params[0].1.value().to_vec().unwrap());
    }
    assert_eq!(opt.steps(), 3);
    out
}

fn check_three(what: &str, opt: &mut dyn Optimizer, want: [[f64; 3]; 3]) {
    let got = three_steps(opt);
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(&format!("{what} step {}", s + 1), g, &w, 1e-6);
    }
}

#[test]
fn sgd_plain_by_hand() {
    // w -= 0.1 g
    check_three(
        "sgd",
        &mut Sgd::new(0.1),
        [[0.95, -1.9, 0.3], [0.94, -1.93, 0.34], [0.96, -1.93, 0.24]],
    );
}

#[test]
fn sgd_momentum_by_hand() {
    // buf1 = g1 = [.5,-1,2]; w1 = [.95,-1.9,.3]
    // buf2 = .9 buf1 + g2 = [.55,-.6,1.4]; w2 = w1 - .1 buf2 = [.895,-1.84,.16]
    // buf3 = .9 buf2 + g3 = [.295,-.54,2.26]; w3 = [.8655,-1.786,-.066]
    check_three(
        "sgd momentum",
        &mut Sgd::new(0.1).with_momentum(0.9),
        [
            [0.95, -1.9, 0.3],
            [0.895, -1.84, 0.16],
            [0.8655, -1.786, -0.066],
        ],
    );
}

#[test]
fn sgd_nesterov_weight_decay_by_hand() {
    // d = g + .1 w; buf = d (first) / .9 buf + d; step direction d + .9 buf.
    // Step 1: d = [.6,-1.2,2.05], buf = d, dir = 1.9 d = [1.14,-2.28,3.895], w = [.886,-1.772,.1105]
    check_three(
        "sgd nesterov+wd",
        &mut Sgd::new(0.1)
            .with_momentum(0.9)
            .with_nesterov(true)
            .with_weight_decay(0.1),
        [
            [0.886, -1.772, 0.1105],
            [0.801566, -1.698132, 0.0183505],
            [0.765319646, -1.588334292, -0.2899382095],
        ],
    );
}

#[test]
fn sgd_dampening_weight_decay_by_hand() {
    // The first buffer is not dampened (PyTorch): buf1 = g1 + .01 w0.
    check_three(
        "sgd dampening+wd",
        &mut Sgd::with_config(SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.5,
            weight_decay: 0.01,
            nesterov: false,
        }),
        [
            [0.949, -1.898, 0.2995],
            [0.8976255, -1.820251, 0.13890025],
            [0.86093963725, -1.7493667745, -0.055708975125],
        ],
    );
}

#[test]
fn adam_bias_correction_by_hand() {
    // Step 1: m = .1 g, v = .001 g^2, m/bc1 = g, sqrt(v/bc2) = |g|: w -= .1 * g/(|g| + 1e-8).
    check_three(
        "adam",
        &mut Adam::new(0.1),
        [
            [0.900000002, -1.900000001, 0.4000000005],
            [0.8196959063846518, -1.8572151424292265, 0.3488973931360799],
            [0.785260531835489, -1.8241423228510014, 0.28529093149382423],
        ],
    );
    // Betas far from 1 and a large eps make every term of the update visible.
    check_three(
        "adam betas/eps",
        &mut Adam::new(0.01).with_betas(0.5, 0.6).with_eps(0.1),
        [
            [0.9916666666666667, -1.990909090909091, 0.49047619047619045],
            [0.9860607616217857, -1.9891470453246693, 0.4875455966043229],
            [0.9864538574607749, -1.9881258925504588, 0.48154264940772773],
        ],
    );
}

#[test]
fn adam_l2_weight_decay_by_hand() {
    check_three(
        "adam wd",
        &mut Adam::new(0.1).with_weight_decay(0.1),
        [
            [0.9000000016666666, -1.9000000008333333, 0.4000000004878049],
            [0.8136483454297575, -1.8400703555381717, 0.34688211681192477],
            [0.7598997572221902, -1.7846241917957342, 0.28166243198478264],
        ],
    );
}

#[test]
fn adamw_decoupled_weight_decay_by_hand() {
    // Step 1: w = w0 (1 - .1 * .1) - .1 g/|g| = [.89,-1.88,.395]
    check_three(
        "adamw",
        &mut AdamW::new(0.1).with_weight_decay(0.1),
        [
            [0.890000002, -1.880000001, 0.3950000005],
            [0.8007959063646517, -1.8184151424192265, 0.3399473931310799],
            [0.7583525727518423, -1.7671581714168092, 0.2729414575575134],
        ],
    );
    assert_eq!(AdamW::new(1e-3).config().weight_decay, 0.01);
    assert_eq!(Adam::new(1e-3).config().weight_decay, 0.0);
}

#[test]
fn params_without_grad_or_frozen_are_skipped() {
    let dev = Device::new_cpu("skip");
    let params = vec![
        named("a", &[1.0, 2.0], &[2], &dev),
        named("b", &[3.0, 4.0], &[2], &dev),
        named("c", &[5.0, 6.0], &[2], &dev),
    ];
    set_grad(&params[0].1, &[1.0, 1.0]);
    set_grad(&params[2].1, &[1.0, 1.0]);
    params[2].1.set_trainable(false);
    let mut opt = Adam::new(0.1);
    opt.step(&params).unwrap();
    assert_eq!(params[1].1.value().to_vec().unwrap(), [3.0, 4.0]);
    assert_eq!(params[2].1.value().to_vec().unwrap(), [5.0, 6.0]);
    assert_ne!(params[0].1.value().to_vec().unwrap(), [1.0, 2.0]);
    let keys: Vec<String> = opt.state().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        ["@lr", "@steps", "a.exp_avg", "a.exp_avg_sq", "a.step"]
    );

    // As in PyTorch, a parameter's Adam step count only advances when it is updated: `b` joins
    // late and gets the bias correction of its own first step (an update of exactly lr * sign).
    set_grad(&params[1].1, &[0.5, -0.25]);
    opt.step(&params).unwrap();
    assert_close(
        "late b",
        &params[1].1.value().to_vec().unwrap(),
        &[2.9, 4.1],
        1e-6,
    );
    let state = opt.state();
    let step_of = |k: &str| {
        state
            .iter()
            .find(|(n, _)| n == k)
            .unwrap()
            .1
            .to_vec()
            .unwrap()
    };
    assert_eq!(step_of("a.step"), [0.0, 2.0]);
    assert_eq!(step_of("b.step"), [0.0, 1.0]);
    assert_eq!(step_of("@steps"), [0.0, 2.0]);
}

#[test]
fn tied_parameter_listed_twice_is_updated_once() {
    let dev = Device::new_cpu("tied");
    let (_, p) = named("embed.weight", &[1.0, 1.0], &[2], &dev);
    let params = vec![
        ("embed.weight".to_string(), p.clone()),
        ("head.weight".to_string(), p.clone()),
    ];
    set_grad(&p, &[1.0, 2.0]);
    Sgd::new(0.5).step(&params).unwrap();
    assert_eq!(p.value().to_vec().unwrap(), [0.5, 0.0]);
    // Two *different* params under one name is an error naming it.
    let bad = vec![
        named("x", &[1.0], &[1], &dev),
        named("x", &[1.0], &[1], &dev),
    ];
    set_grad(&bad[0].1, &[1.0]);
    let e = Sgd::new(0.1).step(&bad).unwrap_err().to_string();
    assert!(e.contains("'x'"), "{e}");
}

#[test]
fn bad_configuration_and_state_are_errors() {
    let dev = Device::new_cpu("bad");
    let params = vec![named("w", &[1.0, 2.0], &[2], &dev)];
    set_grad(&params[0].1, &[1.0, 1.0]);
    let e = Sgd::new(0.1)
        .with_nesterov(true)
        .step(&params)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Nesterov"), "{e}");
    let e = Adam::new(0.1)
        .with_betas(1.0, 0.999)
        .step(&params)
        .unwrap_err()
        .to_string();
    assert!(e.contains("betas"), "{e}");
    assert!(Sgd::new(-1.0).step(&params).is_err());
    // Nothing changed.
    assert_eq!(params[0].1.value().to_vec().unwrap(), [1.0, 2.0]);

    // Adam's state does not load into SGD, and says why.
    let mut adam = Adam::new(0.1);
    adam.step(&params).unwrap();
    let mut sgd = Sgd::new(0.1).with_momentum(0.9);
    let e = sgd.load_state(adam.state()).unwrap_err().to_string();
    assert!(
        e.contains("w.exp_avg") && e.contains("momentum_buffer"),
        "{e}"
    );

    // A moment of the wrong shape is caught before anything is updated.
    let mut adam = Adam::new(0.1);
    let wrong = Tensor::zeros(&[3], &dev).unwrap();
    adam.load_state(vec![
        ("w.exp_avg".into(), wrong.clone()),
        ("w.exp_avg_sq".into(), wrong),
        (
            "w.step".into(),
            Tensor::from_slice(&[0.0, 1.0], &[2], &dev).unwrap(),
        ),
    ])
    .unwrap();
    let before = params[0].1.value().to_vec().unwrap();
    let e = adam.step(&params).unwrap_err().to_string();
    assert!(
        e.contains("w.exp_avg") && e.contains("[3]") && e.contains("[2]"),
        "{e}"
    );
    assert_eq!(params[0].1.value().to_vec().unwrap(), before);

    // Incomplete Adam state.
    let e = Adam::new(0.1)
        .load_state(vec![(
            "w.exp_avg".into(),
            Tensor::zeros(&[2], &dev).unwrap(),
        )])
        .unwrap_err()
        .to_string();
    assert!(e.contains("w.exp_avg_sq") || e.contains("w.step"), "{e}");

    // A gradient of the wrong shape.
    params[0]
        .1
        .set_grad(Some(Tensor::zeros(&[3], &dev).unwrap()));
    let e = Sgd::new(0.1).step(&params).unwrap_err().to_string();
    assert!(e.contains("'w'") && e.contains("[3]"), "{e}");
}

#[test]
fn state_round_trips_and_restores_lr_and_steps() {
    let dev = Device::new_cpu("state");
    let params = vec![named("w", &W0, &[3], &dev)];
    let mut a = Sgd::new(0.1).with_momentum(0.9);
    set_grad(&params[0].1, &G[0]);
    a.step(&params).unwrap();
    a.set_lr(0.05);
    let mut b = Sgd::new(0.1).with_momentum(0.9);
    b.load_state(a.state()).unwrap();
    assert_eq!(b.steps(), 1);
    assert_eq!(b.lr(), 0.05);
    // Large step counts are exact.
    let mut c = Adam::new(0.1);
    let big = (1u64 << 40) + 12345;
    let st = vec![
        ("@steps".to_string(), counter(big, &dev)),
        ("w.step".to_string(), counter(big - 1, &dev)),
        ("w.exp_avg".to_string(), Tensor::zeros(&[3], &dev).unwrap()),
        (
            "w.exp_avg_sq".to_string(),
            Tensor::zeros(&[3], &dev).unwrap(),
        ),
    ];
    c.load_state(st).unwrap();
    assert_eq!(c.steps(), big);
    let s = c.state();
    assert_eq!(
        s.iter()
            .find(|(k, _)| k == "w.step")
            .unwrap()
            .1
            .to_vec()
            .unwrap(),
        counter(big - 1, &dev).to_vec().unwrap()
    );
}

fn counter(v: u64, dev: &Device) -> Tensor {
    let hi = (v >> 24) as f32;
    let lo = (v & ((1 << 24) - 1)) as f32;
    Tensor::from_slice(&[hi, lo], &[2], dev).unwrap()
}

#[test]
fn optimizer_state_is_accounted_as_optimizer_state() {
    let dev = Device::new_cpu("tags");
    let n = 256;
    let params = vec![named("w", &vec![0.5; n], &[n], &dev)];
    set_grad(&params[0].1, &vec![0.25; n]);
    let bytes = params[0].1.value().storage_bytes();
    let mut adam = Adam::new(0.1);
    adam.step(&params).unwrap();
    let s = dev.memory_stats();
    assert_eq!(s.live_of(Tag::OptimizerState), 2 * bytes, "{s:?}");
    assert_eq!(s.live_of(Tag::Parameters), bytes, "{s:?}");
    assert_eq!(s.live_of(Tag::Gradients), bytes, "{s:?}");
    drop(adam);

    let mut sgd = Sgd::new(0.1).with_momentum(0.9);
    sgd.step(&params).unwrap();
    sgd.step(&params).unwrap();
    let s = dev.memory_stats();
    assert_eq!(s.live_of(Tag::OptimizerState), bytes, "{s:?}");
    assert_eq!(s.live_of(Tag::Parameters), bytes, "{s:?}");
}

// ---------------------------------------------------------------------------------------------
// Gradient clipping
// ---------------------------------------------------------------------------------------------

#[test]
fn clip_grad_norm_by_hand() {
    let dev = Device::new_cpu("clip");
    let params = vec![
        named("a", &[0.0, 0.0], &[2], &dev),
        named("b", &[0.0], &[1], &dev),
        named("frozen", &[0.0], &[1], &dev),
    ];
    set_grad(&params[0].1, &[3.0, 4.0]);
    set_grad(&params[1].1, &[12.0]);
    set_grad(&params[2].1, &[100.0]);
    params[2].1.set_trainable(false);
    // sqrt(9 + 16 + 144) = 13
    assert_eq!(grad_norm_sq(&params).unwrap(), 169.0);
    // Below the threshold: nothing changes.
    assert_eq!(clip_grad_norm(&params, 20.0).unwrap(), 13.0);
    assert_eq!(params[0].1.grad().unwrap().to_vec().unwrap(), [3.0, 4.0]);
    // Above: scaled by 6.5 / (13 + 1e-6).
    assert_eq!(clip_grad_norm(&params, 6.5).unwrap(), 13.0);
    let f = 6.5 / (13.0 + 1e-6);
    assert_close(
        "a",
        &params[0].1.grad().unwrap().to_vec().unwrap(),
        &[3.0 * f, 4.0 * f],
        1e-6,
    );
    assert_close(
        "b",
        &params[1].1.grad().unwrap().to_vec().unwrap(),
        &[12.0 * f],
        1e-6,
    );
    assert_eq!(params[2].1.grad().unwrap().to_vec().unwrap(), [100.0]);
    assert!((grad_norm_sq(&params).unwrap().sqrt() - 6.5).abs() < 1e-5);
    assert!(clip_grad_norm(&params, f32::NAN).is_err());
}

#[test]
fn clipping_across_devices_equals_clipping_in_one_place() {
    // A pipeline: each stage has its params on its own device.
    let (d0, d1) = (Device::new_cpu("stage0"), Device::new_cpu("stage1"));
    let s0 = vec![named("l0.w", &[0.0; 4], &[2, 2], &d0)];
    let s1 = vec![named("l1.w", &[0.0; 3], &[3], &d1)];
    let g0 = [1.0, -2.0, 0.5, 3.0];
    let g1 = [4.0, 0.25, -1.0];
    set_grad(&s0[0].1, &g0);
    set_grad(&s1[0].1, &g1);
    let total = (grad_norm_sq(&s0).unwrap() + grad_norm_sq(&s1).unwrap()).sqrt() as f32;
    let factor = clip_factor(total, 2.0);
    scale_grads(&s0, factor).unwrap();
    scale_grads(&s1, factor).unwrap();

    // The same, with all params in one list (one device per param).
    let all = vec![
        named("l0.w", &[0.0; 4], &[2, 2], &d0),
        named("l1.w", &[0.0; 3], &[3], &d1),
    ];
    set_grad(&all[0].1, &g0);
    set_grad(&all[1].1, &g1);
    let norm = clip_grad_norm(&all, 2.0).unwrap();
    assert_eq!(norm, total);
    assert_eq!(
        s0[0].1.grad().unwrap().to_vec().unwrap(),
        all[0].1.grad().unwrap().to_vec().unwrap()
    );
    assert_eq!(
        s1[0].1.grad().unwrap().to_vec().unwrap(),
        all[1].1.grad().unwrap().to_vec().unwrap()
    );
    assert_eq!(clip_factor(1.0, 2.0), 1.0);
}

// ---------------------------------------------------------------------------------------------
// Learning-rate schedules
// ---------------------------------------------------------------------------------------------

#[test]
fn lr_schedules_at_hand_picked_steps() {
    let c = LrSchedule::Constant;
    assert_eq!(c.lr_at(0.3, 0), 0.3);
    assert_eq!(c.lr_at(0.3, 1_000_000), 0.3);

    let w = LrSchedule::LinearWarmup { warmup_steps: 4 };
    assert_eq!(w.lr_at(1.0, 0), 0.25);
    assert_eq!(w.lr_at(1.0, 1), 0.5);
    assert_eq!(w.lr_at(1.0, 3), 1.0);
    assert_eq!(w.lr_at(1.0, 4), 1.0);
    assert_eq!(w.lr_at(1.0, 99), 1.0);
    assert_eq!(
        LrSchedule::LinearWarmup { warmup_steps: 0 }.lr_at(0.5, 0),
        0.5
    );

    let cos = LrSchedule::WarmupCosine {
        warmup_steps: 2,
        total_steps: 12,
        min_lr: 0.1,
    };
    let near = |a: f32, b: f32| (a - b).abs() < 1e-6;
    assert!(near(cos.lr_at(1.0, 0), 0.5));
    assert!(near(cos.lr_at(1.0, 1), 1.0));
    assert!(near(cos.lr_at(1.0, 2), 1.0)); // the cosine starts at the top
                                           // progress 0.5: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55
    assert!(near(cos.lr_at(1.0, 7), 0.55));
    // progress 0.2: 0.1 + 0.9 * (1 + cos(0.2 pi)) / 2
    let q = 0.1 + 0.9 * (1.0 + (0.2 * std::f64::consts::PI).cos()) / 2.0;
    assert!(near(cos.lr_at(1.0, 4), q as f32));
    assert!(near(cos.lr_at(1.0, 12), 0.1));
    assert!(near(cos.lr_at(1.0, 1000), 0.1));

    // `apply` uses the optimizer's step count.
    let mut opt = Sgd::new(1.0);
    assert!(near(cos.apply(&mut opt, 1.0), 0.5));
    assert!(near(opt.lr(), 0.5));
}

#[test]
fn cosine_quarter_point() {
    // warmup 0, total 4: step 1 is progress 0.25.
    let cos = LrSchedule::WarmupCosine {
        warmup_steps: 0,
        total_steps: 4,
        min_lr: 0.0,
    };
    let want = (1.0 + std::f64::consts::FRAC_1_SQRT_2) / 2.0;
    assert!((cos.lr_at(1.0, 1) as f64 - want).abs() < 1e-6);
    assert_eq!(cos.lr_at(2.0, 0), 2.0);
}

// ---------------------------------------------------------------------------------------------
// A two-layer MLP against an independent f64 reference.
// ---------------------------------------------------------------------------------------------

const B: usize = 4;
const I: usize = 3;
const H: usize = 5;
const O: usize = 2;

fn data() -> (Vec<f64>, Vec<f64>) {
    let x = (0..B * I).map(|k| ((k as f64) * 0.7).sin()).collect();
    let y = (0..B * O).map(|k| ((k as f64) * 1.3 + 0.5).cos()).collect();
    (x, y)
}

fn init() -> [Vec<f64>; 4] {
    let f = |n: usize, s: f64| -> Vec<f64> {
        (0..n).map(|k| ((k as f64 + s) * 2.1).sin() * 0.5).collect()
    };
    [f(I * H, 0.0), f(H, 1.0), f(H * O, 2.0), f(O, 3.0)]
}

const SHAPES: [&[usize]; 4] = [&[I, H], &[H], &[H, O], &[O]];
const NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

fn model(dev: &Device) -> Vec<(String, Param)> {
    init()
        .iter()
        .zip(SHAPES)
        .zip(NAMES)
        .map(|((v, s), n)| {
            let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            named(n, &v, s, dev)
        })
        .collect()
}

/// Loss (mean squared error over all outputs) and parameter gradients by autograd.
fn loss_backward(params: &[(String, Param)], x: &Tensor, y: &Tensor) -> Result<f32> {
    let tape = Tape::new();
    let p: Vec<_> = params.iter().map(|(_, p)| tape.stored_param(p)).collect();
    let x = tape.constant(x.clone());
    let y = tape.constant(y.clone());
    let h = x.matmul(&p[0])?.add(&p[1])?.tanh()?;
    let out = h.matmul(&p[2])?.add(&p[3])?;
    let loss = out.sub(&y)?.square()?.mean_all()?;
    let value = loss.to_scalar()?;
    tape.backward(&loss)?;
    Ok(value)
}

/// The same forward and a hand-derived backward in f64 loops.
fn ref_loss_grads(w: &[Vec<f64>; 4], x: &[f64], y: &[f64]) -> (f64, [Vec<f64>; 4]) {
    let (w1, b1, w2, b2) = (&w[0], &w[1], &w[2], &w[3]);
    let mut a = [0.0; B * H];
    for b in 0..B {
        for j in 0..H {
            let mut z = b1[j];
            for i in 0..I {
                z += x[b * I + i] * w1[i * H + j];
            }
            a[b * H + j] = z.tanh();
        }
    }
    let mut out = [0.0; B * O];
    for b in 0..B {
        for k in 0..O {
            let mut z = b2[k];
            for j in 0..H {
                z += a[b * H + j] * w2[j * O + k];
            }
            out[b * O + k] = z;
        }
    }
    let n = (B * O) as f64;
    let loss = out.iter().zip(y).map(|(o, t)| (o - t).powi(2)).sum::<f64>() / n;
    let dout: Vec<f64> = out.iter().zip(y).map(|(o, t)| 2.0 * (o - t) / n).collect();
    let mut g = [
        vec![0.0; I * H],
        vec![0.0; H],
        vec![0.0; H * O],
        vec![0.0; O],
    ];
    let mut dz1 = [0.0; B * H];
    for b in 0..B {
        for k in 0..O {
            g[3][k] += dout[b * O + k];
            for j in 0..H {
                g[2][j * O + k] += a[b * H + j] * dout[b * O + k];
            }
        }
        for j in 0..H {
            let da: f64 = (0..O).map(|k| dout[b * O + k] * w2[j * O + k]).sum();
            dz1[b * H + j] = da * (1.0 - a[b * H + j].powi(2));
            g[1][j] += dz1[b * H + j];
            for i in 0..I {
                g[0][i * H + j] += x[b * I + i] * dz1[b * H + j];
            }
        }
    }
    (loss, g)
}

/// Reference optimizers in plain loops.
enum RefOpt {
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        wd: f64,
        nesterov: bool,
        buf: Option<[Vec<f64>; 4]>,
    },
    Adam {
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
        decoupled: bool,
        t: i32,
        m: [Vec<f64>; 4],
        v: [Vec<f64>; 4],
    },
}

impl RefOpt {
    fn step(&mut self, w: &mut [Vec<f64>; 4], g: &[Vec<f64>; 4], lr_now: f64) {
        match self {
            RefOpt::Sgd {
                lr,
                momentum,
                dampening,
                wd,
                nesterov,
                buf,
            } => {
                *lr = lr_now;
                let first = buf.is_none();
                let bufs = buf.get_or_insert_with(|| g.clone());
                for p in 0..4 {
                    for i in 0..w[p].len() {
                        let mut d = g[p][i] + *wd * w[p][i];
                        if *momentum != 0.0 {
                            bufs[p][i] = if first {
                                d
                            } else {
                                *momentum * bufs[p][i] + (1.0 - *dampening) * d
                            };
                            d = if *nesterov {
                                d + *momentum * bufs[p][i]
                            } else {
                                bufs[p][i]
                            };
                        }
                        w[p][i] -= *lr * d;
                    }
                }
            }
            RefOpt::Adam {
                lr,
                b1,
                b2,
                eps,
                wd,
                decoupled,
                t,
                m,
                v,
            } => {
                *lr = lr_now;
                *t += 1;
                let bc1 = 1.0 - b1.powi(*t);
                let bc2 = 1.0 - b2.powi(*t);
                for p in 0..4 {
                    for i in 0..w[p].len() {
                        let mut gi = g[p][i];
                        if *decoupled {
                            w[p][i] *= 1.0 - *lr * *wd;
                        } else {
                            gi += *wd * w[p][i];
                        }
                        m[p][i] = *b1 * m[p][i] + (1.0 - *b1) * gi;
                        v[p][i] = *b2 * v[p][i] + (1.0 - *b2) * gi * gi;
                        w[p][i] -= *lr * (m[p][i] / bc1) / ((v[p][i] / bc2).sqrt() + *eps);
                    }
                }
            }
        }
    }
}

fn zeros4() -> [Vec<f64>; 4] {
    [
        vec![0.0; I * H],
        vec![0.0; H],
        vec![0.0; H * O],
        vec![0.0; O],
    ]
}

/// Trains `steps` steps with `opt` (and optionally clipping and a schedule) and the reference.
fn train_against_reference(
    what: &str,
    opt: &mut dyn Optimizer,
    mut reference: RefOpt,
    clip: Option<f32>,
    schedule: LrSchedule,
    tol: f64,
) {
    let dev = Device::new_cpu("mlp");
    let (x, y) = data();
    let xs = Tensor::from_vec(x.iter().map(|&v| v as f32).collect(), &[B, I], &dev).unwrap();
    let ys = Tensor::from_vec(y.iter().map(|&v| v as f32).collect(), &[B, O], &dev).unwrap();
    let params = model(&dev);
    let mut w = init();
    let base = opt.lr();
    let mut first_loss = None;
    let mut clipped = 0;
    for step in 0..6 {
        zero_grad(&params);
        let loss = loss_backward(&params, &xs, &ys).unwrap();
        let (ref_loss, mut g) = ref_loss_grads(&w, &x, &y);
        assert!(
            (loss as f64 - ref_loss).abs() <= tol * (1.0 + ref_loss),
            "{what} step {step}: loss {loss} vs reference {ref_loss}"
        );
        first_loss.get_or_insert(ref_loss);
        if let Some(max) = clip {
            let norm = clip_grad_norm(&params, max).unwrap();
            let ref_norm = g.iter().flatten().map(|v| v * v).sum::<f64>().sqrt();
            assert!((norm as f64 - ref_norm).abs() <= tol * (1.0 + ref_norm));
            let coef = max as f64 / (ref_norm + 1e-6);
            if coef < 1.0 {
                clipped += 1;
                g.iter_mut().flatten().for_each(|v| *v *= coef);
            }
        }
        let lr = schedule.apply(opt, base);
        opt.step(&params).unwrap();
        reference.step(&mut w, &g, lr as f64);
        for (k, (_, p)) in params.iter().enumerate() {
            assert_close(
                &format!("{what} step {step} {}", NAMES[k]),
                &p.value().to_vec().unwrap(),
                &w[k],
                tol,
            );
        }
    }
    assert!(
        clip.is_none() || clipped > 0,
        "{what}: clipping never engaged"
    );
    let (last, _) = ref_loss_grads(&w, &x, &y);
    assert!(
        last < first_loss.unwrap(),
        "{what}: the loss did not go down"
    );
}

#[test]
fn mlp_sgd_matches_reference() {
    train_against_reference(
        "sgd",
        &mut Sgd::new(0.2),
        RefOpt::Sgd {
            lr: 0.2,
            momentum: 0.0,
            dampening: 0.0,
            wd: 0.0,
            nesterov: false,
            buf: None,
        },
        None,
        LrSchedule::Constant,
        1e-5,
    );
}

#[test]
fn mlp_sgd_nesterov_weight_decay_clip_warmup_matches_reference() {
    train_against_reference(
        "sgd nesterov",
        &mut Sgd::new(0.2)
            .with_momentum(0.9)
            .with_nesterov(true)
            .with_weight_decay(0.01),
        RefOpt::Sgd {
            lr: 0.2,
            momentum: 0.9,
            dampening: 0.0,
            wd: 0.01,
            nesterov: true,
            buf: None,
        },
        Some(0.5),
        LrSchedule::LinearWarmup { warmup_steps: 3 },
        1e-5,
    );
}

#[test]
fn mlp_sgd_momentum_dampening_cosine_matches_reference() {
    train_against_reference(
        "sgd dampening",
        &mut Sgd::with_config(SgdConfig {
            lr: 0.3,
            momentum: 0.8,
            dampening: 0.3,
            weight_decay: 0.0,
            nesterov: false,
        }),
        RefOpt::Sgd {
            lr: 0.3,
            momentum: 0.8,
            dampening: 0.3,
            wd: 0.0,
            nesterov: false,
            buf: None,
        },
        None,
        LrSchedule::WarmupCosine {
            warmup_steps: 1,
            total_steps: 6,
            min_lr: 0.01,
        },
        1e-5,
    );
}

#[test]
fn mlp_adam_matches_reference() {
    train_against_reference(
        "adam",
        &mut Adam::with_config(AdamConfig {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }),
        RefOpt::Adam {
            lr: 0.05,
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
            wd: 0.01,
            decoupled: false,
            t: 0,
            m: zeros4(),
            v: zeros4(),
        },
        Some(1.0),
        LrSchedule::Constant,
        1e-4,
    );
}

#[test]
fn mlp_adamw_matches_reference() {
    train_against_reference(
        "adamw",
        &mut AdamW::new(0.05).with_weight_decay(0.1),
        RefOpt::Adam {
            lr: 0.05,
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
            wd: 0.1,
            decoupled: true,
            t: 0,
            m: zeros4(),
            v: zeros4(),
        },
        None,
        LrSchedule::WarmupCosine {
            warmup_steps: 2,
            total_steps: 6,
            min_lr: 0.0,
        },
        1e-4,
    );
}

// ---------------------------------------------------------------------------------------------
// Loss scaling: accumulated micro-batch gradients equal the mini-batch gradient.
// ---------------------------------------------------------------------------------------------

/// Accumulates the gradient of a linear model's mean squared error over `x`/`y` split into
/// micro-batches of `sizes`, each mean loss scaled by `loss_scale(size, N)`.
fn accumulated_grad(w: &(String, Param), x: &Tensor, y: &Tensor, sizes: &[usize]) -> Vec<f32> {
    let n: usize = sizes.iter().sum();
    assert_eq!(n, x.shape()[0]);
    zero_grad(std::slice::from_ref(w));
    let mut start = 0;
    for &s in sizes {
        let tape = Tape::new();
        let wv = tape.stored_param(&w.1);
        let xm = tape.constant(x.narrow(0, start, s).unwrap());
        let ym = tape.constant(y.narrow(0, start, s).unwrap());
        let loss = xm
            .matmul(&wv)
            .unwrap()
            .sub(&ym)
            .unwrap()
            .square()
            .unwrap()
            .mean_all()
            .unwrap()
            .mul_scalar(loss_scale(s, n))
            .unwrap();
        tape.backward(&loss).unwrap();
        start += s;
    }
    w.1.grad().unwrap().to_vec().unwrap()
}

#[test]
fn micro_batch_gradients_accumulate_to_the_mini_batch_gradient() {
    let dev = Device::new_cpu("scale");
    let n = 6;
    let x = Tensor::rand_normal(&[n, 3], 0.0, 1.0, 1, &dev).unwrap();
    let y = Tensor::rand_normal(&[n, 2], 0.0, 1.0, 2, &dev).unwrap();
    let w = named("w", &[0.1, -0.2, 0.3, 0.4, -0.5, 0.6], &[3, 2], &dev);

    let whole = accumulated_grad(&w, &x, &y, &[6]);
    let want: Vec<f64> = whole.iter().map(|&v| v as f64).collect();
    for split in [&[3, 3][..], &[1, 5], &[2, 1, 3], &[1, 1, 1, 1, 1, 1]] {
        let got = accumulated_grad(&w, &x, &y, split);
        assert_close(&format!("split {split:?}"), &got, &want, 1e-6);
    }
    assert_eq!(loss_scale(2, 8), 0.25);
}

// ---------------------------------------------------------------------------------------------
// The fused update on wgpu equals the CPU one.
// ---------------------------------------------------------------------------------------------

#[test]
fn adam_on_wgpu_matches_cpu() {
    let gpu = match Device::parse("wgpu") {
        Ok(d) => d,
        Err(e) => {
            eprintln!("adam_on_wgpu_matches_cpu: skipped, no wgpu device: {e}");
            return;
        }
    };
    let n = 1000;
    let w: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut results = Vec::new();
    for (dev, mut opt) in [
        (
            Device::new_cpu("cpu-adam"),
            Box::new(AdamW::new(0.01)) as Box<dyn Optimizer>,
        ),
        (gpu, Box::new(AdamW::new(0.01)) as Box<dyn Optimizer>),
    ] {
        let params = vec![named("w", &w, &[n], &dev)];
        for _ in 0..3 {
            set_grad(&params[0].1, &g);
            opt.step(&params).unwrap();
        }
        for (k, t) in opt.state() {
            if k.ends_with("exp_avg") {
                assert_eq!(t.device(), &dev, "state lives on the param's device");
            }
        }
        results.push(params[0].1.value().to_vec().unwrap());
    }
    let want: Vec<f64> = results[0].iter().map(|&v| v as f64).collect();
    assert_close("wgpu vs cpu", &results[1], &want, 1e-5);
}

/// Two micro-batch backwards (the second adds into the first's gradient), then a step.
fn accumulate_and_step(
    params: &[(String, Param)],
    opt: &mut dyn Optimizer,
    x: &Tensor,
    y: &Tensor,
) -> Result<()> {
    zero_grad(params);
    let half = B / 2;
    for k in 0..2 {
        loss_backward(
            params,
            &x.narrow(0, k * half, half)?,
            &y.narrow(0, k * half, half)?,
        )?;
    }
    opt.step(params)
}

fn bits_of(params: &[(String, Param)]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|(_, p)| {
            p.value()
                .to_vec()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

/// The optimizers update parameters (and Adam's moments) in place when nothing else holds them:
/// bit for bit the out-of-place steps taken when a copy of everything is kept (as a pipeline
/// keeps one to roll back), those copies keep their values, and the in-place steps add no
/// parameter or optimizer-state bytes.
#[test]
fn steps_in_place_equal_steps_out_of_place_and_spare_kept_copies() {
    type MakeOpt = fn() -> Box<dyn Optimizer>;
    let makers: [(&str, MakeOpt); 4] = [
        ("adam", || Box::new(Adam::new(0.05))),
        ("adamw", || {
            Box::new(AdamW::new(0.05).with_weight_decay(0.1))
        }),
        ("sgd", || Box::new(Sgd::new(0.1))),
        ("sgd momentum", || {
            Box::new(Sgd::new(0.1).with_momentum(0.9))
        }),
    ];
    let (xv, yv) = data();
    for (what, make) in makers {
        let dev = Device::cpu().virtual_device(&format!("in-place {what}"), None);
        let x = Tensor::from_vec(xv.iter().map(|&v| v as f32).collect(), &[B, I], &dev).unwrap();
        let y = Tensor::from_vec(yv.iter().map(|&v| v as f32).collect(), &[B, O], &dev).unwrap();
        let (fast, slow) = (model(&dev), model(&dev));
        let (mut fast_opt, mut slow_opt) = (make(), make());
        for step in 0..4 {
            // The reference keeps every value and the optimizer state across its step.
            let kept_values: Vec<Tensor> = slow.iter().map(|(_, p)| p.value()).collect();
            let kept_bits = bits_of(&slow);
            let kept_state = slow_opt.state();
            let state_bits: Vec<Vec<u32>> = kept_state
                .iter()
                .map(|(_, t)| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
                .collect();
            accumulate_and_step(&slow, slow_opt.as_mut(), &x, &y).unwrap();
            let still: Vec<Vec<u32>> = kept_values
                .iter()
                .map(|t| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
                .collect();
            assert_eq!(
                still, kept_bits,
                "{what}: a kept value changed at step {step}"
            );
            let state_now: Vec<Vec<u32>> = kept_state
                .iter()
                .map(|(_, t)| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect())
                .collect();
            assert_eq!(
                state_now, state_bits,
                "{what}: kept state changed at step {step}"
            );

            dev.memory().reset_peak();
            let before = dev.memory_stats();
            accumulate_and_step(&fast, fast_opt.as_mut(), &x, &y).unwrap();
            let after = dev.memory_stats();
            assert_eq!(bits_of(&fast), bits_of(&slow), "{what}, step {step}");
            // From the second step on (moments exist), nothing new is allocated for parameters
            // or moments (SGD with momentum makes its new buffer out of place).
            if step > 0 {
                assert_eq!(
                    after.peak_of(Tag::Parameters),
                    before.live_of(Tag::Parameters),
                    "{what}: a parameter was copied at step {step}"
                );
                if what.starts_with("adam") {
                    assert_eq!(
                        after.peak_of(Tag::OptimizerState),
                        before.live_of(Tag::OptimizerState),
                        "{what}: the moments were copied at step {step}"
                    );
                }
            }
        }
    }
}
