//! Finite-difference gradient checks of every `Var` op (CPU), and CPU-vs-wgpu agreement of the
//! gradients for a representative subset (skipped, saying why, without a software adapter).
//!
//! The checker is `wgpipe_autograd::gradcheck` on every element: the scalar checked is
//! `sum(f(inputs) * W)` for fixed random weights `W`; numeric gradients are central differences
//! with the loss accumulated in f64 over the f32 outputs.

use std::sync::OnceLock;

use wgpipe_autograd::gradcheck::GradCheck;
use wgpipe_autograd::tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_autograd::tensor::{Device, Result, Tensor};
use wgpipe_autograd::{ForwardCtx, Var};

// ---------------------------------------------------------------------------------------------
// inputs

/// A small deterministic generator (xorshift*), so tests need no extra crates.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

fn cpu() -> Device {
    Device::cpu()
}

/// Uniform values in `[lo, hi)`.
fn uniform(shape: &[usize], lo: f32, hi: f32, seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v = (0..numel(shape)).map(|_| r.uniform(lo, hi)).collect();
    Tensor::from_vec(v, shape, &cpu()).unwrap()
}

/// Values in about [-1, 1].
fn randn(shape: &[usize], seed: u64) -> Tensor {
    uniform(shape, -1.0, 1.0, seed)
}

/// Tensors whose values are all distinct, at least 0.03 apart across every tensor returned and
/// at least 0.015 away from 0: finite differences with eps 1e-3 never cross a kink of relu, abs,
/// max, maximum or a max-pool window.
fn spaced(shapes: &[&[usize]], seed: u64) -> Vec<Tensor> {
    let total: usize = shapes.iter().map(|s| numel(s)).sum();
    let mut grid: Vec<f32> = (0..total)
        .map(|k| (k as f32 - total as f32 / 2.0 + 0.5) * 0.03)
        .collect();
    let mut r = Rng::new(seed);
    for i in (1..grid.len()).rev() {
        grid.swap(i, r.below(i + 1));
    }
    let mut at = 0;
    shapes
        .iter()
        .map(|s| {
            let n = numel(s);
            at += n;
            Tensor::from_vec(grid[at - n..at].to_vec(), s, &cpu()).unwrap()
        })
        .collect()
}

/// Integer indices in `0..bound` as an f32 tensor.
fn indices(shape: &[usize], bound: usize, seed: u64) -> Tensor {
    let mut r = Rng::new(seed);
    let v = (0..numel(shape)).map(|_| r.below(bound) as f32).collect();
    Tensor::from_vec(v, shape, &cpu()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// the check

/// For smooth ops: every element of every input, weights from this file's generator.
const SMOOTH: GradCheck = GradCheck {
    eps: 1e-2,
    rtol: 1e-2,
    atol: 1e-4,
    sample: None,
    weights: weights_for,
};
/// For piecewise-linear ops on `spaced` inputs.
const KINKED: GradCheck = GradCheck {
    eps: 1e-3,
    ..SMOOTH
};

fn weights_for(shape: &[usize], dev: &Device) -> Result<Tensor> {
    uniform(shape, -1.0, 1.0, 0xC0FFEE ^ numel(shape) as u64).to_device(dev)
}

/// Checks the gradient of `f` with respect to every input against central differences.
#[track_caller]
fn gradcheck(name: &str, inputs: &[Tensor], f: impl Fn(&[Var]) -> Result<Var>) {
    SMOOTH.check(name, inputs, f)
}

#[test]
#[should_panic(expected = "differ from finite differences")]
fn gradcheck_catches_a_wrong_gradient() {
    // x^2 with a backward of x instead of 2x
    gradcheck("wrong", &[randn(&[3], 0)], |v| {
        let y = v[0].value().square()?;
        let x = v[0].value().clone();
        Var::from_op("wrong_square", &[&v[0]], y, move |g, _| {
            Ok(vec![Some(g.mul(&x)?)])
        })
    });
}

// ---------------------------------------------------------------------------------------------
// elementwise binary, with broadcasting and views

#[test]
fn grad_add_broadcast() {
    gradcheck("add", &[randn(&[2, 3, 4], 1), randn(&[3, 1], 2)], |v| {
        v[0].add(&v[1])
    });
    // a transposed view broadcast against a row
    gradcheck("add(t)", &[randn(&[4, 3], 3), randn(&[4], 4)], |v| {
        v[0].t()?.add(&v[1])
    });
}

#[test]
fn grad_sub_broadcast() {
    gradcheck("sub", &[randn(&[3, 4], 5), randn(&[4], 6)], |v| {
        v[0].sub(&v[1])
    });
    gradcheck("sub(rev)", &[randn(&[1, 4], 7), randn(&[3, 1], 8)], |v| {
        v[1].sub(&v[0])
    });
}

#[test]
fn grad_mul_broadcast() {
    gradcheck("mul", &[randn(&[2, 1, 4], 9), randn(&[3, 1], 10)], |v| {
        v[0].mul(&v[1])
    });
    gradcheck("mul(self)", &[randn(&[3, 4], 11)], |v| v[0].mul(&v[0]));
}

#[test]
fn grad_div_broadcast() {
    gradcheck(
        "div",
        &[randn(&[3, 4], 12), uniform(&[1, 4], 0.5, 2.0, 13)],
        |v| v[0].div(&v[1]),
    );
}

#[test]
fn grad_maximum_minimum() {
    let x = spaced(&[&[3, 4], &[4]], 14);
    KINKED.check("maximum", &x, |v| v[0].maximum(&v[1]));
    KINKED.check("minimum", &x, |v| v[1].minimum(&v[0]));
}

#[test]
fn grad_pow() {
    gradcheck(
        "pow",
        &[uniform(&[3, 4], 0.5, 2.0, 15), uniform(&[4], -1.0, 2.0, 16)],
        |v| v[0].pow(&v[1]),
    );
}

/// A random shape of rank `1..=3` with dims in `1..=4`, and a shape that broadcasts against it
/// (some axes set to 1, maybe fewer leading axes).
fn random_broadcast_pair(r: &mut Rng) -> (Vec<usize>, Vec<usize>) {
    let rank = 1 + r.below(3);
    let a: Vec<usize> = (0..rank).map(|_| 1 + r.below(4)).collect();
    let drop = r.below(rank);
    let b: Vec<usize> = a[drop..]
        .iter()
        .map(|&d| if r.below(2) == 0 { 1 } else { d })
        .collect();
    (a, b)
}

#[test]
fn grad_random_shapes() {
    let mut r = Rng::new(2024);
    for case in 0..6u64 {
        let (sa, sb) = random_broadcast_pair(&mut r);
        let (a, b) = (randn(&sa, 200 + case), randn(&sb, 300 + case));
        let pos = uniform(&sb, 0.5, 2.0, 400 + case);
        let name = format!("random {sa:?} vs {sb:?}");
        gradcheck(&format!("add {name}"), &[b.clone(), a.clone()], |v| {
            v[0].add(&v[1])
        });
        gradcheck(&format!("mul {name}"), &[a.clone(), b.clone()], |v| {
            v[0].mul(&v[1])
        });
        gradcheck(&format!("div {name}"), &[a.clone(), pos], |v| {
            v[0].div(&v[1])
        });
        let sp = spaced(&[&sa, &sb], 500 + case);
        KINKED.check(&format!("maximum {name}"), &sp, |v| v[0].maximum(&v[1]));
        // a reduction over a random axis, keepdim or not
        let axis = r.below(sa.len()) as isize
            - if r.below(2) == 0 {
                sa.len() as isize
            } else {
                0
            };
        let keep = r.below(2) == 0;
        gradcheck(
            &format!("sum({axis}, {keep}) {sa:?}"),
            std::slice::from_ref(&a),
            |v| v[0].sum(&[axis], keep)?.square(),
        );
        gradcheck(
            &format!("var({axis}, {keep}) {sa:?}"),
            std::slice::from_ref(&a),
            |v| v[0].var(&[axis], keep),
        );
        // a batched matmul with broadcast batch dims
        let (m, k, n) = (1 + r.below(4), 1 + r.below(4), 1 + r.below(4));
        let (ba, bb) = random_broadcast_pair(&mut r);
        let (ba, bb) = (
            &ba[ba.len().saturating_sub(2)..],
            &bb[bb.len().saturating_sub(2)..],
        );
        let sx: Vec<usize> = ba.iter().copied().chain([m, k]).collect();
        let sy: Vec<usize> = bb.iter().copied().chain([k, n]).collect();
        gradcheck(
            &format!("matmul {sx:?} @ {sy:?}"),
            &[randn(&sx, 600 + case), randn(&sy, 700 + case)],
            |v| v[0].matmul(&v[1]),
        );
    }
}

// ---------------------------------------------------------------------------------------------
// scalar and unary (on transposed views)

#[test]
fn grad_scalar_ops() {
    let x = [randn(&[3, 4], 17)];
    gradcheck("add_scalar", &x, |v| v[0].add_scalar(0.7)?.square());
    gradcheck("sub_scalar", &x, |v| v[0].sub_scalar(0.7)?.square());
    gradcheck("mul_scalar", &x, |v| v[0].mul_scalar(-1.5));
    gradcheck("div_scalar", &x, |v| v[0].div_scalar(4.0));
    let p = [uniform(&[3, 4], 0.5, 2.0, 18)];
    gradcheck("powf(2.5)", &p, |v| v[0].powf(2.5));
    gradcheck("powf(-0.5)", &p, |v| v[0].powf(-0.5));
    gradcheck("powf(3) neg base", &x, |v| v[0].powf(3.0));
}

#[test]
fn grad_unary_smooth() {
    let x = [randn(&[4, 3], 19)];
    type Op = fn(&Var) -> Result<Var>;
    let ops: [(&str, Op); 10] = [
        ("neg", |v| v.neg()),
        ("exp", |v| v.exp()),
        ("tanh", |v| v.tanh()),
        ("sigmoid", |v| v.sigmoid()),
        ("gelu", |v| v.gelu()),
        ("gelu_tanh", |v| v.gelu_tanh()),
        ("sin", |v| v.sin()),
        ("cos", |v| v.cos()),
        ("square", |v| v.square()),
        ("abs(smooth side)", |v| v.add_scalar(3.0)?.abs()),
    ];
    for (name, op) in ops {
        gradcheck(name, &x, |v| op(&v[0].t()?));
    }
    let p = [uniform(&[4, 3], 0.5, 2.0, 20)];
    let pos: [(&str, Op); 4] = [
        ("log", |v| v.log()),
        ("sqrt", |v| v.sqrt()),
        ("rsqrt", |v| v.rsqrt()),
        ("recip", |v| v.recip()),
    ];
    for (name, op) in pos {
        gradcheck(name, &p, |v| op(&v[0].t()?));
    }
}

/// `Var::unary` takes its gradient from the op's descriptor (one fused kernel).
#[test]
fn grad_unary_from_descriptors() {
    use wgpipe_autograd::tensor::UnaryOp;
    let x = [randn(&[4, 3], 23)];
    for op in [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::GeluTanh,
        UnaryOp::GeluTanhGrad,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Square,
        UnaryOp::Affine {
            mul: 1.5,
            add: -0.5,
        },
        UnaryOp::RSub(1.0),
    ] {
        gradcheck(op.name(), &x, |v| v[0].t()?.unary(op));
    }
    let p = [uniform(&[4, 3], 0.5, 2.0, 24)];
    for op in [
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Powf(2.5),
        UnaryOp::RDiv(2.0),
    ] {
        gradcheck(op.name(), &p, |v| v[0].t()?.unary(op));
    }
}

#[test]
fn grad_silu() {
    let x = [uniform(&[4, 3], -4.0, 4.0, 25)];
    gradcheck("silu", &x, |v| v[0].t()?.silu());
}

#[test]
fn grad_unary_kinked() {
    let x = spaced(&[&[4, 3]], 21);
    KINKED.check("relu", &x, |v| v[0].t()?.relu());
    KINKED.check("abs", &x, |v| v[0].t()?.abs());
}

// ---------------------------------------------------------------------------------------------
// matmul

#[test]
fn grad_matmul() {
    gradcheck(
        "matmul 2d",
        &[randn(&[3, 4], 22), randn(&[4, 5], 23)],
        |v| v[0].matmul(&v[1]),
    );
    gradcheck(
        "matmul batched x 2d",
        &[randn(&[2, 3, 4], 24), randn(&[4, 5], 25)],
        |v| v[0].matmul(&v[1]),
    );
    gradcheck(
        "matmul broadcast batch",
        &[randn(&[2, 1, 3, 4], 26), randn(&[3, 4, 2], 27)],
        |v| v[0].matmul(&v[1]),
    );
    gradcheck(
        "matmul 2d x batched",
        &[randn(&[3, 4], 28), randn(&[2, 4, 5], 29)],
        |v| v[0].matmul(&v[1]),
    );
    gradcheck(
        "matmul transposed views",
        &[randn(&[4, 3], 30), randn(&[5, 4], 31)],
        |v| v[0].t()?.matmul(&v[1].t()?),
    );
    gradcheck(
        "matmul batched transposed",
        &[randn(&[2, 4, 3], 32), randn(&[2, 4, 3], 33)],
        |v| v[0].t()?.matmul(&v[1]),
    );
}

/// The attention's products over head views of a packed projection (batch axes that need two
/// strides, read in place by the kernel): gradients against central differences, and against
/// the same graph on contiguous copies of the views (the one-stride path the kernel had before).
#[test]
fn grad_matmul_of_permuted_head_views() {
    let scores = |v: &[Var]| -> Result<Var> {
        let [q, k, w] = split_packed(&v[0], 2)?;
        q.matmul(&k.transpose(-2, -1)?)?.matmul(&w)
    };
    let x = randn(&[2, 5, 3 * 6], 60);
    gradcheck(
        "q @ k^T @ v on permuted heads",
        std::slice::from_ref(&x),
        scores,
    );
    let copied = |v: &[Var]| -> Result<Var> {
        let [q, k, w] = split_packed(&v[0], 2)?;
        let (q, k, w) = (q.contiguous()?, k.contiguous()?, w.contiguous()?);
        q.matmul(&k.transpose(-2, -1)?.contiguous()?)?.matmul(&w)
    };
    let (y, g) = SMOOTH.gradients(std::slice::from_ref(&x), scores).unwrap();
    let (y_ref, g_ref) = SMOOTH.gradients(&[x], copied).unwrap();
    let close = |a: &Tensor, b: &Tensor| {
        let (a, b) = (a.to_vec().unwrap(), b.to_vec().unwrap());
        a.iter()
            .zip(&b)
            .all(|(p, q)| (p - q).abs() <= 1e-5 * (1.0 + q.abs()))
    };
    assert!(close(&y, &y_ref), "values differ from the copied views'");
    assert!(
        close(&g[0], &g_ref[0]),
        "gradients differ from the copied views'"
    );
}

// ---------------------------------------------------------------------------------------------
// reductions

#[test]
fn grad_sum_mean() {
    let x = [randn(&[2, 3, 4], 34)];
    gradcheck("sum(1)", &x, |v| v[0].sum(&[1], false));
    gradcheck("sum(0,2,keep)", &x, |v| v[0].sum(&[0, -1], true));
    gradcheck("sum(all)", &x, |v| v[0].sum(&[], false)?.square());
    gradcheck("sum_all of view", &x, |v| {
        v[0].permute(&[2, 0, 1])?.sum(&[0], false)
    });
    gradcheck("mean(-1)", &x, |v| v[0].mean(&[-1], false));
    gradcheck("mean(0,1,keep)", &x, |v| v[0].mean(&[0, 1], true));
    gradcheck("mean(all)", &x, |v| v[0].mean_all()?.square());
}

#[test]
fn grad_max_min() {
    let x = spaced(&[&[2, 3, 4]], 35);
    KINKED.check("max(-1)", &x, |v| v[0].max(&[-1], false));
    KINKED.check("max(0,2,keep)", &x, |v| v[0].max(&[0, 2], true));
    KINKED.check("min(1)", &x, |v| v[0].min(&[1], false));
    KINKED.check("min(all)", &x, |v| v[0].min(&[], true));
    KINKED.check("max of view", &x, |v| {
        v[0].transpose(0, 2)?.max(&[1], false)
    });
}

#[test]
fn grad_var() {
    let x = [randn(&[2, 3, 4], 36)];
    gradcheck("var(-1)", &x, |v| v[0].var(&[-1], false));
    gradcheck("var(0,1,keep)", &x, |v| v[0].var(&[0, 1], true));
    gradcheck("var(all)", &x, |v| v[0].var(&[], false));
}

// ---------------------------------------------------------------------------------------------
// nn

#[test]
fn grad_softmax() {
    let x = [randn(&[2, 3, 4], 37).mul_scalar(2.0).unwrap()];
    gradcheck("softmax(-1)", &x, |v| v[0].softmax(-1));
    gradcheck("softmax(1)", &x, |v| v[0].softmax(1));
    gradcheck("softmax of view", &x, |v| v[0].t()?.softmax(-1));
    gradcheck("log_softmax(-1)", &x, |v| v[0].log_softmax(-1));
    gradcheck("log_softmax(0)", &x, |v| v[0].log_softmax(0));
}

#[test]
fn grad_bias_act() {
    for op in wgpipe_autograd::tensor::BIAS_ACTIVATIONS {
        // z at least 0.015 from 0 and |bias| < 0.005: no finite difference (eps 1e-3) moves
        // z + bias across relu's kink.
        let zb = [
            spaced(&[&[2, 3, 4]], 41).remove(0),
            uniform(&[4], -0.005, 0.005, 42),
        ];
        gradcheck(&format!("bias_act {}", op.name()), &zb, |v| {
            v[0].bias_act(&v[1], op)
        });
        gradcheck(&format!("bias_act {} of a view", op.name()), &zb, |v| {
            v[0].permute(&[1, 0, 2])?.bias_act(&v[1], op)
        });
    }
}

#[test]
fn grad_add_layer_norm_with_a_carried_gradient() {
    let inputs = [
        randn(&[2, 3, 5], 60),
        randn(&[2, 3, 5], 61),
        uniform(&[5], 0.5, 1.5, 62),
        randn(&[5], 63),
    ];
    // The sum's other consumer (sin) is recorded after the norm, so its gradient is already
    // there when the norm's backward runs and is carried into the fused pass.
    gradcheck("add_layer_norm with a carried gradient", &inputs, |v| {
        let (s, y) = v[0].add_layer_norm(&v[1], &v[2], &v[3], 1e-5)?;
        y.mul(&s.sin()?)
    });
    gradcheck("add_layer_norm", &inputs, |v| {
        let (s, y) = v[0].add_layer_norm(&v[1], &v[2], &v[3], 1e-5)?;
        y.mul(&s.tanh()?)?.add(&s)
    });
    gradcheck("add_layer_norm of views", &inputs, |v| {
        let view = |x: &Var| x.permute(&[1, 0, 2]);
        let (s, y) = view(&v[0])?.add_layer_norm(&view(&v[1])?, &v[2], &v[3], 1e-5)?;
        y.mul(&s)
    });
}

/// Class ids for `n` rows of `c` classes.
fn class_ids(n: usize, c: usize) -> Tensor {
    let ids = (0..n).map(|i| ((i * 5 + 2) % c) as f32).collect();
    Tensor::from_vec(ids, &[n], &cpu()).unwrap()
}

#[test]
fn grad_cross_entropy() {
    let x = [uniform(&[6, 7], -3.0, 3.0, 64), randn(&[6], 65)];
    let t = class_ids(6, 7);
    // Each row's loss weighted differently, so a wrong per-row factor shows.
    gradcheck("cross_entropy_rows", &x, |v| {
        v[0].cross_entropy_rows(&t)?.mul(&v[1])
    });
    let tt = class_ids(7, 6);
    gradcheck("cross_entropy_rows of a view", &x, |v| {
        v[0].t()?.cross_entropy_rows(&tt)?.sum(&[], false)
    });
}

#[test]
fn grad_causal_attention() {
    // q, k, v [2, 2, 5, 3], scores scaled up so the softmax is far from uniform.
    let qkv = [
        randn(&[2, 2, 5, 3], 38),
        randn(&[2, 2, 5, 3], 39),
        randn(&[2, 2, 5, 3], 40),
    ];
    gradcheck("causal_attention", &qkv, |v| {
        v[0].causal_attention(&v[1], &v[2], 1.7, None)
    });
    // Strided views as inputs (what the model passes: heads permuted out of [B, T, H, dh]).
    gradcheck("causal_attention of views", &qkv, |v| {
        let view = |x: &Var| x.permute(&[0, 2, 1, 3]);
        view(&v[0])?.causal_attention(&view(&v[1])?, &view(&v[2])?, 0.6, None)
    });
    let mask = attention_dropout_mask();
    gradcheck("causal_attention with dropout", &qkv, move |v| {
        v[0].causal_attention(&v[1], &v[2], 0.8, Some(&mask))
    });
    // One input only needing a gradient (the others constants).
    gradcheck("causal_attention grad of k only", &qkv[1..2], |v| {
        let tape = v[0].tape();
        let (q, vv) = (tape.constant(qkv[0].clone()), tape.constant(qkv[2].clone()));
        q.causal_attention(&v[0], &vv, 1.3, None)
    });
}

/// A dropout mask (p = 0.4) for attention weights of 2 samples, 2 heads, 5 positions.
fn attention_dropout_mask() -> Tensor {
    ForwardCtx::train(3, 1, 0)
        .dropout_mask(&[2, 2, 5, 5], 0.4, 1, &cpu())
        .unwrap()
        .expect("a training context drops")
}

#[test]
fn grad_causal_attention_packed() {
    // [2, 5, 3 * 6]: 2 heads of 3.
    let x = [randn(&[2, 5, 18], 41)];
    gradcheck("causal_attention_packed", &x, |v| {
        v[0].causal_attention_packed(2, 1.7, None)
    });
    let mask = attention_dropout_mask();
    gradcheck("causal_attention_packed with dropout", &x, move |v| {
        v[0].causal_attention_packed(2, 0.8, Some(&mask))
    });
    // No leading axes: [t, 3 d].
    gradcheck(
        "causal_attention_packed of [t, 3 d]",
        &[randn(&[4, 12], 42)],
        |v| v[0].causal_attention_packed(4, 1.1, None),
    );
}

/// Heads split out of a packed `[b, t, 3 d]` by views, as a model without the packed op does.
fn split_packed(x: &Var, heads: usize) -> Result<[Var; 3]> {
    let s = x.shape().to_vec();
    let (b, t, d) = (s[0], s[1], s[2] / 3);
    let part = |i: usize| {
        x.narrow(-1, i * d, d)?
            .reshape(&[b, t, heads, d / heads])?
            .permute(&[0, 2, 1, 3])
    };
    Ok([part(0)?, part(1)?, part(2)?])
}

#[test]
fn causal_attention_packed_equals_the_split_heads_bit_for_bit() {
    let x = randn(&[3, 7, 24], 43);
    let ctx = ForwardCtx::train(2, 0, 0);
    let mask = ctx.dropout_mask(&[3, 4, 7, 7], 0.3, 2, &cpu()).unwrap();
    for m in [None, mask] {
        let run = |packed: bool| -> (Vec<f32>, Vec<f32>) {
            let tape = wgpipe_autograd::Tape::new();
            let xv = tape.leaf(x.clone());
            let y = if packed {
                xv.causal_attention_packed(4, 0.9, m.as_ref()).unwrap()
            } else {
                let [q, k, v] = split_packed(&xv, 4).unwrap();
                q.causal_attention(&k, &v, 0.9, m.as_ref())
                    .unwrap()
                    .permute(&[0, 2, 1, 3])
                    .unwrap()
                    .reshape(&[3, 7, 8])
                    .unwrap()
            };
            let w = randn(y.shape(), 44);
            let g = tape.backward_with(&y, &w).unwrap();
            (
                y.value().to_vec().unwrap(),
                g.get(&xv).unwrap().to_vec().unwrap(),
            )
        };
        assert_eq!(run(true), run(false), "dropout: {}", m.is_some());
    }
}

#[test]
fn causal_attention_packed_refuses_bad_shapes() {
    let tape = wgpipe_autograd::Tape::new();
    let x = tape.leaf(randn(&[2, 4, 12], 1));
    for (heads, bad) in [(0, "heads = 0"), (3, "heads = 3"), (5, "heads = 5")] {
        let msg = x
            .causal_attention_packed(heads, 1.0, None)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("[2, 4, 12]") && msg.contains(bad), "{msg}");
    }
    let msg = tape
        .leaf(randn(&[12], 2))
        .causal_attention_packed(1, 1.0, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[12]"), "{msg}");
    let wrong_mask = randn(&[2, 4, 4], 3);
    let msg = x
        .causal_attention_packed(2, 1.0, Some(&wrong_mask))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("[2, 4, 4]") && msg.contains("[2, 2, 4, 4]"),
        "{msg}"
    );
}

#[test]
fn causal_attention_refuses_bad_shapes() {
    let tape = wgpipe_autograd::Tape::new();
    let a = tape.leaf(randn(&[2, 4, 3], 1));
    let b = tape.leaf(randn(&[2, 5, 3], 2));
    let msg = a
        .causal_attention(&b, &a, 1.0, None)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("[2, 4, 3]") && msg.contains("[2, 5, 3]"),
        "{msg}"
    );
    let wrong_mask = randn(&[2, 3, 3], 3);
    let msg = a
        .causal_attention(&a, &a, 1.0, Some(&wrong_mask))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("[2, 3, 3]") && msg.contains("[2, 4, 4]"),
        "{msg}"
    );
}

#[test]
fn grad_layer_norm() {
    gradcheck(
        "layer_norm",
        &[
            randn(&[2, 3, 5], 38),
            uniform(&[5], 0.5, 1.5, 39),
            randn(&[5], 40),
        ],
        |v| v[0].layer_norm(&v[1], &v[2], 1e-5),
    );
    gradcheck(
        "layer_norm of view",
        &[
            randn(&[5, 4], 41),
            uniform(&[5], 0.5, 1.5, 42),
            randn(&[5], 43),
        ],
        |v| v[0].t()?.layer_norm(&v[1], &v[2], 1e-5),
    );
}

#[test]
fn grad_conv2d() {
    let p = Conv2dParams {
        padding: (1, 1),
        ..Default::default()
    };
    gradcheck(
        "conv2d bias pad",
        &[
            randn(&[2, 3, 5, 5], 44),
            randn(&[4, 3, 3, 3], 45),
            randn(&[4], 46),
        ],
        |v| v[0].conv2d(&v[1], Some(&v[2]), p),
    );
    let p = Conv2dParams {
        stride: (2, 1),
        padding: (1, 0),
        dilation: (1, 2),
        groups: 1,
    };
    gradcheck(
        "conv2d stride dilation",
        &[randn(&[1, 2, 6, 6], 47), randn(&[3, 2, 2, 2], 48)],
        |v| v[0].conv2d(&v[1], None, p),
    );
    let p = Conv2dParams {
        padding: (1, 1),
        groups: 3,
        ..Default::default()
    };
    gradcheck(
        "conv2d depthwise",
        &[randn(&[1, 3, 4, 4], 49), randn(&[3, 1, 3, 3], 50)],
        |v| v[0].conv2d(&v[1], None, p),
    );
}

#[test]
fn grad_pools() {
    let x = spaced(&[&[2, 2, 5, 5]], 51);
    let p = Pool2dParams {
        kernel: (2, 2),
        stride: (2, 2),
        padding: (0, 0),
    };
    KINKED.check("max_pool2d 2x2", &x, |v| v[0].max_pool2d(p));
    let p = Pool2dParams {
        kernel: (3, 3),
        stride: (2, 2),
        padding: (1, 1),
    };
    KINKED.check("max_pool2d 3x3 s2 p1", &x, |v| v[0].max_pool2d(p));
    gradcheck("avg_pool2d 3x3 s2 p1", &[randn(&[2, 2, 5, 5], 52)], |v| {
        v[0].avg_pool2d(p)
    });
    gradcheck("avg_pool2d of view", &[randn(&[2, 2, 5, 5], 53)], |v| {
        v[0].transpose(2, 3)?.avg_pool2d(Pool2dParams {
            kernel: (2, 3),
            stride: (1, 2),
            padding: (0, 1),
        })
    });
}

#[test]
fn grad_dropout() {
    let ctx = ForwardCtx::train(7, 3, 1).at_layer(2);
    gradcheck("dropout", &[randn(&[4, 6], 54)], move |v| {
        v[0].dropout(0.3, &ctx, 0)
    });
    let eval = ForwardCtx::eval();
    gradcheck("dropout eval", &[randn(&[4, 6], 55)], move |v| {
        v[0].dropout(0.3, &eval, 0)?.tanh()
    });
}

// ---------------------------------------------------------------------------------------------
// shapes and views

#[test]
fn grad_views() {
    let x = [randn(&[2, 3, 4], 56)];
    gradcheck("reshape", &x, |v| v[0].reshape(&[4, usize::MAX])?.square());
    gradcheck("reshape of view", &x, |v| {
        v[0].transpose(0, 2)?.reshape(&[4, 6])?.square()
    });
    gradcheck("permute", &x, |v| v[0].permute(&[2, 0, 1])?.square());
    gradcheck("transpose", &x, |v| v[0].transpose(0, -1)?.sin());
    gradcheck("t", &x, |v| v[0].t()?.sin());
    gradcheck("narrow", &x, |v| v[0].narrow(1, 1, 2)?.square());
    gradcheck("narrow start", &x, |v| v[0].narrow(-1, 0, 3)?.square());
    gradcheck("narrow of view", &x, |v| {
        v[0].t()?.narrow(1, 2, 2)?.square()
    });
    gradcheck("unsqueeze", &x, |v| v[0].unsqueeze(1)?.square());
    gradcheck("squeeze", &[randn(&[3, 1, 4], 57)], |v| {
        v[0].squeeze(1)?.square()
    });
    gradcheck("flatten", &x, |v| v[0].flatten(1, 2)?.sin());
    gradcheck("contiguous", &x, |v| {
        v[0].permute(&[1, 2, 0])?.contiguous()?.sin()
    });
    gradcheck("broadcast_to", &[randn(&[3, 1], 58)], |v| {
        v[0].broadcast_to(&[2, 3, 4])?.sin()
    });
    gradcheck("expand", &[randn(&[4], 59)], |v| {
        v[0].expand(&[3, 4])?.sin()
    });
}

#[test]
fn grad_concat_stack() {
    let xs = [randn(&[2, 3], 60), randn(&[2, 1], 61), randn(&[2, 2], 62)];
    gradcheck("concat", &xs, |v| {
        Var::concat(&[&v[0], &v[1], &v[2]], 1)?.square()
    });
    // a constant among the parts, and a view
    gradcheck("concat const", &xs[..2], |v| {
        let c = v[0].tape().constant(randn(&[2, 4], 63));
        Var::concat(&[&v[1], &c, &v[0].sin()?], -1)
    });
    let ys = [randn(&[3, 4], 64), randn(&[4, 3], 65)];
    gradcheck("stack", &ys, |v| {
        Var::stack(&[&v[0], &v[1].t()?], 0)?.square()
    });
    gradcheck("stack(-1)", &ys, |v| {
        Var::stack(&[&v[1].t()?, &v[0], &v[0]], -1)?.sin()
    });
}

#[test]
fn grad_split_chunk_unbind() {
    let x = [randn(&[3, 7], 66)];
    // Each piece through its own op; one piece (the middle) unused: its slice gets zeros.
    gradcheck("split", &x, |v| {
        let p = v[0].split(3, 1)?;
        assert_eq!(p.len(), 3);
        p[0].square()?.sum(&[1], true)?.add(&p[2].sin()?)
    });
    gradcheck("split_sizes of a view", &x, |v| {
        let p = v[0].t()?.split_sizes(&[2, 0, 4, 1], 0)?;
        Var::concat(&[&p[3], &p[2].exp()?, &p[0]], 0)
    });
    gradcheck("chunk, a piece used twice", &x, |v| {
        let p = v[0].chunk(2, 0)?;
        p[1].mul(&p[1].sin()?)?.add(&p[0].narrow(0, 0, 1)?)
    });
    gradcheck("one piece", &x, |v| v[0].chunk(1, -1)?[0].square());
    gradcheck("unbind, two slices unused", &x, |v| {
        let cols = v[0].unbind(1)?;
        assert_eq!((cols.len(), cols[0].shape()), (7, &[3][..]));
        cols[0].mul(&cols[4])?.add(&cols[6].sin()?)?.add(&cols[0])
    });
}

/// `split` gives the gradient the `narrow`s it replaces give (each slice written once, zeros
/// elsewhere, where the narrows pad and sum), bit for bit, in one backward node.
#[test]
fn split_backward_equals_narrows_bit_for_bit() {
    let x = randn(&[4, 10, 6], 67);
    let w = randn(&[4, 3, 6], 68);
    let run = |by_split: bool| -> (Vec<f32>, usize) {
        let tape = wgpipe_autograd::Tape::new();
        let xv = tape.leaf(x.clone());
        let pieces = if by_split {
            xv.split_sizes(&[3, 4, 3], 1).unwrap()
        } else {
            vec![
                xv.narrow(1, 0, 3).unwrap(),
                xv.narrow(1, 3, 4).unwrap(),
                xv.narrow(1, 7, 3).unwrap(),
            ]
        };
        // The last piece is left out, the first two meet the same weights.
        let y = pieces[0]
            .mul(&tape.constant(w.clone()))
            .unwrap()
            .add(&pieces[1].narrow(1, 1, 3).unwrap().tanh().unwrap())
            .unwrap()
            .sum(&[0, 1, 2], false)
            .unwrap();
        let nodes = tape.len();
        let g = tape.backward(&y).unwrap();
        (g.get(&xv).unwrap().to_vec().unwrap(), nodes)
    };
    let (by_split, split_nodes) = run(true);
    let (by_narrow, narrow_nodes) = run(false);
    assert_eq!(by_split, by_narrow);
    assert_eq!(
        split_nodes + 2,
        narrow_nodes,
        "one split node for three narrows"
    );
    // The left-out piece's slice is zero, the others are not.
    let g = Tensor::from_vec(by_split, &[4, 10, 6], &cpu()).unwrap();
    let sum_abs = |t: Tensor| t.abs().unwrap().sum_all().unwrap().to_scalar().unwrap();
    assert_eq!(sum_abs(g.narrow(1, 7, 3).unwrap()), 0.0);
    assert!(sum_abs(g.narrow(1, 0, 7).unwrap()) > 1.0);
}

#[test]
fn split_refuses_bad_sizes_naming_the_shape() {
    let tape = wgpipe_autograd::Tape::new();
    let x = tape.leaf(randn(&[2, 5], 69));
    let msg = x.split_sizes(&[2, 2], 1).unwrap_err().to_string();
    assert!(msg.contains("[2, 5]") && msg.contains("[2, 2]"), "{msg}");
    let msg = x.split(0, 0).unwrap_err().to_string();
    assert!(msg.contains("[2, 5]"), "{msg}");
    let msg = x.chunk(0, 1).unwrap_err().to_string();
    assert!(msg.contains("chunk") && msg.contains("[2, 5]"), "{msg}");
    assert!(x.split(1, 2).is_err());
}

// ---------------------------------------------------------------------------------------------
// indexing and masking

#[test]
fn grad_index_select() {
    let idx = Tensor::from_vec(vec![2.0, 0.0, 2.0, 1.0, 2.0], &[5], &cpu()).unwrap();
    let i2 = idx.clone();
    gradcheck("index_select(0) repeats", &[randn(&[3, 4], 66)], move |v| {
        v[0].index_select(0, &i2)
    });
    let idx = Tensor::from_vec(vec![3.0, 1.0, 3.0], &[3], &cpu()).unwrap();
    gradcheck(
        "index_select(-1) of view",
        &[randn(&[4, 2, 3], 67)],
        move |v| v[0].permute(&[1, 2, 0])?.index_select(-1, &idx)?.square(),
    );
}

#[test]
fn grad_gather() {
    let idx = indices(&[3, 5], 4, 68);
    gradcheck("gather(1)", &[randn(&[3, 4], 69)], move |v| {
        v[0].gather(1, &idx)
    });
    let idx = indices(&[5, 4], 3, 70);
    gradcheck("gather(0)", &[randn(&[3, 4], 71)], move |v| {
        v[0].gather(0, &idx)?.square()
    });
}

#[test]
fn grad_masked_fill_where() {
    let mask = Tensor::from_vec(vec![1.0, 0.0, 0.0, 1.0], &[1, 4], &cpu()).unwrap();
    gradcheck("masked_fill", &[randn(&[3, 4], 72)], move |v| {
        v[0].masked_fill(&mask, -5.0)?.square()
    });
    let cond = indices(&[3, 4], 2, 73);
    gradcheck(
        "where_cond",
        &[randn(&[3, 4], 74), randn(&[4], 75)],
        move |v| Var::where_cond(&cond, &v[0], &v[1])?.square(),
    );
}

#[test]
fn grad_composite_mlp() {
    // a small network: every piece at once, with parameters reused
    gradcheck(
        "mlp",
        &[
            randn(&[3, 4], 76),
            randn(&[4, 5], 77),
            randn(&[5], 78),
            randn(&[5, 2], 79),
        ],
        |v| {
            let h = v[0].matmul(&v[1])?.add(&v[2])?.gelu()?;
            let o = h.matmul(&v[3])?.log_softmax(-1)?;
            o.add(&h.sum(&[-1], true)?.mul_scalar(0.1)?)
        },
    );
}

#[test]
fn grad_checkpointed_segment() {
    // the grad of x flows through a checkpointed segment (params: see tests/checkpoint.rs)
    let w = randn(&[4, 4], 81);
    gradcheck("checkpoint", &[randn(&[3, 4], 80)], move |v| {
        let w = w.clone();
        let y = wgpipe_autograd::checkpoint(&v[0], move |x| {
            let w = x.tape().constant(w.clone());
            x.matmul(&w)?.tanh()?.mul(x)
        })?;
        y.square()
    });
}

// ---------------------------------------------------------------------------------------------
// the same gradients on wgpu

fn wgpu_device() -> Option<&'static Device> {
    static DEV: OnceLock<std::result::Result<Device, String>> = OnceLock::new();
    match DEV.get_or_init(|| Device::test_wgpu().map_err(|e| e.to_string())) {
        Ok(d) => Some(d),
        Err(why) => {
            eprintln!("SKIPPED: gradients on wgpu vs CPU ({why})");
            None
        }
    }
}

fn same_on_wgpu(name: &str, dev: &Device, inputs: &[Tensor], f: impl Fn(&[Var]) -> Result<Var>) {
    let on = |dev: &Device| {
        let xs: Vec<Tensor> = inputs.iter().map(|t| t.to_device(dev).unwrap()).collect();
        SMOOTH.gradients(&xs, &f).expect("forward and backward")
    };
    let (yc, gc) = on(&cpu());
    let (yg, gg) = on(dev);
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let (a, b) = (a.to_vec().unwrap(), b.to_vec().unwrap());
        assert_eq!(a.len(), b.len(), "{name}: {what} sizes");
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            let tol = 1e-4 + 1e-3 * x.abs().max(y.abs());
            assert!(
                (x - y).abs() <= tol,
                "{name}: {what}[{k}] is {x} on CPU but {y} on wgpu"
            );
        }
    };
    close(&yc, &yg, "output");
    for (i, (a, b)) in gc.iter().zip(&gg).enumerate() {
        close(a, b, &format!("grad of input {i}"));
    }
}

/// Every unary op (`UnaryOp::ALL`, so a new op is covered with no line here) through
/// `Var::unary`, forward and backward, on wgpu against the CPU. Inputs are in [-2, 2), or in
/// [0.5, 2) for an op that is not finite on all of those on the CPU (log, sqrt, ...).
#[test]
fn wgpu_unary_gradients_match_cpu_for_every_op() {
    use wgpipe_autograd::tensor::UnaryOp;
    let Some(dev) = wgpu_device() else { return };
    for op in UnaryOp::ALL {
        // Scalar-carrying ops get a scalar that is not zero (ALL has them zero).
        let op = match op {
            UnaryOp::Affine { .. } => UnaryOp::Affine {
                mul: -1.5,
                add: 0.25,
            },
            UnaryOp::Powf(_) => UnaryOp::Powf(2.5),
            UnaryOp::RDiv(_) => UnaryOp::RDiv(2.0),
            UnaryOp::RSub(_) => UnaryOp::RSub(1.0),
            UnaryOp::MaxScalar(_) => UnaryOp::MaxScalar(0.3),
            UnaryOp::MinScalar(_) => UnaryOp::MinScalar(-0.3),
            UnaryOp::GtScalar(_) => UnaryOp::GtScalar(0.1),
            UnaryOp::EqScalar(_) => UnaryOp::EqScalar(0.5),
            op => op,
        };
        let signed = uniform(&[4, 3], -2.0, 2.0, 120);
        let finite = |t: &Tensor| -> bool {
            let ones = Tensor::ones(t.shape(), t.device()).unwrap();
            let y = t.unary(op).unwrap().to_vec().unwrap();
            let g = t.unary_grad(op, &ones).unwrap().to_vec().unwrap();
            y.iter().chain(&g).all(|v| v.is_finite())
        };
        let x = if finite(&signed) {
            signed
        } else {
            uniform(&[4, 3], 0.5, 2.0, 121)
        };
        same_on_wgpu(op.name(), dev, &[x], move |v| v[0].t()?.unary(op));
    }
}

#[test]
fn wgpu_gradients_match_cpu() {
    let Some(dev) = wgpu_device() else { return };
    eprintln!("gradients on {dev} vs CPU");
    same_on_wgpu(
        "add broadcast",
        dev,
        &[randn(&[2, 3, 4], 90), randn(&[3, 1], 91)],
        |v| v[0].add(&v[1])?.mul(&v[0]),
    );
    same_on_wgpu("unary", dev, &[uniform(&[4, 3], 0.5, 2.0, 92)], |v| {
        v[0].t()?.log()?.add(&v[0].t()?.sqrt()?)?.tanh()?.gelu()
    });
    same_on_wgpu(
        "matmul transposed broadcast",
        dev,
        &[randn(&[2, 4, 3], 93), randn(&[5, 4], 94)],
        |v| v[0].t()?.matmul(&v[1].t()?),
    );
    same_on_wgpu("reductions", dev, &[randn(&[2, 3, 4], 95)], |v| {
        v[0].sum(&[1], true)?
            .add(&v[0].var(&[-1], true)?)?
            .add(&v[0].max(&[0], true)?)
    });
    same_on_wgpu("split", dev, &[randn(&[3, 9], 116)], |v| {
        let p = v[0].split_sizes(&[4, 2, 3], -1)?;
        Var::concat(&[&p[2].exp()?, &p[0].square()?], 1)
    });
    same_on_wgpu("unbind", dev, &[randn(&[3, 4], 117)], |v| {
        let rows = v[0].unbind(0)?;
        rows[2].mul(&rows[0])
    });
    same_on_wgpu("softmax", dev, &[randn(&[3, 5], 96)], |v| {
        v[0].softmax(-1)?.add(&v[0].log_softmax(0)?)
    });
    same_on_wgpu(
        "layer_norm",
        dev,
        &[
            randn(&[3, 5], 97),
            uniform(&[5], 0.5, 1.5, 98),
            randn(&[5], 99),
        ],
        |v| v[0].layer_norm(&v[1], &v[2], 1e-5),
    );
    same_on_wgpu(
        "add_layer_norm and a carried layer-norm gradient",
        dev,
        &[
            randn(&[3, 70], 110),
            randn(&[3, 70], 111),
            uniform(&[70], 0.5, 1.5, 112),
            randn(&[70], 113),
        ],
        |v| {
            let (s, y) = v[0].add_layer_norm(&v[1], &v[2], &v[3], 1e-5)?;
            let z = s.layer_norm(&v[2], &v[3], 1e-5)?;
            y.mul(&s)?.add(&z)
        },
    );
    same_on_wgpu(
        "cross_entropy",
        dev,
        &[uniform(&[5, 70], -3.0, 3.0, 114), randn(&[5], 115)],
        |v| {
            let t = class_ids(5, 70).to_device(v[0].device())?;
            v[0].cross_entropy_rows(&t)?.mul(&v[1])
        },
    );
    same_on_wgpu(
        "conv2d + pools",
        dev,
        &[
            randn(&[1, 2, 6, 6], 100),
            randn(&[3, 2, 3, 3], 101),
            randn(&[3], 102),
        ],
        |v| {
            let y = v[0].conv2d(
                &v[1],
                Some(&v[2]),
                Conv2dParams {
                    padding: (1, 1),
                    ..Default::default()
                },
            )?;
            let p = Pool2dParams {
                kernel: (2, 2),
                stride: (2, 2),
                padding: (0, 0),
            };
            y.max_pool2d(p)?.add(&y.avg_pool2d(p)?)
        },
    );
    let idx = indices(&[4], 3, 103);
    let gidx = indices(&[3, 2], 4, 104);
    same_on_wgpu("index ops", dev, &[randn(&[3, 4], 105)], move |v| {
        let dev = v[0].device();
        let a = v[0]
            .index_select(0, &idx.to_device(dev)?)?
            .sum(&[0], true)?;
        let b = v[0].gather(1, &gidx.to_device(dev)?)?.sum(&[1], true)?;
        a.add(&b)
    });
    let ctx = ForwardCtx::train(1, 2, 3);
    same_on_wgpu("dropout", dev, &[randn(&[4, 8], 106)], move |v| {
        v[0].dropout(0.5, &ctx, 4)
    });
    for op in wgpipe_autograd::tensor::BIAS_ACTIVATIONS {
        let zb = [randn(&[6, 5], 110), randn(&[5], 111)];
        same_on_wgpu(&format!("bias_act {}", op.name()), dev, &zb, move |v| {
            v[0].bias_act(&v[1], op)
        });
    }
    // t = 70: rows longer than the row kernels' workgroup on lavapipe.
    let qkv = [
        randn(&[2, 70, 4], 107),
        randn(&[2, 70, 4], 108),
        randn(&[2, 70, 4], 109),
    ];
    same_on_wgpu("causal_attention", dev, &qkv, |v| {
        v[0].causal_attention(&v[1], &v[2], 1.5, None)
    });
    let mask = ctx
        .dropout_mask(&[2, 70, 70], 0.3, 5, dev)
        .unwrap()
        .unwrap();
    same_on_wgpu("causal_attention with dropout", dev, &qkv, move |v| {
        let m = mask.to_device(v[0].value().device())?;
        v[0].causal_attention(&v[1], &v[2], 0.7, Some(&m))
    });
    // Two heads of 3 over t = 70, packed.
    let packed = [randn(&[2, 70, 18], 112)];
    same_on_wgpu("causal_attention_packed", dev, &packed, |v| {
        v[0].causal_attention_packed(2, 1.5, None)
    });
    let mask = ctx
        .dropout_mask(&[2, 2, 70, 70], 0.3, 6, dev)
        .unwrap()
        .unwrap();
    same_on_wgpu(
        "causal_attention_packed with dropout",
        dev,
        &packed,
        move |v| {
            let m = mask.to_device(v[0].value().device())?;
            v[0].causal_attention_packed(2, 0.7, Some(&m))
        },
    );
}
