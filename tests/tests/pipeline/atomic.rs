//! All or nothing outside `train_step`: a failing or panicking optimizer on one stage, a
//! non-finite gradient norm, an allocation failure half-way through one optimizer's step.
//! Each leaves parameters, gradients, optimizer state and step counters bit-identical, and a
//! retry then trains exactly as if nothing had failed.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use wgpipe_autograd::optim::{Adam, AdamW, Optimizer};
use wgpipe_autograd::Param;
use wgpipe_pipeline::{CheckpointMode, Pipeline, ScheduleKind, StageCause};
use wgpipe_tensor::{Device, Error, Result, Tensor};
use wgpipe_tests::*;

const K: usize = 4;

/// How the injected optimizer fails: after its inner optimizer has applied the update.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fail {
    Error,
    Panic,
}

/// An optimizer that runs `inner` and then fails on demand: the worst case, a stage whose
/// parameters and state have already changed when it reports the failure.
struct Faulty {
    inner: Box<dyn Optimizer>,
    arm: Arc<Mutex<Option<Fail>>>,
}

impl Optimizer for Faulty {
    fn step(&mut self, params: &[(String, Param)]) -> Result<()> {
        self.inner.step(params)?;
        let armed = *self.arm.lock().unwrap();
        match armed {
            Some(Fail::Error) => Err(Error::Invalid {
                op: "Faulty::step",
                msg: "injected optimizer failure".into(),
            }),
            Some(Fail::Panic) => panic!("injected optimizer panic"),
            None => Ok(()),
        }
    }
    fn lr(&self) -> f32 {
        self.inner.lr()
    }
    fn set_lr(&mut self, lr: f32) {
        self.inner.set_lr(lr)
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        self.inner.state()
    }
    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<()> {
        self.inner.load_state(state)
    }
    fn steps(&self) -> u64 {
        self.inner.steps()
    }
}

type Make = fn() -> Box<dyn Optimizer>;

fn optimizers() -> [(&'static str, Make); 3] {
    [
        ("SGD", sgd as Make),
        ("Adam", || Box::new(Adam::new(0.01))),
        ("AdamW", || Box::new(AdamW::new(0.01))),
    ]
}

/// A 4-stage pipeline over the 8-layer MLP whose last stage's optimizer is a [`Faulty`].
fn pipeline(make: Make, arm: &Arc<Mutex<Option<Fail>>>) -> Pipeline {
    let cfg = PipeCfg::new(K, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut pipe = sim_pipeline(mlp(6, 12, 3, 5), &cfg);
    let n = Cell::new(0);
    pipe.set_optimizer(|| {
        n.set(n.get() + 1);
        if n.get() == K {
            Box::new(Faulty {
                inner: make(),
                arm: arm.clone(),
            })
        } else {
            make()
        }
    });
    pipe
}

/// Every bit of state a step can change: values, gradients, optimizer state, counters.
#[derive(Debug, PartialEq)]
struct Bits {
    params: Vec<(String, Vec<u32>)>,
    grads: Vec<(String, Option<Vec<u32>>)>,
    optim: Vec<Vec<(String, Vec<u32>)>>,
    steps: Vec<u64>,
    lrs: Vec<u32>,
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn all_bits(pipe: &Pipeline) -> Bits {
    let ps = pipe.named_parameters();
    Bits {
        params: ps
            .iter()
            .map(|(n, p)| (n.clone(), bits(&p.value())))
            .collect(),
        grads: ps
            .iter()
            .map(|(n, p)| (n.clone(), p.grad().map(|g| bits(&g))))
            .collect(),
        optim: pipe
            .optimizers()
            .iter()
            .map(|o| {
                o.state()
                    .iter()
                    .map(|(k, t)| (k.clone(), bits(t)))
                    .collect()
            })
            .collect(),
        steps: pipe.optimizers().iter().map(|o| o.steps()).collect(),
        lrs: pipe.optimizers().iter().map(|o| o.lr().to_bits()).collect(),
    }
}

fn data() -> (Tensor, Tensor) {
    (normal_data(&[8, 6], 31), normal_data(&[8, 3], 32))
}

#[test]
fn a_failing_optimizer_on_the_last_stage_leaves_every_stage_bit_identical() {
    let (x, y) = data();
    for (name, make) in optimizers() {
        for fail in [Fail::Error, Fail::Panic] {
            let what = format!("{name}, {fail:?}");
            let arm = Arc::new(Mutex::new(None));
            let mut pipe = pipeline(make, &arm);
            let reference_arm = Arc::new(Mutex::new(None));
            let mut reference = pipeline(make, &reference_arm);
            // Two good steps (moments and momentum buffers exist), then the gradients of a third.
            for p in [&mut pipe, &mut reference] {
                for _ in 0..2 {
                    p.train_step(&x, &y, &mse).unwrap();
                    p.optimizer_step().unwrap();
                }
                p.train_step(&x, &y, &mse).unwrap();
            }
            let before = all_bits(&pipe);
            assert_eq!(before, all_bits(&reference), "{what}: same start");

            *arm.lock().unwrap() = Some(fail);
            let err = pipe.optimizer_step().unwrap_err();
            let msg = err.to_string();
            assert_eq!(err.stage(), Some(K - 1), "{what}: {msg}");
            assert!(
                msg.contains("stage 3") && msg.contains("optimizer step"),
                "{what}: {msg}"
            );
            match (fail, err.cause()) {
                (Fail::Error, Some(StageCause::Tensor(e))) => {
                    assert!(
                        e.to_string().contains("injected optimizer failure"),
                        "{what}: {e}"
                    )
                }
                (Fail::Panic, Some(StageCause::Panic(m))) => {
                    assert!(m.contains("injected optimizer panic"), "{what}: {m}")
                }
                other => panic!("{what}: unexpected cause {other:?}"),
            }
            assert!(
                all_bits(&pipe) == before,
                "{what}: a stage changed after the failed optimizer step"
            );

            // The retry applies the step once: bit-identical to a pipeline that never failed.
            *arm.lock().unwrap() = None;
            pipe.optimizer_step().unwrap();
            reference.optimizer_step().unwrap();
            assert!(
                all_bits(&pipe) == all_bits(&reference),
                "{what}: retry differs"
            );
            pipe.train_step(&x, &y, &mse).unwrap();
            reference.train_step(&x, &y, &mse).unwrap();
            pipe.optimizer_step().unwrap();
            reference.optimizer_step().unwrap();
            assert!(
                all_bits(&pipe) == all_bits(&reference),
                "{what}: next step differs"
            );
        }
    }
}

#[test]
fn clipping_a_non_finite_norm_is_an_error_naming_the_stage_and_changes_nothing() {
    let (x, y) = data();
    let arm = Arc::new(Mutex::new(None));
    let mut pipe = pipeline(sgd, &arm);
    pipe.train_step(&x, &y, &mse).unwrap();
    // A NaN in one gradient of stage 2 (layers 4 and 5: LayerNorm, Linear).
    let (name, p) = pipe
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n.starts_with("5."))
        .unwrap();
    let mut g = p.grad().unwrap().to_vec().unwrap();
    g[1] = f32::NAN;
    p.set_grad(Some(
        Tensor::from_vec(g, p.grad().unwrap().shape(), &p.device()).unwrap(),
    ));
    let before = all_bits(&pipe);
    let err = pipe.clip_grad_norm(0.1).unwrap_err();
    let msg = err.to_string();
    assert_eq!(err.stage(), Some(2), "{msg}");
    assert!(
        msg.contains("clip_grad_norm") && msg.contains("NaN"),
        "{name}: {msg}"
    );
    assert!(all_bits(&pipe) == before, "clipping changed a gradient");
    assert!(pipe.clip_grad_norm(f32::NAN).is_err());

    // A finite norm clips every stage, from one global norm.
    pipe.zero_grad();
    pipe.train_step(&x, &y, &mse).unwrap();
    let norm = pipe.clip_grad_norm(1e-3).unwrap();
    assert!(norm.is_finite() && norm > 1e-3);
    let after: f64 = pipe
        .named_parameters()
        .iter()
        .filter_map(|(_, p)| p.grad())
        .map(|g| {
            g.to_vec()
                .unwrap()
                .iter()
                .map(|v| (*v as f64).powi(2))
                .sum::<f64>()
        })
        .sum::<f64>()
        .sqrt();
    assert!((after - 1e-3).abs() < 1e-6, "{after}");
}

#[test]
fn one_optimizer_out_of_memory_half_way_changes_nothing() {
    // Three parameters on a device with a capacity: for some capacity the step runs out of
    // memory after the first parameter's update. Whatever the capacity, an Err must leave
    // every parameter and the state as they were, and an Ok must have updated all three.
    for (name, make) in optimizers() {
        let mut saw_err = false;
        for cap_kib in (24..=96).step_by(2) {
            let dev = Device::cpu().virtual_device("capped", Some(cap_kib * 1024));
            let params: Vec<(String, Param)> = (0..3)
                .map(|i| {
                    let p = Param::new(
                        format!("p{i}"),
                        Tensor::from_vec(vec![0.5 + i as f32; 1000], &[1000], &dev).unwrap(),
                    );
                    p.set_grad(Some(
                        Tensor::from_vec(vec![0.25; 1000], &[1000], &dev).unwrap(),
                    ));
                    (format!("p{i}"), p)
                })
                .collect();
            let mut opt = make();
            let vals = |ps: &[(String, Param)]| -> Vec<Vec<u32>> {
                ps.iter().map(|(_, p)| bits(&p.value())).collect()
            };
            let before = vals(&params);
            let state_before: Vec<String> = opt.state().into_iter().map(|(k, _)| k).collect();
            match opt.step(&params) {
                Ok(()) => {
                    let after = vals(&params);
                    assert!(
                        after.iter().zip(&before).all(|(a, b)| a != b),
                        "{name} cap {cap_kib} KiB: Ok but not every parameter changed"
                    );
                }
                Err(e) => {
                    saw_err = true;
                    assert!(
                        vals(&params) == before,
                        "{name} cap {cap_kib} KiB: {e}: some parameter changed"
                    );
                    let state: Vec<String> = opt.state().into_iter().map(|(k, _)| k).collect();
                    assert_eq!(
                        state, state_before,
                        "{name} cap {cap_kib} KiB: state changed"
                    );
                    assert_eq!(opt.steps(), 0, "{name}");
                }
            }
        }
        assert!(
            saw_err,
            "{name}: no capacity ran out of memory; widen the range"
        );
    }
}

#[test]
fn a_split_error_carries_one_prefix() {
    let cfg = PipeCfg::new(2, 8, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut pipe = sim_pipeline(mlp(6, 12, 3, 11), &cfg);
    let x = normal_data(&[4, 6], 1);
    let y = normal_data(&[4, 3], 2);
    let msg = pipe.train_step(&x, &y, &mse).unwrap_err().to_string();
    assert_eq!(msg.matches("pipeline configuration").count(), 1, "{msg}");
    assert!(
        msg.contains("4 samples") && msg.contains("8 micro-batches"),
        "{msg}"
    );
}

/// The price of all-or-nothing: the peak memory of one AdamW step per stage, against the live
/// bytes before it. `cargo test -p wgpipe-tests --test pipeline -- --ignored --nocapture
/// optimizer_step_peak_memory`.
#[test]
#[ignore = "a measurement: prints figures"]
fn optimizer_step_peak_memory() {
    let (x, y) = data();
    let mut pipe = pipeline(|| Box::new(AdamW::new(0.01)), &Arc::new(Mutex::new(None)));
    for _ in 0..2 {
        pipe.train_step(&x, &y, &mse).unwrap();
        pipe.optimizer_step().unwrap();
    }
    pipe.train_step(&x, &y, &mse).unwrap();
    let devices = pipe.devices();
    let live: Vec<usize> = devices.iter().map(|d| d.memory_stats().live).collect();
    for d in &devices {
        d.memory().reset_peak();
    }
    let t0 = std::time::Instant::now();
    pipe.optimizer_step().unwrap();
    let dt = t0.elapsed();
    for (i, d) in devices.iter().enumerate() {
        let s = d.memory_stats();
        eprintln!(
            "stage {i}: live before {} B, peak during the step {} B (+{:.0}%)",
            live[i],
            s.peak,
            (s.peak as f64 / live[i] as f64 - 1.0) * 100.0
        );
    }
    eprintln!("optimizer_step: {dt:?}");
}
