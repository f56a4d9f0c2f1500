//! BiT's ResNetV2 read from a timm checkpoint against timm itself: the fixture's
//! `model.safetensors` is a small random `ResNetV2` as `resnetv2_50x1_bit` builds it (the fixed
//! stem, StdConv2d, GroupNorm(32), pre-activation bottlenecks, a 1x1-conv head), and
//! `reference.safetensors` timm's logits, loss and gradients for two images in float64
//! (`scripts/timm_resnetv2_reference.py`).

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Tape};
use wgpipe_models::hf::{load_layers, HfCheckpoint};
use wgpipe_models::{cross_entropy, forward_all, HfNames, ResNetV2};
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
