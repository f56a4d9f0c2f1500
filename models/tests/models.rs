//! Whole models: build, shapes, names, cost hints, causality, head replacement, and a few SGD
//! steps that reduce the loss on a fixed batch.

mod common;

use common::*;
use wgpipe_autograd::optim::zero_grad;
use wgpipe_autograd::{ForwardCtx, Module, Optimizer, Sgd, Tape};
use wgpipe_models::{
    cross_entropy, finish_step_all, forward_all, replace_head, sequence_buffers,
    sequence_parameters, AmoebaNet, ResNet,
};
use wgpipe_tensor::Tensor;

type Layers = Vec<Box<dyn Module>>;

fn ids(n: usize, vocab: usize, seed: u64, shape: &[usize]) -> Tensor {
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as u64 * 7 + seed * 13 + (i as u64 * i as u64) % 5) % vocab as u64) as f32)
        .collect();
    t(&v, shape)
}

fn logits(layers: &Layers, x: &Tensor, ctx: &ForwardCtx) -> Tensor {
    let tape = Tape::no_grad();
    forward_all(layers, &tape.constant(x.clone()), ctx)
        .unwrap()
        .value()
        .clone()
}

/// Cost hints chained through the sequence agree with the real shapes and parameter count.
fn check_costs(layers: &Layers, x: &Tensor) {
    let mut shape = x.shape().to_vec();
    let mut h = Tape::no_grad().constant(x.clone());
    let mut bytes = 0;
    let mut skips = wgpipe_autograd::SkipRouter::new();
    for (i, l) in layers.iter().enumerate() {
        let c = l.cost(&shape);
        h = skips
            .forward(l.as_ref(), i, &h, &ForwardCtx::eval().at_layer(i as u64))
            .unwrap();
        assert_eq!(
            c.output_shape,
            h.shape().to_vec(),
            "layer {i}: {}",
            l.name()
        );
        assert!(c.flops >= 0.0);
        bytes += c.param_bytes;
        shape = c.output_shape;
    }
    // Each layer's own bytes: a tied copy takes memory where it sits, though it counts once
    // among the trainable scalars.
    let held: usize = sequence_parameters(layers)
        .iter()
        .map(|(_, p)| p.value().numel())
        .sum();
    assert_eq!(bytes, 4 * held);
}

/// `steps` of plain SGD on one fixed batch; returns the losses.
fn train(layers: &Layers, x: &Tensor, y: &Tensor, lr: f32, steps: usize) -> Vec<f32> {
    let params = sequence_parameters(layers);
    let mut opt = Sgd::new(lr);
    let mut losses = Vec::new();
    for step in 0..steps {
        zero_grad(&params);
        let tape = Tape::new();
        let out = forward_all(
            layers,
            &tape.constant(x.clone()),
            &ForwardCtx::train(1, step as u64, 0),
        )
        .unwrap();
        let loss = cross_entropy(&out, y).unwrap();
        losses.push(loss.to_scalar().unwrap());
        tape.backward(&loss).unwrap();
        wgpipe_autograd::sum_tied_grads(&params).unwrap();
        opt.step(&params).unwrap();
        finish_step_all(layers).unwrap();
    }
    losses
}

#[track_caller]
fn assert_falls(losses: &[f32], factor: f32) {
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(
        last < factor * first,
        "loss did not fall enough: {losses:?}"
    );
}

#[test]
fn transformer_lm_builds_and_runs() {
    let dev = cpu();
    let layers = tiny_lm().build(7, &dev).unwrap();
    assert_eq!(layers.len(), 2 + 3);
    let names: Vec<String> = sequence_parameters(&layers)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for n in [
        "0.tok.weight",
        "0.pos.weight",
        "1.attn.q.weight",
        "2.mlp.fc2.bias",
        "3.weight",
        "4.weight",
    ] {
        assert!(names.iter().any(|m| m == n), "missing {n}");
    }
    // The head is tied to the token embedding (GPT-2): no bias, the table's values.
    assert!(!names.iter().any(|m| m == "4.bias"));
    let params = sequence_parameters(&layers);
    let value = |n: &str| vals(&params.iter().find(|(m, _)| m == n).unwrap().1.value());
    assert_eq!(value("4.weight"), value("0.tok.weight"));
    let x = ids(2 * 6, 11, 1, &[2, 6]);
    let y = logits(&layers, &x, &ForwardCtx::eval());
    assert_eq!(y.shape(), &[2, 6, 11]);
    check_costs(&layers, &x);
    // Same seed: same model; dropout in training replays with the same ctx.
    let again = tiny_lm().build(7, &dev).unwrap();
    assert_eq!(vals(&y), vals(&logits(&again, &x, &ForwardCtx::eval())));
    let ctx = ForwardCtx::train(3, 1, 2);
    assert_eq!(
        vals(&logits(&layers, &x, &ctx)),
        vals(&logits(&again, &x, &ctx))
    );
    assert_ne!(vals(&logits(&layers, &x, &ctx)), vals(&y));
    // Too long a sequence is an error.
    let tape = Tape::no_grad();
    assert!(forward_all(
        &layers,
        &tape.constant(ids(9, 11, 1, &[1, 9])),
        &ForwardCtx::eval()
    )
    .is_err());
}

#[test]
fn transformer_lm_is_causal() {
    let layers = tiny_lm().build(3, &cpu()).unwrap();
    let x = ids(8, 11, 2, &[1, 8]);
    let mut v = vals(&x);
    v[5] = (v[5] + 1.0) % 11.0;
    let a = vals(&logits(&layers, &x, &ForwardCtx::eval()));
    let b = vals(&logits(&layers, &t(&v, &[1, 8]), &ForwardCtx::eval()));
    assert_eq!(a[..5 * 11], b[..5 * 11], "positions < 5 changed");
    assert_ne!(a[5 * 11..6 * 11], b[5 * 11..6 * 11]);
}

#[test]
fn transformer_lm_learns_a_fixed_batch() {
    let layers = tiny_lm().build(1, &cpu()).unwrap();
    let x = ids(4 * 8, 11, 3, &[4, 8]);
    // Next-token targets: x shifted by one (the last predicts token 0).
    let v = vals(&x);
    let y: Vec<f32> = (0..32)
        .map(|i| if i % 8 == 7 { 0.0 } else { v[i + 1] })
        .collect();
    let losses = train(&layers, &x, &t(&y, &[4, 8]), 0.1, 30);
    assert!((losses[0] - 11f32.ln()).abs() < 1.5, "{losses:?}");
    assert_falls(&losses, 0.7);
}

fn resnet() -> ResNet {
    ResNet {
        blocks: vec![1, 1],
        width: 4,
        num_classes: 3,
        in_channels: 3,
    }
}

#[test]
fn resnet_builds_runs_and_learns() {
    let dev = cpu();
    let layers = resnet().build(2, &dev).unwrap();
    // stem, 2 blocks, GAP, head
    assert_eq!(layers.len(), 5);
    let names: Vec<String> = sequence_parameters(&layers)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for n in [
        "0.conv1.weight",
        "1.bn1.weight",
        "2.downsample.0.weight",
        "4.weight",
    ] {
        assert!(names.iter().any(|m| m == n), "missing {n} in {names:?}");
    }
    let bufs: Vec<String> = sequence_buffers(&layers)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(
        bufs.iter().any(|n| n == "2.downsample.1.running_var"),
        "{bufs:?}"
    );
    let x = rand(&[6, 3, 8, 8], 4);
    assert_eq!(logits(&layers, &x, &ForwardCtx::eval()).shape(), &[6, 3]);
    check_costs(&layers, &x);
    let y = t(&[0., 1., 2., 0., 1., 2.], &[6]);
    let before = vals(&sequence_buffers(&layers)[0].1.value());
    let losses = train(&layers, &x, &y, 0.1, 15);
    assert_falls(&losses, 0.7);
    // Running statistics moved (finish_step ran).
    assert_ne!(before, vals(&sequence_buffers(&layers)[0].1.value()));
    assert!(logits(&layers, &x, &ForwardCtx::eval())
        .to_vec()
        .unwrap()
        .iter()
        .all(|v| v.is_finite()));
}

#[test]
fn amoebanet_builds_runs_and_learns() {
    let dev = cpu();
    let net = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 3,
        in_channels: 3,
    };
    let layers = net.build(3, &dev).unwrap();
    // stem, N, R, N, R, N, pool, head
    assert_eq!(layers.len(), 8);
    let names: Vec<String> = sequence_parameters(&layers)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for n in [
        "1.pre1.conv.weight",
        "1.op3.conv1.weight", // the first cell's 1x7 conv
        "2.pre2.conv.weight",
        "2.op3.conv1.weight", // the reduction cell's 3x3 conv
        "3.pre2.a.weight",    // a factorized reduction after the reduction cell
        "7.bias",
    ] {
        assert!(names.iter().any(|m| m == n), "missing {n} in {names:?}");
    }
    let x = rand(&[6, 3, 8, 8], 5);
    assert_eq!(logits(&layers, &x, &ForwardCtx::eval()).shape(), &[6, 3]);
    check_costs(&layers, &x);
    // Cells after the first read h_(i-2), the cell before last's output, through a skip.
    let skips = wgpipe_autograd::resolve_skips(&layers).unwrap();
    let pairs: Vec<(usize, usize)> = skips.iter().map(|e| (e.producer, e.consumer)).collect();
    assert_eq!(pairs, vec![(1, 2), (2, 3), (3, 4), (4, 5)]);
    let y = t(&[0., 1., 2., 0., 1., 2.], &[6]);
    let losses = train(&layers, &x, &y, 0.1, 15);
    assert_falls(&losses, 0.7);
}

#[test]
fn replace_head_for_transfer() {
    let dev = cpu();
    let mut layers = resnet().build(2, &dev).unwrap();
    let body_before = vals(&sequence_parameters(&layers)[0].1.value());
    replace_head(&mut layers, 7, 99, &dev).unwrap();
    let x = rand(&[2, 3, 8, 8], 4);
    assert_eq!(logits(&layers, &x, &ForwardCtx::eval()).shape(), &[2, 7]);
    assert_eq!(
        body_before,
        vals(&sequence_parameters(&layers)[0].1.value())
    );
    let mut lm_layers = tiny_lm().build(1, &dev).unwrap();
    replace_head(&mut lm_layers, 5, 1, &dev).unwrap();
    let y = logits(&lm_layers, &ids(4, 11, 1, &[1, 4]), &ForwardCtx::eval());
    assert_eq!(y.shape(), &[1, 4, 5]);
    // A model whose last element is not a linear head.
    let mut no_head: Layers = vec![Box::new(wgpipe_models::Relu)];
    assert!(replace_head(&mut no_head, 3, 0, &dev).is_err());
}

/// The parameter count of AmoebaNet-D with 1 normal cell per third, 4 filters, 3 input channels
/// and 3 classes, counted by hand from the genotype (convolutions without bias, BN = 2 C):
///
/// - stem: 3x3 conv 3->4 (108) + BN 4 (8) = 116
/// - ReLU-conv1x1-BN a->b: a b + 2 b; factorized reduction a->b: 2 (a b / 2) + 2 b (the same);
///   op conv1x1(c) = c² + 2c; conv3x3(c), q = c/4: c q + 2q + 9q² + 2q + q c + 2c;
///   conv1x7-7x1(c): c q + 2q + 7q² + 2q + 7q² + 2q + q c + 2c.
///   A normal cell has 3 conv1x1 and 2 conv1x7-7x1, a reduction cell one of each of conv1x1,
///   conv3x3 and conv1x7-7x1 (the rest are pools and identities).
/// - cell 0 (normal, c 4, inputs 4 and 4): pre1 24 + pre2 0 (same channels) + 3 x 24 + 2 x 36
///   = 168; output 16 channels
/// - cell 1 (reduction, c 8, inputs 16 and 4): pre1 144 + pre2 48 + 80 + 92 + 116 = 480; out 24
/// - cell 2 (normal, c 8, inputs 24 and 16 at twice the resolution): pre1 208 + factorized
///   reduction 144 + 3 x 80 + 2 x 116 = 824; out 32
/// - cell 3 (reduction, c 16, inputs 32 and 24): pre1 544 + pre2 416 + 288 + 320 + 408 = 1976;
///   out 48
/// - cell 4 (normal, c 16, inputs 48 and 32 at twice the resolution): pre1 800 + 544 + 3 x 288
///   + 2 x 408 = 3024; out 64
/// - head: Linear 64->3 = 195
///
/// Total 116 + 168 + 480 + 824 + 1976 + 3024 + 195 = 6783.
#[test]
fn amoebanet_d_parameter_count_matches_a_hand_count() {
    let net = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 3,
        in_channels: 3,
    };
    let layers = net.build(1, &cpu()).unwrap();
    let per_layer: Vec<usize> = layers
        .iter()
        .map(|l| l.parameters().iter().map(|(_, p)| p.value().numel()).sum())
        .collect();
    assert_eq!(per_layer, vec![116, 168, 480, 824, 1976, 3024, 0, 195]);
    assert_eq!(wgpipe_models::parameter_count(&layers), 6783);
}
