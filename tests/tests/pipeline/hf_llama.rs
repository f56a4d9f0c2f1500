//! A Llama read from a Hugging Face folder, trained through the pipeline (issue 57): at K=2 and
//! K=4, under GPipe and 1F1B, one step's loss and every parameter's gradient equal
//! transformers' for the same batch (`models/tests/fixtures/llama_gqa`, its reference made by
//! `scripts/hf_models_reference.py` in float64), as the plain run's do.

use std::collections::HashMap;
use std::path::Path;

use wgpipe_models::hf::load_llama;
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

#[test]
fn a_llama_from_a_hugging_face_folder_trains_like_transformers_at_k2_and_k4() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/llama_gqa");
    let r = reference(&dir);
    let tensor = |name: &str| {
        let (shape, v) = &r[name];
        Tensor::from_vec(v.clone(), shape, &Device::cpu()).unwrap()
    };
    let (x, y) = (tensor("input_ids"), tensor("targets"));
    for (k, balance) in [(2, vec![2, 3]), (4, vec![1, 1, 1, 2])] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let what = format!("K={k} {schedule:?}");
            let (llama, layers) = load_llama(&dir, 0..5, &Device::cpu()).unwrap();
            let cfg = PipeCfg {
                balance: Some(balance.clone()),
                ..PipeCfg::new(k, 2, CheckpointMode::ExceptLast, schedule)
            };
            let mut pipe = sim_pipeline(layers, &cfg);
            let report = pipe
                .train_step(&x, &y, &|l, t| cross_entropy(l, t))
                .unwrap();
            let want = r["loss"].1[0];
            assert!(
                (report.loss - want).abs() <= 1e-6 * want,
                "{what}: loss {} vs {want}",
                report.loss
            );
            let params = pipe.named_parameters();
            let grads = r.keys().filter(|n| n.starts_with("grad.")).count();
            assert_eq!(
                params.len(),
                grads,
                "{what}: every parameter has a reference gradient"
            );
            for (name, p) in params {
                let (layer, rest) = name.split_once('.').unwrap();
                let key = format!(
                    "grad.{}",
                    llama.checkpoint_name(layer.parse().unwrap(), rest)
                );
                let (got, want) = (p.grad().unwrap().to_vec().unwrap(), &r[&key].1);
                let e = rel_err(&got, want);
                assert!(e <= 1e-4, "{what}: {key} off by {e:.2e}");
            }
        }
    }
}
