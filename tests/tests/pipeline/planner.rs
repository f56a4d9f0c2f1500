//! The planner: its cost model against the simulated cluster (time within 5%, measured peak
//! memory never above the prediction), its search against exhaustive enumeration of the same
//! space, and the error when nothing fits.

use wgpipe_autograd::Module;
use wgpipe_pipeline::plan::cost::{with_remat, Candidate, CostModel, ScheduleFacts};
use wgpipe_pipeline::plan::search::compositions;
use wgpipe_pipeline::plan::{plan, plan_on, profile_layers, PlanError, PlanOptions, Profile};
use wgpipe_pipeline::{
    Balance, CheckpointMode, DeviceSpec, LinkSpec, Pipeline, PipelineError, PlanInputs,
    ScheduleKind, SimCluster, Topology,
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

/// [`specs`] with these memories: tight enough that re-materialization and the balance
/// decide what fits.
fn capped_specs(caps: [u64; 3]) -> Vec<DeviceSpec> {
    let mut specs = specs();
    for (s, cap) in specs.iter_mut().zip(caps) {
        s.memory_bytes = cap;
    }
    specs
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

/// The cost model of `profile` on `specs` joined by `links` for the tests' mini-batch of N.
fn cost_model<'a>(
    profile: &'a Profile,
    specs: &'a [DeviceSpec],
    links: &'a Topology,
) -> CostModel<'a> {
    CostModel {
        profile,
        specs,
        links,
        batch: N,
    }
}

/// 4 devices for data parallelism: a fast and a slow one twice, all with room.
fn specs4() -> Vec<DeviceSpec> {
    let mut s = specs();
    s[2].memory_bytes = 1 << 20;
    s.push(s[1]);
    s
}

/// Runs `c` on the simulated cluster `specs` joined by `links` for two steps (with its replicas) on the first
/// `rows` samples; returns (simulated makespan of the second step, per device peak of its
/// train step, per device peak over the whole run, all-reduce and optimizer step included).
fn run_on(
    c: &Candidate,
    schedule: &wgpipe_pipeline::Schedule,
    specs: Vec<DeviceSpec>,
    rows: usize,
    links: &Topology,
) -> (f64, Vec<u64>, Vec<u64>) {
    let (x, y) = data();
    let (x, y) = (x.narrow(0, 0, rows).unwrap(), y.narrow(0, 0, rows).unwrap());
    // Unlimited memory: the prediction is checked against what is measured, not the cap.
    let unlimited: Vec<DeviceSpec> = specs
        .into_iter()
        .map(|s| DeviceSpec {
            memory_bytes: u64::MAX,
            ..s
        })
        .collect();
    let cluster = SimCluster::on(&Device::cpu(), &unlimited, links.clone())
        .unwrap()
        .select(&c.order);
    let mut builder = Pipeline::builder(model())
        .sim(cluster.clone())
        .balance(Balance::Explicit(c.balance.clone()))
        .schedule(schedule.clone())
        .checkpoint_layers(c.checkpoint_layers.clone())
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
    let flat = Topology::flat(LINK);
    let model = cost_model(&profile, &specs, &flat);
    let mut worst = 0.0f64;
    for kind in ScheduleKind::ALL {
        let (k, v) = match kind.default_chunks() {
            1 => (3, 1),
            _ => (2, 2),
        };
        let order: Vec<usize> = vec![2, 0, 1][..k].to_vec();
        // By stage: uniform, and modes alternating so that with two chunks each device holds
        // one re-materialized stage and one that is not (a mix on one device); each without
        // and with layers checkpointed inside the stages (runs at a stage's start, inside it
        // and at its end, depending on the balance).
        let stages = k * v;
        let modes: [Vec<CheckpointMode>; 3] = [
            vec![CheckpointMode::Never; stages],
            vec![CheckpointMode::Always; stages],
            (0..stages)
                .map(|s| [CheckpointMode::ExceptLast, CheckpointMode::Never][(s / k + s) % 2])
                .collect(),
        ];
        for (remat, checkpoint_layers) in modes
            .into_iter()
            .flat_map(|r| [(r.clone(), vec![]), (r, vec![0, 1, 3, 4, 5, 7])])
        {
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
                checkpoint_layers,
            };
            let facts = ScheduleFacts::of(&schedule);
            let p = model.predict(&c, &schedule, &facts).unwrap();
            let err = check_prediction(&c, &p, &schedule, specs.clone(), N, model.links);
            worst = worst.max(err);
        }
    }
    eprintln!("worst time error {:.3}%", worst * 100.0);
}

/// Runs `c` on `rows` samples and checks the prediction `p`: simulated step within 5%, every
/// device's measured peaks (train step; whole step with all-reduce and optimizer) at most
/// predicted. Returns the relative time error.
fn check_prediction(
    c: &Candidate,
    p: &wgpipe_pipeline::plan::Prediction,
    schedule: &wgpipe_pipeline::Schedule,
    specs: Vec<DeviceSpec>,
    rows: usize,
    links: &Topology,
) -> f64 {
    let (measured, step_peaks, all_peaks) = run_on(c, schedule, specs, rows, links);
    let what = format!(
        "{:?} R={} batch {rows} remat {:?} checkpointed layers {:?}",
        c.kind, c.replicas, c.remat, c.checkpoint_layers
    );
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
    let flat = Topology::flat(LINK);
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
    // Uneven shares too: 9 samples on 2 replicas (5 + 4), 10 on 3 (4 + 3 + 3).
    let uneven = [
        (
            9,
            vec![0, 1, 2, 3],
            2,
            ScheduleKind::OneFOneB,
            1,
            2,
            vec![4, 4],
        ),
        (10, vec![0, 1, 3], 3, ScheduleKind::GPipe, 1, 2, vec![8]),
    ];
    let cases: Vec<_> = cases
        .into_iter()
        .map(|(o, r, kind, v, m, b)| (N, o, r, kind, v, m, b))
        .chain(uneven)
        .collect();
    // On one kind of link, and on two nodes of two devices with a slow link between them
    // (each transfer and ring priced on the links it crosses, by the runtime as by the
    // prediction).
    let nodes = two_nodes();
    for links in [&flat, &nodes] {
        check_replicated_cases(&profile, &specs, links, &cases);
    }
}

type ReplicatedCase = (
    usize,
    Vec<usize>,
    usize,
    ScheduleKind,
    usize,
    usize,
    Vec<usize>,
);

/// 4 devices in 2 nodes of 2: [`LINK`] inside a node, a link 20 times slower between them.
fn two_nodes() -> Topology {
    let slow = LinkSpec {
        bandwidth_bytes_per_sec: LINK.bandwidth_bytes_per_sec / 20.0,
        latency_sec: 10.0 * LINK.latency_sec,
    };
    Topology::nodes(4, 2, LINK, slow).unwrap()
}

fn check_replicated_cases(
    profile: &Profile,
    specs: &[DeviceSpec],
    links: &Topology,
    cases: &[ReplicatedCase],
) {
    let model = cost_model(profile, specs, links);
    for (batch, order, r, kind, v, m, balance) in cases.iter().cloned() {
        let model = CostModel { batch, ..model };
        let k = order.len() / r;
        for remat in [
            vec![CheckpointMode::Never; k * v],
            vec![CheckpointMode::Always; k * v],
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
                checkpoint_layers: Vec::new(),
            };
            let p = model
                .predict(&c, &schedule, &ScheduleFacts::of(&schedule))
                .unwrap();
            assert_eq!(p.step_peak_bytes.len(), r * k);
            check_prediction(&c, &p, &schedule, specs.to_vec(), batch, model.links);
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
    // A planner error can carry a pipeline error, not the reverse.
    let _ = PlanError::from(PipelineError::Config(e.to_string()));
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

/// Every per-stage re-materialization of `k` stages.
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

/// The best fitting configuration by brute force: R replicas of K devices (R x K at most the
/// devices), every ordered choice of R x K devices, `kinds` (interleaved with v = 2), `ms`
/// (within each replica's share), every balance, and every per-stage re-materialization or,
/// when `remat_all` is false, none (the search re-materializes only to fit, so with memory to
/// spare that is its whole space). Returns (best step, its candidate, configurations tried).
fn brute_force(
    model: &CostModel<'_>,
    kinds: &[ScheduleKind],
    ms: &[usize],
    remat_all: bool,
) -> (f64, Candidate, usize) {
    brute_force_from(model, kinds, ms, remat_all, 1)
}

/// [`brute_force`] over pipelines of at least `min_stages` devices.
fn brute_force_from(
    model: &CostModel<'_>,
    kinds: &[ScheduleKind],
    ms: &[usize],
    remat_all: bool,
    min_stages: usize,
) -> (f64, Candidate, usize) {
    let specs = model.specs;
    let layers = model.profile.layers.len();
    let mut best = f64::INFINITY;
    let mut best_c = None;
    let mut tried = 0usize;
    for r in 1..=specs.len() {
        for k in min_stages..=specs.len() / r {
            for order in ordered_subsets(specs.len(), r * k) {
                for &kind in kinds {
                    let v = if kind == ScheduleKind::Interleaved1F1B {
                        2
                    } else {
                        1
                    };
                    if k * v > layers || (v > 1 && k == 1) {
                        continue;
                    }
                    for &m in ms.iter().filter(|&&m| m <= model.batch / r) {
                        let always = kind.generate(k, v, m, CheckpointMode::Always).unwrap();
                        let remats = if remat_all {
                            remat_choices(k * v)
                        } else {
                            vec![vec![CheckpointMode::Never; k * v]]
                        };
                        for remat in remats {
                            let schedule = with_remat(&always, &remat);
                            let facts = ScheduleFacts::of(&schedule);
                            for balance in compositions(layers, k * v) {
                                let c = Candidate {
                                    order: order.clone(),
                                    replicas: r,
                                    kind,
                                    chunks: v,
                                    micro_batches: m,
                                    balance,
                                    remat: remat.clone(),
                                    checkpoint_layers: Vec::new(),
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
    }
    (best, best_c.expect("something fits"), tried)
}

/// The exact search (every balance tried) and the heuristic one (min-max balances refined by
/// moving boundaries) for `model`'s batch against the brute-force optimum `best`: within 1%,
/// never below it.
fn check_search_against(
    model: &CostModel<'_>,
    kinds: &[ScheduleKind],
    ms: &[usize],
    best: f64,
) -> Candidate {
    let mut chosen = None;
    for (what, exhaustive_balances) in [("exact", usize::MAX), ("heuristic", 0)] {
        let options = PlanOptions {
            kinds: kinds.to_vec(),
            chunks: vec![2],
            micro_batches: Some(ms.to_vec()),
            exhaustive_balances,
            // Brute force enumerates whole stages' modes: the search is held to that space
            // (checkpointed layers are tested against the same search without them).
            layer_remat: false,
            ..PlanOptions::default()
        };
        let r = plan_on(
            model.profile,
            model.specs,
            model.links,
            model.batch,
            &options,
        )
        .unwrap();
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
        chosen.get_or_insert(r.best.candidate);
    }
    chosen.unwrap()
}

/// The search against brute force over the same space (replicas, device subsets in every
/// order, kinds, M, every balance, every per-stage re-materialization), with memories tight
/// enough that the fastest configurations do not fit: both the exact mode (few balances, all
/// tried) and the heuristic mode (min-max balances refined by moving boundaries) are within 1%
/// of the optimum.
#[test]
fn search_is_within_one_percent_of_exhaustive_enumeration() {
    let (_, profile) = profiled();
    let specs = capped_specs([26_000u64, 22_000, 16_000]);
    let kinds = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::Interleaved1F1B,
    ];
    let ms = [2, 4, 6];
    let flat = Topology::flat(LINK);
    let model = cost_model(&profile, &specs, &flat);
    let (best, best_c, tried) = brute_force(&model, &kinds, &ms, true);
    eprintln!("exhaustive: {tried} configurations, best {best:.4e} s: {best_c:?}");
    assert!(
        best_c.remat.iter().any(|&m| m != CheckpointMode::Never),
        "the memories should be tight enough that the optimum re-materializes somewhere"
    );
    check_search_against(&model, &kinds, &ms, best);
}

/// With replicas in the space: 4 devices (a fast and a slow one twice) and a fast link, where
/// data parallelism pays. Brute force over every R x K <= 4, ordered device choice, kind, M and
/// balance (memory to spare: nothing is re-materialized); the optimum has R > 1, and the search
/// finds it within 1%.
#[test]
fn search_with_replicas_is_within_one_percent_of_exhaustive_enumeration() {
    let (_, profile) = profiled();
    let specs = specs4();
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e10,
        latency_sec: 1e-7,
    };
    let kinds = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];
    let ms = [1, 2, 3];
    let flat = Topology::flat(link);
    let model = CostModel {
        profile: &profile,
        specs: &specs,
        links: &flat,
        batch: N,
    };
    let (best, best_c, tried) = brute_force(&model, &kinds, &ms, false);
    eprintln!("exhaustive: {tried} configurations, best {best:.4e} s: {best_c:?}");
    assert!(best_c.replicas > 1, "data parallelism should pay here");
    let chosen = check_search_against(&model, &kinds, &ms, best);
    assert!(chosen.replicas > 1, "{chosen:?}");
    // 9 samples: the replicas' shares differ (5 + 4, 3 + 3 + 3, 3 + 2 + 2 + 2), so layouts that
    // swap replicas are different candidates; the search still finds the optimum.
    let model = CostModel { batch: 9, ..model };
    let (best, best_c, tried) = brute_force(&model, &[ScheduleKind::OneFOneB], &[1, 2], false);
    eprintln!("exhaustive, 9 samples: {tried} configurations, best {best:.4e} s: {best_c:?}");
    check_search_against(&model, &[ScheduleKind::OneFOneB], &[1, 2], best);
    // Pure data parallelism (K = 1) wins there; `min_stages` keeps a pipeline, and the search
    // finds the best of those.
    assert_eq!(best_c.pipeline_devices(), 1, "{best_c:?}");
    let (best2, best2_c, _) =
        brute_force_from(&model, &[ScheduleKind::OneFOneB], &[1, 2], false, 2);
    let options = PlanOptions {
        kinds: vec![ScheduleKind::OneFOneB],
        micro_batches: Some(vec![1, 2]),
        min_stages: 2,
        ..PlanOptions::default()
    };
    let r = plan(&profile, &specs, link, 9, &options).unwrap();
    let got = &r.best;
    eprintln!("min_stages 2: best {best2:.4e} s {best2_c:?}; search {got:?}");
    assert!(got.candidate.pipeline_devices() >= 2, "{:?}", got.candidate);
    assert!(
        got.prediction.step_secs <= best2 * 1.01,
        "{} vs {best2}",
        got.prediction.step_secs
    );
    let too_many = PlanOptions {
        min_stages: 5,
        ..options
    };
    let err = plan(&profile, &specs, link, 9, &too_many)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least 5 stages"), "{err}");
}

/// On a two-level cluster (two nodes of a fast and a slow device; a fast link inside a node,
/// one a hundred times slower between them), brute force over the same space as above (every
/// R x K, ordered device choice, kind, M and balance, nothing re-materialized), priced on the
/// links each candidate crosses: the search is within 1% of the optimum, exact and heuristic.
/// The slow link moves the optimum: it differs from the one-level cluster's, and crosses
/// between the nodes less.
#[test]
fn search_on_two_nodes_is_within_one_percent_of_exhaustive_enumeration() {
    let (_, profile) = profiled();
    let specs = specs4();
    let fast = LinkSpec {
        bandwidth_bytes_per_sec: 1e10,
        latency_sec: 1e-7,
    };
    let slow = LinkSpec {
        bandwidth_bytes_per_sec: 1e8,
        latency_sec: 1e-5,
    };
    // specs4 is fast, slow, fast, slow: each node holds one of each.
    let nodes = Topology::nodes(4, 2, fast, slow).unwrap();
    let flat = Topology::flat(fast);
    let kinds = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];
    let ms = [1, 2, 3];
    let on_nodes = cost_model(&profile, &specs, &nodes);
    let (best, best_c, tried) = brute_force(&on_nodes, &kinds, &ms, false);
    eprintln!("exhaustive on two nodes: {tried} configurations, best {best:.4e} s: {best_c:?}");
    let (flat_best, flat_c, _) =
        brute_force(&cost_model(&profile, &specs, &flat), &kinds, &ms, false);
    eprintln!("exhaustive on one node: best {flat_best:.4e} s: {flat_c:?}");
    let crossings = |c: &Candidate| {
        let k = c.pipeline_devices();
        let stage_links = (0..c.replicas)
            .flat_map(|r| (1..k).map(move |d| (r * k + d - 1, r * k + d)))
            .filter(|&(a, b)| nodes.node(c.order[a]) != nodes.node(c.order[b]))
            .count();
        let rings = (0..k)
            .filter(|&d| {
                let ring = (0..c.replicas).map(|r| c.order[r * k + d]);
                nodes.ring_link(ring) == slow
            })
            .count();
        stage_links + rings
    };
    assert!(
        best > flat_best * 1.01,
        "the slow link between nodes should cost the one-level optimum time"
    );
    assert!(
        crossings(&best_c) < crossings(&flat_c),
        "the optimum on two nodes should cross between them less than the one-level one: \
         {best_c:?} vs {flat_c:?}"
    );
    let chosen = check_search_against(&on_nodes, &kinds, &ms, best);
    assert_eq!(crossings(&chosen), crossings(&best_c), "{chosen:?}");
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
        "{what}: {:?} R={} K={} M={} balance {:?}: predicted {:.4e} s, simulated {measured:.4e} s; peaks {:?} <= {:?}",
        c.kind,
        c.replicas,
        c.pipeline_devices(),
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

/// A small ResNet (with batch norm) and 16 images of 5 classes for it.
fn small_resnet() -> (
    wgpipe_models::ResNet,
    wgpipe_tensor::Tensor,
    wgpipe_tensor::Tensor,
) {
    let net = wgpipe_models::ResNet {
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
    (net, x, y)
}

/// A ResNet with batch norm (statistics kept from each forward until the step ends), planned on
/// 3 devices of two speeds; every schedule kind forced in turn, so the memory walk meets each.
#[test]
fn planned_resnet_runs_as_predicted_under_every_schedule() {
    let (net, x, y) = small_resnet();
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
    // The synthesized schedule's plan here (K = 3, M = 4) has the last device send three input
    // gradients before the previous device can be known to have taken any: in some thread
    // timings all three are still held when the third is checked, while that backward's tape
    // is alive (which the walk once left out of the check's peak).
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

/// Timed profiling (rounds over all layers) times every layer and the loss, and leaves what it
/// found: parameter gradients (one set beforehand, the others none) and batch-norm statistics,
/// bit for bit; on a model with batch norm and on one whose layers pop skips.
#[test]
fn timed_profiling_measures_every_layer_and_leaves_the_model_as_it_was() {
    let (resnet, x, y) = small_resnet();
    let ce = |out: &wgpipe_autograd::Var, t: &wgpipe_tensor::Tensor| cross_entropy(out, t);
    check_timed_profile(
        "resnet",
        resnet.build(3, &Device::cpu()).unwrap(),
        &x,
        &y,
        &ce,
    );
    let (x, y) = (normal_data(&[N, 6], 94), normal_data(&[N, 3], 95));
    check_timed_profile("skips", skip_model(7), &x, &y, &mse);
}

fn check_timed_profile(
    name: &str,
    mut layers: Vec<Box<dyn Module>>,
    x: &wgpipe_tensor::Tensor,
    y: &wgpipe_tensor::Tensor,
    loss: &wgpipe_pipeline::LossFn,
) {
    use wgpipe_pipeline::plan::{profile_layers_timed, ProfileRun};
    let bits = |t: &wgpipe_tensor::Tensor| -> Vec<u32> {
        t.to_vec().unwrap().into_iter().map(f32::to_bits).collect()
    };
    let state = |layers: &[Box<dyn Module>]| -> Vec<(String, Option<Vec<u32>>)> {
        layers
            .iter()
            .flat_map(|l| {
                let grads = l
                    .parameters()
                    .into_iter()
                    .map(|(n, p)| (format!("grad {n}"), p.grad().map(|g| bits(&g))));
                let buffers = l
                    .buffers()
                    .into_iter()
                    .map(|(n, b)| (format!("buffer {n}"), Some(bits(&b.value()))));
                grads.chain(buffers).collect::<Vec<_>>()
            })
            .collect()
    };
    let (_, p) = layers.iter().flat_map(|l| l.parameters()).nth(1).unwrap();
    p.set_grad(Some(normal_data(p.value().shape(), 96)));
    let before = state(&layers);
    assert!(before
        .iter()
        .any(|(n, g)| n.starts_with("grad") && g.is_some()));
    let run = ProfileRun {
        reps: 3,
        ..ProfileRun::default()
    };
    let profile = profile_layers_timed(&mut layers, x, y, loss, None, &Device::cpu(), run).unwrap();
    let after = state(&layers);
    assert_eq!(after.len(), before.len());
    for (a, b) in after.iter().zip(&before) {
        assert!(a == b, "{name}: {} changed", b.0);
    }
    let b = 2 * profile.profiled_at;
    for (i, l) in profile.layers.iter().enumerate() {
        let t = [
            l.forward_secs.at(b),
            l.backward_secs.at(b),
            l.backward_input_secs.at(b),
            l.backward_weight_secs.at(b),
        ];
        assert!(t.iter().all(|t| *t > 0.0), "{name} layer {i}: {t:?}");
    }
    assert!(profile.loss.secs.at(b) > 0.0, "{name}: loss not timed");
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

/// `builder.plan_replicated(..)` end to end: where data parallelism pays (4 devices, a fast
/// link), the plan has R > 1, builds with its replicas, trains, and the simulated cluster
/// measures what was predicted (the all-reduces included).
#[test]
fn planned_replicas_run_as_predicted() {
    let (x, y) = data();
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e10,
        latency_sec: 1e-7,
    };
    let cluster = SimCluster::new(&Device::cpu(), &specs4(), link);
    let inputs = PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &mse,
        batch: N,
        options: PlanOptions::default(),
    };
    let (builder, report, _) = Pipeline::builder(model())
        .optimizer(sgd)
        .plan_replicated(&cluster, &inputs, model)
        .unwrap();
    eprintln!("{report}");
    assert!(report.best.candidate.replicas > 1, "{report}");
    check_planned(builder, &report, &x, &y, &mse, "replicated mlp");
}

/// A test layer that does `k` times its inner layer's work: the mean of `k` applications.
struct Repeat {
    inner: ShiftLinear,
    k: usize,
}

impl Module for Repeat {
    fn name(&self) -> String {
        format!("Repeat{}x({})", self.k, self.inner.name())
    }
    fn forward(
        &self,
        x: &wgpipe_autograd::Var,
        ctx: &wgpipe_autograd::ForwardCtx,
    ) -> wgpipe_tensor::Result<wgpipe_autograd::Var> {
        let mut sum = self.inner.forward(x, ctx)?;
        for _ in 1..self.k {
            sum = sum.add(&self.inner.forward(x, ctx)?)?;
        }
        sum.mul_scalar(1.0 / self.k as f32)
    }
    fn parameters(&self) -> Vec<(String, wgpipe_autograd::Param)> {
        self.inner.parameters()
    }
    fn cost(&self, input_shape: &[usize]) -> wgpipe_autograd::CostHint {
        let mut c = self.inner.cost(input_shape);
        c.flops *= self.k as f64;
        c
    }
}

const WIDTH: usize = 96;

/// Six layers of width 96; with `slow`, the first does 8 times the work.
fn timed_model(slow: bool) -> Vec<Box<dyn Module>> {
    (0..6)
        .map(|i| -> Box<dyn Module> {
            let inner = ShiftLinear::new(WIDTH, 70 + i as u64);
            if slow && i == 0 {
                Box::new(Repeat { inner, k: 8 })
            } else {
                Box::new(inner)
            }
        })
        .collect()
}

/// Planning real CPU devices from measured layer times: every layer's times are measured and
/// positive, the measured profile is what the plan uses (FLOPs = seconds x rate), a layer that
/// does 8 times the work measures several times slower and gets a stage of its own share, and
/// the planned pipeline runs; its predicted step is printed beside the measured wall step (no
/// timed assertion: the machine is shared).
#[test]
fn measured_layer_times_plan_real_cpu_devices() {
    let x = normal_data(&[N, WIDTH], 85);
    let y = normal_data(&[N, WIDTH], 86);
    let devices: Vec<Device> = (0..2)
        .map(|i| Device::new_cpu(&format!("cpu{i}")))
        .collect();
    let inputs = PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &mse,
        batch: N,
        options: PlanOptions {
            kinds: vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB],
            measure_reps: 5,
            // Two stages: with one allowed, the slow model's best two-stage plans predicted
            // within 1% of the one-device plan (the slow layer bounds both), and in two CI
            // trials the planner took one device there, a fine choice that failed this test.
            min_stages: 2,
            ..PlanOptions::default()
        },
    };
    // (slow, the first stage's layers) of each plan. The slow model is planned again, up to
    // three times, while its plan does not isolate the slow layer: on a busy machine one
    // measurement can be off (a run beside the other tests once gave [3, 3]), three in a row
    // would mean the planner does not follow the measured times.
    let isolated = |plans: &[(bool, usize)]| plans.iter().any(|&(slow, first)| slow && first <= 2);
    let mut first_stage: Vec<(bool, usize)> = Vec::new();
    for slow in [false, true, true, true] {
        if isolated(&first_stage) {
            break;
        }
        let (builder, report, profile) = Pipeline::builder(timed_model(slow))
            .optimizer(sgd)
            .plan_devices(&devices, &inputs)
            .unwrap();
        assert_eq!(profile.timed_reps, 5);
        let b = 2 * profile.profiled_at;
        for l in &profile.layers {
            for (what, t) in [
                ("forward", l.forward_secs),
                ("backward", l.backward_secs),
                ("input part", l.backward_input_secs),
                ("weight part", l.backward_weight_secs),
            ] {
                assert!(t.at(b) > 0.0, "{}: {what} not measured: {t:?}", l.name);
            }
        }
        let timed = profile.with_measured_times(1e12).unwrap();
        let (as_flops, secs) = (
            timed.layers[0].forward_flops.at(b),
            profile.layers[0].forward_secs.at(b),
        );
        assert!(
            (as_flops / (secs * 1e12) - 1.0).abs() < 1e-9,
            "{as_flops} vs {secs} s"
        );
        let (f0, f1) = (
            profile.layers[0].forward_secs.at(b) + profile.layers[0].backward_secs.at(b),
            profile.layers[1].forward_secs.at(b) + profile.layers[1].backward_secs.at(b),
        );
        eprintln!(
            "slow first layer {slow}: layer 0 {f0:.3e} s, layer 1 {f1:.3e} s ({:.1}x); plan:\n{report}",
            f0 / f1
        );
        if slow {
            assert!(
                f0 > 3.0 * f1,
                "8 times the work measured only {:.1}x",
                f0 / f1
            );
        }
        let c = &report.best.candidate;
        assert_eq!(c.order.len(), 2, "min_stages 2: {report}");
        first_stage.push((slow, c.balance[0]));
        let mut pipe = builder.build().unwrap();
        let mut wall = 0.0;
        for _ in 0..3 {
            let r = pipe.train_step(&x, &y, &mse).unwrap();
            pipe.optimizer_step().unwrap();
            wall = r.wall_secs;
        }
        eprintln!(
            "predicted step {:.3e} s, measured wall step {wall:.3e} s on {} CPU devices",
            report.best.prediction.step_secs,
            c.order.len()
        );
        assert!(report.best.prediction.step_secs > 0.0 && wall > 0.0);
    }
    // The slow layer is 8 of the 13 units of work: its stage holds it alone or with one more
    // ([1, 5] or [2, 4] are within a few percent). The plain model's layers measure alike, so
    // any balance of it is as good as another when the plan takes one micro-batch: nothing to
    // check there.
    assert!(
        isolated(&first_stage),
        "the slow layer's stage should hold at most 2 layers: {first_stage:?} ((slow, first stage) per plan)"
    );
}

/// The same on wgpu (lavapipe here): the layers are timed on the adapter (its queue waited
/// for), the plan uses those times, and the planned pipeline trains on the two devices.
#[test]
fn measured_layer_times_plan_wgpu_devices() {
    let test = "measured_layer_times_plan_wgpu_devices";
    let (Some(a), Some(b)) = (test_wgpu_or_skip(test), test_wgpu_or_skip(test)) else {
        return;
    };
    let x = normal_data(&[N, WIDTH], 87);
    let y = normal_data(&[N, WIDTH], 88);
    let inputs = PlanInputs {
        inputs: &x,
        targets: &y,
        loss: &mse,
        batch: N,
        options: PlanOptions {
            kinds: vec![ScheduleKind::OneFOneB],
            measure_reps: 3,
            ..PlanOptions::default()
        },
    };
    let (builder, report, profile) = Pipeline::builder(timed_model(true))
        .optimizer(sgd)
        .plan_devices(&[a, b], &inputs)
        .unwrap();
    eprintln!("{report}");
    assert_eq!(profile.timed_reps, 3);
    assert!(report.basis.contains("measured"), "{}", report.basis);
    let at = 2 * profile.profiled_at;
    assert!(profile
        .layers
        .iter()
        .all(|l| l.forward_secs.at(at) > 0.0 && l.backward_secs.at(at) > 0.0));
    let mut pipe = builder.build().unwrap();
    let r = pipe.train_step(&x, &y, &mse).unwrap();
    pipe.optimizer_step().unwrap();
    assert!(r.loss.is_finite());
    eprintln!(
        "predicted step {:.3e} s, measured wall step {:.3e} s (the first, with shader compilation)",
        report.best.prediction.step_secs, r.wall_secs
    );
}

/// Re-materialization chosen per stage: with two chunks per device and memories tight enough,
/// the optimum over every per-stage choice re-materializes one of a device's stages and not
/// the other, and the search finds it (within 1%, as above).
#[test]
fn remat_is_chosen_per_stage_where_a_device_holds_two() {
    let (_, profile) = profiled();
    let specs = capped_specs([20_000u64, 18_000, 14_000]);
    let kinds = [ScheduleKind::Interleaved1F1B];
    let ms = [2, 4, 6];
    let flat = Topology::flat(LINK);
    let model = cost_model(&profile, &specs, &flat);
    let (best, best_c, tried) = brute_force(&model, &kinds, &ms, true);
    eprintln!("exhaustive: {tried} configurations, best {best:.4e} s: {best_c:?}");
    let k = best_c.pipeline_devices();
    let placement = ScheduleKind::Interleaved1F1B
        .generate(k, 2, best_c.micro_batches, CheckpointMode::Always)
        .unwrap()
        .placement;
    let mixed = (0..k).any(|d| {
        let modes: Vec<CheckpointMode> = (0..placement.len())
            .filter(|&s| placement[s] == d)
            .map(|s| best_c.remat[s])
            .collect();
        modes.windows(2).any(|w| w[0] != w[1])
    });
    assert!(mixed, "no device of the optimum mixes modes: {best_c:?}");
    check_search_against(&model, &kinds, &ms, best);
}

/// Tight memories on every device alike, where the balances the heuristic search starts from
/// (the pace, compute and memory min-max partitions) may all overflow a device: the search
/// must still find what brute force finds, within 1%.
#[test]
fn heuristic_search_finds_a_plan_where_its_first_balances_do_not_fit() {
    let (_, profile) = profiled();
    for caps in [[18_000u64; 3], [16_000, 18_000, 18_000]] {
        let specs = capped_specs(caps);
        let kinds = [ScheduleKind::Interleaved1F1B];
        let ms = [2, 4, 6];
        let flat = Topology::flat(LINK);
        let model = cost_model(&profile, &specs, &flat);
        let (best, best_c, tried) = brute_force(&model, &kinds, &ms, true);
        eprintln!(
            "caps {caps:?}: exhaustive: {tried} configurations, best {best:.4e} s: {best_c:?}"
        );
        check_search_against(&model, &kinds, &ms, best);
    }
}

/// 4 blocks of [Linear(16, 256), GELU, Linear(256, 16), ReLU]: the GELUs keep wide outputs
/// for little arithmetic, the cheapest layers to re-materialize.
fn wide_mlp() -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    (0..4u64)
        .flat_map(|i| {
            [
                Box::new(wgpipe_models::Linear::new(16, 256, 300 + i, &d).unwrap())
                    as Box<dyn Module>,
                Box::new(wgpipe_models::Gelu::Tanh),
                Box::new(wgpipe_models::Linear::new(256, 16, 310 + i, &d).unwrap()),
                Box::new(wgpipe_models::Relu),
            ]
        })
        .collect()
}

/// Per-layer re-materialization where it pays: on two devices whose memories hold less than
/// the plain step, the planner checkpoints layers inside stages (the GELUs first) instead of
/// recomputing whole stages, its step is shorter than the best plan without that choice, and
/// the plan runs as predicted (simulated step within 5%, measured peaks at most predicted).
/// Where memory is ample it checkpoints nothing.
#[test]
fn checkpointed_layers_are_planned_where_they_pay_and_run_as_predicted() {
    // Enough rows that the activations, not the parameters, fill the memories.
    let rows = 512;
    let x = normal_data(&[rows, 16], 83);
    let y = normal_data(&[rows, 16], 84);
    let loss = |out: &wgpipe_autograd::Var, t: &wgpipe_tensor::Tensor| mse(out, t);
    let plan_at = |memory_bytes: u64, layer_remat: bool| {
        let specs = vec![
            DeviceSpec {
                flops_per_sec: 1e9,
                memory_bytes,
            };
            2
        ];
        let cluster = SimCluster::new(&Device::cpu(), &specs, LINK);
        let inputs = PlanInputs {
            inputs: &x,
            targets: &y,
            loss: &loss,
            batch: rows,
            options: PlanOptions {
                kinds: vec![ScheduleKind::GPipe, ScheduleKind::OneFOneB],
                micro_batches: Some(vec![8]),
                min_stages: 2,
                layer_remat,
                ..PlanOptions::default()
            },
        };
        Pipeline::builder(wide_mlp())
            .optimizer(sgd)
            .plan(&cluster, &inputs)
    };
    let (_, ample, _) = plan_at(u64::MAX, true).unwrap();
    assert!(
        ample.best.candidate.checkpoint_layers.is_empty()
            && ample
                .best
                .candidate
                .remat
                .iter()
                .all(|&m| m == CheckpointMode::Never),
        "memory to spare, yet something is re-materialized: {:?}",
        ample.best.candidate
    );
    eprintln!("{ample}");
    let plain_peak = *ample.best.prediction.peak_bytes.iter().max().unwrap();
    let mut paid = 0;
    for fraction in [0.9, 0.85, 0.8, 0.65] {
        let cap = (plain_peak as f64 * fraction) as u64;
        let (builder, with, _) = match plan_at(cap, true) {
            Ok(p) => p,
            Err(e @ PlanError::NoFit(_)) => {
                eprintln!("cap {fraction} x {plain_peak}: {e}");
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        let whole = plan_at(cap, false).map(|(_, r, _)| r.best.prediction.step_secs);
        let c = &with.best.candidate;
        eprintln!(
            "cap {fraction} x {plain_peak}: {:.4e} s with layers {:?} (remat {:?}), {whole:?} s without",
            with.best.prediction.step_secs, c.checkpoint_layers, c.remat
        );
        if let Ok(whole) = whole {
            assert!(
                with.best.prediction.step_secs <= whole * (1.0 + 1e-9),
                "checkpointed layers made the plan slower: {} vs {whole}",
                with.best.prediction.step_secs
            );
        }
        for (d, &p) in with.best.prediction.peak_bytes.iter().enumerate() {
            assert!(p <= cap, "device {d}: predicted {p} over the cap {cap}");
        }
        if c.checkpoint_layers.is_empty() {
            continue;
        }
        assert!(
            whole
                .as_ref()
                .map_or(true, |&w| with.best.prediction.step_secs < w),
            "layers were checkpointed without a shorter step"
        );
        paid += 1;
        check_planned(builder, &with, &x, &y, &loss, &format!("cap {fraction}"));
    }
    assert!(paid > 0, "no cap made checkpointed layers pay");
}
