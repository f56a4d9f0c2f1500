//! Per-layer re-materialization (`PipelineBuilder::checkpoint_layers`): the same parameters bit
//! for bit as without it, under every kind of schedule (split backwards and whole-stage
//! recomputes included), less memory held between forward and backward, and clear errors.

use wgpipe_autograd::Module;
use wgpipe_models::{Linear, Relu};
use wgpipe_pipeline::{CheckpointMode, PipelineError, ScheduleKind};
use wgpipe_tensor::{Device, Tag};
use wgpipe_tests::*;

/// Trains `steps` steps of the 9-layer Transformer (dropout on) with `ckpt` re-materialized.
fn train(cfg: &PipeCfg, ckpt: &[usize], steps: usize) -> RunResult {
    let x = token_ids(8, 6, 16, 1);
    let y = token_ids(8, 6, 16, 2);
    let cfg = PipeCfg {
        checkpoint_layers: ckpt.to_vec(),
        ..cfg.clone()
    };
    let mut pipe = sim_pipeline(deep_transformer(0.1, 7), &cfg);
    pipe_train(&mut pipe, &x, &y, &cross_entropy, steps).0
}

fn bits(r: &RunResult) -> (Vec<u32>, Vec<(String, Vec<u32>)>) {
    (
        r.losses.iter().map(|l| l.to_bits()).collect(),
        r.params
            .iter()
            .map(|(n, v)| (n.clone(), v.iter().map(|f| f.to_bits()).collect()))
            .collect(),
    )
}

#[test]
fn checkpointed_layers_train_bit_for_bit_like_plain_under_every_kind_of_schedule() {
    // Blocks 1-3 and 5-6 (of embedding, 6 blocks, LayerNorm, head): runs that start a stage,
    // end one, and sit inside one, depending on the balance.
    let ckpt = [1, 2, 3, 5, 6];
    let cases = [
        (ScheduleKind::GPipe, 2, CheckpointMode::Never),
        (ScheduleKind::OneFOneB, 2, CheckpointMode::Never),
        // Split backwards: the runs' weight gradients come in the input part.
        (ScheduleKind::ZbH1, 2, CheckpointMode::Never),
        (ScheduleKind::ZbV, 2, CheckpointMode::Never),
        (ScheduleKind::Interleaved1F1B, 2, CheckpointMode::Never),
        // Whole-stage recomputes: the runs are checkpointed again inside the Recompute.
        (ScheduleKind::GPipe, 3, CheckpointMode::ExceptLast),
        (ScheduleKind::ZbH1, 2, CheckpointMode::Always),
    ];
    for (schedule, k, mode) in cases {
        let cfg = PipeCfg::new(k, 4, mode, schedule);
        let plain = train(&cfg, &[], 3);
        let ck = train(&cfg, &ckpt, 3);
        assert!(
            bits(&plain) == bits(&ck),
            "{schedule:?} K={k} {mode:?}: checkpointed layers changed the losses or parameters \
             (losses {:?} vs {:?})",
            plain.losses,
            ck.losses
        );
        // The run trained: the parameters moved.
        let first = train(&cfg, &ckpt, 0);
        assert_ne!(bits(&first).1, bits(&ck).1, "{schedule:?}: nothing trained");
    }
}

const N: usize = 16;
const WIDTH: usize = 32;

/// 32 layers: 16 x [Linear(32, 32), ReLU].
fn deep_mlp() -> Vec<Box<dyn Module>> {
    let d = Device::cpu();
    (0..16)
        .flat_map(|i| {
            [
                Box::new(Linear::new(WIDTH, WIDTH, 40 + i as u64, &d).unwrap()) as Box<dyn Module>,
                Box::new(Relu),
            ]
        })
        .collect()
}

/// The largest measured activation peak over the stages of a GPipe step (K=2, M=4).
fn peak(mode: CheckpointMode, ckpt: Vec<usize>) -> usize {
    let x = normal_data(&[N, WIDTH], 31);
    let y = normal_data(&[N, WIDTH], 32);
    let cfg = PipeCfg {
        checkpoint_layers: ckpt,
        ..PipeCfg::new(2, 4, mode, ScheduleKind::GPipe)
    };
    let mut pipe = sim_pipeline(deep_mlp(), &cfg);
    let r = pipe.train_step(&x, &y, &mse).unwrap();
    r.stages
        .iter()
        .map(|s| s.memory.peak_of(Tag::Activations))
        .max()
        .unwrap()
}

#[test]
fn checkpointed_layers_hold_less_between_forward_and_backward() {
    let plain = peak(CheckpointMode::Never, vec![]);
    // Every layer but each stage's last: a stage keeps one run's input per micro-batch.
    let most: Vec<usize> = (0..32).filter(|&i| i != 15 && i != 31).collect();
    let ck = peak(CheckpointMode::Never, most);
    let half: Vec<usize> = (0..32).filter(|i| i % 4 < 2).collect();
    let some = peak(CheckpointMode::Never, half);
    eprintln!("activation peaks: plain {plain}, half the layers {some}, most layers {ck}");
    // Plain GPipe keeps 4 micro-batches' full tapes (16 layers' stashes each); checkpointed,
    // 4 inputs (and the last layers' stashes) plus one micro-batch's re-run tape.
    assert!(
        (ck as f64) < 0.5 * plain as f64,
        "checkpointing most layers: peak {ck} is not well below {plain}"
    );
    assert!(
        ck < some && some < plain,
        "peaks should fall as more layers are checkpointed: {plain} > {some} > {ck}"
    );
}

#[test]
fn checkpoint_layers_that_cannot_be_re_materialized_are_errors() {
    let cfg = PipeCfg {
        checkpoint_layers: vec![3, 40],
        ..PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe)
    };
    let e = try_sim_pipeline(mlp(4, 8, 2, 1), &cfg)
        .err()
        .expect("layer 40 does not exist");
    assert!(
        matches!(&e, PipelineError::Config(m) if m.contains("layer 40") && m.contains("8 layers")),
        "{e}"
    );
    // A layer that stashes a skip.
    let layers = skip_model(3);
    let with_skip = layers
        .iter()
        .position(|l| !l.skips().is_empty())
        .expect("the skip model has skip layers");
    let n = layers.len();
    let cfg = PipeCfg {
        checkpoint_layers: vec![with_skip],
        ..PipeCfg::new(2, 2, CheckpointMode::Never, ScheduleKind::GPipe)
    };
    let e = try_sim_pipeline(layers, &cfg)
        .err()
        .expect("a layer with skips cannot be checkpointed");
    assert!(
        matches!(&e, PipelineError::Config(m) if m.contains(&format!("layer {with_skip}")) && m.contains("skips")),
        "{e} ({n} layers)"
    );
}
