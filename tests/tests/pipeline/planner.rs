//! The planner: its cost model against the simulated cluster (time within 5%, measured peak
//! memory never above the prediction), its search against exhaustive enumeration of the same
//! space, and the error when nothing fits.

use wgpipe_autograd::Module;
use wgpipe_pipeline::plan::cost::{with_remat, Candidate, CostModel, ScheduleFacts};
use wgpipe_pipeline::plan::search::compositions;
use wgpipe_pipeline::plan::{plan, profile_layers, PlanError, PlanOptions, Profile};
use wgpipe_pipeline::{
    Balance, CheckpointMode, DeviceSpec, LinkSpec, Pipeline, PipelineError, PlanInputs,
    ScheduleKind, SimCluster,
};
use wgpipe_tensor::Device;
use wgpipe_tests::*;

const N: usize = 12;

fn data() -> (wgpipe_tensor::Tensor, wgpipe_tensor::Tensor) {
    (normal_data(&[N, 8], 81), normal_data(&[N, 6], 82))
}

fn model() -> Vec<Box<dyn Module>> {
    mlp(8, 24, 6, 90)
}

fn profiled() -> (Vec<Box<dyn Module>>, Profile) {
    let (x, y) = data();
    let mut layers = model();
    let sgd_factory = || sgd();
    let p = profile_layers(
        &mut layers,
        &x,
        &y,
        &mse,
        Some(&sgd_factory),
        &Device::cpu(),
    )
    .unwrap();
    (layers, p)
}

/// 2 fast devices with room and 1 slow device with little; a link that costs time.
fn specs() -> Vec<DeviceSpec> {
    vec![
        DeviceSpec {
            flops_per_sec: 2e9,
            memory_bytes: 1 << 20,
        },
        DeviceSpec {
            flops_per_sec: 1e9,
            memory_bytes: 1 << 20,
        },
        DeviceSpec {
            flops_per_sec: 2e9,
            memory_bytes: 1 << 19,
        },
    ]
}

const LINK: LinkSpec = LinkSpec {
    bandwidth_bytes_per_sec: 1e8,
    latency_sec: 2e-6,
};

/// 4 devices for data parallelism: a fast and a slow one twice, all with room.
fn specs4() -> Vec<DeviceSpec> {
    let mut s = specs();
    s[2].memory_bytes = 1 << 20;
    s.push(s[1]);
    s
}

/// Runs `c` on the simulated cluster `specs` for two steps (with its replicas); returns
/// (simulated makespan of the second step, per device peak of its train step, per device peak
/// over the whole run, all-reduce and optimizer step included).
fn run(
    c: &Candidate,
    schedule: &wgpipe_pipeline::Schedule,
    specs: Vec<DeviceSpec>,
) -> (f64, Vec<u64>, Vec<u64>) {
    let (x, y) = data();
    // Unlimited memory: the prediction is checked against what is measured, not the cap.
    let unlimited: Vec<DeviceSpec> = specs
        .into_iter()
        .map(|s| DeviceSpec {
            memory_bytes: u64::MAX,
            ..s
        })
        .collect();
    let cluster = SimCluster::new(&Device::cpu(), &unlimited, LINK).select(&c.order);
    let mut builder = Pipeline::builder(model())
        .sim(cluster.clone())
        .balance(Balance::Explicit(c.balance.clone()))
        .schedule(schedule.clone())
        .optimizer(sgd);
    if c.replicas > 1 {
        builder = builder.replicas(c.replicas, model);
    }
    let mut pipe: Pipeline = builder.build().unwrap();
    let mut last = None;
    for _ in 0..2 {
        let r = pipe.train_step(&x, &y, &mse).unwrap();
        pipe.optimizer_step().unwrap();
        last = Some(r);
    }
    let r = last.unwrap();
    let step_peaks = r.stages.iter().map(|s| s.memory.peak as u64).collect();
    // Peaks since the last step began: its train step and optimizer step.
    let all_peaks = cluster
        .devices()
        .iter()
        .map(|d| d.memory_stats().peak as u64)
        .collect();
    (r.simulated.unwrap().makespan_secs, step_peaks, all_peaks)
}

#[test]
fn predicted_step_time_and_memory_agree_with_the_simulated_cluster() {
    let (_, profile) = profiled();
    let specs = specs();
    let model = CostModel {
        profile: &profile,
        specs: &specs,
        link: LINK,
        batch: N,
    };
    let mut worst = 0.0f64;
    for kind in ScheduleKind::ALL {
        let (k, v) = match kind.default_chunks() {
            1 => (3, 1),
            _ => (2, 2),
        };
        let order: Vec<usize> = vec![2, 0, 1][..k].to_vec();
        for remat in [
            vec![CheckpointMode::Never; k],
            vec![CheckpointMode::Always; k],
            (0..k)
                .map(|d| [CheckpointMode::ExceptLast, CheckpointMode::Never][d % 2])
                .collect(),
        ] {
            let m = 4;
            let always = kind.generate(k, v, m, CheckpointMode::Always).unwrap();
            let schedule = with_remat(&always, &remat);
            let n_stages = k * v;
            let balance = compositions(8, n_stages)[n_stages % 3].clone();
            let c = Candidate {
                order: order.clone(),
                replicas: 1,
                kind,
                chunks: v,
                micro_batches: m,
                balance,
                remat: remat.clone(),
            };
            let facts = ScheduleFacts::of(&schedule);
            let p = model.predict(&c, &schedule, &facts).unwrap();
            let err = check_prediction(&c, &p, &schedule, specs.clone());
            worst = worst.max(err);
        }
    }
    eprintln!("worst time error {:.3}%", worst * 100.0);
}

/// Runs `c` and checks the prediction `p`: simulated step within 5%, every device's measured
/// peaks (train step; whole step with all-reduce and optimizer) at most predicted. Returns
/// the relative time error.
fn check_prediction(
    c: &Candidate,
    p: &wgpipe_pipeline::plan::Prediction,
    schedule: &wgpipe_pipeline::Schedule,
    specs: Vec<DeviceSpec>,
) -> f64 {
    let (measured, step_peaks, all_peaks) = run(c, schedule, specs);
    let what = format!("{:?} R={} remat {:?}", c.kind, c.replicas, c.remat);
    let err = (p.step_secs - measured).abs() / measured;
    eprintln!(
        "{what}: predicted {:.3e} s, simulated {measured:.3e} s ({:+.2}%); peaks predicted {:?} measured {step_peaks:?}",
        p.step_secs,
        (p.step_secs / measured - 1.0) * 100.0,
        p.step_peak_bytes
    );
    assert!(err <= 0.05, "{what}: time off by {:.2}%", err * 100.0);
    assert_eq!(
        step_peaks.len(),
        c.order.len(),
        "{what}: one row per device"
    );
    for (d, (&pred, &got)) in p.step_peak_bytes.iter().zip(&step_peaks).enumerate() {
        assert!(
            got <= pred,
            "{what}: device {d} measured {got} bytes above the predicted {pred}"
        );
    }
    for (d, (&pred, &got)) in p.peak_bytes.iter().zip(&all_peaks).enumerate() {
        assert!(
            got <= pred,
            "{what}: device {d} measured {got} bytes (all-reduce and optimizer step included) above the predicted {pred}"
        );
    }
    err
}

/// Data-parallel candidates (R = 2 of K = 2 on fast/slow pairs, with 1F1B, ZB-H1 and
/// interleaving; R = 3 and 4 of one device each) predicted and then run with replicas: the
/// step with the ring all-reduces within 5%, no device above its predicted peaks.
#[test]
fn predicted_replicated_step_agrees_with_the_simulated_cluster() {
    let (_, profile) = profiled();
    let specs = specs4();
    let model = CostModel {
        profile: &profile,
        specs: &specs,
        link: LINK,
        batch: N,
    };
    let cases = [
        (
            vec![0, 1, 2, 3],
            2,
            ScheduleKind::OneFOneB,
            1,
            3,
            vec![3, 5],
        ),
        (vec![0, 1, 2, 3], 2, ScheduleKind::ZbH1, 1, 2, vec![5, 3]),
        (
            vec![1, 0, 3, 2],
            2,
            ScheduleKind::Interleaved1F1B,
            2,
            2,
            vec![2, 2, 2, 2],
        ),
        (vec![0, 1, 3], 3, ScheduleKind::GPipe, 1, 2, vec![8]),
        (vec![0, 1, 2, 3], 4, ScheduleKind::GPipe, 1, 3, vec![8]),
    ];
    for (order, r, kind, v, m, balance) in cases {
        let k = order.len() / r;
        for remat in [
            vec![CheckpointMode::Never; k],
            vec![CheckpointMode::Always; k],
        ] {
            let always = kind.generate(k, v, m, CheckpointMode::Always).unwrap();
            let schedule = with_remat(&always, &remat);
            let c = Candidate {
                order: order.clone(),
                replicas: r,
                kind,
                chunks: v,
                micro_batches: m,
                balance: balance.clone(),
                remat,
            };
            let p = model
                .predict(&c, &schedule, &ScheduleFacts::of(&schedule))
                .unwrap();
            assert_eq!(p.step_peak_bytes.len(), r * k);
            check_prediction(&c, &p, &schedule, specs.clone());
        }
    }
}

#[test]
fn no_fit_names_the_device_bytes_and_smallest_memory() {
    let (_, profile) = profiled();
    let tiny: Vec<DeviceSpec> = specs()
        .into_iter()
        .map(|s| DeviceSpec {
            memory_bytes: 4096,
            ..s
        })
        .collect();
    let e = plan(&profile, &tiny, LINK, N, &PlanOptions::default()).unwrap_err();
    let PlanError::NoFit(nf) = &e else {
        panic!("{e}")
    };
    assert_eq!(nf.available, 4096);
    assert!(nf.needed > 4096);
    let msg = e.to_string();
    eprintln!("{msg}");
    assert!(msg.contains(&format!("device {}", nf.device)), "{msg}");
    assert!(msg.contains(&nf.needed.to_string()), "{msg}");
    // With every device at the reported smallest memory, a plan exists.
    let enough: Vec<DeviceSpec> = tiny
        .iter()
        .map(|s| DeviceSpec {
            memory_bytes: nf.smallest_memory,
            ..*s
        })
        .collect();
    plan(&profile, &enough, LINK, N, &PlanOptions::default()).unwrap();
    let _ = PipelineError::Plan(e);
}

/// Every ordered choice of `k` of `n` devices.
fn ordered_subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for rest in ordered_subsets(n, k - 1) {
        for d in 0..n {
            if !rest.contains(&d) {
                let mut o = rest.clone();
                o.push(d);
                out.push(o);
            }
        }
    }
    out
}

/// Every per-device re-materialization of `k` devices.
fn remat_choices(k: usize) -> Vec<Vec<CheckpointMode>> {
    let modes = [
        CheckpointMode::Never,
        CheckpointMode::ExceptLast,
        CheckpointMode::Always,
    ];
    (0..3usize.pow(k as u32))
        .map(|mut code| {
            (0..k)
                .map(|_| {
                    let m = modes[code % 3];
                    code /= 3;
                    m
                })
                .collect()
        })
        .collect()
}

/// The search against brute force over the same space (device subsets in every order, kinds,
/// M, every balance, every per-device re-materialization), with memories tight enough that the
/// fastest configurations do not fit: both the exact mode (few balances, all tried) and the
/// heuristic mode (min-max balances refined by moving boundaries) are within 1% of the optimum.
#[test]
fn search_is_within_one_percent_of_exhaustive_enumeration() {
    let (_, profile) = profiled();
    let mut specs = specs();
    for (s, cap) in specs.iter_mut().zip([26_000u64, 22_000, 16_000]) {
        s.memory_bytes = cap;
    }
    let kinds = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
    ];
    let ms = vec![2, 4, 6];
    let model = CostModel {
        profile: &profile,
        specs: &specs,
        link: LINK,
        batch: N,
    };
    let mut best = f64::INFINITY;
    let mut best_c = None;
    let mut tried = 0usize;
    for k in 1..=specs.len() {
        for order in ordered_subsets(specs.len(), k) {
            for kind in kinds {
                let v = if kind == ScheduleKind::Interleaved1F1B {
                    2
                } else {
                    1
                };
                if k * v > profile.layers.len() || (v > 1 && k == 1) {
                    continue;
                }
                for &m in &ms {
                    let always = kind.generate(k, v, m, CheckpointMode::Always).unwrap();
                    for remat in remat_choices(k) {
                        let schedule = with_remat(&always, &remat);
                        let facts = ScheduleFacts::of(&schedule);
                        for balance in compositions(profile.layers.len(), k * v) {
                            let c = Candidate {
                                order: order.clone(),
                                replicas: 1,
                                kind,
                                chunks: v,
                                micro_batches: m,
                                balance,
                                remat: remat.clone(),
                            };
                            let p = model.predict(&c, &schedule, &facts).unwrap();
                            tried += 1;
                            let fits = p
                                .peak_bytes
                                .iter()
                                .zip(&c.order)
                                .all(|(&b, &d)| b <= specs[d].memory_bytes);
                            if fits && p.step_secs < best {
                                best = p.step_secs;
                                best_c = Some(c);
                            }
                        }
                    }
                }
            }
        }
    }
    let best_c = best_c.expect("something fits");
    eprintln!("exhaustive: {tried} configurations, best {best:.4e} s: {best_c:?}");
    assert!(
        best_c.remat.iter().any(|&m| m != CheckpointMode::Never),
        "the memories should be tight enough that the optimum re-materializes somewhere"
    );
    for (what, exhaustive_balances) in [("exact", usize::MAX), ("heuristic", 0)] {
        let options = PlanOptions {
            kinds: kinds.to_vec(),
            chunks: vec![2],
            micro_batches: Some(ms.clone()),
            exhaustive_balances,
            ..PlanOptions::default()
        };
        let r = plan(&profile, &specs, LINK, N, &options).unwrap();
        let got = r.best.prediction.step_secs;
        eprintln!(
            "{what} search: {} predicted, best {got:.4e} s ({:.3}x the exhaustive optimum): {:?}",
            r.evaluated,
            got / best,
            r.best.candidate
        );
        assert!(
            got >= best * (1.0 - 1e-9),
            "{what}: better than the optimum?"
        );
        assert!(got <= best * 1.01, "{what}: {got} vs optimum {best}");
    }
}

/// `builder.plan(..)` end to end on a Transformer LM and 4 unequal devices: the chosen plan
/// builds, trains, and the simulated cluster measures what was predicted.
#[test]
fn planned_transformer_runs_as_predicted() {
    let layers = deep_transformer(0.0, 5);
    let cfg = transformer_cfg(0.0);
    let x = token_ids(N, cfg.seq_len, cfg.vocab, 1);
    let y = token_ids(N, cfg.seq_len, cfg.vocab, 2);
    let loss = |out: &wgpipe_autograd::Var, t: &wgpipe_tensor::Tensor| cross_entropy(out, t);
    let specs = vec![
        DeviceSpec {
            flops_per_sec: 4e9,
            memory_bytes: 400_000,
        },
        DeviceSpec {
            flops_per_sec: 4e9,
            memory_bytes: 400_000,
        },
        DeviceSpec {
            flops_per_sec: 1e9,
            memory_bytes: 250_000,
        },
        DeviceSpec {
            flops_per_sec: 1e9,
            memory_bytes: 250_000,
        },
    ];
    let cluster = SimCluster::new(&Device::cpu(), &specs, LINK);
    let inputs = PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &loss,
        batch: N,
        options: PlanOptions::default(),
    };
    let (builder, report, _) = Pipeline::builder(layers)
        .optimizer(sgd)
        .plan(&cluster, &inputs)
        .unwrap();
    eprintln!("{report}");
    check_planned(builder, &report, &x, &y, &loss, "transformer");
    for (d, &dev) in report.best.candidate.order.iter().enumerate() {
        assert!(report.best.prediction.peak_bytes[d] <= specs[dev].memory_bytes);
    }
}

/// Builds the planned pipeline, trains two steps, and checks the second against the plan: the
/// simulated step within 5% of the prediction, every device's measured peak at most predicted.
fn check_planned(
    builder: wgpipe_pipeline::PipelineBuilder,
    report: &wgpipe_pipeline::PlanReport,
    x: &wgpipe_tensor::Tensor,
    y: &wgpipe_tensor::Tensor,
    loss: &wgpipe_pipeline::LossFn,
    what: &str,
) {
    let mut pipe = builder.seed(SEED).build().unwrap();
    let mut r = None;
    for _ in 0..2 {
        r = Some(pipe.train_step(x, y, loss).unwrap());
        pipe.optimizer_step().unwrap();
    }
    let r = r.unwrap();
    let measured = r.simulated.unwrap().makespan_secs;
    let p = &report.best.prediction;
    let c = &report.best.candidate;
    eprintln!(
        "{what}: {:?} K={} M={} balance {:?}: predicted {:.4e} s, simulated {measured:.4e} s; peaks {:?} <= {:?}",
        c.kind,
        c.order.len(),
        c.micro_batches,
        c.balance,
        p.step_secs,
        r.stages.iter().map(|s| s.memory.peak).collect::<Vec<_>>(),
        p.step_peak_bytes
    );
    assert!((p.step_secs / measured - 1.0).abs() <= 0.05, "{what}");
    for (d, s) in r.stages.iter().enumerate() {
        assert!(
            s.memory.peak as u64 <= p.step_peak_bytes[d],
            "{what} device {d}: measured {} above predicted {}",
            s.memory.peak,
            p.step_peak_bytes[d]
        );
    }
}

/// A ResNet with batch norm (statistics kept from each forward until the step ends), planned on
/// 3 devices of two speeds; every schedule kind forced in turn, so the memory walk meets each.
#[test]
fn planned_resnet_runs_as_predicted_under_every_schedule() {
    use wgpipe_models::ResNet;
    let net = ResNet {
        blocks: vec![1, 1],
        width: 4,
        num_classes: 5,
        in_channels: 3,
    };
    let x = normal_data(&[16, 3, 8, 8], 91);
    let y = wgpipe_tensor::Tensor::from_vec(
        (0..16).map(|i| (i % 5) as f32).collect(),
        &[16],
        &Device::cpu(),
    )
    .unwrap();
    let loss = |out: &wgpipe_autograd::Var, t: &wgpipe_tensor::Tensor| cross_entropy(out, t);
    let specs = vec![
        DeviceSpec {
            flops_per_sec: 3e9,
            memory_bytes: 1 << 30,
        },
        DeviceSpec {
            flops_per_sec: 1e9,
            memory_bytes: 1 << 30,
        },
        DeviceSpec {
            flops_per_sec: 3e9,
            memory_bytes: 1 << 30,
        },
    ];
    let cluster = SimCluster::new(&Device::cpu(), &specs, LINK);
    for kind in ScheduleKind::ALL {
        let inputs = PlanInputs {
            inputs: &x,
            targets: &y,
            loss: &loss,
            batch: 16,
            options: PlanOptions {
                kinds: vec![kind],
                chunks: vec![2],
                micro_batches: Some(vec![2, 4]),
                ..PlanOptions::default()
            },
        };
        let (builder, report, _) = Pipeline::builder(net.build(3, &Device::cpu()).unwrap())
            .optimizer(sgd)
            .plan(&cluster, &inputs)
            .unwrap();
        check_planned(builder, &report, &x, &y, &loss, &format!("{kind:?}"));
    }
}

/// A model with skips across stages (spans of 1 to 3 stages, one identity, two linear), planned
/// on 3 unequal devices with every schedule kind forced: the skip transfers the builder adds
/// are in the predicted step, the skips the consumers hold in the predicted peaks.
#[test]
fn planned_skip_model_runs_as_predicted_under_every_schedule() {
    let x = normal_data(&[N, 6], 83);
    let y = normal_data(&[N, 3], 84);
    let cluster = SimCluster::new(&Device::cpu(), &specs(), LINK);
    for kind in ScheduleKind::ALL {
        let inputs = PlanInputs {
            inputs: &x,
            targets: &y,
            loss: &mse,
            batch: N,
            options: PlanOptions {
                kinds: vec![kind],
                chunks: vec![2],
                micro_batches: Some(vec![2, 3, 4]),
                ..PlanOptions::default()
            },
        };
        let (builder, report, _) = Pipeline::builder(skip_model(7))
            .optimizer(sgd)
            .plan(&cluster, &inputs)
            .unwrap();
        check_planned(builder, &report, &x, &y, &mse, &format!("skips {kind:?}"));
    }
}

/// AmoebaNet-D (each cell pops the previous cell's input) planned end to end.
#[test]
fn planned_amoebanet_d_runs_as_predicted() {
    use wgpipe_models::AmoebaNet;
    let net = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 3,
        in_channels: 3,
    };
    let x = normal_data(&[8, 3, 8, 8], 92);
    let y = wgpipe_tensor::Tensor::from_vec(
        (0..8).map(|i| (i % 3) as f32).collect(),
        &[8],
        &Device::cpu(),
    )
    .unwrap();
    let loss = |out: &wgpipe_autograd::Var, t: &wgpipe_tensor::Tensor| cross_entropy(out, t);
    let cluster = SimCluster::new(&Device::cpu(), &specs(), LINK);
    let inputs = PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &loss,
        batch: 8,
        options: PlanOptions {
            chunks: vec![2],
            micro_batches: Some(vec![1, 2]),
            ..PlanOptions::default()
        },
    };
    let (builder, report, _) = Pipeline::builder(net.build(5, &Device::cpu()).unwrap())
        .optimizer(sgd)
        .plan(&cluster, &inputs)
        .unwrap();
    eprintln!("{report}");
    check_planned(builder, &report, &x, &y, &loss, "amoebanet");
}
