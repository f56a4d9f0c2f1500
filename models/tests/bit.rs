//! BiT's ResNetV2 read from a timm checkpoint against timm itself: the fixture's
//! `model.safetensors` is a small random `ResNetV2` as `resnetv2_50x1_bit` builds it (the fixed
//! stem, StdConv2d, GroupNorm(32), pre-activation bottlenecks, a 1x1-conv head), and
//! `reference.safetensors` timm's logits, loss and gradients for two images in float64
//! (`scripts/timm_resnetv2_reference.py`).

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Tape};
use wgpipe_models::data::Interpolation;
use wgpipe_models::hf::{
    image_preprocessing, load_layers, resnetv2_of, save_hf, HfCheckpoint, HfFolder, Preprocessing,
    SaveOptions,
};
use wgpipe_models::{cross_entropy, forward_all, sequence_parameters, HfNames, ResNetV2};
use wgpipe_tensor::DType;
use wgpipe_tensor::{Device, Tensor};

fn model() -> ResNetV2 {
    ResNetV2 {
        depths: vec![1, 1],
        channels: vec![128, 256],
        stem_channels: 32,
        in_channels: 3,
        num_classes: 5,
        groups: 32,
    }
}

fn equals_timm(dev: &Device) {
    let dir = fixture_path("bit");
    let r = read_reference(&dir.join("reference.safetensors"));
    let resnet = model();
    let checkpoint = HfCheckpoint::open_file(&dir.join("model.safetensors")).unwrap();
    let layers = load_layers(&resnet, &checkpoint, 0..resnet.num_layers(), dev).unwrap();
    let tensor = |name: &str| Tensor::from_vec(r[name].1.clone(), &r[name].0, dev).unwrap();
    let tape = Tape::new();
    let logits = forward_all(
        &layers,
        &tape.constant(tensor("images")),
        &ForwardCtx::eval(),
    )
    .unwrap();
    let e = norm_err(&vals(logits.value()), &r["logits"].1);
    eprintln!("logits: {e:.2e}");
    assert!(e <= 1e-5, "logits off by {e:.2e}");
    let loss = cross_entropy(&logits, &tensor("labels")).unwrap();
    let want = r["loss"].1[0];
    assert!((loss.to_scalar().unwrap() - want).abs() <= 1e-5 * want.abs());
    tape.backward(&loss).unwrap();
    let mut compared = 0;
    for (k, layer) in layers.iter().enumerate() {
        for (name, p) in layer.parameters() {
            let key = format!("grad.{}", resnet.checkpoint_key(k, &name).0);
            let e = norm_err(&vals(&p.grad().unwrap()), &r[&key].1);
            eprintln!("{key}: {e:.2e}");
            assert!(e <= 1e-4, "{key} off by {e:.2e}");
            compared += 1;
        }
    }
    assert_eq!(
        compared,
        r.keys().filter(|n| n.starts_with("grad.")).count()
    );
}

#[test]
fn a_bit_resnetv2_from_a_timm_checkpoint_equals_timm() {
    equals_timm(&cpu());
}

#[test]
fn a_bit_resnetv2_on_wgpu_equals_timm() {
    match Device::test_wgpu() {
        Ok(dev) => equals_timm(&dev),
        Err(e) => eprintln!("SKIPPED: no wgpu test device: {e}"),
    }
}

#[test]
fn resnetv2_sizes_are_checked() {
    let mut bad = model();
    bad.channels = vec![128, 100];
    let e = bad.build(0, &cpu()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("multiples of 32 groups"), "{e}");
    let bit = ResNetV2::bit50(1, 10);
    assert_eq!(bit.num_layers(), 3 + 4 + 6 + 3 + 3);
    assert_eq!(
        bit.checkpoint_key(5, "conv2.weight").0,
        "stages.1.blocks.1.conv2.weight"
    );
    assert_eq!(bit.checkpoint_key(0, "conv.weight").0, "stem.conv.weight");
    assert_eq!(bit.checkpoint_key(18, "fc.bias").0, "head.fc.bias");
}

/// Fine-tuning on other classes: the body from the checkpoint, a fresh head for 3 classes
/// (timm's initialization: N(0, 0.01), zero bias); the output has 3 columns, the body's values
/// are the checkpoint's, and one step's gradient reaches the stem.
#[test]
fn a_pretrained_body_takes_a_new_head_for_other_classes() {
    let dir = fixture_path("bit");
    let resnet = model();
    let checkpoint = HfCheckpoint::open_file(&dir.join("model.safetensors")).unwrap();
    let n = resnet.num_layers();
    let mut layers = load_layers(&resnet, &checkpoint, 0..n - 1, &cpu()).unwrap();
    let head = resnet.new_head(3, 7, &cpu()).unwrap();
    let params = head.parameters();
    assert_eq!(params[0].1.shape(), [3, 256, 1, 1]);
    let w = vals(&params[0].1.value());
    let std = (w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32).sqrt();
    assert!((0.007..0.013).contains(&std), "head weight std {std}");
    assert!(vals(&params[1].1.value()).iter().all(|&b| b == 0.0));
    layers.push(head);
    let r = read_reference(&dir.join("reference.safetensors"));
    let x = Tensor::from_vec(r["images"].1.clone(), &r["images"].0, &cpu()).unwrap();
    let tape = Tape::new();
    let logits = forward_all(&layers, &tape.constant(x), &ForwardCtx::eval()).unwrap();
    assert_eq!(logits.shape(), [2, 3]);
    let labels = Tensor::from_vec(vec![0.0, 2.0], &[2], &cpu()).unwrap();
    tape.backward(&cross_entropy(&logits, &labels).unwrap())
        .unwrap();
    let stem = &layers[0].parameters()[0].1;
    assert!(vals(&stem.grad().unwrap()).iter().any(|&g| g != 0.0));
    assert!(resnet.new_head(0, 0, &cpu()).is_err());
}

/// A checkpoint file has no config: the sizes come from its tensors' shapes.
#[test]
fn the_model_is_read_from_the_checkpoints_shapes() {
    let checkpoint = HfCheckpoint::open_file(&fixture_path("bit/model.safetensors")).unwrap();
    assert_eq!(resnetv2_of(&checkpoint).unwrap(), model());
    let gpt2 = HfCheckpoint::open(&fixture_path("gpt2")).unwrap();
    let e = resnetv2_of(&gpt2).unwrap_err().to_string();
    assert!(
        e.contains("not a timm ResNetV2") && e.contains("stem.conv.weight") && e.contains("gpt2"),
        "{e}"
    );
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("wgpipe-bit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The folder's config.json states the preprocessing as timm writes it; what it leaves out is
/// BiT's; what it states wrong is named.
#[test]
fn the_preprocessing_is_read_from_timms_config() {
    let dir = temp_dir("pre");
    assert_eq!(image_preprocessing(&dir, 3).unwrap(), Preprocessing::bit());
    let write = |cfg: &str| std::fs::write(dir.join("config.json"), cfg).unwrap();
    write(
        r#"{"architecture": "resnetv2_50x1_bit", "pretrained_cfg": {"interpolation": "bicubic", "crop_pct": 0.875, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}"#,
    );
    let pre = image_preprocessing(&dir, 3).unwrap();
    assert_eq!(pre.interpolation, Interpolation::Bicubic);
    assert_eq!(pre.crop_pct, 0.875);
    assert_eq!(pre.mean, [0.485, 0.456, 0.406]);
    assert_eq!(pre.resize(224).side, 224);
    for (cfg, named) in [
        (
            r#"{"pretrained_cfg": {"interpolation": "nearest"}}"#,
            "interpolation",
        ),
        (r#"{"pretrained_cfg": {"crop_pct": 1.5}}"#, "crop_pct"),
        (r#"{"pretrained_cfg": {"mean": [0.5, 0.5]}}"#, "mean"),
        (r#"{"pretrained_cfg": {"std": [0.5, 0.0, 0.5]}}"#, "std"),
        ("{not json", "config.json"),
    ] {
        write(cfg);
        let e = image_preprocessing(&dir, 3).unwrap_err().to_string();
        assert!(e.contains(named) && e.contains("config.json"), "{cfg}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `config.json` written beside a saved model: timm's registered name where the sizes are
/// one, else the sizes as `model_args`.
#[test]
fn the_saved_config_names_the_architecture_timm_registers() {
    let c = ResNetV2::bit50(1, 3).config_json(DType::F32);
    assert_eq!(c["architecture"], "resnetv2_50x1_bit");
    assert_eq!(c["num_classes"], 3);
    assert_eq!(c["num_features"], 2048);
    assert!(c.get("model_args").is_none());
    assert_eq!(
        ResNetV2::bit50(3, 3).config_json(DType::F32)["architecture"],
        "resnetv2_50x3_bit"
    );
    let c = model().config_json(DType::F32);
    assert_eq!(c["architecture"], "resnetv2");
    assert_eq!(c["model_args"]["layers"], serde_json::json!([1, 1]));
    assert_eq!(c["model_args"]["channels"], serde_json::json!([128, 256]));
    assert_eq!(c["pretrained_cfg"]["interpolation"], "bilinear");
}

/// A fine-tuned model (the fixture's body, a new 3-class head) saved with `save_hf`, loaded by
/// timm: the small one into timm's `ResNetV2` of its sizes with `load_state_dict(strict=True)`,
/// giving wgpipe's logits; and a `resnetv2_50x1_bit` by `timm.create_model("local-dir:...")`
/// from the folder alone (its config.json and weights). Needs a Python with torch and timm
/// (`WGPIPE_PYTHON`, else `python3`); skipped, saying so, where there is none.
#[test]
fn timm_loads_saved_bit_models_and_agrees() {
    let Some(python) = python_with("torch, timm") else {
        return;
    };
    let dir = fixture_path("bit");
    let checkpoint = HfCheckpoint::open_file(&dir.join("model.safetensors")).unwrap();
    let tuned = ResNetV2 {
        num_classes: 3,
        ..model()
    };
    let n = tuned.num_layers();
    let mut layers = load_layers(&model(), &checkpoint, 0..n - 1, &cpu()).unwrap();
    layers.push(tuned.new_head(3, 11, &cpu()).unwrap());
    let small = temp_dir("save-small");
    save_hf(
        &small,
        &tuned,
        &sequence_parameters(&layers),
        SaveOptions::default(),
    )
    .unwrap();
    let r = read_reference(&dir.join("reference.safetensors"));
    let x = Tensor::from_vec(r["images"].1.clone(), &r["images"].0, &cpu()).unwrap();
    let ours = forward_all(&layers, &Tape::new().constant(x), &ForwardCtx::eval()).unwrap();

    let big = temp_dir("save-bit50");
    let bit50 = ResNetV2::bit50(1, 4);
    let zeros = wgpipe_models::init::without_random_init(|| bit50.build(0, &cpu())).unwrap();
    save_hf(
        &big,
        &bit50,
        &sequence_parameters(&zeros),
        SaveOptions::default(),
    )
    .unwrap();
    let script = format!(
        "import json, torch, timm\n\
         from functools import partial\n\
         from safetensors.torch import load_file\n\
         from timm.layers import StdConv2d\n\
         from timm.models.resnetv2 import ResNetV2\n\
         cfg = json.load(open({small:?} + '/config.json'))['model_args']\n\
         m = ResNetV2(layers=cfg['layers'], channels=cfg['channels'], stem_chs=cfg['stem_chs'], \
             num_classes=3, stem_type='fixed', conv_layer=partial(StdConv2d, eps=1e-8)).eval()\n\
         m.load_state_dict(load_file({small:?} + '/model.safetensors'), strict=True)\n\
         x = torch.tensor({xs:?}).reshape(2, 3, 32, 32)\n\
         b = timm.create_model('local-dir:' + {big:?})\n\
         assert b.num_classes == 4 and type(b).__name__ == 'ResNetV2', b.num_classes\n\
         print(json.dumps(m(x).flatten().tolist()))",
        small = small.display().to_string(),
        big = big.display().to_string(),
        xs = r["images"].1,
    );
    let theirs = python_floats(&python, &script);
    assert_near(
        &vals(ours.value()),
        &theirs,
        1e-4,
        "timm's logits of the saved model",
    );
    std::fs::remove_dir_all(&small).unwrap();
    std::fs::remove_dir_all(&big).unwrap();
}
