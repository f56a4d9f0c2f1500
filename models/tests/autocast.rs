//! Autocast (issue 13): models run with `ForwardCtx::compute` F16 / BF16 against the same
//! models in f32 on the same weights; f32 master weights and their cached compute copies; and
//! with `compute = F32`, layers run exactly the tensor ops they ran before autocast existed.
//!
//! The f32 gradients these tests compare against are checked by finite differences in
//! `grads.rs` (every layer) and `autograd/tests/gradcheck.rs` (every op); here the half paths
//! are compared with them.

mod common;

use common::*;
use wgpipe_autograd::optim::zero_grad;
use wgpipe_autograd::{Adam, ForwardCtx, Module, Optimizer, Param, Tape, Var};
use wgpipe_models::layers::*;
use wgpipe_models::{
    cross_entropy, finish_step_all, forward_all, sequence_buffers, sequence_parameters, AmoebaNet,
    ResNet,
};
use wgpipe_tensor::memory::{with_tag, Tag};
use wgpipe_tensor::{DType, Device, Error, Tensor, UnaryOp};

type Layers = Vec<Box<dyn Module>>;

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

fn ids(n: usize, vocab: usize, seed: u64, shape: &[usize], dev: &Device) -> Tensor {
    let v: Vec<f32> = (0..n as u64)
        .map(|i| ((i * 7 + seed * 13 + (i * i) % 5) % vocab as u64) as f32)
        .collect();
    Tensor::from_vec(v, shape, dev).unwrap()
}

/// What one forward and backward gave: the loss, the output (widened to f32), and each
/// parameter's gradient with its dtype.
struct Run {
    loss: f32,
    out: Vec<f32>,
    out_dtype: DType,
    grads: Vec<(String, DType, Vec<f32>)>,
}

fn run(layers: &Layers, x: &Tensor, y: &Tensor, ctx: &ForwardCtx) -> Run {
    let params = sequence_parameters(layers);
    zero_grad(&params);
    let tape = Tape::new();
    let out = forward_all(layers, &tape.constant(x.clone()), ctx).unwrap();
    let loss = cross_entropy(&out, y).unwrap();
    assert_eq!(loss.value().dtype(), DType::F32, "losses compute in f32");
    tape.backward(&loss).unwrap();
    wgpipe_autograd::sum_tied_grads(&params).unwrap();
    let grads = params
        .iter()
        .map(|(n, p)| {
            let g = p.grad().unwrap_or_else(|| panic!("{n} got no gradient"));
            (n.clone(), g.dtype(), vals(&g))
        })
        .collect();
    finish_step_all(layers).unwrap();
    Run {
        loss: loss.to_scalar().unwrap(),
        out: vals(out.value()),
        out_dtype: out.value().dtype(),
        grads,
    }
}

/// Largest `|a - b|` relative to the largest `|b|`.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (u, v)| m.max((u - v).abs())) / scale
}

/// How far run `a` is from the f32 run `b`: the outputs (relative to their largest magnitude),
/// the loss (relative), and the worst parameter gradient with its name. Each gradient is taken
/// relative to its own largest value, or to a twentieth of the model's largest gradient when
/// it is much smaller: such gradients are sums that cancel (a key bias's is exactly 0, softmax
/// being shift-invariant; a batch-norm bias's sums a centred gradient), so in both runs their
/// values are mostly rounding.
struct Errors {
    out: f32,
    loss: f32,
    grad: f32,
    worst: String,
}

/// The largest `|g - g32|` relative to `g32`'s largest value, or to `largest / 20` (the largest
/// gradient of the model or layer) when that is larger (see [`Errors`]).
fn grad_err(g: &[f32], g32: &[f32], largest: f32) -> f32 {
    let own = g32.iter().fold(0f32, |m, v| m.max(v.abs()));
    let abs = g
        .iter()
        .zip(g32)
        .fold(0f32, |m, (u, v)| m.max((u - v).abs()));
    abs / own.max(largest / 20.0)
}

fn errors(a: &Run, b: &Run) -> Errors {
    let largest = b
        .grads
        .iter()
        .flat_map(|(_, _, g)| g.iter())
        .fold(0f32, |m, v| m.max(v.abs()));
    let mut e = Errors {
        out: rel_err(&a.out, &b.out),
        loss: (a.loss - b.loss).abs() / b.loss.abs(),
        grad: 0.0,
        worst: String::new(),
    };
    for ((n, _, g), (_, _, g32)) in a.grads.iter().zip(&b.grads) {
        let err = grad_err(g, g32, largest);
        if err > e.grad {
            (e.grad, e.worst) = (err, n.clone());
        }
    }
    e
}

/// The error a half run is allowed against f32, per quantity: the larger of a fixed bound (what
/// a well-conditioned model shows: every half op rounds once, 2^-11 relative for f16 and 2^-8
/// for bf16, and a few dozen layers of such roundings add up) and 4x the model's own
/// sensitivity, the error its f32 run shows when every weight is perturbed by one relative
/// rounding of the half dtype. Tiny CNNs (batch norm over 8 values, max-pools, ReLU kinks) are
/// ill-conditioned: there a one-rounding weight perturbation alone moves some gradients by
/// a third, and half rounds every activation too.
fn allowed(dtype: DType, sensitivity: &Errors) -> Errors {
    let (out, loss, grad) = match dtype {
        DType::F16 => (1e-2, 2e-3, 1e-2),
        _ => (4e-2, 1e-2, 8e-2),
    };
    Errors {
        out: f32::max(out, 4.0 * sensitivity.out),
        loss: f32::max(loss, 4.0 * sensitivity.loss),
        grad: f32::max(grad, 4.0 * sensitivity.grad),
        worst: String::new(),
    }
}

/// The f32 run of `layers` with every weight `w` replaced by `w (1 + r u)`, `u` uniform in
/// `[-1, 1)` and `r` the half dtype's relative rounding; the weights are restored after.
fn perturbed_run(layers: &Layers, x: &Tensor, y: &Tensor, ctx: &ForwardCtx, dtype: DType) -> Run {
    let r = if dtype == DType::F16 {
        2f32.powi(-11)
    } else {
        2f32.powi(-8)
    };
    let params = sequence_parameters(layers);
    let saved: Vec<Tensor> = params.iter().map(|(_, p)| p.value()).collect();
    for (i, (_, p)) in params.iter().enumerate() {
        let v = p.value();
        let u = Tensor::rand_uniform(v.shape(), -r, r, 100 + i as u64, v.device()).unwrap();
        p.set_value(v.add(&v.mul(&u).unwrap()).unwrap());
    }
    let out = run(layers, x, y, ctx);
    for ((_, p), v) in params.iter().zip(saved) {
        p.set_value(v);
    }
    out
}

/// Runs `layers` in f32 and in each half dtype on the same weights and inputs: the outputs are
/// in the compute dtype, the loss is f32 and close, every gradient is f32 and close (see
/// [`allowed`]).
fn compare_half_with_f32(what: &str, layers: &Layers, x: &Tensor, y: &Tensor) {
    let ctx = ForwardCtx::train(5, 1, 0);
    let full = run(layers, x, y, &ctx);
    assert_eq!(full.out_dtype, DType::F32);
    for dtype in HALVES {
        let half = run(layers, x, y, &ctx.with_compute(dtype));
        assert_eq!(
            half.out_dtype, dtype,
            "{what}: the output stays in {dtype:?}"
        );
        for (n, d, _) in &half.grads {
            assert_eq!(
                *d,
                DType::F32,
                "{what}: the master weight {n} gets an f32 gradient"
            );
        }
        let sens = errors(&perturbed_run(layers, x, y, &ctx, dtype), &full);
        let (e, ok) = (errors(&half, &full), allowed(dtype, &sens));
        eprintln!(
            "{what} {dtype:?} vs f32: output {:.2e}, loss {} vs {} ({:.2e}), worst gradient \
             {:.2e} ({}); f32 with weights perturbed by one rounding: output {:.2e}, loss \
             {:.2e}, gradient {:.2e} ({})",
            e.out,
            half.loss,
            full.loss,
            e.loss,
            e.grad,
            e.worst,
            sens.out,
            sens.loss,
            sens.grad,
            sens.worst
        );
        for (quantity, got, bound) in [
            ("output", e.out, ok.out),
            ("loss", e.loss, ok.loss),
            ("gradient", e.grad, ok.grad),
        ] {
            assert!(
                got <= bound,
                "{what} {dtype:?}: {quantity} error {got} > {bound} (worst gradient: {})",
                e.worst
            );
        }
    }
}

/// `sum(y^2)` in f32: a loss on a half output.
fn sum_of_squares(y: &Var) -> Var {
    y.to_dtype(DType::F32)
        .and_then(|v| v.square())
        .and_then(|v| v.sum_all())
        .unwrap()
}

fn devices() -> Vec<Device> {
    let mut v = vec![cpu()];
    match Device::test_wgpu() {
        Ok(d) => v.push(d),
        Err(e) => eprintln!("SKIPPED (wgpu part): no wgpu device to test on ({e})"),
    }
    v
}

#[test]
fn transformer_lm_in_half_matches_f32() {
    for dev in devices() {
        let layers = tiny_lm().build(3, &dev).unwrap();
        let x = ids(2 * 8, 11, 1, &[2, 8], &dev);
        let y = ids(2 * 8, 11, 2, &[2, 8], &dev);
        compare_half_with_f32(&format!("TransformerLm on {}", dev.name()), &layers, &x, &y);
    }
}

#[test]
fn cnns_in_half_match_f32() {
    let dev = cpu();
    let x = Tensor::rand_uniform(&[4, 3, 16, 16], -1.0, 1.0, 9, &dev).unwrap();
    let y = Tensor::from_vec(vec![1.0, 3.0, 0.0, 4.0], &[4], &dev).unwrap();
    let resnet = ResNet {
        blocks: vec![1, 1],
        width: 4,
        num_classes: 5,
        in_channels: 3,
    };
    compare_half_with_f32("ResNet", &resnet.build(1, &dev).unwrap(), &x, &y);
    // Factorized reductions (a narrow's backward), concatenated states, both poolings, skips.
    let amoeba = AmoebaNet {
        normal_cells: 1,
        filters: 4,
        num_classes: 5,
        in_channels: 3,
    };
    compare_half_with_f32("AmoebaNet", &amoeba.build(2, &dev).unwrap(), &x, &y);
}

/// What crosses a stage boundary is in the compute dtype: every layer of the LM outputs it.
#[test]
fn every_layer_passes_the_compute_dtype_on() {
    let dev = cpu();
    let layers = tiny_lm().build(3, &dev).unwrap();
    let x = ids(8, 11, 1, &[1, 8], &dev);
    for dtype in HALVES {
        let ctx = ForwardCtx::train(1, 0, 0).with_compute(dtype);
        let tape = Tape::new();
        let mut h = tape.constant(x.clone());
        for (i, l) in layers.iter().enumerate() {
            h = l.forward(&h, &ctx.at_layer(i as u64)).unwrap();
            assert_eq!(h.value().dtype(), dtype, "layer {i} ({})", l.name());
        }
    }
}

/// A layer fed the wrong dtype where the policy does not cast fails with `DTypeMismatch`
/// naming the op, never computes silently: a half stream meeting an f32 residual.
#[test]
fn a_missing_cast_fails_loudly() {
    let dev = cpu();
    let tape = Tape::new();
    let x = tape.leaf(rand(&[2, 4], 1));
    let lin = Linear::new(4, 4, 3, &dev).unwrap();
    let ctx = ForwardCtx::eval().with_compute(DType::F16);
    let h = lin.forward(&x, &ctx).unwrap();
    match h.add(&x) {
        Err(Error::DTypeMismatch { op, a, b }) => {
            assert_eq!((op, a, b), ("add", DType::F16, DType::F32));
        }
        other => panic!(
            "expected a dtype mismatch, got {:?}",
            other.map(|v| v.shape().to_vec())
        ),
    }
}

/// The gradient of every parameter and of the input of each layer kind in half, against the
/// f32 gradients (checked by finite differences in `grads.rs`). Loss `sum(y * w)` in f32.
#[test]
fn layer_gradients_in_half_match_f32() {
    let dev = cpu();
    let conv = grouped_strided_conv((3, 3), 4);
    let cases: Vec<(&str, Box<dyn Module>, Tensor)> = vec![
        (
            "Linear+gelu",
            Box::new(
                Linear::new(6, 5, 1, &dev)
                    .unwrap()
                    .with_activation(UnaryOp::GeluTanh)
                    .unwrap(),
            ),
            rand(&[3, 2, 6], 1),
        ),
        ("Conv2d", Box::new(conv), rand(&[2, 4, 5, 5], 2)),
        (
            "LayerNorm",
            Box::new(LayerNorm::new(6, &dev).unwrap()),
            rand(&[3, 6], 3),
        ),
        (
            "BatchNorm2d",
            Box::new(BatchNorm2d::new(3, &dev).unwrap()),
            rand(&[2, 3, 4, 4], 4),
        ),
        (
            "Attention",
            Box::new(CausalSelfAttention::new(8, 2, 0.0, 5, &dev).unwrap()),
            rand(&[2, 4, 8], 5),
        ),
        (
            "Attention, packed qkv",
            Box::new(
                CausalSelfAttention::new(8, 2, 0.0, 5, &dev)
                    .unwrap()
                    .packed()
                    .unwrap(),
            ),
            rand(&[2, 4, 8], 5),
        ),
        (
            "TokenPositionEmbedding",
            Box::new(TokenPositionEmbedding::new(7, 6, 4, 0.0, 6, &dev).unwrap()),
            t(&[0., 3., 3., 6., 1., 0.], &[2, 3]),
        ),
    ];
    for (name, m, x) in &cases {
        let is_ids = name.contains("Embedding");
        // Norms run on the stream's dtype: in a model their input is already half.
        let on_stream = name.contains("Norm");
        let grads = |dtype: DType| -> (Vec<Vec<f32>>, DType) {
            let params = m.parameters();
            zero_grad(&params);
            let tape = Tape::new();
            let xv = if is_ids {
                tape.constant(x.clone())
            } else {
                tape.leaf(x.clone())
            };
            let ctx = ForwardCtx::train(1, 0, 0).with_compute(dtype);
            let input = if on_stream {
                xv.to_dtype(dtype).unwrap()
            } else {
                xv.clone()
            };
            let y = m.forward(&input, &ctx).unwrap();
            let out_dtype = y.value().dtype();
            let w = tape.constant(Tensor::rand_uniform(y.shape(), -1.0, 1.0, 7, &dev).unwrap());
            let loss = y
                .to_dtype(DType::F32)
                .unwrap()
                .mul(&w)
                .unwrap()
                .sum_all()
                .unwrap();
            let g = tape.backward(&loss).unwrap();
            let mut out: Vec<Vec<f32>> = params
                .iter()
                .map(|(n, p)| {
                    let g = p.grad().unwrap();
                    assert_eq!(g.dtype(), DType::F32, "{name}: {n}");
                    vals(&g)
                })
                .collect();
            if !is_ids {
                let gx = g.get(&xv).unwrap();
                assert_eq!(
                    gx.dtype(),
                    DType::F32,
                    "{name}: the f32 input gets an f32 gradient"
                );
                out.push(vals(gx));
            }
            (out, out_dtype)
        };
        let (full, _) = grads(DType::F32);
        for dtype in HALVES {
            let (half, out_dtype) = grads(dtype);
            assert_eq!(out_dtype, dtype, "{name} computes in {dtype:?}");
            // A handful of ops between the cast and the loss: a few roundings of the half dtype
            // (the worst measured is 0.83 ulp).
            let ulp = if dtype == DType::F16 {
                2f32.powi(-10)
            } else {
                2f32.powi(-7)
            };
            let largest = full.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
            for (i, (h, f)) in half.iter().zip(&full).enumerate() {
                let e = grad_err(h, f, largest);
                eprintln!("{name} {dtype:?} gradient {i}: {:.2} ulp", e / ulp);
                assert!(
                    e <= 4.0 * ulp,
                    "{name} {dtype:?}: gradient {i} off by {e} (> 4 ulp)"
                );
            }
        }
    }
}

/// With `compute = F32` the layers run the very tensor ops they ran before autocast: the same
/// bits as the plain ops, forward and backward.
#[test]
fn f32_compute_runs_exactly_the_plain_ops() {
    let dev = cpu();
    let ctx = ForwardCtx::train(1, 0, 0).with_compute(DType::F32);
    // Linear with a fused activation: `bias_act(x W^T, b)`.
    let lin = Linear::new(6, 5, 1, &dev)
        .unwrap()
        .with_activation(UnaryOp::Relu)
        .unwrap();
    let x = rand(&[4, 6], 1);
    let plain = |tape: &Tape, x: &Var| {
        x.matmul(&tape.stored_param(&lin.weight).t().unwrap())
            .unwrap()
            .bias_act(
                &tape.stored_param(lin.bias.as_ref().unwrap()),
                UnaryOp::Relu,
            )
            .unwrap()
    };
    same_bits(&lin, &x, &ctx, plain);
    let conv = Conv2d::new(3, 4, 3, 2, &dev).unwrap();
    let plain = |tape: &Tape, x: &Var| {
        let b = tape.stored_param(conv.bias.as_ref().unwrap());
        x.conv2d(&tape.stored_param(&conv.weight), Some(&b), conv.params())
            .unwrap()
    };
    same_bits(&conv, &rand(&[2, 3, 5, 5], 2), &ctx, plain);
    let ln = LayerNorm::new(6, &dev).unwrap();
    let plain = |tape: &Tape, x: &Var| {
        x.layer_norm(
            &tape.stored_param(&ln.weight),
            &tape.stored_param(&ln.bias),
            ln.eps(),
        )
        .unwrap()
    };
    same_bits(&ln, &x, &ctx, plain);
    let pos = PositionalEmbedding::new(8, 6, 3, &dev).unwrap();
    let plain = |tape: &Tape, x: &Var| {
        x.add(&tape.stored_param(&pos.weight).narrow(0, 0, 4).unwrap())
            .unwrap()
    };
    same_bits(&pos, &rand(&[2, 4, 6], 3), &ctx, plain);
}

/// `m.forward(x, ctx)` and `plain(tape, x)` give the same bits, and so do the gradients of
/// `sum(y * w)` for the input and every parameter.
fn same_bits(m: &dyn Module, x: &Tensor, ctx: &ForwardCtx, plain: impl Fn(&Tape, &Var) -> Var) {
    let go = |f: &dyn Fn(&Tape, &Var) -> Var| {
        let params = m.parameters();
        zero_grad(&params);
        let tape = Tape::new();
        let xv = tape.leaf(x.clone());
        let y = f(&tape, &xv);
        let w = tape.constant(Tensor::rand_uniform(y.shape(), -1.0, 1.0, 3, &cpu()).unwrap());
        let g = tape
            .backward(&y.mul(&w).unwrap().sum_all().unwrap())
            .unwrap();
        let mut out = vec![vals(y.value()), vals(g.get(&xv).unwrap())];
        out.extend(params.iter().map(|(_, p)| vals(&p.grad().unwrap())));
        out
    };
    let a = go(&|_: &Tape, xv: &Var| m.forward(xv, ctx).unwrap());
    let b = go(&plain);
    assert_eq!(a, b, "{}: f32 compute must run the plain ops", m.name());
}

/// The cached compute copy of a master weight is made once, shared by every micro-batch, and
/// rebuilt after anything changes the value: an optimizer step, `set_value`, `to_device`.
#[test]
fn the_half_copy_of_a_master_weight_is_never_stale() {
    let dev = cpu();
    let lin = Linear::new(4, 3, 1, &dev).unwrap();
    let w = &lin.weight;
    let a = w.value_in(DType::F16).unwrap();
    assert!(a.shares_storage(&w.value_in(DType::F16).unwrap()), "cached");
    assert_eq!(vals(&a), vals(&w.value().to_dtype(DType::F16).unwrap()));
    assert!(w.value_in(DType::F32).unwrap().shares_storage(&w.value()));
    // Another dtype replaces the copy.
    let b = w.value_in(DType::BF16).unwrap();
    assert_eq!(b.dtype(), DType::BF16);

    // An optimizer step: the next forward uses the new values.
    let params = lin.parameters();
    let mut opt = Adam::new(0.1);
    let x = rand(&[2, 4], 2);
    let ctx = ForwardCtx::train(1, 0, 0).with_compute(DType::F16);
    for step in 0..3 {
        zero_grad(&params);
        let tape = Tape::new();
        let y = lin.forward(&tape.constant(x.clone()), &ctx).unwrap();
        // The reference: the current f32 values cast now, not through the cache.
        let fresh = tape
            .constant(x.to_dtype(DType::F16).unwrap())
            .matmul(
                &tape
                    .constant(w.value().to_dtype(DType::F16).unwrap())
                    .t()
                    .unwrap(),
            )
            .unwrap()
            .add(
                &tape.constant(
                    lin.bias
                        .as_ref()
                        .unwrap()
                        .value()
                        .to_dtype(DType::F16)
                        .unwrap(),
                ),
            )
            .unwrap();
        assert_eq!(
            vals(y.value()),
            vals(fresh.value()),
            "step {step}: stale weights"
        );
        tape.backward(&sum_of_squares(&y)).unwrap();
        assert_eq!(w.grad().unwrap().dtype(), DType::F32);
        opt.step(&params).unwrap();
        assert_eq!(w.value().dtype(), DType::F32, "the master weight stays f32");
    }
    // set_value and to_device drop the copy too.
    let old = w.value_in(DType::F16).unwrap();
    w.set_value(w.value().mul_scalar(2.0).unwrap());
    let new = w.value_in(DType::F16).unwrap();
    assert!(!new.shares_storage(&old));
    assert_eq!(vals(&new), vals(&w.value().to_dtype(DType::F16).unwrap()));
    w.to_device(&Device::new_cpu("other")).unwrap();
    assert!(!w.value_in(DType::F16).unwrap().shares_storage(&new));
}

/// Batch-norm running statistics stay f32 when the model computes in half, and eval mode
/// normalises a half stream with them.
#[test]
fn batch_norm_running_statistics_stay_f32() {
    let dev = cpu();
    let layers: Layers = vec![Box::new(BatchNorm2d::new(3, &dev).unwrap())];
    let x = rand(&[4, 3, 2, 2], 5).add_scalar(2.0).unwrap();
    let ctx = ForwardCtx::train(1, 0, 0).with_compute(DType::F16);
    let tape = Tape::new();
    // The stream arrives in half (as after a half convolution).
    let xh = tape.constant(x.to_dtype(DType::F16).unwrap());
    forward_all(&layers, &xh, &ctx).unwrap();
    finish_step_all(&layers).unwrap();
    let want = vals(&x.mean(&[0, 2, 3], false).unwrap().mul_scalar(0.1).unwrap());
    for (n, b) in sequence_buffers(&layers) {
        assert_eq!(b.value().dtype(), DType::F32, "{n}");
        if n.ends_with("running_mean") {
            assert_close(&vals(&b.value()), &want, 2e-3);
        }
    }
    let y = forward_all(&layers, &xh, &ForwardCtx::eval().with_compute(DType::F16)).unwrap();
    assert_eq!(y.value().dtype(), DType::F16);
}

/// One stage's worth of Transformer blocks keeps half the activation bytes in f16: what the
/// tape holds for backward after the forward, counted by the device's memory tracker.
#[test]
fn half_compute_halves_the_activations_a_stage_keeps() {
    let dev = Device::new_cpu("autocast-memory");
    let layers = tiny_lm().build(3, &dev).unwrap();
    // A middle stage: the two blocks, fed the hidden state of a [4, 8] batch.
    let stage = &layers[1..3];
    let hidden = Tensor::rand_normal(&[4, 8, 16], 0.0, 1.0, 2, &dev).unwrap();
    let kept = |dtype: DType| {
        let x = hidden.to_dtype(dtype).unwrap();
        // Warm the cached weight copies so they are not counted as activations.
        for (_, p) in sequence_parameters(stage) {
            p.value_in(dtype).unwrap();
        }
        let before = dev.memory_stats().live_of(Tag::Activations);
        let tape = Tape::new();
        let xv = tape.leaf(x);
        let ctx = ForwardCtx::train(1, 0, 0).with_compute(dtype);
        let y = with_tag(Tag::Activations, || {
            let mut h = xv.clone();
            for (i, l) in stage.iter().enumerate() {
                h = l.forward(&h, &ctx.at_layer(1 + i as u64)).unwrap();
            }
            h
        });
        let bytes = dev.memory_stats().live_of(Tag::Activations) - before;
        drop((y, tape));
        bytes
    };
    let (f32_bytes, f16_bytes) = (kept(DType::F32), kept(DType::F16));
    let ratio = f16_bytes as f64 / f32_bytes as f64;
    eprintln!(
        "activations kept by one stage (2 blocks, [4, 8, 16], dropout 0.1): f32 {f32_bytes} B, \
         f16 {f16_bytes} B, ratio {ratio:.3}"
    );
    // Everything kept is in the compute dtype except the dropout multipliers, also cast.
    assert!(
        ratio <= 0.55,
        "f16 keeps {ratio:.3} of f32's activation bytes"
    );
}

/// GPipe's micro-batches all run forward before any backward: with the cached copies they
/// share one half copy of each weight instead of keeping one each for their backward.
#[test]
fn micro_batches_share_one_half_copy_of_each_weight() {
    let dev = Device::new_cpu("autocast-cache");
    let layers = tiny_lm().build(3, &dev).unwrap();
    let stage = &layers[1..3];
    let params = sequence_parameters(stage);
    let half_bytes = |pred: &dyn Fn(&Param) -> bool| -> usize {
        params
            .iter()
            .filter(|(_, p)| pred(p))
            .map(|(_, p)| 2 * p.value().numel())
            .sum()
    };
    // Every matmul keeps its weight for backward; biases need not be kept.
    let (matrices, all) = (half_bytes(&|p| p.shape().len() == 2), half_bytes(&|_| true));
    let hidden = Tensor::rand_normal(&[2, 8, 16], 0.0, 1.0, 2, &dev)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let micro_batches = 4;
    let held = |cache: bool| {
        for (_, p) in &params {
            p.set_value(p.value()); // drops any copy
        }
        let before = dev.memory_stats().live;
        let mut keep = Vec::new();
        for mb in 0..micro_batches {
            if !cache {
                for (_, p) in &params {
                    p.set_value(p.value());
                }
            }
            let tape = Tape::new();
            let ctx = ForwardCtx::train(1, 0, mb).with_compute(DType::F16);
            let y = forward_all(stage, &tape.leaf(hidden.clone()), &ctx).unwrap();
            keep.push((tape, y));
        }
        dev.memory_stats().live - before
    };
    let (with, without) = (held(true), held(false));
    eprintln!(
        "{micro_batches} micro-batches in flight: {with} B with the cached copies, {without} B \
         casting per micro-batch (half copy of the stage's weights: {all} B)"
    );
    let extra = without - with;
    let copies = micro_batches as usize - 1;
    assert!(
        copies * matrices <= extra && extra <= copies * all,
        "{extra} B more without the cache; expected between {} and {}",
        copies * matrices,
        copies * all
    );
}

/// A short training run on one device: f16 and bf16 compute with f32 master weights and Adam
/// reach the f32 run's loss (within a few percent) after the same steps.
#[test]
fn half_training_tracks_f32() {
    let dev = cpu();
    let x = ids(4 * 8, 11, 1, &[4, 8], &dev);
    // A learnable target: the next token of a fixed sequence.
    let next: Vec<f32> = vals(&x).iter().map(|&i| (i + 1.0) % 11.0).collect();
    let y = Tensor::from_vec(next, &[4, 8], &dev).unwrap();
    let steps = 40;
    let train = |dtype: DType| -> Vec<f32> {
        let layers = tiny_lm().build(11, &dev).unwrap();
        let params = sequence_parameters(&layers);
        let mut opt = Adam::new(1e-2);
        (0..steps)
            .map(|step| {
                let ctx = ForwardCtx::train(2, step, 0).with_compute(dtype);
                let r = run(&layers, &x, &y, &ctx);
                opt.step(&params).unwrap();
                r.loss
            })
            .collect()
    };
    let full = train(DType::F32);
    assert!(
        full[steps as usize - 1] < 0.5 * full[0],
        "f32 run does not learn: {full:?}"
    );
    for dtype in HALVES {
        let half = train(dtype);
        let (a, b) = (half[steps as usize - 1], full[steps as usize - 1]);
        eprintln!(
            "{steps} Adam steps, loss {:.4} -> f32 {b:.4}, {dtype:?} {a:.4} ({:+.2}%)",
            full[0],
            100.0 * (a - b) / b
        );
        assert!(half.iter().all(|l| l.is_finite()), "{dtype:?}: {half:?}");
        assert!(
            (a - b).abs() <= 0.05 * b + 0.02,
            "{dtype:?}: {a} vs f32 {b}"
        );
    }
}

/// `Param::value_in` on a frozen or untouched param is the value itself in f32.
#[test]
fn param_in_is_the_plain_param_in_its_own_dtype() {
    let p = Param::new("w", rand(&[3], 1));
    let tape = Tape::new();
    let v = tape.param_in(&p, DType::F32).unwrap();
    assert!(v.value().shares_storage(&p.value()));
    assert_eq!(tape.len(), 0, "no node recorded for a same-dtype param");
    let h = tape.param_in(&p, DType::F16).unwrap();
    assert_eq!(h.value().dtype(), DType::F16);
    assert_eq!(tape.len(), 1, "one cast node");
}

/// Re-materialization recomputes in the same precision: a checkpointed half block (dropout on)
/// gives the very gradients of the plain half block, since the recompute casts through the
/// same cached weight copies and replays the same dropout masks.
#[test]
fn recompute_in_half_gives_the_same_bits() {
    let dev = cpu();
    let block = std::rc::Rc::new(TransformerBlock::new(16, 2, 0.1, 4, &dev).unwrap());
    let x = Tensor::rand_normal(&[2, 8, 16], 0.0, 1.0, 5, &dev).unwrap();
    for dtype in HALVES {
        let ctx = ForwardCtx::train(1, 2, 3).with_compute(dtype);
        let go = |checkpointed: bool| {
            let params = block.parameters();
            zero_grad(&params);
            let tape = Tape::new();
            let xv = tape.leaf(x.to_dtype(dtype).unwrap());
            let y = if checkpointed {
                let b = block.clone();
                wgpipe_autograd::checkpoint(&xv, move |h| b.forward(h, &ctx)).unwrap()
            } else {
                block.forward(&xv, &ctx).unwrap()
            };
            assert_eq!(y.value().dtype(), dtype);
            let g = tape.backward(&sum_of_squares(&y)).unwrap();
            let mut out = vec![vals(y.value()), vals(g.get(&xv).unwrap())];
            out.extend(params.iter().map(|(_, p)| vals(&p.grad().unwrap())));
            out
        };
        assert_eq!(go(true), go(false), "{dtype:?}");
    }
}
