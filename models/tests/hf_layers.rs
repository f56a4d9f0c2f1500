//! Llama's layers (RMSNorm, rotary embeddings of three scaling types, the SwiGLU MLP,
//! grouped-query attention, the decoder layer) against transformers itself, and BiT's
//! (GroupNorm, the weight-standardized convolution) against torch and timm: the values of
//! `tests/fixtures/hf_layers.safetensors`, computed by their modules in float64 by
//! `scripts/hf_layers_reference.py`. Also central differences for each layer's backward,
//! the CPU against the wgpu test device, and half precision.

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Module, Tape, Var};
use wgpipe_models::layers::*;
use wgpipe_models::models::{LlamaDecoderLayer, LlamaLayerConfig};
use wgpipe_tensor::{DType, Device, Result, Tensor};

/// The fixture's tensors as f32 values with their shapes.
fn fixture() -> Reference {
    read_reference(&fixture_path("hf_layers.safetensors"))
}

fn tensor(f: &Reference, name: &str, dev: &Device) -> Tensor {
    let (shape, v) = f
        .get(name)
        .unwrap_or_else(|| panic!("no {name} in the fixture"));
    Tensor::from_vec(v.clone(), shape, dev).unwrap()
}

const HIDDEN: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
const EPS: f32 = 1e-5;

/// The three rope types of the fixture, by name.
fn ropes() -> [(&'static str, f32, RopeScaling); 3] {
    [
        ("default", 10000.0, RopeScaling::Default),
        ("linear", 10000.0, RopeScaling::Linear { factor: 2.0 }),
        (
            "llama3",
            500000.0,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 32,
            },
        ),
    ]
}

fn layer_config() -> LlamaLayerConfig {
    LlamaLayerConfig {
        hidden_size: HIDDEN,
        intermediate_size: 24,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        rms_norm_eps: EPS,
        rope_theta: 500000.0,
        rope_scaling: ropes()[2].2,
        attention_bias: false,
        mlp_bias: false,
    }
}

/// Every parameter of `m` set from the fixture's `{prefix}.{name}`.
fn load(m: &dyn Module, f: &Reference, prefix: &str, dev: &Device) {
    for (name, p) in m.parameters() {
        p.set_value(tensor(f, &format!("{prefix}.{name}"), dev));
    }
}

#[test]
fn rope_frequencies_and_rotations_equal_transformers() {
    let f = fixture();
    let q = tensor(&f, "rope.q", &cpu());
    for (name, theta, scaling) in ropes() {
        // The frequencies for head_dim 16 (all three llama3 bands occur), f32 as transformers
        // keeps them: within an ulp or two of its f32 arithmetic.
        let wide = Rope::new(16, theta, scaling).unwrap();
        assert_near(
            wide.inv_freq(),
            &f[&format!("rope.{name}.inv_freq")].1,
            3e-7,
            name,
        );
        let rope = Rope::new(HEAD_DIM, theta, scaling).unwrap();
        for start in [0, 3] {
            let tape = Tape::new();
            let got = rope.apply(&tape.constant(q.clone()), start).unwrap();
            let want = &f[&format!("rope.{name}.from{start}")].1;
            assert_near(
                &vals(got.value()),
                want,
                1e-6,
                &format!("{name} from {start}"),
            );
        }
    }
}

#[test]
fn rms_norm_and_mlp_equal_transformers() {
    let f = fixture();
    let x = tensor(&f, "x", &cpu());
    let norm = RmsNorm::from_weight(tensor(&f, "rms_norm.weight", &cpu()), EPS).unwrap();
    let got = norm.apply(&Tape::new().constant(x.clone())).unwrap();
    assert_near(&vals(got.value()), &f["rms_norm.out"].1, 1e-6, "RmsNorm");

    let mlp = SwiGluMlp::new(HIDDEN, 24, false, 0, &cpu()).unwrap();
    let names: Vec<String> = mlp.parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    );
    load(&mlp, &f, "mlp", &cpu());
    let got = mlp.apply(&Tape::new().constant(x)).unwrap();
    assert_near(&vals(got.value()), &f["mlp.out"].1, 1e-5, "SwiGluMlp");
}

/// The decoder layer's output and every gradient (parameters and input, for the loss
/// `sum(out * r)`) against transformers' `LlamaDecoderLayer` with grouped-query attention.
fn decoder_layer_against_transformers(dev: &Device) {
    let f = fixture();
    let layer = LlamaDecoderLayer::new(&layer_config(), 0, dev).unwrap();
    load(&layer, &f, "layer", dev);
    let tape = Tape::new();
    let x = tape.leaf(tensor(&f, "x", dev));
    let y = layer.apply(&x).unwrap();
    assert_near(&vals(y.value()), &f["layer.out"].1, 1e-5, "output");
    let loss = y
        .mul(&tape.constant(tensor(&f, "layer.r", dev)))
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = tape.backward(&loss).unwrap();
    assert_near(
        &vals(grads.get(&x).unwrap()),
        &f["layer.grad.x"].1,
        1e-5,
        "grad of x",
    );
    for (name, p) in layer.parameters() {
        let want = &f[&format!("layer.grad.{name}")].1;
        assert_near(
            &vals(&p.grad().unwrap()),
            want,
            1e-5,
            &format!("grad of {name}"),
        );
    }
}

#[test]
fn the_decoder_layer_equals_transformers_on_the_cpu() {
    decoder_layer_against_transformers(&cpu());
}

#[test]
fn the_decoder_layer_equals_transformers_on_wgpu() {
    match Device::test_wgpu() {
        Ok(dev) => decoder_layer_against_transformers(&dev),
        Err(e) => eprintln!("SKIPPED: no wgpu test device: {e}"),
    }
}

/// `rope(x)` as a module, for the gradient check.
struct Rotate(Rope);

impl Module for Rotate {
    fn forward(&self, x: &Var, _: &ForwardCtx) -> Result<Var> {
        self.0.apply(x, 2)
    }
}

#[test]
fn gradients_match_central_differences() {
    let eval = ForwardCtx::eval();
    let norm = RmsNorm::from_weight(rand(&[6], 1), EPS).unwrap();
    grad_check_module(&norm, &rand(&[3, 6], 2), &eval, true);
    let mlp = SwiGluMlp::new(6, 10, true, 3, &cpu()).unwrap();
    grad_check_module(&mlp, &rand(&[2, 3, 6], 4), &eval, true);
    for (_, theta, scaling) in ropes() {
        let rotate = Rotate(Rope::new(6, theta, scaling).unwrap());
        grad_check_module(&rotate, &rand(&[2, 3, 6], 5), &eval, true);
    }
    let rope = Rope::new(HEAD_DIM, 10000.0, RopeScaling::Default).unwrap();
    let shape = GqaShape {
        hidden: 8,
        heads: 4,
        kv_heads: 2,
        head_dim: HEAD_DIM,
    };
    let attn = GqaAttention::new(shape, rope, true, 6, &cpu()).unwrap();
    grad_check_module(&attn, &rand(&[2, 3, 8], 7), &eval, true);
}

/// Under f16 and bf16 the decoder layer runs on the half stream (its output half) with f32
/// master gradients, within half precision's rounding of the f32 run.
#[test]
fn the_decoder_layer_trains_in_half_precision() {
    let f = fixture();
    let run = |dtype: DType| {
        let layer = LlamaDecoderLayer::new(&layer_config(), 0, &cpu()).unwrap();
        load(&layer, &f, "layer", &cpu());
        let tape = Tape::new();
        let x = tape.leaf(tensor(&f, "x", &cpu())).to_dtype(dtype).unwrap();
        let y = layer
            .forward(&x, &ForwardCtx::eval().with_compute(dtype))
            .unwrap();
        assert_eq!(y.value().dtype(), dtype);
        let r = tape.constant(tensor(&f, "layer.r", &cpu()));
        let loss = y
            .to_dtype(DType::F32)
            .unwrap()
            .mul(&r)
            .unwrap()
            .sum_all()
            .unwrap();
        tape.backward(&loss).unwrap();
        layer
            .parameters()
            .into_iter()
            .map(|(n, p)| {
                let g = p.grad().unwrap();
                assert_eq!(g.dtype(), DType::F32, "{n}");
                (n, vals(&g), vals(&y.value().to_dtype(DType::F32).unwrap()))
            })
            .collect::<Vec<_>>()
    };
    let full = run(DType::F32);
    for (dtype, tol) in [(DType::F16, 5e-3), (DType::BF16, 4e-2)] {
        for ((name, g, y), (_, g32, y32)) in run(dtype).iter().zip(&full) {
            assert_near(y, y32, tol, &format!("{dtype:?} output"));
            assert_near(g, g32, tol, &format!("{dtype:?} grad of {name}"));
        }
    }
}

#[test]
fn bad_sizes_are_errors_naming_them() {
    let err = |r: Result<Rope>| r.unwrap_err().to_string();
    assert!(err(Rope::new(5, 10000.0, RopeScaling::Default)).contains("head_dim must be even"));
    let e = err(Rope::new(4, 10000.0, RopeScaling::Linear { factor: 0.0 }));
    assert!(e.contains("factor must be > 0"), "{e}");
    let shape = GqaShape {
        hidden: 8,
        heads: 4,
        kv_heads: 3,
        head_dim: 2,
    };
    let e = shape.check().unwrap_err().to_string();
    assert!(
        e.contains("num_key_value_heads = 3 does not divide num_attention_heads = 4"),
        "{e}"
    );
    let norm = RmsNorm::new(4, EPS, &cpu()).unwrap();
    let e = norm
        .apply(&Tape::new().constant(rand(&[2, 5], 1)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not end in dim = 4"), "{e}");
}

/// BiT's GroupNorm and timm's StdConv2d, chained, against torch and timm: the output, the
/// input's and every parameter's gradient for `sum(out * r)`.
fn bit_layers_against_torch(dev: &Device) {
    let f = fixture();
    let gn = GroupNorm::new(4, 8, 1e-5, dev).unwrap();
    let pad = StdConv2d::same_padding(3, 2);
    let geometry = wgpipe_tensor::ops::Conv2dParams {
        stride: (2, 2),
        padding: (pad, pad),
        ..Default::default()
    };
    let biased = Conv2d::with_params(8, 6, (3, 3), geometry, true, 0, dev).unwrap();
    let conv = StdConv2d::from_conv(biased, 1e-8);
    load(&gn, &f, "bit.gn", dev);
    load(&conv, &f, "bit.conv", dev);
    let tape = Tape::new();
    let x = tape.leaf(tensor(&f, "bit.x", dev));
    let normed = gn.apply(&x).unwrap();
    assert_near(&vals(normed.value()), &f["bit.gn.out"].1, 1e-5, "GroupNorm");
    let y = conv.apply(&normed).unwrap();
    assert_near(&vals(y.value()), &f["bit.out"].1, 1e-5, "StdConv2d");
    let r = tape.constant(tensor(&f, "bit.r", dev));
    let grads = tape
        .backward(&y.mul(&r).unwrap().sum_all().unwrap())
        .unwrap();
    assert_near(
        &vals(grads.get(&x).unwrap()),
        &f["bit.grad.x"].1,
        1e-5,
        "grad of x",
    );
    for (prefix, m) in [("gn", &gn as &dyn Module), ("conv", &conv)] {
        for (name, p) in m.parameters() {
            let want = &f[&format!("bit.grad.{prefix}.{name}")].1;
            assert_near(
                &vals(&p.grad().unwrap()),
                want,
                1e-5,
                &format!("grad of {prefix}.{name}"),
            );
        }
    }
}

#[test]
fn group_norm_and_std_conv_equal_torch_and_timm() {
    bit_layers_against_torch(&cpu());
    match Device::test_wgpu() {
        Ok(dev) => bit_layers_against_torch(&dev),
        Err(e) => eprintln!("SKIPPED (the wgpu half): no wgpu test device: {e}"),
    }
}

#[test]
fn group_norm_and_std_conv_match_central_differences_and_run_in_half() {
    let gn = GroupNorm::new(2, 4, 1e-5, &cpu()).unwrap();
    gn.weight.set_value(rand(&[4], 1));
    gn.bias.set_value(rand(&[4], 2));
    grad_check_module(&gn, &rand(&[2, 4, 3, 3], 3), &ForwardCtx::eval(), true);
    let conv = StdConv2d::new(4, 3, 3, 1, 1e-6, 4, &cpu()).unwrap();
    grad_check_module(&conv, &rand(&[1, 4, 4, 4], 5), &ForwardCtx::eval(), true);
    // Under f16 and bf16: the stream stays half, the masters' gradients f32, within half's
    // rounding of the f32 run.
    let run = |dtype: DType| {
        let tape = Tape::new();
        let x = tape.leaf(rand(&[2, 4, 5, 5], 6)).to_dtype(dtype).unwrap();
        let ctx = ForwardCtx::eval().with_compute(dtype);
        let y = conv.forward(&gn.forward(&x, &ctx).unwrap(), &ctx).unwrap();
        assert_eq!(y.value().dtype(), dtype);
        tape.backward(
            &y.to_dtype(DType::F32)
                .unwrap()
                .square()
                .unwrap()
                .sum_all()
                .unwrap(),
        )
        .unwrap();
        let out: Vec<Vec<f32>> = [&gn.weight, &conv.weight]
            .iter()
            .map(|p| {
                let g = p.grad().unwrap();
                assert_eq!(g.dtype(), DType::F32);
                p.zero_grad();
                vals(&g)
            })
            .collect();
        (vals(&y.value().to_dtype(DType::F32).unwrap()), out)
    };
    let (y32, g32) = run(DType::F32);
    for (dtype, tol) in [(DType::F16, 5e-3), (DType::BF16, 4e-2)] {
        let (y, g) = run(dtype);
        assert_near(&y, &y32, tol, &format!("{dtype:?} output"));
        for (a, b) in g.iter().zip(&g32) {
            assert_near(a, b, tol, &format!("{dtype:?} gradient"));
        }
    }
}
