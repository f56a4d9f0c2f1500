//! Each layer's forward against hand-computed values on tiny inputs.

mod common;

use common::*;
use wgpipe_autograd::{ForwardCtx, Module, Tape, Var};
use wgpipe_models::layers::attention::MASK_VALUE;
use wgpipe_models::layers::*;
use wgpipe_tensor::ops::Conv2dParams;

fn run(m: &dyn Module, x: &wgpipe_tensor::Tensor) -> wgpipe_tensor::Tensor {
    let tape = Tape::no_grad();
    m.forward(&tape.constant(x.clone()), &ForwardCtx::eval())
        .unwrap()
        .value()
        .clone()
}

#[test]
fn linear_with_set_weights() {
    let l = Linear::from_tensors(
        t(&[1., 2., 3., 4., 5., 6.], &[3, 2]),
        Some(t(&[0.5, -1., 0.], &[3])),
    )
    .unwrap();
    let y = run(&l, &t(&[1., 1., 2., -1.], &[2, 2]));
    assert_eq!(y.shape(), &[2, 3]);
    assert_close(&vals(&y), &[3.5, 6., 11., 0.5, 1., 4.], 1e-6);
    // Rank 3: the same rows.
    let y3 = run(&l, &t(&[1., 1., 2., -1.], &[1, 2, 2]));
    assert_eq!(y3.shape(), &[1, 2, 3]);
    assert_close(&vals(&y3), &[3.5, 6., 11., 0.5, 1., 4.], 1e-6);
    // A wrong input width is an error naming the layer.
    let tape = Tape::no_grad();
    let e = l
        .forward(
            &tape.constant(t(&[1., 2., 3.], &[1, 3])),
            &ForwardCtx::eval(),
        )
        .err()
        .unwrap();
    assert!(e.to_string().contains("Linear"), "{e}");
}

#[test]
fn linear_without_bias() {
    let l = Linear::with_bias(3, 2, false, 1, &cpu()).unwrap();
    assert_eq!(l.parameters().len(), 1);
    l.weight.set_value(t(&[1., 0., -1., 2., 2., 2.], &[2, 3]));
    let y = run(&l, &t(&[1., 2., 3.], &[1, 3]));
    assert_close(&vals(&y), &[-2., 12.], 1e-6);
}

#[test]
fn layer_norm_values() {
    let ln = LayerNorm::new(3, &cpu()).unwrap();
    let y = run(&ln, &t(&[1., 2., 3., -1., -1., -1.], &[2, 3]));
    let s = 1.0 / (2.0f32 / 3.0 + 1e-5).sqrt();
    assert_close(&vals(&y), &[-s, 0., s, 0., 0., 0.], 1e-5);
    ln.weight.set_value(t(&[2., 1., 1.], &[3]));
    ln.bias.set_value(t(&[0., 1., 0.], &[3]));
    let y = run(&ln, &t(&[1., 2., 3.], &[1, 3]));
    assert_close(&vals(&y), &[-2. * s, 1., s], 1e-5);
}

#[test]
fn embedding_and_positions() {
    let e = Embedding::from_tensor(t(&[0., 1., 10., 11., 20., 21.], &[3, 2])).unwrap();
    let y = run(&e, &t(&[2., 0., 1., 1.], &[2, 2]));
    assert_eq!(y.shape(), &[2, 2, 2]);
    assert_close(&vals(&y), &[20., 21., 0., 1., 10., 11., 10., 11.], 0.0);
    // An id out of range is an error, not a panic.
    let tape = Tape::no_grad();
    assert!(e
        .forward(&tape.constant(t(&[3.], &[1, 1])), &ForwardCtx::eval())
        .is_err());

    let p = PositionalEmbedding::new(4, 2, 7, &cpu()).unwrap();
    p.weight
        .set_value(t(&[100., 200., 300., 400., 0., 0., 0., 0.], &[4, 2]));
    let y2 = run(&p, &y);
    assert_close(
        &vals(&y2),
        &[120., 221., 300., 401., 110., 211., 310., 411.],
        0.0,
    );
    // Longer than max_len: an error.
    assert!(p
        .forward(&tape.constant(rand(&[1, 5, 2], 1)), &ForwardCtx::eval())
        .is_err());
}

#[test]
fn activations() {
    let x = t(&[-1., 0., 2.], &[3]);
    assert_close(&vals(&run(&Relu, &x)), &[0., 0., 2.], 0.0);
    // GELU(x) = x Phi(x): Phi(-1) = 0.158655, Phi(2) = 0.977250; the tanh form within 1e-3.
    assert_close(
        &vals(&run(&Gelu::Exact, &x)),
        &[-0.158_655, 0., 1.954_5],
        2e-6,
    );
    assert_close(
        &vals(&run(&Gelu::Tanh, &x)),
        &[-0.158655, 0., 1.954_5],
        1e-3,
    );
}

#[test]
fn dropout_replays_and_scales() {
    let d = Dropout::new(0.5, 3).unwrap();
    let x = wgpipe_tensor::Tensor::ones(&[4, 64], &cpu()).unwrap();
    // Eval: identity.
    assert_close(&vals(&run(&d, &x)), &vals(&x), 0.0);
    let ctx = ForwardCtx::train(11, 2, 1).at_layer(5);
    let go = |ctx: &ForwardCtx| {
        let tape = Tape::no_grad();
        vals(d.forward(&tape.constant(x.clone()), ctx).unwrap().value())
    };
    let a = go(&ctx);
    assert!(a.iter().all(|&v| v == 0.0 || v == 2.0));
    let kept = a.iter().filter(|&&v| v == 2.0).count();
    assert!((64..=192).contains(&kept), "kept {kept} of 256");
    assert_eq!(a, go(&ctx), "same ctx and site: the same mask");
    let b = go(&ForwardCtx {
        micro_batch: 2,
        ..ctx
    });
    assert_ne!(a, b, "another micro-batch: another mask");
    assert!(Dropout::new(1.0, 0).is_err());
}

#[test]
fn attention_one_head_identity_projections() {
    let dev = cpu();
    let a = CausalSelfAttention::new(2, 1, 0.0, 1, &dev).unwrap();
    let QkvProjection::Separate { q, k, v } = &a.qkv else {
        panic!("new gives separate projections")
    };
    for l in [q, k, v, &a.out] {
        l.weight.set_value(t(&[1., 0., 0., 1.], &[2, 2]));
        l.bias.as_ref().unwrap().set_value(t(&[0., 0.], &[2]));
    }
    // x0 = [1, 0], x1 = [0, 1], x2 = [1, 1]
    let y = run(&a, &t(&[1., 0., 0., 1., 1., 1.], &[1, 3, 2]));
    let s = 1.0 / 2f32.sqrt();
    // Position 0 sees only itself.
    let mut want = vec![1., 0.];
    // Position 1: scores [x1.x0, x1.x1] * s = [0, s].
    let (e0, e1) = (1.0f32, s.exp());
    want.extend([e0 / (e0 + e1), e1 / (e0 + e1)]);
    // Position 2: scores [s, s, 2s].
    let (f0, f2) = (s.exp(), (2.0 * s).exp());
    let z = 2.0 * f0 + f2;
    want.extend([(f0 + f2) / z, (f0 + f2) / z]);
    assert_close(&vals(&y), &want, 1e-5);
}

#[test]
fn causal_mask_blocks_the_future() {
    let dev = cpu();
    let a = CausalSelfAttention::new(8, 2, 0.0, 5, &dev).unwrap();
    let x = rand(&[2, 5, 8], 1);
    let mut v = vals(&x);
    // Change position 3 of every sequence.
    for b in 0..2 {
        for d in 0..8 {
            v[b * 40 + 3 * 8 + d] += 1.5;
        }
    }
    let x2 = t(&v, &[2, 5, 8]);
    let (y, y2) = (vals(&run(&a, &x)), vals(&run(&a, &x2)));
    for b in 0..2 {
        for p in 0..5 {
            let r = b * 40 + p * 8..b * 40 + p * 8 + 8;
            if p < 3 {
                assert_eq!(y[r.clone()], y2[r], "position {p} saw the future");
            } else {
                assert_ne!(y[r.clone()], y2[r], "position {p} must see position 3");
            }
        }
    }
    let m = vals(&causal_mask(3, &dev).unwrap());
    assert_eq!(m, vec![0., 1., 1., 0., 0., 1., 0., 0., 0.]);
}

/// The attention as it was before `Var::causal_attention` fused it: scale, mask, softmax,
/// dropout and the two matmuls as separate ops (the reference for the fused op).
fn unfused_attention(a: &CausalSelfAttention, x: &Var, ctx: &ForwardCtx) -> Var {
    let s = x.shape().to_vec();
    let (b, t, h) = (s[0], s[1], a.heads());
    let dh = s[2] / h;
    let split = |y: Var| {
        y.reshape(&[b, t, h, dh])
            .unwrap()
            .permute(&[0, 2, 1, 3])
            .unwrap()
    };
    let (q, k, v) = match &a.qkv {
        QkvProjection::Separate { q, k, v } => (
            q.forward(x, ctx).unwrap(),
            k.forward(x, ctx).unwrap(),
            v.forward(x, ctx).unwrap(),
        ),
        QkvProjection::Packed(qkv) => {
            let y = qkv.forward(x, ctx).unwrap();
            let d = s[2];
            let part = |i| y.narrow(-1, i * d, d).unwrap();
            (part(0), part(1), part(2))
        }
    };
    let (q, k, v) = (split(q), split(k), split(v));
    let scores = q
        .matmul(&k.transpose(-2, -1).unwrap())
        .unwrap()
        .mul_scalar(1.0 / (dh as f32).sqrt())
        .unwrap();
    let mask = causal_mask(t, x.value().device()).unwrap();
    let probs = scores
        .masked_fill(&mask, MASK_VALUE)
        .unwrap()
        .softmax(-1)
        .unwrap();
    let probs = a.attn_dropout.forward(&probs, ctx).unwrap();
    let y = probs
        .matmul(&v)
        .unwrap()
        .permute(&[0, 2, 1, 3])
        .unwrap()
        .reshape(&[b, t, s[2]])
        .unwrap();
    a.out.forward(&y, ctx).unwrap()
}

/// Output, input gradient and parameter gradients of `f` on `x`, loss `sum(y * w)`.
fn output_and_grads(
    a: &dyn Module,
    x: &wgpipe_tensor::Tensor,
    f: impl Fn(&Var) -> Var,
) -> Vec<Vec<f32>> {
    let tape = Tape::new();
    let xv = tape.leaf(x.clone());
    let y = f(&xv);
    let w = rand(y.shape(), 99);
    let grads = tape.backward_with(&y, &w).unwrap();
    let mut out = vec![vals(y.value()), vals(grads.get(&xv).unwrap())];
    for (_, p) in a.parameters() {
        out.push(vals(&p.grad().unwrap()));
        p.zero_grad();
    }
    out
}

/// The fused attention against the unfused chain: bit for bit where dropout is on (the fused op
/// then takes the chain's products), to rounding where it is off (on the CPU one kernel then
/// runs each head: its own products, none of a masked score).
#[test]
fn fused_attention_equals_the_unfused_chain() {
    for (p, ctx) in [
        (0.0, ForwardCtx::train(4, 0, 1)),
        (0.3, ForwardCtx::train(4, 2, 1)),
        (0.3, ForwardCtx::eval()),
    ] {
        let separate = CausalSelfAttention::new(16, 4, p, 7, &cpu()).unwrap();
        let packed = CausalSelfAttention::new(16, 4, p, 7, &cpu())
            .unwrap()
            .packed()
            .unwrap();
        for (a, form) in [(separate, "separate q, k, v"), (packed, "packed qkv")] {
            let x = rand(&[3, 9, 16], 8);
            let fused = output_and_grads(&a, &x, |x| a.forward(x, &ctx).unwrap());
            let unfused = output_and_grads(&a, &x, |x| unfused_attention(&a, x, &ctx));
            let names = ["output", "input grad"];
            let params: Vec<String> = a.parameters().into_iter().map(|(n, _)| n).collect();
            for (i, (f, u)) in fused.iter().zip(&unfused).enumerate() {
                let what = names
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| params[i - 2].as_str());
                let case = format!("{form}: {what} (dropout {p}, train {})", ctx.train);
                if p > 0.0 && ctx.train {
                    assert_eq!(f, u, "{case}");
                    continue;
                }
                assert_eq!(f.len(), u.len(), "{case}");
                for (j, (a, b)) in f.iter().zip(u).enumerate() {
                    let tol = 1e-6 + 1e-5 * b.abs();
                    assert!(
                        (a - b).abs() <= tol,
                        "{case}: element {j} is {a}, unfused {b}"
                    );
                }
            }
        }
    }
}

/// Dropout off and on, each with its training context.
fn training_cases() -> [(f32, ForwardCtx); 2] {
    [
        (0.0, ForwardCtx::train(4, 0, 1)),
        (0.3, ForwardCtx::train(4, 2, 1)),
    ]
}

#[test]
fn packed_qkv_computes_the_separate_projections_function() {
    // `packed` stacks q's, k's and v's weights: the same function, with the input gradient
    // from one product where the separate form sums three (so equal to rounding, not bits).
    for (p, ctx) in training_cases() {
        let separate = TransformerBlock::new(16, 4, p, 5, &cpu()).unwrap();
        let packed = TransformerBlock::new(16, 4, p, 5, &cpu())
            .unwrap()
            .with_packed_qkv()
            .unwrap();
        let x = rand(&[2, 7, 16], 4);
        let s = output_and_grads(&separate, &x, |x| separate.forward(x, &ctx).unwrap());
        let k = output_and_grads(&packed, &x, |x| packed.forward(x, &ctx).unwrap());
        assert_close(&k[0], &s[0], 1e-5);
        assert_close(&k[1], &s[1], 1e-5);
        // Parameter gradients by name; the packed ones are q's, k's and v's joined.
        let grads = |b: &TransformerBlock, g: &[Vec<f32>]| -> Vec<(String, Vec<f32>)> {
            b.parameters()
                .into_iter()
                .map(|(n, _)| n)
                .zip(g[2..].iter().cloned())
                .collect()
        };
        let (gs, gk) = (grads(&separate, &s), grads(&packed, &k));
        let by_name = |g: &[(String, Vec<f32>)], n: &str| -> Vec<f32> {
            g.iter()
                .find(|(m, _)| m == n)
                .unwrap_or_else(|| panic!("no gradient for {n}"))
                .1
                .clone()
        };
        for part in ["weight", "bias"] {
            let joined: Vec<f32> = ["q", "k", "v"]
                .iter()
                .flat_map(|w| by_name(&gs, &format!("attn.{w}.{part}")))
                .collect();
            assert_close(&by_name(&gk, &format!("attn.qkv.{part}")), &joined, 1e-5);
        }
        for (n, g) in &gk {
            if !n.starts_with("attn.qkv") {
                assert_close(g, &by_name(&gs, n), 1e-5);
            }
        }
        assert_eq!(gk.len(), gs.len() - 4, "qkv.* replaces q.*, k.*, v.*");
    }
    // A packed attention stays packed, with the same weights.
    let a = CausalSelfAttention::new(8, 2, 0.0, 1, &cpu())
        .unwrap()
        .packed()
        .unwrap();
    let w = vals(&a.parameters()[0].1.value());
    let again = a.packed().unwrap();
    assert_eq!(vals(&again.parameters()[0].1.value()), w);
    // Biases on some projections only cannot be packed into one Linear.
    let mut mixed = CausalSelfAttention::new(8, 2, 0.0, 1, &cpu()).unwrap();
    let QkvProjection::Separate { k, .. } = &mut mixed.qkv else {
        panic!("new gives separate projections")
    };
    *k = Linear::with_bias(8, 8, false, 2, &cpu()).unwrap();
    let err = mixed.packed().err().expect("mixed biases").to_string();
    assert!(err.contains("bias"), "{err}");
}

/// `ln` with the layer norm's composed backward, as `Var::layer_norm` recorded it before the
/// fused input gradient (the tape then added it to the input's other gradients).
fn composed_layer_norm(ln: &LayerNorm, x: &Var) -> Var {
    let t = x.tape();
    let (gamma, beta) = (t.stored_param(&ln.weight), t.stored_param(&ln.bias));
    let (y, mean, rstd) = x
        .value()
        .layer_norm(gamma.value(), beta.value(), ln.eps())
        .unwrap();
    let xv = x.value().clone();
    let gm = gamma.value().clone();
    Var::from_op("layer_norm", &[x, &gamma, &beta], y, move |g, _| {
        let xhat = xv.sub(&mean)?.mul(&rstd)?;
        let gxhat = g.mul(&gm)?;
        let m1 = gxhat.mean(&[-1], true)?;
        let m2 = gxhat.mul(&xhat)?.mean(&[-1], true)?;
        let gx = gxhat.sub(&m1)?.sub(&xhat.mul(&m2)?)?.mul(&rstd)?;
        let d = *xv.shape().last().unwrap();
        Ok(vec![
            Some(gx),
            Some(g.mul(&xhat)?.sum_to_shape(&[d])?),
            Some(g.sum_to_shape(&[d])?),
        ])
    })
    .unwrap()
}

#[test]
fn block_with_fused_residual_norm_equals_the_unfused_block_bit_for_bit() {
    for (p, ctx) in training_cases() {
        let b = TransformerBlock::new(16, 4, p, 5, &cpu()).unwrap();
        let x = rand(&[2, 7, 16], 4);
        let fused = output_and_grads(&b, &x, |x| b.forward(x, &ctx).unwrap());
        let unfused = output_and_grads(&b, &x, |x| {
            let a = b
                .attn
                .forward(&composed_layer_norm(&b.ln1, x), &ctx)
                .unwrap();
            let x = x.add(&b.drop1.forward(&a, &ctx).unwrap()).unwrap();
            let m = b
                .mlp
                .forward(&composed_layer_norm(&b.ln2, &x), &ctx)
                .unwrap();
            x.add(&b.drop2.forward(&m, &ctx).unwrap()).unwrap()
        });
        let params: Vec<String> = b.parameters().into_iter().map(|(n, _)| n).collect();
        for (i, (f, u)) in fused.iter().zip(&unfused).enumerate() {
            let what = ["output", "input grad"]
                .get(i)
                .copied()
                .unwrap_or_else(|| params[i - 2].as_str());
            assert_eq!(f, u, "{what} (dropout {p})");
        }
    }
}

#[test]
fn linear_with_activation_equals_linear_then_activation_bit_for_bit() {
    let ctx = ForwardCtx::train(1, 0, 0);
    let x = rand(&[3, 4, 12], 3);
    for op in wgpipe_tensor::BIAS_ACTIVATIONS {
        let fused = Linear::new(12, 7, 4, &cpu())
            .unwrap()
            .with_activation(op)
            .unwrap();
        assert_eq!(fused.activation(), Some(op));
        let got = output_and_grads(&fused, &x, |x| fused.forward(x, &ctx).unwrap());
        let want = output_and_grads(&fused, &x, |x| {
            // the unfused form: matmul + bias (the layer without activation), then the op
            fused
                .forward_act(x, None, &ForwardCtx::eval())
                .unwrap()
                .unary(op)
                .unwrap()
        });
        assert_eq!(got, want, "{}", op.name());
    }
    // Without a bias the activation is applied on its own.
    let nobias = Linear::with_bias(12, 7, false, 4, &cpu())
        .unwrap()
        .with_activation(wgpipe_tensor::UnaryOp::Relu)
        .unwrap();
    let y = vals(&run(&nobias, &x));
    let plain = vals(&run(
        &Linear::with_bias(12, 7, false, 4, &cpu()).unwrap(),
        &x,
    ));
    assert_eq!(y, plain.iter().map(|v| v.max(0.0)).collect::<Vec<_>>());
    let err = Linear::new(2, 2, 0, &cpu())
        .unwrap()
        .with_activation(wgpipe_tensor::UnaryOp::Exp)
        .err()
        .expect("exp is not a fusable activation")
        .to_string();
    assert!(err.contains("exp"), "{err}");
}

#[test]
fn mlp_fused_gelu_equals_the_unfused_layers_bit_for_bit() {
    let ctx = ForwardCtx::train(1, 0, 0);
    let x = rand(&[2, 5, 8], 6);
    for gelu in [Gelu::Tanh, Gelu::Exact] {
        let mut mlp = Mlp::new(8, 32, 9, &cpu()).unwrap();
        mlp.gelu = gelu;
        let got = output_and_grads(&mlp, &x, |x| mlp.forward(x, &ctx).unwrap());
        let want = output_and_grads(&mlp, &x, |x| {
            let h = gelu
                .forward(&mlp.fc1.forward(x, &ctx).unwrap(), &ctx)
                .unwrap();
            mlp.fc2.forward(&h, &ctx).unwrap()
        });
        assert_eq!(got, want, "{gelu:?}");
    }
}

#[test]
fn transformer_block_shapes_and_names() {
    let b = TransformerBlock::new(8, 2, 0.0, 3, &cpu()).unwrap();
    let y = run(&b, &rand(&[2, 3, 8], 2));
    assert_eq!(y.shape(), &[2, 3, 8]);
    let names: Vec<String> = b.parameters().into_iter().map(|(n, _)| n).collect();
    for n in [
        "ln1.weight",
        "ln1.bias",
        "attn.q.weight",
        "attn.k.bias",
        "attn.v.weight",
        "attn.out.bias",
        "ln2.weight",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
        "mlp.fc2.weight",
    ] {
        assert!(names.iter().any(|m| m == n), "missing {n} in {names:?}");
    }
    assert_eq!(names.len(), 16);
    let mlp = &b.mlp;
    assert_eq!(mlp.fc1.out_features(), 32);
    let packed = b.with_packed_qkv().unwrap();
    let names: Vec<String> = packed.parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names[2..6],
        [
            "attn.qkv.weight",
            "attn.qkv.bias",
            "attn.out.weight",
            "attn.out.bias"
        ],
        "{names:?}"
    );
    assert_eq!(packed.parameters()[2].1.value().shape(), &[24, 8]);
    assert_eq!(run(&packed, &rand(&[2, 3, 8], 2)).shape(), &[2, 3, 8]);
}

#[test]
fn conv2d_values() {
    let dev = cpu();
    let x = t(
        &(1..=9).map(|v| v as f32).collect::<Vec<_>>(),
        &[1, 1, 3, 3],
    );
    let c = Conv2d::from_tensors(
        t(&[1., 1., 1., 1.], &[1, 1, 2, 2]),
        Some(t(&[0.5], &[1])),
        Conv2dParams::default(),
    )
    .unwrap();
    let y = run(&c, &x);
    assert_eq!(y.shape(), &[1, 1, 2, 2]);
    assert_close(&vals(&y), &[12.5, 16.5, 24.5, 28.5], 1e-6);
    assert_eq!(c.cost(&[1, 1, 3, 3]).output_shape, vec![1, 1, 2, 2]);

    // Padding 1, stride 2, 3x3 ones: sums of the clipped windows at (0,0), (0,2), (2,0), (2,2).
    let c = Conv2d::from_tensors(
        wgpipe_tensor::Tensor::ones(&[1, 1, 3, 3], &dev).unwrap(),
        None,
        Conv2dParams {
            stride: (2, 2),
            padding: (1, 1),
            ..Conv2dParams::default()
        },
    )
    .unwrap();
    let y = run(&c, &x);
    assert_close(&vals(&y), &[12., 16., 24., 28.], 1e-6);
    assert_eq!(c.cost(&[1, 1, 3, 3]).output_shape, y.shape().to_vec());

    // Depthwise (groups = 2): each channel with its own 1x1 kernel.
    let c = Conv2d::from_tensors(
        t(&[2., -1.], &[2, 1, 1, 1]),
        None,
        Conv2dParams {
            groups: 2,
            ..Conv2dParams::default()
        },
    )
    .unwrap();
    let y = run(&c, &t(&[1., 2., 3., 4.], &[1, 2, 1, 2]));
    assert_close(&vals(&y), &[2., 4., -3., -4.], 1e-6);
    assert!(Conv2d::with_params(
        3,
        4,
        (1, 1),
        Conv2dParams {
            groups: 2,
            ..Default::default()
        },
        true,
        0,
        &dev
    )
    .is_err());
}

#[test]
fn pools_flatten_gap() {
    let x = t(
        &(0..16).map(|v| v as f32).collect::<Vec<_>>(),
        &[1, 1, 4, 4],
    );
    let y = run(&MaxPool2d::new(2, 2, 0), &x);
    assert_close(&vals(&y), &[5., 7., 13., 15.], 0.0);
    let y = run(&AvgPool2d::new(2, 2, 0), &x);
    assert_close(&vals(&y), &[2.5, 4.5, 10.5, 12.5], 1e-6);
    assert_eq!(
        MaxPool2d::new(3, 1, 1).cost(&[2, 3, 5, 5]).output_shape,
        vec![2, 3, 5, 5]
    );
    assert_eq!(
        AvgPool2d::new(3, 2, 1).cost(&[2, 3, 8, 8]).output_shape,
        vec![2, 3, 4, 4]
    );
    let x2 = t(&[1., 2., 3., 4., 10., 20., 30., 40.], &[1, 2, 2, 2]);
    let g = run(&GlobalAvgPool, &x2);
    assert_eq!(g.shape(), &[1, 2]);
    assert_close(&vals(&g), &[2.5, 25.], 1e-6);
    let f = run(&Flatten::default(), &x2);
    assert_eq!(f.shape(), &[1, 8]);
    assert_eq!(
        Flatten::default().cost(&[1, 2, 2, 2]).output_shape,
        vec![1, 8]
    );
}

#[test]
fn batchnorm_train_and_eval() {
    let bn = BatchNorm2d::new(2, &cpu()).unwrap();
    // Channel 0: [1, 3, 5, 7] (mean 4, var 5), channel 1: all 2 (var 0).
    let x = t(&[1., 3., 2., 2., 5., 7., 2., 2.], &[2, 2, 1, 2]);
    let tape = Tape::no_grad();
    let ctx = ForwardCtx::train(0, 0, 0);
    let y = vals(bn.forward(&tape.constant(x.clone()), &ctx).unwrap().value());
    let s = 1.0 / (5.0f32 + 1e-5).sqrt();
    assert_close(&y, &[-3. * s, -s, 0., 0., s, 3. * s, 0., 0.], 1e-5);
    bn.finish_step().unwrap();
    // running_mean = 0.1 * [4, 2]; running_var = 0.9 + 0.1 * unbiased [20/3, 0].
    assert_close(&vals(&bn.running_mean.value()), &[0.4, 0.2], 1e-6);
    assert_close(
        &vals(&bn.running_var.value()),
        &[0.9 + 2.0 / 3.0, 0.9],
        1e-5,
    );
    // Eval: (x - rm) / sqrt(rv + eps).
    let ye = vals(&run(&bn, &x));
    let want0 = (1.0 - 0.4) / (0.9f32 + 2.0 / 3.0 + 1e-5).sqrt();
    assert!((ye[0] - want0).abs() < 1e-5, "{} vs {want0}", ye[0]);
    let names: Vec<String> = bn.buffers().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec!["running_mean", "running_var"]);
}

#[test]
fn sequential_and_residual() {
    let dev = cpu();
    let l = Linear::from_tensors(t(&[2., 0., 0., 2.], &[2, 2]), None).unwrap();
    let seq = Sequential::new("").with("fc", l).with("act", Relu);
    let y = run(&seq, &t(&[1., -1.], &[1, 2]));
    assert_close(&vals(&y), &[2., 0.], 0.0);
    assert_eq!(seq.parameters()[0].0, "fc.weight");
    let r = Residual::new(seq).with_post(Relu);
    let y = run(&r, &t(&[1., -1.], &[1, 2]));
    assert_close(&vals(&y), &[3., 0.], 0.0);
    assert_eq!(r.parameters()[0].0, "body.fc.weight");
    let _ = dev;
}
