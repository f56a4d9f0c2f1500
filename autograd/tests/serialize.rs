//! safetensors save/load: round trips, loading into a model with exact mismatch reports, bad
//! files, and checkpoints that resume training bit-identically.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};
use wgpipe_autograd::optim::{zero_grad, Adam, AdamW, Optimizer, Sgd};
use wgpipe_autograd::serialize::{
    load_file, load_into, load_metadata, load_tensors, load_training_state, save_tensors,
    save_training_state,
};
use wgpipe_autograd::{LrSchedule, Param, Tape};
use wgpipe_tensor::{Device, Result, Tensor};

/// A fresh folder for one test.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wgpipe-serialize-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn named(name: &str, values: &[f32], shape: &[usize], dev: &Device) -> (String, Param) {
    let t = Tensor::from_slice(values, shape, dev).unwrap();
    (name.to_string(), Param::new(name, t))
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// A raw tensor for writing test files with the safetensors crate directly.
struct Raw(Dtype, Vec<usize>, Vec<u8>);

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.2)
    }
    fn data_len(&self) -> usize {
        self.2.len()
    }
}

fn write_raw(path: &Path, tensors: &[(&str, Raw)]) {
    let bytes = safetensors::serialize(tensors.iter().map(|(n, r)| (*n, r)), None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn f32_raw(v: &[f32], shape: &[usize]) -> Raw {
    Raw(
        Dtype::F32,
        shape.to_vec(),
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

#[test]
fn save_load_round_trip_is_exact() {
    let d = dir("round-trip");
    let path = d.join("model.safetensors");
    let dev = Device::new_cpu("rt");
    let a = Tensor::rand_normal(&[3, 4], 0.0, 1.0, 7, &dev).unwrap();
    let special = Tensor::from_slice(
        &[
            f32::MIN_POSITIVE / 4.0,
            -0.0,
            f32::INFINITY,
            f32::MAX,
            1e-30,
        ],
        &[5],
        &dev,
    )
    .unwrap();
    let scalar = Tensor::scalar(2.5, &dev).unwrap();
    // A transposed view is saved in its logical (row-major) order.
    let t = Tensor::arange(0.0, 6.0, 1.0, &dev)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap()
        .t()
        .unwrap();
    let tensors = vec![
        ("blocks.3.attn.q.weight".to_string(), a.clone()),
        ("blocks.3.attn.q.bias".to_string(), special.clone()),
        ("scale".to_string(), scalar.clone()),
        ("transposed".to_string(), t.clone()),
    ];
    let meta = vec![("author".to_string(), "test".to_string())];
    save_tensors(&path, &tensors, &meta).unwrap();
    assert!(
        !d.join("model.safetensors.tmp").exists(),
        "the temporary file is renamed away"
    );

    let loaded = load_file(&path, &dev).unwrap();
    assert_eq!(loaded.metadata, meta);
    assert_eq!(loaded.tensors.len(), 4);
    for (name, want) in &tensors {
        let (_, got) = loaded.tensors.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(got.shape(), want.shape(), "{name}");
        assert_eq!(bits(got), bits(want), "{name}");
    }
    assert_eq!(load_metadata(&path).unwrap(), meta);
    assert_eq!(load_tensors(&path, &dev).unwrap().len(), 4);

    // The file is plain safetensors: another reader sees names, dtypes and shapes.
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let q = st.tensor("blocks.3.attn.q.weight").unwrap();
    assert_eq!(q.dtype(), Dtype::F32);
    assert_eq!(q.shape(), [3, 4]);

    // Saving again replaces the file atomically.
    save_tensors(&path, &tensors[..1], &[]).unwrap();
    assert_eq!(load_tensors(&path, &dev).unwrap().len(), 1);
    assert!(load_metadata(&path).unwrap().is_empty());

    // Duplicate names are refused.
    let e = save_tensors(&path, &[tensors[0].clone(), tensors[0].clone()], &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blocks.3.attn.q.weight") && e.contains("twice"),
        "{e}"
    );
    // An unwritable place names the file.
    let bad = d.join("no-such-dir").join("x.safetensors");
    let e = save_tensors(&bad, &tensors, &[]).unwrap_err().to_string();
    assert!(
        e.contains("x.safetensors") && e.contains("cannot write"),
        "{e}"
    );
}

#[test]
fn f16_and_bf16_are_widened() {
    let d = dir("half");
    let path = d.join("half.safetensors");
    let vals = [1.0f32, -2.5, 0.333_251_95, 65504.0];
    let h: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let b: Vec<u8> = vals
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    write_raw(
        &path,
        &[
            ("h", Raw(Dtype::F16, vec![2, 2], h)),
            ("b", Raw(Dtype::BF16, vec![4], b)),
        ],
    );
    let dev = Device::new_cpu("half");
    let t = load_tensors(&path, &dev).unwrap();
    let get = |n: &str| t.iter().find(|(k, _)| k == n).unwrap().1.clone();
    assert_eq!(get("h").shape(), [2, 2]);
    let want_h: Vec<f32> = vals
        .iter()
        .map(|&v| half::f16::from_f32(v).to_f32())
        .collect();
    let want_b: Vec<f32> = vals
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert_eq!(get("h").to_vec().unwrap(), want_h);
    assert_eq!(get("b").to_vec().unwrap(), want_b);

    // Into a model: reported as converted.
    let params = vec![
        named("h", &[0.0; 4], &[2, 2], &dev),
        named("b", &[0.0; 4], &[4], &dev),
    ];
    let r = load_into(&path, &params, true).unwrap();
    assert_eq!(r.loaded, ["h", "b"]);
    assert_eq!(r.converted.len(), 2);
    assert_eq!(params[0].1.value().to_vec().unwrap(), want_h);
}

#[test]
fn load_into_reports_every_mismatch_exactly() {
    let d = dir("mismatch");
    let path = d.join("m.safetensors");
    let dev = Device::new_cpu("mm");
    write_raw(
        &path,
        &[
            ("enc.weight", f32_raw(&[1.0; 12], &[3, 4])),
            ("enc.bias", f32_raw(&[2.0; 4], &[4])),
            ("extra.weight", f32_raw(&[0.0; 2], &[2])),
        ],
    );
    let fresh = || {
        vec![
            named("enc.weight", &[0.0; 12], &[3, 4], &dev),
            named("enc.bias", &[0.0; 4], &[4], &dev),
            named("head.bias", &[0.0; 2], &[2], &dev),
        ]
    };

    // Strict: missing and unexpected names, all in one message; nothing changes.
    let params = fresh();
    let e = load_into(&path, &params, true).unwrap_err().to_string();
    assert!(e.contains("m.safetensors"), "{e}");
    assert!(
        e.contains("1 missing (in the model, not in the file): head.bias"),
        "{e}"
    );
    assert!(
        e.contains("1 unexpected (in the file, not in the model): extra.weight"),
        "{e}"
    );
    assert_eq!(params[0].1.value().to_vec().unwrap(), [0.0; 12]);

    // Not strict: loads what matches and reports the rest.
    let r = load_into(&path, &params, false).unwrap();
    assert_eq!(r.loaded, ["enc.weight", "enc.bias"]);
    assert_eq!(r.missing, ["head.bias"]);
    assert_eq!(r.unexpected, ["extra.weight"]);
    assert_eq!(params[0].1.value().to_vec().unwrap(), [1.0; 12]);
    assert_eq!(params[2].1.value().to_vec().unwrap(), [0.0; 2]);

    // A misshapen tensor is an error even when not strict, with both shapes.
    let params = vec![
        named("enc.weight", &[0.0; 12], &[4, 3], &dev),
        named("enc.bias", &[0.0; 4], &[4], &dev),
    ];
    let e = load_into(&path, &params, false).unwrap_err().to_string();
    assert!(
        e.contains("shape mismatch: enc.weight is [3, 4] in the file vs [4, 3] in the model"),
        "{e}"
    );
    // And nothing was loaded, not even the tensor that matched.
    assert_eq!(params[1].1.value().to_vec().unwrap(), [0.0; 4]);

    // A wrong dtype.
    let path2 = d.join("ints.safetensors");
    write_raw(
        &path2,
        &[("enc.bias", Raw(Dtype::I64, vec![4], vec![0u8; 32]))],
    );
    let params = vec![named("enc.bias", &[0.0; 4], &[4], &dev)];
    let e = load_into(&path2, &params, true).unwrap_err().to_string();
    assert!(
        e.contains("'enc.bias' has dtype I64") && e.contains("F32, F16 and BF16"),
        "{e}"
    );
    let e = load_tensors(&path2, &dev).unwrap_err().to_string();
    assert!(e.contains("I64"), "{e}");
}

#[test]
fn bad_files_are_clear_errors() {
    let d = dir("bad-files");
    let dev = Device::new_cpu("bad");
    let good = d.join("good.safetensors");
    save_tensors(
        &good,
        &[("w".to_string(), Tensor::ones(&[64], &dev).unwrap())],
        &[],
    )
    .unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let params = vec![named("w", &[0.0; 64], &[64], &dev)];

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", bytes[..bytes.len() - 10].to_vec()),
        ("header-only", bytes[..20].to_vec()),
        ("empty", Vec::new()),
        ("garbage", b"this is not a safetensors file at all".to_vec()),
        ("huge-header", {
            let mut b = u64::MAX.to_le_bytes().to_vec();
            b.extend_from_slice(b"{}");
            b
        }),
        ("bad-json", {
            let mut b = bytes.clone();
            b[8] = b'[';
            b
        }),
        ("trailing", {
            let mut b = bytes.clone();
            b.extend_from_slice(&[0; 4]);
            b
        }),
    ];
    for (what, content) in cases {
        let path = d.join(format!("{what}.safetensors"));
        std::fs::write(&path, content).unwrap();
        for e in [
            load_tensors(&path, &dev).unwrap_err().to_string(),
            load_into(&path, &params, true).unwrap_err().to_string(),
        ] {
            assert!(e.contains(&format!("{what}.safetensors")), "{what}: {e}");
            assert!(e.contains("not a valid safetensors file"), "{what}: {e}");
        }
    }
    assert_eq!(params[0].1.value().to_vec().unwrap(), [0.0; 64]);

    let e = load_tensors(d.join("absent.safetensors"), &dev)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("absent.safetensors") && e.contains("cannot read"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: save → load → continue equals training without the break.
// ---------------------------------------------------------------------------------------------

fn mlp(dev: &Device) -> Vec<(String, Param)> {
    let shapes: [(&str, &[usize]); 4] = [
        ("fc1.weight", &[3, 8]),
        ("fc1.bias", &[8]),
        ("fc2.weight", &[8, 2]),
        ("fc2.bias", &[2]),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, (n, s))| {
            let t = Tensor::rand_normal(s, 0.0, 0.5, 100 + i as u64, dev).unwrap();
            (n.to_string(), Param::new(*n, t))
        })
        .collect()
}

fn batch(step: u64, dev: &Device) -> (Tensor, Tensor) {
    (
        Tensor::rand_normal(&[6, 3], 0.0, 1.0, 1000 + step, dev).unwrap(),
        Tensor::rand_normal(&[6, 2], 0.0, 1.0, 2000 + step, dev).unwrap(),
    )
}

/// One training step (gradients accumulated over two micro-batches), returns the loss.
fn train_step(
    params: &[(String, Param)],
    opt: &mut dyn Optimizer,
    step: u64,
    dev: &Device,
) -> Result<f32> {
    zero_grad(params);
    let (x, y) = batch(step, dev);
    let mut total = 0.0;
    for (start, len) in [(0, 2), (2, 4)] {
        let tape = Tape::new();
        let p: Vec<_> = params.iter().map(|(_, p)| tape.stored_param(p)).collect();
        let x = tape.constant(x.narrow(0, start, len)?);
        let y = tape.constant(y.narrow(0, start, len)?);
        let h = x.matmul(&p[0])?.add(&p[1])?.tanh()?;
        let loss = h
            .matmul(&p[2])?
            .add(&p[3])?
            .sub(&y)?
            .square()?
            .mean_all()?
            .mul_scalar(len as f32 / 6.0)?;
        total += loss.to_scalar()?;
        tape.backward(&loss)?;
    }
    wgpipe_autograd::optim::clip_grad_norm(params, 1.0)?;
    LrSchedule::WarmupCosine {
        warmup_steps: 2,
        total_steps: 8,
        min_lr: 0.001,
    }
    .apply(opt, 0.05);
    opt.step(params)?;
    Ok(total)
}

fn resume_is_bit_identical(what: &str, make: &dyn Fn() -> Box<dyn Optimizer>) {
    let d = dir(&format!("resume-{what}"));
    let path = d.join("ckpt.safetensors");
    let dev = Device::new_cpu("resume");

    // Uninterrupted: 8 steps.
    let params = mlp(&dev);
    let mut opt = make();
    let straight: Vec<u32> = (0..8)
        .map(|s| {
            train_step(&params, opt.as_mut(), s, &dev)
                .unwrap()
                .to_bits()
        })
        .collect();
    let final_straight: Vec<Vec<u32>> = params.iter().map(|(_, p)| bits(&p.value())).collect();

    // Interrupted after 4 steps: save, then load into a fresh model and optimizer.
    let params = mlp(&dev);
    let buffers = vec![named("norm.running_mean", &[0.5, -0.5], &[2], &dev)];
    let mut opt = make();
    let mut resumed: Vec<u32> = (0..4)
        .map(|s| {
            train_step(&params, opt.as_mut(), s, &dev)
                .unwrap()
                .to_bits()
        })
        .collect();
    let meta = vec![("note".to_string(), "halfway".to_string())];
    save_training_state(&path, &params, &buffers, opt.as_ref(), 4, &meta).unwrap();
    drop((params, opt));

    let dev2 = Device::new_cpu("resume-2");
    let params = mlp(&dev2);
    // Scramble the fresh model so that a load that missed anything shows.
    for (_, p) in &params {
        p.set_value(p.value().mul_scalar(3.0).unwrap());
    }
    let buffers = vec![named("norm.running_mean", &[0.0, 0.0], &[2], &dev2)];
    let mut opt = make();
    let info = load_training_state(&path, &params, &buffers, opt.as_mut()).unwrap();
    assert_eq!(info.step, 4);
    assert_eq!(info.metadata, meta);
    assert_eq!(opt.steps(), 4);
    assert_eq!(buffers[0].1.value().to_vec().unwrap(), [0.5, -0.5]);
    for (k, t) in opt.state() {
        if !k.starts_with('@') && !k.ends_with(".step") {
            assert_eq!(t.device(), &dev2, "{k} is on its parameter's device");
        }
    }
    resumed.extend((4..8).map(|s| {
        train_step(&params, opt.as_mut(), s, &dev2)
            .unwrap()
            .to_bits()
    }));
    assert_eq!(straight, resumed, "{what}: losses differ after resuming");
    let final_resumed: Vec<Vec<u32>> = params.iter().map(|(_, p)| bits(&p.value())).collect();
    assert_eq!(
        final_straight, final_resumed,
        "{what}: parameters differ after resuming"
    );
}

#[test]
fn resume_adam_is_bit_identical() {
    resume_is_bit_identical("adam", &|| Box::new(Adam::new(0.05)));
}

#[test]
fn resume_adamw_is_bit_identical() {
    resume_is_bit_identical("adamw", &|| Box::new(AdamW::new(0.05)));
}

#[test]
fn resume_sgd_nesterov_is_bit_identical() {
    resume_is_bit_identical("sgd", &|| {
        Box::new(
            Sgd::new(0.05)
                .with_momentum(0.9)
                .with_nesterov(true)
                .with_weight_decay(1e-3),
        )
    });
}

#[test]
fn checkpoint_errors_name_the_problem() {
    let d = dir("ckpt-errors");
    let path = d.join("ckpt.safetensors");
    let dev = Device::new_cpu("ckpt-err");
    let params = mlp(&dev);
    let mut adam = Adam::new(0.01);
    train_step(&params, &mut adam, 0, &dev).unwrap();
    save_training_state(&path, &params, &[], &adam, 1, &[]).unwrap();

    // The optimizer state of Adam does not load into SGD; the model is left as it was.
    let fresh = mlp(&dev);
    let before = bits(&fresh[0].1.value());
    let mut sgd = Sgd::new(0.01).with_momentum(0.9);
    let e = load_training_state(&path, &fresh, &[], &mut sgd)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ckpt.safetensors") && e.contains("exp_avg"),
        "{e}"
    );
    assert_eq!(bits(&fresh[0].1.value()), before);

    // A model with a missing parameter.
    let e = load_training_state(&path, &fresh[..3], &[], &mut Adam::new(0.01))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unexpected") && e.contains("fc2.bias"), "{e}");

    // A model whose parameter has another shape: both the weight and its moments mismatch.
    let mut other = mlp(&dev);
    other[1] = named("fc1.bias", &[0.0; 7], &[7], &dev);
    let e = load_training_state(&path, &other, &[], &mut Adam::new(0.01))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("fc1.bias is [8] in the file vs [7] in the model"),
        "{e}"
    );

    // A plain tensor file is not a checkpoint.
    let plain = d.join("plain.safetensors");
    save_tensors(
        &plain,
        &[("w".into(), Tensor::ones(&[1], &dev).unwrap())],
        &[],
    )
    .unwrap();
    let e = load_training_state(&plain, &fresh, &[], &mut Adam::new(0.01))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a wgpipe checkpoint"), "{e}");

    // Reserved names and keys.
    let bad = vec![named("optim.x", &[0.0], &[1], &dev)];
    assert!(save_training_state(&path, &bad, &[], &adam, 1, &[]).is_err());
    let e = save_training_state(
        &path,
        &params,
        &[],
        &adam,
        1,
        &[("wgpipe.step".into(), "9".into())],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("reserved"), "{e}");
    // The earlier checkpoint is intact after the refused saves.
    assert_eq!(
        load_training_state(&path, &fresh, &[], &mut Adam::new(0.01))
            .unwrap()
            .step,
        1
    );
}
