//! Tied weights across stages: the Transformer LM's token embedding (first stage) and head (last
//! stage) are copies of one parameter; their gradients are summed before every optimizer step
//! (also before the replica average), so the copies stay bit-identical and training equals
//! plain training of one shared parameter.

use wgpipe_autograd::serialize::TensorFile;
use wgpipe_autograd::tied_groups;
use wgpipe_models::{parameter_count, TransformerLm};
use wgpipe_pipeline::{
    ActionKind, CheckpointMode, LinkSpec, LoadOptions, Pipeline, SaveOptions, ScheduleKind,
};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

fn lm_data(n: usize) -> (Tensor, Tensor) {
    let t = transformer_cfg(0.0).seq_len;
    (token_ids(n, t, 16, 0), token_ids(n, t, 16, 5))
}

/// The values of every tie group's copies (in stage order) in each replica.
fn tied_copies(pipe: &Pipeline) -> Vec<Vec<Vec<f32>>> {
    pipe.replicas()
        .iter()
        .flat_map(|p| {
            let params = p.named_parameters();
            tied_groups(&params)
                .into_iter()
                .map(|(_, idx)| {
                    idx.iter()
                        .map(|&i| params[i].1.value().to_vec().unwrap())
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn assert_copies_identical(pipe: &Pipeline, what: &str) {
    let groups = tied_copies(pipe);
    assert!(!groups.is_empty(), "{what}: no tied parameters");
    for copies in groups {
        assert!(copies.len() >= 2, "{what}: a group with one copy");
        for c in &copies[1..] {
            assert!(*c == copies[0], "{what}: tied copies differ");
        }
    }
}

#[test]
fn tied_copies_stay_bit_identical_for_ten_steps_and_train_as_one_parameter() {
    const STEPS: usize = 10;
    let (x, y) = lm_data(8);
    let reference = plain_train(&deep_transformer(0.0, 3), &x, &y, &cross_entropy, STEPS);
    for (k, schedule) in [
        (2, ScheduleKind::GPipe),
        (4, ScheduleKind::OneFOneB),
        (3, ScheduleKind::Interleaved1F1B),
        (2, ScheduleKind::ZbV), // the V puts the embedding and the head on device 0
    ] {
        let cfg = PipeCfg::new(k, 4, CheckpointMode::ExceptLast, schedule);
        let mut pipe = sim_pipeline(deep_transformer(0.0, 3), &cfg);
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let r = pipe.train_step(&x, &y, &cross_entropy).unwrap();
            losses.push(r.loss);
            pipe.optimizer_step().unwrap();
            assert_copies_identical(&pipe, &format!("K={k} {schedule:?} step {step}"));
        }
        let got = RunResult {
            losses,
            params: snapshot(&pipe.named_parameters()),
        };
        assert_close(&got, &reference, 1e-5, &format!("K={k} {schedule:?}"));
    }
}

#[test]
fn ties_are_summed_before_the_replica_average() {
    let (x, y) = lm_data(8);
    let reference = plain_train(&deep_transformer(0.0, 3), &x, &y, &cross_entropy, 4);
    let cfg = PipeCfg::new(2, 2, CheckpointMode::Always, ScheduleKind::OneFOneB);
    let mut pipe = dp_sim_pipeline(2, || deep_transformer(0.0, 3), &cfg).unwrap();
    let mut losses = Vec::new();
    for step in 0..4 {
        losses.push(pipe.train_step(&x, &y, &cross_entropy).unwrap().loss);
        pipe.optimizer_step().unwrap();
        assert_copies_identical(&pipe, &format!("R=2 step {step}"));
    }
    let got = RunResult {
        losses,
        params: snapshot(&pipe.named_parameters()),
    };
    assert_close(&got, &reference, 1e-5, "R=2 x K=2");
}

#[test]
fn the_exchange_of_tied_gradients_shows_in_the_trace_between_first_and_last_device() {
    let (x, y) = lm_data(8);
    let mut cfg = PipeCfg::new(3, 2, CheckpointMode::Never, ScheduleKind::GPipe);
    cfg.link = LinkSpec {
        bandwidth_bytes_per_sec: 1e6,
        latency_sec: 0.0,
    };
    let mut pipe = sim_pipeline(deep_transformer(0.0, 3), &cfg);
    let r = pipe.train_step(&x, &y, &cross_entropy).unwrap();
    let sim = r.simulated.as_ref().unwrap();
    let ties: Vec<_> = sim
        .timeline
        .events
        .iter()
        .filter(|e| e.kind == ActionKind::ExchangeTied)
        .collect();
    let mut pairs: Vec<_> = ties.iter().map(|e| (e.device, e.peer)).collect();
    pairs.sort();
    assert_eq!(pairs, vec![(0, Some(2)), (2, Some(0))]);
    // A ring of two over the link: 2 (R - 1) / R x bytes / bandwidth, after the last work.
    let bytes = (16 * 16 * 4) as f64;
    for e in &ties {
        assert!((e.end - e.start - bytes / 1e6).abs() < 1e-12, "{e:?}");
        assert!((e.end - sim.makespan_secs).abs() < 1e-12);
    }
    let json = r.chrome_trace_json("tied");
    assert!(json.contains("tied gradients"));
    assert!(r
        .wall_timeline
        .events
        .iter()
        .any(|e| e.kind == ActionKind::ExchangeTied));
}

#[test]
fn tying_the_head_to_the_embedding_drops_its_weight_and_bias_from_the_count() {
    let cfg = transformer_cfg(0.0);
    let tied = cfg.build(1, &Device::cpu()).unwrap();
    let untied = TransformerLm {
        tie_embeddings: false,
        ..cfg.clone()
    }
    .build(1, &Device::cpu())
    .unwrap();
    let (v, d) = (cfg.vocab, cfg.d_model);
    assert_eq!(parameter_count(&untied) - parameter_count(&tied), d * v + v);
}

#[test]
fn tied_copies_that_differ_are_a_build_error_naming_both() {
    let layers = deep_transformer(0.0, 3);
    let head = layers.last().unwrap().parameters();
    let w = &head.iter().find(|(n, _)| n == "weight").unwrap().1;
    w.set_value(w.value().mul_scalar(2.0).unwrap());
    let n = layers.len();
    let cfg = PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe);
    let e = try_sim_pipeline(layers, &cfg)
        .err()
        .expect("built")
        .to_string();
    assert!(
        e.contains(&format!("{}.weight", n - 1)) && e.contains("0.tok.weight"),
        "{e}"
    );
}

/// A checkpoint holds each tied parameter and its optimizer state once, under the first copy's
/// name; loading puts them into every copy, and training resumes bit-exactly.
#[test]
fn a_checkpoint_holds_tied_copies_once_and_loads_them_into_every_copy() {
    let (x, y) = lm_data(8);
    let cfg = PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe);
    let mut pipe = sim_pipeline(deep_transformer(0.0, 3), &cfg);
    for _ in 0..2 {
        pipe.train_step(&x, &y, &cross_entropy).unwrap();
        pipe.optimizer_step().unwrap();
    }
    let path = std::env::temp_dir().join(format!(
        "wgpipe-tied-once-{}.safetensors",
        std::process::id()
    ));
    pipe.save(&path, &SaveOptions::default()).unwrap();
    let names = TensorFile::open(&path).unwrap().names();
    let params = pipe.named_parameters();
    let groups = tied_groups(&params);
    assert!(!groups.is_empty());
    let mut later_copies = 0;
    for (_, idx) in &groups {
        assert!(names.contains(&params[idx[0]].0), "{names:?}");
        for &i in &idx[1..] {
            later_copies += 1;
            let later = &params[i].0;
            assert!(
                !names
                    .iter()
                    .any(|n| n == later || n.starts_with(&format!("optim.{later}."))),
                "{later} saved again: {names:?}"
            );
        }
    }
    let model_side = names.iter().filter(|n| !n.starts_with("optim.")).count();
    assert_eq!(
        model_side,
        params.len() - later_copies + pipe.named_buffers().len()
    );
    // Another initialization, then the checkpoint: every copy gets the saved values.
    let mut resumed = sim_pipeline(deep_transformer(0.0, 4), &cfg);
    resumed.load(&path, &LoadOptions::default()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_copies_identical(&resumed, "loaded");
    assert_eq!(
        snapshot(&resumed.named_parameters()),
        snapshot(&pipe.named_parameters())
    );
    for p in [&mut pipe, &mut resumed] {
        for _ in 0..2 {
            p.train_step(&x, &y, &cross_entropy).unwrap();
            p.optimizer_step().unwrap();
        }
    }
    assert_eq!(
        snapshot(&resumed.named_parameters()),
        snapshot(&pipe.named_parameters())
    );
}
