//! Initialisation statistics against PyTorch's bounds, seeds, cost hints, deferred batch norm.

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Module, Tape};
use wgpipe_models::init::{kaiming_uniform_bound, sub_seed, Init};
use wgpipe_models::layers::*;
use wgpipe_tensor::ops::Conv2dParams;

fn stats(v: &[f32]) -> (f32, f32, f32) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    let maxabs = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    (mean as f32, var as f32, maxabs)
}

/// U(-b, b): every value inside, mean ~0, variance ~b^2/3.
#[track_caller]
fn assert_uniform(v: &[f32], b: f32) {
    let (mean, var, maxabs) = stats(v);
    assert!(maxabs <= b, "max |w| {maxabs} > bound {b}");
    assert!(maxabs > 0.95 * b, "max |w| {maxabs} far below bound {b}");
    let sd_mean = b / 3f32.sqrt() / (v.len() as f32).sqrt();
    assert!(mean.abs() < 5.0 * sd_mean, "mean {mean}");
    assert!(
        (var / (b * b / 3.0) - 1.0).abs() < 0.06,
        "var {var} vs {}",
        b * b / 3.0
    );
}

#[test]
fn linear_and_conv_init_match_pytorch_bounds() {
    let dev = cpu();
    let l = Linear::new(256, 64, 1, &dev).unwrap();
    assert_eq!(kaiming_uniform_bound(256), 1.0 / 16.0);
    assert_uniform(&vals(&l.weight.value()), 1.0 / 16.0);
    let b = vals(&l.bias.as_ref().unwrap().value());
    assert!(b.iter().all(|v| v.abs() <= 1.0 / 16.0));
    assert_ne!(b[..4], vals(&l.weight.value())[..4]);
    // Conv: fan_in = c_in / groups * kh * kw = 4 * 3 * 3.
    let c = Conv2d::with_params(
        8,
        64,
        (3, 3),
        Conv2dParams {
            groups: 2,
            ..Conv2dParams::default()
        },
        true,
        2,
        &dev,
    )
    .unwrap();
    assert_eq!(c.weight.shape(), vec![64, 4, 3, 3]);
    assert_uniform(&vals(&c.weight.value()), 1.0 / 6.0);
    assert!(vals(&c.bias.as_ref().unwrap().value())
        .iter()
        .all(|v| v.abs() <= 1.0 / 6.0));
}

#[test]
fn embedding_norm_init() {
    let dev = cpu();
    let e = Embedding::new(1000, 16, 3, &dev).unwrap();
    let (mean, var, _) = stats(&vals(&e.weight.value()));
    assert!(
        mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
        "{mean} {var}"
    );
    let ln = LayerNorm::new(5, &dev).unwrap();
    assert_eq!(vals(&ln.weight.value()), vec![1.0; 5]);
    assert_eq!(vals(&ln.bias.value()), vec![0.0; 5]);
    assert_eq!(ln.eps(), 1e-5);
    let bn = BatchNorm2d::new(4, &dev).unwrap();
    assert_eq!(vals(&bn.weight.value()), vec![1.0; 4]);
    assert_eq!(vals(&bn.running_var.value()), vec![1.0; 4]);
    assert!(!bn.running_mean.is_trainable());
}

#[test]
fn seeds_are_deterministic_and_distinct() {
    let dev = cpu();
    let w = |seed| vals(&Linear::new(8, 8, seed, &dev).unwrap().weight.value());
    assert_eq!(w(5), w(5));
    assert_ne!(w(5), w(6));
    let mut init = Init::new(9);
    let (a, b) = (init.next(), init.next());
    assert_ne!(a, b);
    assert_eq!(a, sub_seed(9, 0));
    assert_eq!(Init::new(9).next(), a);
}

#[test]
fn cost_hints() {
    let dev = cpu();
    let l = Linear::new(10, 20, 0, &dev).unwrap();
    let c = l.cost(&[4, 3, 10]);
    assert_eq!(c.param_bytes, 4 * (10 * 20 + 20));
    assert_eq!(c.output_shape, vec![4, 3, 20]);
    assert_eq!(c.flops, 2.0 * 12.0 * 200.0 + 12.0 * 20.0);
    assert_eq!(c.activation_bytes, 4 * 4 * 3 * 10);

    let check = |m: &dyn Module, input: &[usize], x: wgpipe_tensor::Tensor| {
        let n: usize = m
            .parameters()
            .iter()
            .map(|(_, p)| p.shape().iter().product::<usize>())
            .sum();
        let c = m.cost(input);
        assert_eq!(c.param_bytes, 4 * n, "{}", m.name());
        assert!(c.flops > 0.0, "{}", m.name());
        let tape = Tape::no_grad();
        let y = m.forward(&tape.constant(x), &ForwardCtx::eval()).unwrap();
        assert_eq!(c.output_shape, y.shape().to_vec(), "{}", m.name());
    };
    check(&LayerNorm::new(6, &dev).unwrap(), &[2, 6], rand(&[2, 6], 1));
    check(
        &CausalSelfAttention::new(8, 2, 0.1, 0, &dev).unwrap(),
        &[2, 3, 8],
        rand(&[2, 3, 8], 1),
    );
    check(
        &TransformerBlock::new(8, 2, 0.1, 0, &dev).unwrap(),
        &[2, 3, 8],
        rand(&[2, 3, 8], 1),
    );
    check(
        &TokenPositionEmbedding::new(11, 5, 8, 0.1, 0, &dev).unwrap(),
        &[2, 3],
        t(&[1., 2., 3., 4., 5., 6.], &[2, 3]),
    );
    let conv = Conv2d::with_params(
        4,
        6,
        (3, 3),
        Conv2dParams {
            stride: (2, 2),
            padding: (1, 1),
            ..Conv2dParams::default()
        },
        true,
        0,
        &dev,
    )
    .unwrap();
    check(&conv, &[2, 4, 7, 7], rand(&[2, 4, 7, 7], 1));
    check(
        &BatchNorm2d::new(4, &dev).unwrap(),
        &[2, 4, 3, 3],
        rand(&[2, 4, 3, 3], 1),
    );
}

#[test]
fn batchnorm_running_stats_do_not_depend_on_micro_batches() {
    let dev = cpu();
    let x = rand(&[8, 3, 2, 2], 21)
        .mul_scalar(3.0)
        .unwrap()
        .add_scalar(1.0)
        .unwrap();
    // Whole-mini-batch statistics by hand.
    let v = vals(&x);
    let mut mean = [0f64; 3];
    let mut m2 = [0f64; 3];
    for c in 0..3 {
        let xs: Vec<f64> = (0..8)
            .flat_map(|n| (0..4).map(move |k| (n, k)))
            .map(|(n, k)| v[n * 12 + c * 4 + k] as f64)
            .collect();
        mean[c] = xs.iter().sum::<f64>() / 32.0;
        m2[c] = xs.iter().map(|x| (x - mean[c]).powi(2)).sum::<f64>();
    }
    let want_rm: Vec<f32> = mean.iter().map(|m| (0.1 * m) as f32).collect();
    let want_rv: Vec<f32> = m2.iter().map(|s| (0.9 + 0.1 * s / 31.0) as f32).collect();

    for chunks in [1usize, 2, 4] {
        let bn = BatchNorm2d::new(3, &dev).unwrap();
        let per = 8 / chunks;
        for m in 0..chunks {
            let tape = Tape::new();
            let xb = tape.constant(x.narrow(0, m * per, per).unwrap());
            bn.forward(&xb, &ForwardCtx::train(0, 0, m as u64)).unwrap();
            // A recompute and an eval forward add nothing.
            let rec = ForwardCtx {
                recompute: true,
                ..ForwardCtx::train(0, 0, m as u64)
            };
            bn.forward(&xb, &rec).unwrap();
            bn.forward(&xb, &ForwardCtx::eval()).unwrap();
        }
        assert_eq!(bn.pending_pieces(), chunks);
        // Not updated before finish_step.
        assert_eq!(vals(&bn.running_mean.value()), vec![0.0; 3]);
        bn.finish_step().unwrap();
        assert_eq!(bn.pending_pieces(), 0);
        assert_close(&vals(&bn.running_mean.value()), &want_rm, 1e-5);
        assert_close(&vals(&bn.running_var.value()), &want_rv, 1e-5);
        // A step with no forward leaves them alone.
        bn.finish_step().unwrap();
        assert_close(&vals(&bn.running_mean.value()), &want_rm, 1e-5);
    }
}
