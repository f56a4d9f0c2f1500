//! Pipelined training equals plain training on the whole mini-batch, for every K, M, checkpoint
//! mode and schedule, and is deterministic.
//!
//! Tolerance: relative 1e-5, norm-wise per tensor (largest |difference| over largest |value|
//! of that tensor; see `rel_err`). Pipelining changes only the order of sums (the weight
//! gradient's sum over the batch is split into M partial sums), so the error is a few f32
//! ulps per step: measured worst cases are printed by each test.

use wgpipe_pipeline::{CheckpointMode, PipelineError, ScheduleKind};
use wgpipe_tensor::Tensor;
use wgpipe_tests::*;

const STEPS: usize = 3;

fn mlp_data(n: usize) -> (Tensor, Tensor) {
    (normal_data(&[n, 6], 1), normal_data(&[n, 3], 2))
}

fn lm_data(n: usize) -> (Tensor, Tensor) {
    let t = transformer_cfg(0.0).seq_len;
    (token_ids(n, t, 16, 0), token_ids(n, t, 16, 5))
}

/// Runs the grid K in 1..=4, M in 1..=5 and 8, every mode and schedule against `reference`;
/// within one (K, M, schedule) every checkpoint mode must give bit-identical results (a
/// recompute replays the forward exactly). A few configurations run twice: bit-identical.
fn grid(
    name: &str,
    make: &dyn Fn() -> Vec<Box<dyn wgpipe_autograd::Module>>,
    x: &Tensor,
    y: &Tensor,
    loss: &wgpipe_pipeline::LossFn,
    reference: &RunResult,
) {
    let mut worst = (0.0f64, String::new());
    let mut ran = 0;
    let layers = make().len();
    for k in 1..=4 {
        for m in [1, 2, 3, 4, 5, 8] {
            for schedule in ALL_SCHEDULES {
                if !runs(schedule, k, m, layers) {
                    continue;
                }
                ran += 1;
                let mut first: Option<RunResult> = None;
                for mode in ALL_MODES {
                    let cfg = PipeCfg::new(k, m, mode, schedule);
                    let mut pipe = sim_pipeline(make(), &cfg);
                    let (got, _) = pipe_train(&mut pipe, x, y, loss, STEPS);
                    let what = format!("{name} K={k} M={m} {mode} {schedule:?}");
                    let (e, at) = worst_err(&got, reference);
                    assert!(e <= 1e-5, "{what}: relative error {e:.3e} > 1e-5 at {at}");
                    if e > worst.0 {
                        worst = (e, format!("{what} at {at}"));
                    }
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert!(
                            *f == got,
                            "{what}: differs from {} (checkpointing changed the result by {:.3e})",
                            ALL_MODES[0],
                            worst_err(&got, f).0
                        ),
                    }
                    if mode == CheckpointMode::ExceptLast && (m == k || m == 8) {
                        let mut again = sim_pipeline(make(), &cfg);
                        let (got2, _) = pipe_train(&mut again, x, y, loss, STEPS);
                        assert!(
                            got2 == *first.as_ref().unwrap(),
                            "{what}: not deterministic"
                        );
                    }
                }
            }
        }
    }
    eprintln!(
        "{name}: {ran} (K, M, schedule) x 3 modes; worst relative error vs plain {:.3e} ({})",
        worst.0, worst.1
    );
    // Every schedule ran at every K and M (DualPipeV where M >= 2K: 14 of the 216 are below).
    assert!(
        ran == 4 * 6 * ALL_SCHEDULES.len() - 14,
        "{name}: {ran} configurations ran"
    );
}

#[test]
fn mlp_pipelined_equals_plain_for_every_k_m_mode_schedule() {
    let (x, y) = mlp_data(8);
    let make = || mlp(6, 12, 3, 11);
    let reference = plain_train(&make(), &x, &y, &mse, STEPS);
    grid("MLP", &make, &x, &y, &mse, &reference);
}

#[test]
fn transformer_pipelined_equals_plain_for_every_k_m_mode_schedule() {
    let (x, y) = lm_data(8);
    let make = || deep_transformer(0.0, 3);
    let reference = plain_train(&make(), &x, &y, &cross_entropy, STEPS);
    grid("Transformer", &make, &x, &y, &cross_entropy, &reference);
}

#[test]
fn uneven_micro_batches_equal_plain() {
    // N = 10 into M = 4 gives micro-batches of 3, 3, 2, 2; each loss is scaled by its share.
    let (x, y) = mlp_data(10);
    let reference = plain_train(&mlp(6, 12, 3, 11), &x, &y, &mse, STEPS);
    let (tx, ty) = lm_data(10);
    let lm_reference = plain_train(&transformer(0.0, 3), &tx, &ty, &cross_entropy, STEPS);
    for k in [1, 2, 3] {
        for schedule in ALL_SCHEDULES {
            if !runs(schedule, k, 4, 5) {
                continue;
            }
            for mode in ALL_MODES {
                let cfg = PipeCfg::new(k, 4, mode, schedule);
                let mut pipe = sim_pipeline(mlp(6, 12, 3, 11), &cfg);
                let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, STEPS);
                assert_close(&got, &reference, 1e-5, &format!("MLP N=10 {cfg:?}"));
                let mut pipe = sim_pipeline(transformer(0.0, 3), &cfg);
                let (got, _) = pipe_train(&mut pipe, &tx, &ty, &cross_entropy, STEPS);
                assert_close(&got, &lm_reference, 1e-5, &format!("LM N=10 {cfg:?}"));
            }
        }
    }
}

#[test]
fn more_micro_batches_than_samples_is_a_clear_error() {
    let (x, y) = mlp_data(4);
    let cfg = PipeCfg::new(2, 8, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut pipe = sim_pipeline(mlp(6, 12, 3, 11), &cfg);
    let before = snapshot(&pipe.named_parameters());
    let err = pipe.train_step(&x, &y, &mse).unwrap_err();
    assert!(matches!(err, PipelineError::Config(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("4 samples") && msg.contains("8 micro-batches"),
        "{msg}"
    );
    assert_eq!(snapshot(&pipe.named_parameters()), before);
    assert!(pipe
        .named_parameters()
        .iter()
        .all(|(_, p)| p.grad().is_none()));
    // A mini-batch that can be split still trains.
    let (x, y) = mlp_data(8);
    pipe.train_step(&x, &y, &mse).unwrap();
    // The evaluation forward gives the same error.
    let e = pipe
        .forward(&normal_data(&[3, 6], 9))
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 samples"), "{e}");
}

/// With dropout the plain whole-batch run cannot reproduce per-micro-batch masks, so check
/// instead: identical across checkpoint modes (recompute replays the masks bit for bit), run to
/// run, and across K (masks are keyed by the global layer index, not the stage); and that
/// dropout did act.
#[test]
fn dropout_replays_identically_across_modes_runs_and_stages() {
    let (x, y) = lm_data(8);
    let no_dropout = {
        let cfg = PipeCfg::new(2, 4, CheckpointMode::Never, ScheduleKind::GPipe);
        let mut pipe = sim_pipeline(deep_transformer(0.0, 3), &cfg);
        pipe_train(&mut pipe, &x, &y, &cross_entropy, STEPS).0
    };
    for schedule in ALL_SCHEDULES {
        for m in [1, 3, 4] {
            let mut by_k: Vec<RunResult> = Vec::new();
            for k in [1, 2, 4] {
                let mut first: Option<RunResult> = None;
                if !runs(schedule, k, m, 9) {
                    continue;
                }
                for mode in ALL_MODES {
                    let cfg = PipeCfg::new(k, m, mode, schedule);
                    let mut pipe = sim_pipeline(deep_transformer(0.2, 3), &cfg);
                    let (got, _) = pipe_train(&mut pipe, &x, &y, &cross_entropy, STEPS);
                    match &first {
                        None => {
                            let mut again = sim_pipeline(deep_transformer(0.2, 3), &cfg);
                            let (got2, _) = pipe_train(&mut again, &x, &y, &cross_entropy, STEPS);
                            assert!(got == got2, "{cfg:?}: not deterministic with dropout");
                            first = Some(got);
                        }
                        Some(f) => assert!(
                            *f == got,
                            "{cfg:?}: checkpoint mode changed the result with dropout by {:.3e}",
                            worst_err(&got, f).0
                        ),
                    }
                }
                by_k.extend(first);
            }
            if by_k.is_empty() {
                continue;
            }
            for r in &by_k[1..] {
                assert_close(
                    r,
                    &by_k[0],
                    1e-5,
                    &format!("dropout, K vs K=1, M={m} {schedule:?}"),
                );
            }
            let (e, _) = worst_err(&by_k[0], &no_dropout);
            assert!(e > 1e-3, "dropout 0.2 changed nothing ({e:.3e})");
        }
    }
}

/// Batch norm: statistics per micro-batch in training, but the running statistics are updated
/// once per mini-batch from the whole mini-batch (deferred), so after a step they equal plain
/// training's whatever K, M, schedule and checkpoint mode (a recompute must not count twice).
#[test]
fn batch_norm_running_statistics_do_not_depend_on_k_or_m() {
    use wgpipe_models::{BatchNorm2d, Linear, Relu};
    let make = || -> Vec<Box<dyn wgpipe_autograd::Module>> {
        let d = wgpipe_tensor::Device::cpu();
        vec![
            Box::new(Linear::new(6, 8, 1, &d).unwrap()),
            Box::new(BatchNorm2d::new(8, &d).unwrap()),
            Box::new(Relu),
            Box::new(Linear::new(8, 3, 2, &d).unwrap()),
        ]
    };
    let (x, y) = mlp_data(8);
    let plain = make();
    plain_train(&plain, &x, &y, &mse, 1);
    let want = snapshot(&wgpipe_models::sequence_buffers(&plain));
    for k in [1, 2] {
        for m in [1, 2, 4, 8] {
            for schedule in ALL_SCHEDULES {
                if !runs(schedule, k, m, 4) {
                    continue;
                }
                for mode in ALL_MODES {
                    let mut pipe = sim_pipeline(make(), &PipeCfg::new(k, m, mode, schedule));
                    pipe_train(&mut pipe, &x, &y, &mse, 1);
                    let got = snapshot(&pipe.named_buffers());
                    assert_eq!(got.len(), want.len());
                    for ((n, a), (_, b)) in got.iter().zip(&want) {
                        let e = rel_err(a, b);
                        assert!(
                            e <= 1e-5,
                            "K={k} M={m} {mode} {schedule:?}: {n} off by {e:.3e}"
                        );
                    }
                }
            }
        }
    }
}

/// Every partitioning rule (and a stage without parameters) gives a valid pipeline that trains
/// like plain training; invalid balances are clear errors.
#[test]
fn every_balance_rule_trains_like_plain() {
    use wgpipe_pipeline::{Balance, Pipeline};
    let (x, y) = mlp_data(8);
    let reference = plain_train(&mlp(6, 12, 3, 11), &x, &y, &mse, STEPS);
    let sample = x.narrow(0, 0, 2).unwrap();
    let rules = [
        Balance::ByParams,
        Balance::ByFlops {
            input_shape: vec![2, 6],
        },
        Balance::ByMemory {
            input_shape: vec![2, 6],
            optimizer_factor: 3.0,
        },
        Balance::ByTime { sample },
        // Stage 1 is a lone ReLU: no parameters, no optimizer work.
        Balance::Explicit(vec![1, 1, 5, 1]),
    ];
    for rule in rules {
        for k in [2, 4] {
            if matches!(&rule, Balance::Explicit(b) if b.len() != k) {
                continue;
            }
            let cluster = wgpipe_pipeline::SimCluster::uniform(
                &wgpipe_tensor::Device::cpu(),
                k,
                u64::MAX,
                1e9,
                wgpipe_pipeline::LinkSpec::FREE,
            );
            let mut pipe = Pipeline::builder(mlp(6, 12, 3, 11))
                .sim(cluster)
                .balance(rule.clone())
                .micro_batches(4)
                .checkpoint(CheckpointMode::ExceptLast)
                .schedule(ScheduleKind::OneFOneB)
                .seed(SEED)
                .optimizer(sgd)
                .build()
                .unwrap();
            let b = pipe.balance();
            assert_eq!(b.len(), k);
            assert!(
                b.iter().all(|&n| n > 0) && b.iter().sum::<usize>() == 8,
                "{b:?}"
            );
            let (got, _) = pipe_train(&mut pipe, &x, &y, &mse, STEPS);
            assert_close(
                &got,
                &reference,
                1e-5,
                &format!("{rule:?} K={k} balance {b:?}"),
            );
        }
    }
    for (bad, what) in [
        (vec![4, 0, 4], "0 layers"),
        (vec![4, 3], "7"),
        (vec![4, 5], "9"),
    ] {
        let k = bad.len();
        let cfg = PipeCfg::new(k, 2, CheckpointMode::Never, ScheduleKind::GPipe).balance(bad);
        let e = try_sim_pipeline(mlp(6, 12, 3, 11), &cfg)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(what), "{e}");
    }
    let cfg = PipeCfg::new(9, 2, CheckpointMode::Never, ScheduleKind::GPipe);
    let e = try_sim_pipeline(mlp(6, 12, 3, 11), &cfg).err();
    assert!(e.is_some(), "9 stages for 8 layers must fail");
}

/// The evaluation forward (micro-batched, no tape, dropout off) equals the plain eval forward.
#[test]
fn eval_forward_equals_plain_eval() {
    use wgpipe_autograd::{ForwardCtx, Tape};
    let (x, _) = lm_data(8);
    let plain = transformer(0.3, 3);
    let want = wgpipe_models::forward_all(
        &plain,
        &Tape::no_grad().constant(x.clone()),
        &ForwardCtx::eval(),
    )
    .unwrap()
    .value()
    .to_vec()
    .unwrap();
    for (k, m) in [(1, 1), (2, 4), (4, 3)] {
        let cfg = PipeCfg::new(k, m, CheckpointMode::Always, ScheduleKind::GPipe);
        let pipe = sim_pipeline(transformer(0.3, 3), &cfg);
        let got = pipe.forward(&x).unwrap();
        assert_eq!(got.shape(), &[8, 6, 16]);
        let e = rel_err(&got.to_vec().unwrap(), &want);
        assert!(e <= 1e-6, "K={k} M={m}: {e:.3e}");
    }
}

/// With one micro-batch the pipeline's dropout masks are plain training's (both keyed by
/// (seed, step, micro-batch 0, global layer index)), so even with dropout it equals plain.
#[test]
fn one_micro_batch_with_dropout_equals_plain() {
    let (x, y) = lm_data(8);
    let reference = plain_train(&transformer(0.2, 3), &x, &y, &cross_entropy, STEPS);
    for k in [1, 2, 4] {
        for schedule in ALL_SCHEDULES {
            if !runs(schedule, k, 1, 5) {
                continue;
            }
            for mode in ALL_MODES {
                let mut pipe =
                    sim_pipeline(transformer(0.2, 3), &PipeCfg::new(k, 1, mode, schedule));
                let (got, _) = pipe_train(&mut pipe, &x, &y, &cross_entropy, STEPS);
                assert_close(
                    &got,
                    &reference,
                    1e-5,
                    &format!("dropout K={k} M=1 {mode} {schedule:?}"),
                );
            }
        }
    }
}

#[test]
fn skips_pipelined_equal_plain_for_every_k_m_mode_schedule() {
    let (x, y) = mlp_data(8);
    let make = || skip_model(21);
    let reference = plain_train(&make(), &x, &y, &mse, STEPS);
    grid("skips", &make, &x, &y, &mse, &reference);
}
