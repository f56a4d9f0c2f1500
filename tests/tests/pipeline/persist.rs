//! Whole-pipeline checkpoint files (`Pipeline::save` / `Pipeline::load`): a load that fails
//! changes nothing (not even the optimizer state of stages checked before the failing one);
//! an unreadable file is told apart from a checkpoint of another model (which names the
//! tensor); non-finite values are refused on request; concurrent saves to one path never
//! publish a broken file; temporaries of dead processes are cleaned up.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use wgpipe_autograd::optim::AdamW;
use wgpipe_autograd::serialize::{load_file, save_tensors, TensorFile};
use wgpipe_pipeline::{
    CheckpointMode, LoadOptions, PersistError, Pipeline, SaveOptions, ScheduleKind,
};
use wgpipe_tensor::{Device, Tensor};
use wgpipe_tests::*;

pub(crate) fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wgpipe-persist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A trained `k`-stage AdamW pipeline over the 8-layer MLP (`seed` changes its weights).
fn trained(k: usize, seed: u64, steps: usize) -> Pipeline {
    let cfg = PipeCfg::new(k, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut pipe = sim_pipeline(mlp(6, 12, 3, seed), &cfg);
    pipe.set_optimizer(|| Box::new(AdamW::new(0.01)));
    let (x, y) = (normal_data(&[8, 6], seed), normal_data(&[8, 3], seed + 1));
    for _ in 0..steps {
        pipe.train_step(&x, &y, &mse).unwrap();
        pipe.optimizer_step().unwrap();
    }
    pipe
}

/// Parameter values and every stage's optimizer state, as bits.
pub(crate) fn state_bits(pipe: &Pipeline) -> Vec<(String, Vec<u32>)> {
    let bits = |t: &Tensor| t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect();
    let mut v: Vec<(String, Vec<u32>)> = pipe
        .named_parameters()
        .iter()
        .map(|(n, p)| (n.clone(), bits(&p.value())))
        .collect();
    for (i, o) in pipe.optimizers().iter().enumerate() {
        for (k, t) in o.state() {
            v.push((format!("stage {i}: {k}"), bits(&t)));
        }
    }
    v.push(("step".into(), vec![pipe.step_count() as u32]));
    v
}

/// Rewrites the checkpoint at `from` into `to` with `edit` applied to its tensors.
fn rewrite(from: &Path, to: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let f = load_file(from, &Device::cpu()).unwrap();
    let mut tensors = f.tensors;
    edit(&mut tensors);
    save_tensors(to, &tensors, &f.metadata).unwrap();
}

#[test]
fn save_then_load_restores_everything_across_k() {
    let d = dir("roundtrip");
    let path = d.join("ckpt.safetensors");
    let src = trained(4, 3, 3);
    src.save(&path, &SaveOptions::default()).unwrap();
    // Into a 4-stage pipeline of other weights, and into a 2-stage one.
    let mut same_k = trained(4, 9, 1);
    let r = same_k.load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(r.step, 3);
    assert_eq!(state_bits(&same_k), state_bits(&src));
    let mut other_k = trained(2, 9, 1);
    other_k.load(&path, &LoadOptions::default()).unwrap();
    assert_eq!(
        snapshot(&other_k.named_parameters()),
        snapshot(&src.named_parameters())
    );
    assert_eq!(other_k.step_count(), 3);
}

#[test]
fn a_load_that_fails_on_the_last_stage_changes_no_stage() {
    let d = dir("atomic-load");
    let good = d.join("good.safetensors");
    let broken = d.join("broken.safetensors");
    trained(4, 3, 3)
        .save(&good, &SaveOptions::default())
        .unwrap();
    // Drop one moment of a parameter of the last stage (layer 7: the last Linear).
    rewrite(&good, &broken, |t| {
        t.retain(|(n, _)| n != "optim.7.weight.exp_avg");
    });
    let mut pipe = trained(4, 9, 2);
    let before = state_bits(&pipe);
    let err = pipe.load(&broken, &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, PersistError::Mismatch { .. }), "{err:?}");
    assert!(msg.contains("stage 3") && msg.contains("7.weight"), "{msg}");
    assert!(
        state_bits(&pipe) == before,
        "a failed load changed the pipeline (earlier stages' optimizer state?)"
    );
}

#[test]
fn unreadable_files_are_told_apart_from_other_models() {
    let d = dir("kinds");
    let good = d.join("good.safetensors");
    trained(4, 3, 1)
        .save(&good, &SaveOptions::default())
        .unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let truncated = d.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let garbage = d.join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a checkpoint at all").unwrap();
    let plain = d.join("plain.safetensors");
    save_tensors(&plain, &[("w".into(), normal_data(&[2], 1))], &[]).unwrap();
    let mut pipe = trained(4, 9, 1);
    let before = state_bits(&pipe);
    for (what, p) in [
        ("truncated", &truncated),
        ("garbage", &garbage),
        ("plain", &plain),
    ] {
        let err = pipe.load(p, &LoadOptions::default()).unwrap_err();
        assert!(
            matches!(err, PersistError::Unreadable { .. }),
            "{what}: {err:?}"
        );
        assert!(
            err.to_string().contains("cannot be read as a checkpoint"),
            "{what}: {err}"
        );
    }
    let err = pipe
        .load(d.join("missing.safetensors"), &LoadOptions::default())
        .unwrap_err();
    assert!(matches!(err, PersistError::Unreadable { .. }), "{err:?}");

    // Another model: a wider MLP. The first tensor that differs is named, with both shapes.
    let cfg = PipeCfg::new(4, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let wide = sim_pipeline(mlp(6, 16, 3, 1), &cfg);
    let other = d.join("other.safetensors");
    wide.save(&other, &SaveOptions::default()).unwrap();
    let err = pipe.load(&other, &LoadOptions::default()).unwrap_err();
    match &err {
        PersistError::Mismatch { tensor, why, .. } => {
            assert_eq!(tensor, "0.weight", "{err}");
            assert!(
                why.contains("shape mismatch") && why.contains("more"),
                "{err}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(state_bits(&pipe) == before);
}

#[test]
fn non_finite_checkpoints_are_refused_on_request() {
    let d = dir("nan");
    let good = d.join("good.safetensors");
    let nan = d.join("nan.safetensors");
    trained(4, 3, 1)
        .save(&good, &SaveOptions::default())
        .unwrap();
    rewrite(&good, &nan, |t| {
        let (_, w) = t.iter_mut().find(|(n, _)| n == "5.bias").unwrap();
        let mut v = w.to_vec().unwrap();
        v[0] = f32::NAN;
        *w = Tensor::from_vec(v, w.shape(), &Device::cpu()).unwrap();
    });
    let mut pipe = trained(4, 9, 1);
    let before = state_bits(&pipe);
    let strict = LoadOptions {
        require_finite: true,
        ..Default::default()
    };
    let err = pipe.load(&nan, &strict).unwrap_err();
    assert!(
        matches!(&err, PersistError::NonFinite { tensor, .. } if tensor == "5.bias"),
        "{err:?}"
    );
    assert!(err.to_string().contains("5.bias") && err.to_string().contains("NaN"));
    assert!(state_bits(&pipe) == before);
    // Refused by default too; loaded only when asked not to check.
    let err = pipe.load(&nan, &LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, PersistError::NonFinite { .. }), "{err:?}");
    let lax = LoadOptions {
        require_finite: false,
        ..Default::default()
    };
    pipe.load(&nan, &lax).unwrap();
    // And a save of it is refused on request, publishing nothing.
    let out = d.join("out.safetensors");
    let opts = SaveOptions {
        require_finite: true,
        ..Default::default()
    };
    let err = pipe.save(&out, &opts).unwrap_err();
    assert!(
        matches!(&err, PersistError::NonFinite { tensor, .. } if tensor == "5.bias"),
        "{err:?}"
    );
    assert!(!out.exists());
}

#[test]
fn two_threads_saving_to_one_path_never_publish_a_broken_file() {
    let d = dir("concurrent");
    let path = d.join("ckpt.safetensors");
    let (a, b) = (trained(2, 3, 1), trained(2, 5, 1));
    a.save(&path, &SaveOptions::default()).unwrap();
    let path = &path;
    let done = AtomicBool::new(false);
    // Nothing in here panics (a panic would leave the reader spinning): failures are counted.
    let (reads, bad_reads, failed_saves) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let (mut n, mut bad) = (0, Vec::new());
            while !done.load(Ordering::SeqCst) {
                if let Err(e) = TensorFile::open(path) {
                    bad.push(e.to_string());
                }
                n += 1;
            }
            (n, bad)
        });
        let writers: Vec<_> = [a, b]
            .into_iter()
            .map(|p| {
                s.spawn(move || {
                    (0..100)
                        .filter_map(|_| p.save(path, &SaveOptions::default()).err())
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let failed: Vec<String> = writers
            .into_iter()
            .flat_map(|w| {
                w.join()
                    .unwrap_or_else(|_| vec!["a writer panicked".into()])
            })
            .collect();
        done.store(true, Ordering::SeqCst);
        let (n, bad) = reader.join().unwrap_or_default();
        (n, bad, failed)
    });
    assert!(
        failed_saves.is_empty(),
        "failed saves: {:?}",
        &failed_saves[..failed_saves.len().min(3)]
    );
    assert!(
        bad_reads.is_empty(),
        "{} of {reads} reads saw a broken file: {:?}",
        bad_reads.len(),
        &bad_reads[..bad_reads.len().min(3)]
    );
    eprintln!("{reads} reads during 200 saves, all whole files");
    let mut check = trained(2, 9, 1);
    check.load(path, &LoadOptions::default()).unwrap();
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n != "ckpt.safetensors")
        .collect();
    assert!(left.is_empty(), "temporaries left behind: {left:?}");
}

#[test]
fn stale_temporaries_of_dead_processes_are_cleaned_and_live_ones_kept() {
    let d = dir("stale");
    let path = d.join("ckpt.safetensors");
    // No process has pid 4294967290 (above Linux's pid_max); ours is alive.
    let dead = d.join(".ckpt.safetensors.4294967290-0.wgpipe-tmp");
    let live = d.join(format!(
        ".ckpt.safetensors.{}-999999.wgpipe-tmp",
        std::process::id()
    ));
    let other = d.join(".other.safetensors.4294967290-0.wgpipe-tmp");
    for f in [&dead, &live, &other] {
        std::fs::write(f, b"half a checkpoint").unwrap();
    }
    trained(2, 3, 1)
        .save(&path, &SaveOptions::default())
        .unwrap();
    if Path::new("/proc/self").exists() {
        assert!(!dead.exists(), "a dead process's temporary was not removed");
    }
    assert!(live.exists(), "a live save's temporary was removed");
    assert!(other.exists(), "another file's temporary was removed");
}

/// A checkpoint records the settings that change the arithmetic: a resume under other ones
/// (here M = 4 instead of 2) is refused naming them, and nothing changes; allowed explicitly,
/// it loads and says which differ. K is not among them (a checkpoint reshards).
#[test]
fn a_resume_under_other_arithmetic_settings_is_refused_unless_allowed() {
    let d = dir("settings");
    let path = d.join("m2.safetensors");
    trained(2, 3, 1)
        .save(&path, &SaveOptions::default())
        .unwrap();
    let cfg = PipeCfg::new(4, 4, CheckpointMode::ExceptLast, ScheduleKind::GPipe);
    let mut other = sim_pipeline(mlp(6, 12, 3, 9), &cfg);
    other.set_optimizer(|| Box::new(AdamW::new(0.01)));
    let before = state_bits(&other);
    let err = other.load(&path, &LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    match &err {
        PersistError::OtherSettings { settings, .. } => {
            let names: Vec<&str> = settings.iter().map(|o| o.name.as_str()).collect();
            assert_eq!(names, ["micro_batches"], "{msg}");
            assert_eq!(
                (settings[0].saved.as_str(), settings[0].now.as_str()),
                ("2", "4")
            );
        }
        e => panic!("{e:?}"),
    }
    assert!(msg.contains("micro_batches 4 (saved with 2)"), "{msg}");
    assert!(state_bits(&other) == before);
    let allow = LoadOptions {
        allow_other_settings: true,
        ..Default::default()
    };
    let restored = other.load(&path, &allow).unwrap();
    assert_eq!(restored.other_settings.len(), 1);
    // The same settings at another K load without a word.
    let mut k4 = sim_pipeline(
        mlp(6, 12, 3, 9),
        &PipeCfg::new(4, 2, CheckpointMode::ExceptLast, ScheduleKind::GPipe),
    );
    k4.set_optimizer(|| Box::new(AdamW::new(0.01)));
    assert!(k4
        .load(&path, &LoadOptions::default())
        .unwrap()
        .other_settings
        .is_empty());
    std::fs::remove_dir_all(&d).unwrap();
}
