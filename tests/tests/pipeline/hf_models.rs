//! Models read from Hugging Face folders and a timm checkpoint, trained through the pipeline
//! (issue 57): at K=2 and
//! K=4, under GPipe and 1F1B, one step's loss and every parameter's gradient equal
//! transformers' for the same batch (`models/tests/fixtures/*`, the references made by
//! `scripts/hf_models_reference.py` in float64), as the plain run's do. The tied models' head
//! sits on the last stage and its table on the first: after the step both copies hold
//! transformers' gradient of the one shared tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use wgpipe_autograd::Module;
use wgpipe_models::hf::{load_gpt2, load_layers, load_llama, HfCheckpoint};
use wgpipe_models::HfNames;
use wgpipe_pipeline::{CheckpointMode, ScheduleKind};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

fn reference(dir: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let path = dir.join("reference.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            let v = view
                .data()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect();
            (name, (view.shape().to_vec(), v))
        })
        .collect()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures")
        .join(name)
}

/// One pipelined step of `load`'s model under each (K, balance) and schedule, against the
/// reference of `folder`.
fn trains_like_transformers<M: HfNames>(
    folder: &str,
    load: impl Fn(&Path) -> (M, Vec<Box<dyn Module>>),
    cuts: &[(usize, Vec<usize>)],
) {
    trains_like_the_reference(folder, ["input_ids", "targets"], load, cuts);
}

/// [`trains_like_transformers`] with the reference's input and target tensors named `io`.
fn trains_like_the_reference<M: HfNames>(
    folder: &str,
    io: [&str; 2],
    load: impl Fn(&Path) -> (M, Vec<Box<dyn Module>>),
    cuts: &[(usize, Vec<usize>)],
) {
    let dir = fixture(folder);
    let r = reference(&dir);
    let tensor = |name: &str| {
        let (shape, v) = &r[name];
        Tensor::from_vec(v.clone(), shape, &Device::cpu()).unwrap()
    };
    let (x, y) = (tensor(io[0]), tensor(io[1]));
    for (k, balance) in cuts {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let what = format!("{folder} K={k} {schedule:?}");
            let (model, layers) = load(&dir);
            let cfg = PipeCfg {
                balance: Some(balance.clone()),
                ..PipeCfg::new(*k, 2, CheckpointMode::ExceptLast, schedule)
            };
            let mut pipe = sim_pipeline(layers, &cfg);
            let report = pipe
                .train_step(&x, &y, &|l, t| cross_entropy(l, t))
                .unwrap();
            let want = r["loss"].1[0];
            assert!(
                (report.loss - want).abs() <= 2e-6 * want,
                "{what}: loss {} vs {want}",
                report.loss
            );
            // Each checkpoint tensor's gradient, laid out as the checkpoint lays it out; the
            // step leaves a tied table and its head each holding the sum of the two.
            let mut grads: HashMap<String, Vec<f32>> = HashMap::new();
            for (name, p) in pipe.named_parameters() {
                let (layer, rest) = name.split_once('.').unwrap();
                let (key, transposed) = model.checkpoint_key(layer.parse().unwrap(), rest);
                let mut g = p.grad().unwrap();
                if transposed {
                    g = g.t().unwrap().contiguous().unwrap();
                }
                let g = g.to_vec().unwrap();
                let key = format!("grad.{key}");
                if let Some(first) = grads.get(&key) {
                    assert_eq!(first, &g, "{what}: the tied copies of {key} differ");
                } else {
                    grads.insert(key, g);
                }
            }
            let want_count = r.keys().filter(|n| n.starts_with("grad.")).count();
            assert_eq!(grads.len(), want_count, "{what}: every reference gradient");
            for (key, got) in &grads {
                let e = rel_err(got, &r[key].1);
                assert!(e <= 1e-4, "{what}: {key} off by {e:.2e}");
            }
        }
    }
}

#[test]
fn a_llama_from_a_hugging_face_folder_trains_like_transformers_at_k2_and_k4() {
    let load = |dir: &Path| load_llama(dir, 0..5, &Device::cpu()).unwrap();
    trains_like_transformers("llama_gqa", load, &[(2, vec![2, 3]), (4, vec![1, 1, 1, 2])]);
    // Its bf16 shards with an index, as transformers saves a bf16 checkpoint.
    trains_like_transformers(
        "llama_bf16_shards",
        load,
        &[(2, vec![3, 2]), (4, vec![2, 1, 1, 1])],
    );
}

#[test]
fn a_tied_llama_and_a_gpt2_train_like_transformers_with_the_tie_across_stages() {
    let llama = |dir: &Path| load_llama(dir, 0..4, &Device::cpu()).unwrap();
    trains_like_transformers("llama_tied", llama, &[(2, vec![2, 2])]);
    // Without its dropout (0.1 in the file), as transformers' reference ran in eval mode.
    let gpt2 = |dir: &Path| {
        let (mut model, _) = load_gpt2(dir, 0..1, &Device::cpu()).unwrap();
        model.config.dropout = 0.0;
        let checkpoint = HfCheckpoint::open(dir).unwrap();
        let layers = load_layers(&model, &checkpoint, 0..5, &Device::cpu()).unwrap();
        (model, layers)
    };
    trains_like_transformers("gpt2", gpt2, &[(2, vec![2, 3]), (4, vec![1, 1, 1, 2])]);
}

/// timm's BiT ResNetV2 (`models/tests/fixtures/bit`, `scripts/timm_resnetv2_reference.py`):
/// stem, two bottlenecks, norm and head over K=2 and K=4.
#[test]
fn a_bit_resnetv2_from_a_timm_checkpoint_trains_like_timm_at_k2_and_k4() {
    let resnet = wgpipe_models::ResNetV2 {
        depths: vec![1, 1],
        channels: vec![128, 256],
        stem_channels: 32,
        in_channels: 3,
        num_classes: 5,
        groups: 32,
    };
    let load = |dir: &Path| {
        let checkpoint = HfCheckpoint::open_file(&dir.join("model.safetensors")).unwrap();
        let layers = load_layers(&resnet, &checkpoint, 0..5, &Device::cpu()).unwrap();
        (resnet.clone(), layers)
    };
    trains_like_the_reference(
        "bit",
        ["images", "labels"],
        load,
        &[(2, vec![2, 3]), (4, vec![1, 1, 1, 2])],
    );
}

/// A Llama whose stages read their own layers from the folder (`checkpoint_factory`, what
/// each rank does under MPI) trains like the one loaded whole: the same loss and gradients,
/// bit for bit. Describing its layers (every rank does, for every layer) reads no tensor.
#[test]
fn a_llama_built_stage_by_stage_from_its_folder_trains_like_the_loaded_one() {
    use wgpipe_pipeline::{Balance, Pipeline, SimCluster};
    let dir = fixture("llama_gqa");
    let r = reference(&dir);
    let tensor = |name: &str| {
        let (shape, v) = &r[name];
        Tensor::from_vec(v.clone(), shape, &Device::cpu()).unwrap()
    };
    let (x, y) = (tensor("input_ids"), tensor("targets"));
    let cpu = Device::cpu();
    let (llama, layers) = load_llama(&dir, 0..5, &cpu).unwrap();
    let checkpoint = std::sync::Arc::new(HfCheckpoint::open(&dir).unwrap());
    let factory = wgpipe_models::hf::checkpoint_factory(&llama, checkpoint, &cpu).unwrap();
    let described = factory.describe_range(0..5).unwrap();
    for (name, p) in wgpipe_models::sequence_parameters(&described) {
        let v = p.value().to_vec().unwrap();
        let zeros = v.iter().all(|&x| x == 0.0);
        let ones = v.iter().all(|&x| x == 1.0); // the norms' weights, built as ones
        assert!(zeros || ones, "{name} was read to describe it");
    }
    let step = |pipe: &mut Pipeline| {
        let loss = pipe
            .train_step(&x, &y, &|l, t| cross_entropy(l, t))
            .unwrap()
            .loss;
        let grads: Vec<(String, Vec<u32>)> = pipe
            .named_parameters()
            .into_iter()
            .map(|(n, p)| {
                let g = p.grad().unwrap().to_vec().unwrap();
                (n, g.iter().map(|v| v.to_bits()).collect())
            })
            .collect();
        (loss.to_bits(), grads)
    };
    let sim = || SimCluster::uniform(&cpu, 2, 1 << 30, 1e9, wgpipe_pipeline::LinkSpec::FREE);
    let mut by_stage = Pipeline::builder_from(factory)
        .unwrap()
        .sim(sim())
        .balance(Balance::Explicit(vec![2, 3]))
        .micro_batches(2)
        .build()
        .unwrap();
    let mut whole = Pipeline::builder(layers)
        .sim(sim())
        .balance(Balance::Explicit(vec![2, 3]))
        .micro_batches(2)
        .build()
        .unwrap();
    let (got, want) = (step(&mut by_stage), step(&mut whole));
    assert_eq!(got, want);
    let loss = f32::from_bits(got.0);
    assert!((loss - r["loss"].1[0]).abs() <= 2e-6 * loss, "loss {loss}");
}
