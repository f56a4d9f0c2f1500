//! Sharded checkpoints (`Pipeline::save_sharded`, a folder given to `Pipeline::load`,
//! `consolidate`, `split`): a checkpoint saved by K = 4 x R = 2 resumes bit-exactly with K = 1
//! and K = 2, against the uninterrupted run and the one-file checkpoint of the same state; the
//! two forms convert into each other; a damaged folder is an error naming the shard or the
//! tensor and changes nothing; a save that fails half-way leaves the previous one loadable.

use std::path::{Path, PathBuf};

use serde_json::Value;
use wgpipe_autograd::optim::AdamW;
use wgpipe_autograd::serialize::load_file;
use wgpipe_pipeline::{
    consolidate, split, CheckpointMode, LoadOptions, PersistError, Pipeline, SaveOptions,
    ScheduleKind, INDEX_FILE,
};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

use crate::persist::{dir, state_bits};

/// Token ids for the test transformer.
fn lm_data() -> (Tensor, Tensor) {
    let t = transformer_cfg(0.0).seq_len;
    (token_ids(8, t, 16, 0), token_ids(8, t, 16, 5))
}

/// R = 2 replicas of a K-device GPipe pipeline (M = 2) over the 9-layer transformer with
/// dropout and tied embeddings (`seed` sets its weights), with AdamW.
fn lm_pipeline(k: usize, seed: u64) -> Pipeline {
    let cfg = PipeCfg::new(k, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut pipe = dp_sim_pipeline(2, move || deep_transformer(0.1, seed), &cfg).unwrap();
    pipe.set_optimizer(|| Box::new(AdamW::new(0.01)));
    pipe
}

fn train(pipe: &mut Pipeline, steps: usize) -> Vec<f32> {
    let (x, y) = lm_data();
    pipe_train(pipe, &x, &y, &cross_entropy, steps).0.losses
}

/// Every tensor of a checkpoint file as bits, by name, and its metadata.
type FileBits = (Vec<(String, Vec<u32>)>, Vec<(String, String)>);

fn file_bits(path: &Path) -> FileBits {
    let f = load_file(path, &Device::cpu()).unwrap();
    let mut t: Vec<(String, Vec<u32>)> = f
        .tensors
        .iter()
        .map(|(n, t)| {
            let bits = t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
            (n.clone(), bits)
        })
        .collect();
    t.sort();
    (t, f.metadata)
}

fn index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

fn shard_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

/// A K = 4 x R = 2 pipeline trained 2 steps, saved sharded into `<d>/sharded` and as one file
/// `<d>/one.safetensors`; then the loss of its third step (the uninterrupted run).
fn saved(d: &Path) -> (PathBuf, PathBuf, f32) {
    let mut src = lm_pipeline(4, 3);
    train(&mut src, 2);
    let (sharded, one) = (d.join("sharded"), d.join("one.safetensors"));
    src.save_sharded(&sharded, &SaveOptions::default()).unwrap();
    src.save(&one, &SaveOptions::default()).unwrap();
    let next = train(&mut src, 1)[0];
    (sharded, one, next)
}

#[test]
fn a_4x2_sharded_checkpoint_resumes_bit_exactly_with_k_1_and_k_2() {
    let d = dir("shards-resume");
    let (sharded, one, next) = saved(&d);
    // One shard per device of replica 0, each holding its stages' tensors, and the index.
    let files = shard_files(&sharded);
    assert_eq!(
        files,
        (1..=4)
            .map(|i| format!("model-save1-{i:05}-of-00004.safetensors"))
            .collect::<Vec<_>>()
    );
    let idx = index(&sharded);
    let map = idx["weight_map"].as_object().unwrap();
    let (want, _) = file_bits(&one);
    let mut names: Vec<&String> = map.keys().collect();
    names.sort();
    assert_eq!(
        names,
        want.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        "the index lists the tensors of the one-file checkpoint"
    );
    // Balance 3,2,2,2: layer 0 (the embedding) on device 0, layer 8 (the head, a tied copy
    // saved under the embedding's name) nowhere, layer 7 (the norm) on device 3.
    assert_eq!(
        map["0.tok.weight"],
        "model-save1-00001-of-00004.safetensors"
    );
    assert_eq!(map["7.weight"], "model-save1-00004-of-00004.safetensors");
    assert!(!map.keys().any(|k| k.starts_with("8.")), "{map:?}");
    assert_eq!(idx["metadata"]["wgpipe.step"], "2");
    assert_eq!(idx["metadata"]["wgpipe.layout.devices"], "4");
    assert_eq!(idx["metadata"]["wgpipe.layout.replicas"], "2");

    for k in [1, 2, 4] {
        let mut from_shards = lm_pipeline(k, 9);
        let r = from_shards.load(&sharded, &LoadOptions::default()).unwrap();
        assert_eq!(r.step, 2);
        // The independent reference: the one-file checkpoint of the same state.
        let mut from_file = lm_pipeline(k, 9);
        from_file.load(&one, &LoadOptions::default()).unwrap();
        assert!(
            state_bits(&from_shards) == state_bits(&from_file),
            "K = {k}: parameters or optimizer state differ from the one-file load"
        );
        for rep in from_shards.replicas() {
            assert_eq!(
                snapshot(&rep.named_parameters()),
                snapshot(&from_file.named_parameters()),
                "K = {k}: replica {}",
                rep.index()
            );
        }
        let got = train(&mut from_shards, 1)[0];
        assert_eq!(
            got.to_bits(),
            next.to_bits(),
            "K = {k}: the next step's loss {got} vs {next} uninterrupted"
        );
        train(&mut from_file, 1);
        assert!(
            state_bits(&from_shards) == state_bits(&from_file),
            "K = {k}: after the next step"
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn consolidate_and_split_convert_between_the_two_forms() {
    let d = dir("shards-convert");
    let (sharded, one, _) = saved(&d);
    // Sharded -> one file: the same tensors, bits and metadata (the save's own keys aside).
    let joined = d.join("joined.safetensors");
    consolidate(&sharded, &joined).unwrap();
    let (want, want_meta) = file_bits(&one);
    let (got, got_meta) = file_bits(&joined);
    assert!(
        got == want,
        "consolidated tensors differ from the one-file save"
    );
    let wgpipe_keys = |m: &[(String, String)]| -> Vec<(String, String)> {
        m.iter()
            .filter(|(k, _)| !k.starts_with("wgpipe.layout."))
            .cloned()
            .collect()
    };
    assert_eq!(wgpipe_keys(&got_meta), want_meta);
    // One file -> 3 shards (whole layers each), loading like the file.
    let parts = d.join("parts");
    split(&one, &parts, 3).unwrap();
    assert_eq!(shard_files(&parts).len(), 3);
    let mut from_parts = lm_pipeline(2, 9);
    from_parts
        .load(parts.join(INDEX_FILE), &LoadOptions::default())
        .unwrap();
    let mut from_file = lm_pipeline(2, 9);
    from_file.load(&one, &LoadOptions::default()).unwrap();
    assert!(state_bits(&from_parts) == state_bits(&from_file));
    // And back: the split consolidates to the same file.
    let again = d.join("again.safetensors");
    consolidate(&parts, &again).unwrap();
    assert!(file_bits(&again).0 == want);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A copy of the folder `from` as `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_damaged_folder_is_an_error_naming_the_shard_or_tensor_and_changes_nothing() {
    let d = dir("shards-damaged");
    let (sharded, _, _) = saved(&d);
    let mut pipe = lm_pipeline(2, 9);
    let before = state_bits(&pipe);
    let shard2 = "model-save1-00002-of-00004.safetensors";
    let shard3 = "model-save1-00003-of-00004.safetensors";
    let case = |name: &str, damage: &dyn Fn(&Path)| -> PersistError {
        let broken = d.join(name);
        copy_dir(&sharded, &broken);
        damage(&broken);
        let mut p = lm_pipeline(2, 9);
        let e = p.load(&broken, &LoadOptions::default()).unwrap_err();
        assert!(
            state_bits(&p) == before,
            "{name}: a failed load changed the pipeline"
        );
        e
    };
    // A shard deleted.
    let e = case("missing", &|b| {
        std::fs::remove_file(b.join(shard2)).unwrap()
    });
    assert!(matches!(e, PersistError::Unreadable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(shard2) && msg.contains("missing"), "{msg}");
    // A shard cut short.
    let e = case("truncated", &|b| {
        let bytes = std::fs::read(b.join(shard3)).unwrap();
        std::fs::write(b.join(shard3), &bytes[..bytes.len() - 16]).unwrap();
    });
    assert!(e.to_string().contains(shard3), "{e}");
    // A shard missing from the index (its tensors dropped from the weight_map).
    let e = case("unindexed", &|b| {
        let mut idx = index(b);
        idx["weight_map"]
            .as_object_mut()
            .unwrap()
            .retain(|_, f| f != shard3);
        std::fs::write(b.join(INDEX_FILE), idx.to_string()).unwrap();
    });
    assert!(e.to_string().contains(shard3), "{e}");
    // One tensor the index names is not in its shard.
    let e = case("no-tensor", &|b| {
        let mut idx = index(b);
        let map = idx["weight_map"].as_object_mut().unwrap();
        map.insert("0.bogus".into(), Value::from(shard2));
        std::fs::write(b.join(INDEX_FILE), idx.to_string()).unwrap();
    });
    let msg = e.to_string();
    assert!(msg.contains("0.bogus") && msg.contains(shard2), "{msg}");
    // The index deleted: no checkpoint.
    let e = case("no-index", &|b| {
        std::fs::remove_file(b.join(INDEX_FILE)).unwrap()
    });
    assert!(e.to_string().contains(INDEX_FILE), "{e}");
    // A checkpoint of another model (2 blocks, not 6): the tensor that differs is named.
    let other = d.join("other");
    let cfg = PipeCfg::new(2, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut small = dp_sim_pipeline(2, || transformer(0.1, 3), &cfg).unwrap();
    small.set_optimizer(|| Box::new(AdamW::new(0.01)));
    small.save_sharded(&other, &SaveOptions::default()).unwrap();
    let e = pipe.load(&other, &LoadOptions::default()).unwrap_err();
    match &e {
        PersistError::Mismatch { tensor, .. } => assert!(!tensor.is_empty(), "{e}"),
        _ => panic!("{e:?}"),
    }
    assert!(state_bits(&pipe) == before);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_save_that_fails_half_way_leaves_the_previous_checkpoint_loadable() {
    let d = dir("shards-half");
    let ckpt = d.join("ckpt");
    let mut src = lm_pipeline(4, 3);
    train(&mut src, 1);
    src.save_sharded(&ckpt, &SaveOptions::default()).unwrap();
    let at1 = state_bits(&src);
    train(&mut src, 1);
    // The third shard of the next save cannot be written (a folder in its place).
    let blocker = ckpt.join("model-save2-00003-of-00004.safetensors");
    std::fs::create_dir_all(&blocker).unwrap();
    let e = src
        .save_sharded(&ckpt, &SaveOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("model-save2-00003-of-00004"), "{e}");
    let mut back = lm_pipeline(4, 9);
    assert_eq!(back.load(&ckpt, &LoadOptions::default()).unwrap().step, 1);
    assert!(state_bits(&back) == at1, "the previous checkpoint changed");
    // Once the way is clear the next save goes through and replaces the previous one's files.
    std::fs::remove_dir(&blocker).unwrap();
    src.save_sharded(&ckpt, &SaveOptions::default()).unwrap();
    assert!(shard_files(&ckpt)
        .iter()
        .all(|f| f.starts_with("model-save2-")));
    assert_eq!(back.load(&ckpt, &LoadOptions::default()).unwrap().step, 2);
    assert!(state_bits(&back) == state_bits(&src));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_non_finite_value_is_refused_on_request_naming_the_tensor_and_writing_no_index() {
    let d = dir("shards-nan");
    let ckpt = d.join("ckpt");
    let mut src = lm_pipeline(4, 3);
    train(&mut src, 1);
    // A NaN in a parameter of the last device's stage.
    let (name, p) = src
        .named_parameters()
        .into_iter()
        .find(|(n, _)| n.starts_with("7."))
        .unwrap();
    let shape = p.shape();
    let n = shape.iter().product();
    p.set_value(Tensor::from_vec(vec![f32::NAN; n], &shape, &p.device()).unwrap());
    let opts = SaveOptions {
        require_finite: true,
        ..SaveOptions::default()
    };
    let e = src.save_sharded(&ckpt, &opts).unwrap_err();
    match &e {
        PersistError::NonFinite { tensor, .. } => assert_eq!(*tensor, name),
        _ => panic!("{e:?}"),
    }
    assert!(!ckpt.join(INDEX_FILE).exists(), "an index was written");
    std::fs::remove_dir_all(&d).unwrap();
}
