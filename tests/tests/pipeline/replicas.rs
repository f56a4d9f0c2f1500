//! Data parallelism in one process: R replicas of a K-stage pipeline train like one pipeline on
//! the whole mini-batch, stay bit-identical, fail all together, and show the all-reduce.

use std::sync::{Arc, Mutex};

use wgpipe_autograd::Module;
use wgpipe_pipeline::{
    sim::collectives::ring_all_reduce_secs, CheckpointMode, LinkSpec, LoadOptions, Pipeline,
    PipelineError, SaveOptions, ScheduleKind,
};
use wgpipe_tensor::Tensor;
use wgpipe_tests::*;

const STEPS: usize = 4;

fn data() -> (Tensor, Tensor) {
    (normal_data(&[12, 6], 1), normal_data(&[12, 3], 2))
}

fn model() -> Vec<Box<dyn Module>> {
    mlp(6, 8, 3, 11)
}

/// A replica's parameters and gradients, as host vectors.
type ReplicaState = (RunResult, Vec<(String, Option<Vec<f32>>)>);

/// Every replica's parameters and gradients.
fn replica_states(pipe: &Pipeline) -> Vec<ReplicaState> {
    pipe.replicas()
        .iter()
        .map(|p| {
            let params = p.named_parameters();
            (
                RunResult {
                    losses: vec![],
                    params: snapshot(&params),
                },
                grad_snapshot(&params),
            )
        })
        .collect()
}

fn assert_replicas_identical(pipe: &Pipeline, what: &str) {
    let states = replica_states(pipe);
    for (i, s) in states.iter().enumerate().skip(1) {
        assert!(
            *s == states[0],
            "{what}: replica {i} differs from replica 0"
        );
    }
}

#[test]
fn two_replicas_of_two_stages_equal_one_pipeline_on_the_whole_batch() {
    let (x, y) = data();
    let plain = plain_train(&model(), &x, &y, &mse, STEPS);
    for schedule in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
    ] {
        let cfg = PipeCfg::new(2, 3, CheckpointMode::ExceptLast, schedule);
        let mut single = sim_pipeline(
            model(),
            &PipeCfg {
                m: 6,
                ..cfg.clone()
            },
        );
        let (one, _) = pipe_train(&mut single, &x, &y, &mse, STEPS);
        let mut dp = dp_sim_pipeline(2, model, &cfg).unwrap();
        assert_eq!((dp.num_replicas(), dp.num_devices()), (2, 2));
        let (two, reports) = pipe_train(&mut dp, &x, &y, &mse, STEPS);
        let (e, at) = worst_err(&two, &one);
        println!("{schedule:?}: R=2 x K=2 vs one pipeline: relative error {e:.3e} at {at}");
        assert!(e <= 1e-5, "{schedule:?}: {e:.3e} at {at}");
        assert!(
            worst_err(&two, &plain).0 <= 1e-5,
            "{schedule:?} vs plain training"
        );
        assert_eq!(
            reports[0].stages.len(),
            4,
            "one report row per device (R x K)"
        );
        assert_replicas_identical(&dp, &format!("{schedule:?} after {STEPS} steps"));
    }
}

#[test]
fn uneven_shards_are_weighted_by_their_samples() {
    // 7 samples over 2 replicas: shards of 4 and 3; the mean loss over all 7 is what counts.
    let (x, y) = (normal_data(&[7, 6], 3), normal_data(&[7, 3], 4));
    let plain = plain_train(&model(), &x, &y, &mse, 2);
    let cfg = PipeCfg::new(2, 3, CheckpointMode::Never, ScheduleKind::OneFOneB);
    let mut dp = dp_sim_pipeline(2, model, &cfg).unwrap();
    let (got, _) = pipe_train(&mut dp, &x, &y, &mse, 2);
    let (e, at) = worst_err(&got, &plain);
    assert!(e <= 1e-5, "{e:.3e} at {at}");
    assert_replicas_identical(&dp, "uneven shards");
}

#[test]
fn a_failed_step_on_one_replica_leaves_every_replica_unchanged() {
    let (x, y) = data();
    let cfg = PipeCfg::new(2, 3, CheckpointMode::ExceptLast, ScheduleKind::OneFOneB);
    // Each replica's model ends in a Fault layer; the test keeps replica 1's trigger.
    let triggers: Arc<Mutex<Vec<Arc<Mutex<FaultState>>>>> = Arc::default();
    let make = {
        let triggers = triggers.clone();
        move || {
            let mut layers = model();
            let (fault, state) = Fault::new();
            triggers.lock().unwrap().push(state);
            layers.push(Box::new(fault));
            layers
        }
    };
    let mut dp = dp_sim_pipeline(2, make.clone(), &PipeCfg { ..cfg.clone() }).unwrap();
    let mut reference = dp_sim_pipeline(2, make, &cfg).unwrap();
    dp.train_step(&x, &y, &mse).unwrap();
    dp.optimizer_step().unwrap();
    reference.train_step(&x, &y, &mse).unwrap();
    reference.optimizer_step().unwrap();
    // Accumulated gradients from a first, unapplied step must survive the failed one too.
    dp.train_step(&x, &y, &mse).unwrap();
    reference.train_step(&x, &y, &mse).unwrap();
    let before = replica_states(&dp);

    // triggers: dp replica 0, dp replica 1, reference replica 0, reference replica 1.
    let replica1 = triggers.lock().unwrap()[1].clone();
    for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::BackwardError] {
        // Replica 1's micro-batch 1: its layers see it as micro-batch 3 + 1 of the R x M.
        replica1.lock().unwrap().armed = Some((kind, 3 + 1));
        let e = dp.train_step(&x, &y, &mse).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, PipelineError::Stage { micro_batch: 1, .. })
                && text.contains("replica 1 of 2"),
            "{kind:?}: {text}"
        );
        assert!(replica_states(&dp) == before, "{kind:?}: a replica changed");
        replica1.lock().unwrap().armed = None;
    }
    // The next step trains like an unfailed run.
    dp.train_step(&x, &y, &mse).unwrap();
    dp.optimizer_step().unwrap();
    reference.train_step(&x, &y, &mse).unwrap();
    reference.optimizer_step().unwrap();
    assert!(replica_states(&dp) == replica_states(&reference));
}

#[test]
fn the_simulated_all_reduce_is_a_ring_and_shows_in_the_pictures() {
    let (x, y) = data();
    let link = LinkSpec {
        bandwidth_bytes_per_sec: 1e6,
        latency_sec: 1e-4,
    };
    let cfg = PipeCfg {
        link,
        ..PipeCfg::new(2, 3, CheckpointMode::ExceptLast, ScheduleKind::GPipe)
    };
    let mut single = sim_pipeline(model(), &cfg);
    let alone = single.train_step(&x, &y, &mse).unwrap();
    let mut dp = dp_sim_pipeline(3, model, &cfg).unwrap();
    let r = dp.train_step(&x, &y, &mse).unwrap();
    let sim = r.simulated.as_ref().expect("simulated");
    let t = &sim.timeline;
    assert_eq!(t.num_devices(), 6);
    assert_eq!(t.collectives.len(), 6, "one all-reduce per device");
    for c in &t.collectives {
        let d = c.device % 2;
        assert_eq!(c.bytes, 4 * alone.stages[d].num_params as u64);
        let want = ring_all_reduce_secs(c.bytes, 3, &link);
        // 2(R-1)/R x bytes / bandwidth + 2(R-1) latencies, by hand for R = 3.
        let by_hand = 4.0 / 3.0 * c.bytes as f64 / 1e6 + 4.0 * 1e-4;
        assert!((want - by_hand).abs() < 1e-12);
        assert!(((c.end - c.start) - want).abs() < 1e-12, "{c:?}");
        let last_work = t
            .events
            .iter()
            .filter(|e| e.device % 2 == d)
            .map(|e| e.end)
            .fold(0.0, f64::max);
        assert_eq!(
            c.start, last_work,
            "starts when the stage is done everywhere"
        );
        assert!(c.end <= sim.makespan_secs);
    }
    // The all-reduce is what makes the step longer than one replica's pipeline.
    let alone_makespan = alone.simulated.as_ref().unwrap().makespan_secs;
    assert!(sim.makespan_secs > alone_makespan);
    assert!(r.chrome_trace_json("dp").contains("\"all-reduce\""));
    let svg = r.svg_timeline("dp");
    assert_eq!(svg.matches("class=\"event all-reduce\"").count(), 6);
    // The measured (wall) timeline shows the measured all-reduce too.
    assert_eq!(r.wall_timeline.collectives.len(), 6);
}

#[test]
fn replicas_need_r_times_k_devices_and_the_same_model() {
    let cfg = PipeCfg::new(3, 1, CheckpointMode::Never, ScheduleKind::GPipe);
    // 2 x 3 devices are given, as replicas(4) cannot divide them.
    let cluster_of_6 = |make: fn() -> Vec<Box<dyn Module>>, r| {
        let mut c = cfg.clone();
        c.k = 6 / r;
        dp_sim_pipeline(r, make, &c).map(|_| ())
    };
    assert!(cluster_of_6(model, 2).is_ok());
    let e = {
        let layers = model();
        let cluster = wgpipe_pipeline::SimCluster::uniform(
            &wgpipe_tensor::Device::cpu(),
            6,
            u64::MAX,
            1e9,
            LinkSpec::FREE,
        );
        Pipeline::builder(layers)
            .sim(cluster)
            .replicas(4, model)
            .build()
            .err()
            .unwrap()
            .to_string()
    };
    assert!(
        e.contains("replicas(4) needs R x K devices") && e.contains("6 were given"),
        "{e}"
    );
    // The factory's second model (replica 1's) is wider than its first.
    let mut width = 7;
    let growing = move || {
        width += 1;
        mlp(6, width, 3, 11)
    };
    let e = dp_sim_pipeline(2, growing, &PipeCfg { k: 3, ..cfg })
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("replica 1") && e.contains("differ from replica 0's"),
        "{e}"
    );
}

#[test]
fn a_checkpoint_of_replicas_resumes_bit_exactly_in_one_pipeline_and_in_replicas() {
    let (x, y) = data();
    let cfg = PipeCfg::new(2, 3, CheckpointMode::ExceptLast, ScheduleKind::OneFOneB);
    let dir = std::env::temp_dir().join(format!("wgpipe-dp-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("dp.safetensors");
    let mut dp = dp_sim_pipeline(2, model, &cfg).unwrap();
    pipe_train(&mut dp, &x, &y, &mse, 2);
    dp.save(&path, &SaveOptions::default()).unwrap();
    let (straight, _) = pipe_train(&mut dp, &x, &y, &mse, 2);

    let mut resumed = dp_sim_pipeline(2, || mlp(6, 8, 3, 99), &cfg).unwrap();
    resumed.load(&path, &LoadOptions::default()).unwrap();
    assert_replicas_identical(&resumed, "after load");
    let (again, _) = pipe_train(&mut resumed, &x, &y, &mse, 2);
    assert!(
        again == straight,
        "resumed replicas differ from the straight run"
    );

    // In one process without replicas: the same model, the whole mini-batch (rel 1e-5: the
    // gradient sums are split differently).
    // Other arithmetic on purpose (R = 1, M = 6): refused unless allowed, then said.
    let mut single = sim_pipeline(mlp(6, 8, 3, 99), &PipeCfg { m: 6, ..cfg });
    assert!(single.load(&path, &LoadOptions::default()).is_err());
    let allow = LoadOptions {
        allow_other_settings: true,
        ..Default::default()
    };
    let restored = single.load(&path, &allow).unwrap();
    let names: Vec<&str> = restored
        .other_settings
        .iter()
        .map(|o| o.name.as_str())
        .collect();
    assert_eq!(names, ["replicas", "micro_batches"]);
    let (one, _) = pipe_train(&mut single, &x, &y, &mse, 2);
    assert!(worst_err(&one, &straight).0 <= 1e-5);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Token sequences for the Transformer LM of the tests (vocabulary 16).
fn lm_data(n: usize) -> (Tensor, Tensor) {
    let t = transformer_cfg(0.0).seq_len;
    (token_ids(n, t, 16, 0), token_ids(n, t, 16, 5))
}

/// R replicas x M micro-batches draw the dropout masks of one pipeline over R x M micro-batches
/// (replica r's micro-batch m is the mini-batch's micro-batch rM + m), so data parallelism with
/// dropout trains like the pipeline alone, at float noise (the sums differ in order only).
#[test]
fn replicas_with_dropout_train_like_one_pipeline_over_r_times_m_micro_batches() {
    let (x, y) = lm_data(8);
    let make = || deep_transformer(0.1, 3);
    let alone = PipeCfg::new(2, 4, CheckpointMode::ExceptLast, ScheduleKind::OneFOneB);
    let (want, _) = pipe_train(&mut sim_pipeline(make(), &alone), &x, &y, &cross_entropy, 3);
    let cfg = PipeCfg::new(2, 2, CheckpointMode::ExceptLast, ScheduleKind::OneFOneB);
    let mut dp = dp_sim_pipeline(2, make, &cfg).unwrap();
    let (got, _) = pipe_train(&mut dp, &x, &y, &cross_entropy, 3);
    assert_close(&got, &want, 1e-5, "R=2 x M=2 against M=4, dropout 0.1");
    assert_replicas_identical(&dp, "dropout");
}

/// A step that fails on one replica leaves every replica on the step it was on (the key of its
/// dropout masks): with dropout, training after the failure equals a run that never failed,
/// bit for bit.
#[test]
fn a_failed_step_with_dropout_leaves_every_replica_on_the_same_step() {
    let (x, y) = lm_data(8);
    let cfg = PipeCfg::new(2, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let triggers: Arc<Mutex<Vec<Arc<Mutex<FaultState>>>>> = Arc::default();
    let make = {
        let triggers = triggers.clone();
        move || {
            let mut layers = deep_transformer(0.1, 3);
            let (fault, state) = Fault::new();
            triggers.lock().unwrap().push(state);
            layers.push(Box::new(fault));
            layers
        }
    };
    let mut dp = dp_sim_pipeline(2, make.clone(), &cfg).unwrap();
    let mut reference = dp_sim_pipeline(2, make, &cfg).unwrap();
    // triggers: dp replica 0, dp replica 1, reference replica 0, reference replica 1.
    let replica1 = triggers.lock().unwrap()[1].clone();
    for (pipe, fail) in [(&mut dp, true), (&mut reference, false)] {
        pipe.train_step(&x, &y, &cross_entropy).unwrap();
        pipe.optimizer_step().unwrap();
        if fail {
            // Replica 1's second micro-batch (2 + 1 of the R x M) fails its forward.
            replica1.lock().unwrap().armed = Some((FaultKind::Error, 2 + 1));
            let e = pipe.train_step(&x, &y, &cross_entropy).unwrap_err();
            assert!(e.to_string().contains("replica 1 of 2"), "{e}");
            replica1.lock().unwrap().armed = None;
            assert_eq!(pipe.step_count(), 1);
        }
        for _ in 0..2 {
            pipe.train_step(&x, &y, &cross_entropy).unwrap();
            pipe.optimizer_step().unwrap();
        }
    }
    assert!(replica_states(&dp) == replica_states(&reference));
}

/// K = 2 devices x `schedule`'s chunks of Linear + ReLU (width 6), a [`Fault`] after stage
/// `fault_stage`'s; the balance; each call's fault trigger goes to `triggers`.
fn faulty_stages(
    schedule: ScheduleKind,
    fault_stage: usize,
    triggers: &Arc<Mutex<Vec<Arc<Mutex<FaultState>>>>>,
) -> (Vec<Box<dyn Module>>, Vec<usize>) {
    let d = wgpipe_tensor::Device::cpu();
    let mut layers: Vec<Box<dyn Module>> = Vec::new();
    let mut balance = Vec::new();
    for s in 0..2 * schedule.default_chunks() {
        layers.push(Box::new(
            wgpipe_models::Linear::new(6, 6, 100 + s as u64, &d).unwrap(),
        ));
        layers.push(Box::new(wgpipe_models::Relu));
        balance.push(2);
        if s == fault_stage {
            let (fault, state) = Fault::new();
            triggers.lock().unwrap().push(state);
            layers.push(Box::new(fault));
            balance[s] += 1;
        }
    }
    (layers, balance)
}

/// Every fault kind, on each replica, on the first and the last stage, under every schedule:
/// one error naming the stage, micro-batch and replica; nothing changed on any replica; and
/// the steps after it bit-identical to a run that never failed.
#[test]
fn the_replica_fault_matrix_leaves_every_replica_as_before() {
    let (x, y) = (normal_data(&[12, 6], 1), normal_data(&[12, 6], 2));
    let m = 4; // DualPipeV needs M >= 2K
    for schedule in ScheduleKind::ALL {
        let last = 2 * schedule.default_chunks() - 1;
        for stage in [0, last] {
            for replica in 0..2 {
                for kind in [FaultKind::Error, FaultKind::Panic, FaultKind::BackwardError] {
                    let what = format!("{kind:?} on replica {replica} stage {stage} {schedule:?}");
                    let triggers: Arc<Mutex<Vec<Arc<Mutex<FaultState>>>>> = Arc::default();
                    let build = || {
                        let make = {
                            let triggers = triggers.clone();
                            move || faulty_stages(schedule, stage, &triggers).0
                        };
                        let balance = faulty_stages(schedule, stage, &Arc::default()).1;
                        let cfg = PipeCfg::new(2, m, CheckpointMode::ExceptLast, schedule)
                            .balance(balance);
                        dp_sim_pipeline(2, make, &cfg).unwrap()
                    };
                    let mut dp = build();
                    let mut reference = build();
                    for p in [&mut dp, &mut reference] {
                        p.train_step(&x, &y, &mse).unwrap();
                        p.optimizer_step().unwrap();
                        p.train_step(&x, &y, &mse).unwrap();
                    }
                    let before = replica_states(&dp);
                    // triggers: dp's replicas 0 and 1, then the reference's.
                    let trigger = triggers.lock().unwrap()[replica].clone();
                    // Micro-batch 1 of that replica: the layers see it as replica x M + 1.
                    trigger.lock().unwrap().armed = Some((kind, (replica * m + 1) as u64));
                    let e = dp.train_step(&x, &y, &mse).unwrap_err();
                    trigger.lock().unwrap().armed = None;
                    let text = e.to_string();
                    assert!(
                        matches!(e, PipelineError::Stage { stage: s, micro_batch: 1, .. } if s == stage)
                            && text.contains(&format!("replica {replica} of 2")),
                        "{what}: {text}"
                    );
                    assert!(replica_states(&dp) == before, "{what}: a replica changed");
                    for p in [&mut dp, &mut reference] {
                        p.optimizer_step().unwrap();
                        p.train_step(&x, &y, &mse).unwrap();
                        p.optimizer_step().unwrap();
                    }
                    assert!(
                        replica_states(&dp) == replica_states(&reference),
                        "{what}: the steps after the failure differ from a run without it"
                    );
                }
            }
        }
    }
}
