//! The same seed gives the same weights on every backend, and the models compute the same
//! outputs and gradients on wgpu (lavapipe or any adapter) as on the CPU. Skipped, saying why,
//! when this machine has no wgpu adapter.

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Module, Tape};
use wgpipe_models::{
    cross_entropy, forward_all, sequence_parameters, AmoebaNet, ResNet, TransformerLm,
};
use wgpipe_tensor::{Device, Tensor};

fn gpu() -> Option<Device> {
    match Device::test_wgpu().or_else(|_| Device::wgpu(0)) {
        Ok(d) => {
            eprintln!("comparing the CPU with {}", d.name());
            Some(d)
        }
        Err(e) => {
            eprintln!("SKIPPED: no wgpu device: {e}");
            None
        }
    }
}

/// Builds `build` on both devices, checks equal weights, then equal loss and gradients.
fn compare(build: impl Fn(&Device) -> Vec<Box<dyn Module>>, x: &Tensor, y: &Tensor, dev: &Device) {
    let (a, b) = (build(&cpu()), build(dev));
    let (pa, pb) = (sequence_parameters(&a), sequence_parameters(&b));
    for ((n, p), (_, q)) in pa.iter().zip(&pb) {
        assert_eq!(vals(&p.value()), vals(&q.value()), "init of {n} differs");
    }
    let run = |layers: &[Box<dyn Module>], d: &Device| {
        let tape = Tape::new();
        let x = tape.constant(x.to_device(d).unwrap());
        let out = forward_all(layers, &x, &ForwardCtx::train(4, 0, 0)).unwrap();
        let loss = cross_entropy(&out, &y.to_device(d).unwrap()).unwrap();
        tape.backward(&loss).unwrap();
        loss.to_scalar().unwrap()
    };
    let (la, lb) = (run(&a, &cpu()), run(&b, dev));
    assert!(
        (la - lb).abs() < 1e-4 * (1.0 + la.abs()),
        "loss {la} vs {lb}"
    );
    for ((n, p), (_, q)) in pa.iter().zip(&pb) {
        let (ga, gb) = (vals(&p.grad().unwrap()), vals(&q.grad().unwrap()));
        let scale = ga.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (u, v) in ga.iter().zip(&gb) {
            assert!((u - v).abs() <= 2e-3 * scale, "grad of {n}: {u} vs {v}");
        }
    }
}

#[test]
fn models_agree_across_backends() {
    let Some(dev) = gpu() else { return };
    let lm = TransformerLm {
        vocab: 13,
        ..tiny_lm()
    };
    let ids: Vec<f32> = (0..16).map(|i| ((i * 5 + 3) % 13) as f32).collect();
    let tg: Vec<f32> = (0..16).map(|i| ((i * 3 + 1) % 13) as f32).collect();
    compare(
        |d| lm.build(11, d).unwrap(),
        &t(&ids, &[2, 8]),
        &t(&tg, &[2, 8]),
        &dev,
    );
    let labels = t(&[0., 1., 2., 1.], &[4]);
    let x = rand(&[4, 3, 8, 8], 3);
    let rn = ResNet {
        blocks: vec![1, 1],
        width: 4,
        num_classes: 3,
        in_channels: 3,
    };
    compare(|d| rn.build(5, d).unwrap(), &x, &labels, &dev);
    let am = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 3,
        in_channels: 3,
    };
    compare(|d| am.build(6, d).unwrap(), &x, &labels, &dev);
}
