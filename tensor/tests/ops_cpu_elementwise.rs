//! Elementwise ops on the CPU device against naive references.

mod common;

use common::gelu_ref::*;
use common::*;
use proptest::prelude::*;
use wgpipe_tensor::{BinaryOp, Device, Error, Tensor, UnaryOp};

/// A unary method, e.g. `Tensor::exp`.
type UnaryFn = fn(&Tensor) -> wgpipe_tensor::Result<Tensor>;
/// A unary method and its scalar reference.
type UnaryCase = (&'static str, UnaryFn, fn(f32) -> f32);
/// A scalar op's result and its scalar reference.
type ScalarCase = (&'static str, Tensor, Box<dyn Fn(f32) -> f32>);
/// A binary method, e.g. `Tensor::add`.
type BinaryFn = fn(&Tensor, &Tensor) -> wgpipe_tensor::Result<Tensor>;

/// Every unary method with its scalar reference.
fn unary_cases() -> Vec<UnaryCase> {
    vec![
        ("neg", Tensor::neg, |x| -x),
        ("exp", Tensor::exp, f32::exp),
        ("abs", Tensor::abs, f32::abs),
        ("sign", Tensor::sign, |x| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }),
        ("tanh", Tensor::tanh, f32::tanh),
        ("sigmoid", Tensor::sigmoid, |x| 1.0 / (1.0 + (-x).exp())),
        ("relu", Tensor::relu, |x| x.max(0.0)),
        ("gelu", Tensor::gelu, gelu_exact_ref),
        ("gelu_grad", Tensor::gelu_grad, gelu_exact_grad_ref),
        ("gelu_tanh", Tensor::gelu_tanh, gelu_tanh),
        ("gelu_tanh_grad", Tensor::gelu_tanh_grad, gelu_tanh_grad),
        ("sin", Tensor::sin, f32::sin),
        ("cos", Tensor::cos, f32::cos),
        ("square", Tensor::square, |x| x * x),
        ("recip", Tensor::recip, |x| 1.0 / x),
    ]
}

#[test]
fn unary_ops_match_scalar_functions_on_every_layout() {
    let x = Nd::rand(&[3, 4, 5], 1, -3.0, 3.0);
    for (name, f, r) in unary_cases() {
        let want = Nd::new(&x.shape, x.data.iter().map(|&v| r(v)).collect());
        for variant in 0..VARIANTS {
            let got = f(&x.tensor_as(variant)).unwrap();
            assert!(got.is_contiguous(), "{name}");
            assert_eq!(got.shape(), &x.shape[..], "{name}");
            let g = got.to_vec().unwrap();
            for (i, (&a, &b)) in g.iter().zip(&want.data).enumerate() {
                assert!(
                    close(a, b, 1e-5, 1e-6),
                    "{name} variant {variant} elem {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn positive_domain_unary_ops() {
    let x = Nd::rand(&[2, 7], 2, 0.1, 4.0);
    let cases: [UnaryCase; 3] = [
        ("log", Tensor::log, f32::ln),
        ("sqrt", Tensor::sqrt, f32::sqrt),
        ("rsqrt", Tensor::rsqrt, |x| 1.0 / x.sqrt()),
    ];
    for (name, f, r) in cases {
        let want = Nd::new(&x.shape, x.data.iter().map(|&v| r(v)).collect());
        for variant in 0..VARIANTS {
            let got = f(&x.tensor_as(variant)).unwrap();
            assert!(
                got.to_vec()
                    .unwrap()
                    .iter()
                    .zip(&want.data)
                    .all(|(&a, &b)| close(a, b, 1e-5, 1e-6)),
                "{name} variant {variant}"
            );
        }
    }
}

#[test]
fn unary_special_values() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[0.0, -0.0, 1.0, -2.0], &[4], &dev).unwrap();
    assert_eq!(x.sign().unwrap().to_vec().unwrap()[..2], [0.0, 0.0]);
    assert_eq!(
        x.relu().unwrap().to_vec().unwrap(),
        vec![0.0, 0.0, 1.0, 0.0]
    );
    let big = Tensor::from_slice(&[-100.0, 100.0], &[2], &dev).unwrap();
    assert_eq!(big.sigmoid().unwrap().to_vec().unwrap(), vec![0.0, 1.0]);
    assert_eq!(big.tanh().unwrap().to_vec().unwrap(), vec![-1.0, 1.0]);
    let l = Tensor::from_slice(&[0.0], &[1], &dev)
        .unwrap()
        .log()
        .unwrap();
    assert_eq!(l.to_vec().unwrap(), vec![f32::NEG_INFINITY]);
    assert_eq!(
        Tensor::from_slice(&[0.0], &[1], &dev)
            .unwrap()
            .recip()
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![f32::INFINITY]
    );
    // Negative bases with integral exponents stay real (as powf does).
    let n = Tensor::from_slice(&[-2.0, -3.0], &[2], &dev).unwrap();
    assert_eq!(n.powf(2.0).unwrap().to_vec().unwrap(), vec![4.0, 9.0]);
    assert_eq!(n.powf(3.0).unwrap().to_vec().unwrap(), vec![-8.0, -27.0]);
    let e = Tensor::from_slice(&[3.0, 2.0], &[2], &dev).unwrap();
    assert_eq!(n.pow(&e).unwrap().to_vec().unwrap(), vec![-8.0, 9.0]);
}

#[test]
fn selection_does_not_leak_the_unselected_branch() {
    let dev = Device::cpu();
    let c = Tensor::from_slice(&[1.0, 0.0, 1.0], &[3], &dev).unwrap();
    let a = Tensor::from_slice(&[1.0, f32::NAN, f32::INFINITY], &[3], &dev).unwrap();
    let b = Tensor::from_slice(&[f32::NAN, 2.0, f32::NEG_INFINITY], &[3], &dev).unwrap();
    let w = Tensor::where_cond(&c, &a, &b).unwrap().to_vec().unwrap();
    assert_eq!(w, vec![1.0, 2.0, f32::INFINITY]);
    // Attention-style mask: -inf exactly where masked, the rest untouched.
    let x = Tensor::from_slice(&[0.5, -1.0, 2.0], &[3], &dev).unwrap();
    let y = x
        .masked_fill(&c, f32::NEG_INFINITY)
        .unwrap()
        .to_vec()
        .unwrap();
    assert_eq!(y, vec![f32::NEG_INFINITY, -1.0, f32::NEG_INFINITY]);
    let s = Tensor::from_slice(&[0.0, f32::NEG_INFINITY, 0.0], &[1, 3], &dev).unwrap();
    assert_eq!(s.softmax(1).unwrap().to_vec().unwrap(), vec![0.5, 0.0, 0.5]);
    let ls = s.log_softmax(1).unwrap().to_vec().unwrap();
    assert_eq!(ls[1], f32::NEG_INFINITY);
    assert!((ls[0] + std::f32::consts::LN_2).abs() < 1e-6);
    assert_eq!(s.max(&[1], false).unwrap().to_vec().unwrap(), vec![0.0]);
    let all = Tensor::full(&[2], f32::NEG_INFINITY, &dev).unwrap();
    assert_eq!(
        all.max(&[], false).unwrap().to_scalar().unwrap(),
        f32::NEG_INFINITY
    );
    assert_eq!(all.argmax(0, false).unwrap().to_scalar().unwrap(), 0.0);
}

#[test]
fn scalar_ops() {
    let x = Nd::rand(&[4, 3], 3, 0.5, 2.0);
    let t = x.tensor_as(1);
    let cases: Vec<ScalarCase> = vec![
        (
            "add_scalar",
            t.add_scalar(1.5).unwrap(),
            Box::new(|v| v + 1.5),
        ),
        (
            "sub_scalar",
            t.sub_scalar(1.5).unwrap(),
            Box::new(|v| v - 1.5),
        ),
        (
            "mul_scalar",
            t.mul_scalar(-2.0).unwrap(),
            Box::new(|v| v * -2.0),
        ),
        (
            "div_scalar",
            t.div_scalar(4.0).unwrap(),
            Box::new(|v| v / 4.0),
        ),
        ("powf", t.powf(2.5).unwrap(), Box::new(|v| v.powf(2.5))),
        (
            "maximum_scalar",
            t.maximum_scalar(1.0).unwrap(),
            Box::new(|v| v.max(1.0)),
        ),
        (
            "minimum_scalar",
            t.minimum_scalar(1.0).unwrap(),
            Box::new(|v| v.min(1.0)),
        ),
        (
            "affine",
            t.affine(3.0, -1.0).unwrap(),
            Box::new(|v| v * 3.0 - 1.0),
        ),
        (
            "rsub_scalar",
            t.rsub_scalar(1.0).unwrap(),
            Box::new(|v| 1.0 - v),
        ),
        (
            "rdiv_scalar",
            t.rdiv_scalar(2.0).unwrap(),
            Box::new(|v| 2.0 / v),
        ),
        (
            "gt_scalar",
            t.gt_scalar(1.0).unwrap(),
            Box::new(|v| (v > 1.0) as u8 as f32),
        ),
        (
            "unary(Affine)",
            t.unary(UnaryOp::Affine { mul: 2.0, add: 1.0 }).unwrap(),
            Box::new(|v| 2.0 * v + 1.0),
        ),
    ];
    for (name, got, r) in cases {
        let want: Vec<f32> = x.data.iter().map(|&v| r(v)).collect();
        let g = got.to_vec().unwrap();
        assert!(
            g.iter().zip(&want).all(|(&a, &b)| close(a, b, 1e-5, 1e-6)),
            "{name}: {g:?} vs {want:?}"
        );
    }
    let e = Tensor::from_slice(&[1.0, 2.0, 2.0, 3.0], &[4], &Device::cpu()).unwrap();
    assert_eq!(
        e.eq_scalar(2.0).unwrap().to_vec().unwrap(),
        vec![0.0, 1.0, 1.0, 0.0]
    );
    assert_eq!(
        e.gt_scalar(2.0).unwrap().to_vec().unwrap(),
        vec![0.0, 0.0, 0.0, 1.0]
    );
}

#[test]
fn silu_values() {
    let d = Device::cpu();
    let x = Tensor::from_vec(vec![-2.0, 0.0, 1.0, 3.0], &[4], &d).unwrap();
    let y = x.silu().unwrap().to_vec().unwrap();
    let want = [-0.238_405_84, 0.0, 0.731_058_6, 2.857_722_7];
    for (a, b) in y.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{y:?}");
    }
}

fn binary_ref(op: BinaryOp, a: f32, b: f32) -> f32 {
    let f = |c: bool| c as u8 as f32;
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Maximum => a.max(b),
        BinaryOp::Minimum => a.min(b),
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Eq => f(a == b),
        BinaryOp::Ne => f(a != b),
        BinaryOp::Lt => f(a < b),
        BinaryOp::Le => f(a <= b),
        BinaryOp::Gt => f(a > b),
        BinaryOp::Ge => f(a >= b),
    }
}

/// Broadcast output shape and the two operand shapes derived from it.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<usize>)> {
    (
        prop::collection::vec((0usize..4, any::<bool>(), any::<bool>()), 0..5),
        0usize..5,
        0usize..5,
    )
        .prop_map(|(axes, drop_a, drop_b)| {
            let mk = |drop: usize, pick: &dyn Fn(&(usize, bool, bool)) -> bool| -> Vec<usize> {
                axes.iter()
                    .skip(drop.min(axes.len()))
                    .map(|a| if pick(a) { 1 } else { a.0 })
                    .collect()
            };
            let a = mk(drop_a, &|a| a.1);
            let b = mk(drop_b, &|a| a.2);
            (broadcast(&a, &b), a, b)
        })
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn binary_broadcast_matches_naive(
        (out, sa, sb) in broadcast_pair(),
        op_i in 0usize..13,
        va in 0..VARIANTS,
        vb in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let op = BinaryOp::ALL[op_i];
        // Positive bases keep pow real; rounding to halves makes the comparisons see ties.
        let a = Nd::rand(&sa, seed, 0.5, 3.0);
        let a = Nd::new(&sa, a.data.iter().map(|v| (v * 2.0).round() / 2.0).collect());
        let b = Nd::rand(&sb, seed + 1, 0.5, 3.0);
        let b = Nd::new(&sb, b.data.iter().map(|v| (v * 2.0).round() / 2.0).collect());
        let got = a.tensor_as(va).binary(op, &b.tensor_as(vb)).unwrap();
        let want = Nd::from_fn(&out, |i| binary_ref(op, a.at_broadcast(i), b.at_broadcast(i)));
        assert_nd(&got, &want, 1e-5, 1e-6);
    }

    #[test]
    fn unary_on_broadcast_views((out, sa, _sb) in broadcast_pair(), seed in 0u64..1000) {
        let a = Nd::rand(&sa, seed, -2.0, 2.0);
        let view = a.tensor().broadcast_to(&out).unwrap();
        let got = view.exp().unwrap();
        let want = Nd::from_fn(&out, |i| a.at_broadcast(i).exp());
        assert_nd(&got, &want, 1e-6, 0.0);
    }

    #[test]
    fn where_cond_broadcasts_three_ways(
        (out, sa, sb) in broadcast_pair(),
        seed in 0u64..1000,
        vc in 0..VARIANTS,
    ) {
        let c = Nd::rand_index(&out, seed, 2);
        let a = Nd::rand(&sa, seed + 1, -1.0, 1.0);
        let b = Nd::rand(&sb, seed + 2, -1.0, 1.0);
        let got = Tensor::where_cond(&c.tensor_as(vc), &a.tensor(), &b.tensor()).unwrap();
        let want = Nd::from_fn(&out, |i| if c.at(i) != 0.0 { a.at_broadcast(i) } else { b.at_broadcast(i) });
        assert_nd(&got, &want, 0.0, 0.0);
    }
}

#[test]
fn named_binary_methods_are_the_ops() {
    let a = Nd::rand(&[2, 3], 5, 1.0, 2.0).tensor();
    let b = Nd::rand(&[3], 6, 1.0, 2.0).tensor();
    let methods: [(BinaryOp, BinaryFn); 13] = [
        (BinaryOp::Add, Tensor::add),
        (BinaryOp::Sub, Tensor::sub),
        (BinaryOp::Mul, Tensor::mul),
        (BinaryOp::Div, Tensor::div),
        (BinaryOp::Maximum, Tensor::maximum),
        (BinaryOp::Minimum, Tensor::minimum),
        (BinaryOp::Pow, Tensor::pow),
        (BinaryOp::Eq, Tensor::eq),
        (BinaryOp::Ne, Tensor::ne),
        (BinaryOp::Lt, Tensor::lt),
        (BinaryOp::Le, Tensor::le),
        (BinaryOp::Gt, Tensor::gt),
        (BinaryOp::Ge, Tensor::ge),
    ];
    for (op, f) in methods {
        assert_eq!(
            f(&a, &b).unwrap().to_vec().unwrap(),
            a.binary(op, &b).unwrap().to_vec().unwrap(),
            "{op:?}"
        );
    }
}

#[test]
fn masked_fill_puts_value_where_mask_is_nonzero() {
    let dev = Device::cpu();
    let x = Tensor::arange(0.0, 6.0, 1.0, &dev)
        .unwrap()
        .reshape(&[2, 3])
        .unwrap();
    let mask = Tensor::from_slice(&[1.0, 0.0, 2.0], &[3], &dev).unwrap();
    let y = x.masked_fill(&mask, -1e9).unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![-1e9, 1.0, -1e9, -1e9, 4.0, -1e9]);
    // A causal mask on a transposed view.
    let m = Tensor::from_slice(&[0.0, 1.0, 0.0, 0.0], &[2, 2], &dev).unwrap();
    let y = Tensor::ones(&[2, 2], &dev)
        .unwrap()
        .masked_fill(&m.t().unwrap(), 0.0)
        .unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![1.0, 1.0, 0.0, 1.0]);
}

#[test]
fn empty_and_size_one_dims() {
    let dev = Device::cpu();
    let e = Tensor::zeros(&[0, 3], &dev).unwrap();
    let r = Tensor::ones(&[1, 3], &dev).unwrap();
    assert_eq!(e.add(&r).unwrap().shape(), &[0, 3]);
    assert_eq!(e.exp().unwrap().shape(), &[0, 3]);
    assert_eq!(e.mul_scalar(2.0).unwrap().numel(), 0);
    let c = Tensor::ones(&[4, 1], &dev).unwrap();
    assert_eq!(
        c.add(&Tensor::zeros(&[0], &dev).unwrap()).unwrap().shape(),
        &[4, 0]
    );
    assert_eq!(Tensor::where_cond(&e, &r, &r).unwrap().shape(), &[0, 3]);
    let s = Tensor::scalar(2.0, &dev).unwrap();
    let y = s.mul(&r).unwrap();
    assert_eq!(y.shape(), &[1, 3]);
    assert_eq!(y.to_vec().unwrap(), vec![2.0; 3]);
    assert_eq!(s.add(&s).unwrap().shape(), &[] as &[usize]);
}

#[test]
fn elementwise_flops_are_counted() {
    let dev = Device::new_cpu("flops");
    let a = Tensor::ones(&[4, 5], &dev).unwrap();
    let b = Tensor::ones(&[5], &dev).unwrap();
    let f0 = dev.flops();
    a.add(&b).unwrap();
    assert_eq!(dev.flops() - f0, 20);
    a.exp().unwrap();
    assert_eq!(dev.flops() - f0, 40);
}

#[test]
fn elementwise_errors_name_op_and_shapes() {
    let dev = Device::cpu();
    let a = Tensor::zeros(&[2, 3], &dev).unwrap();
    let b = Tensor::zeros(&[4], &dev).unwrap();
    assert_err!(
        a.add(&b),
        Error::Shape { op: "add", .. },
        "add",
        "[2, 3]",
        "[4]"
    );
    assert_err!(
        a.pow(&b),
        Error::Shape { op: "pow", .. },
        "pow",
        "[2, 3]",
        "[4]"
    );
    assert_err!(
        a.ge(&b),
        Error::Shape { op: "ge", .. },
        "ge",
        "[2, 3]",
        "[4]"
    );
    assert_err!(
        Tensor::where_cond(&a, &a, &b),
        Error::Shape {
            op: "where_cond",
            ..
        },
        "where_cond",
        "[2, 3]",
        "[4]"
    );
    assert_err!(
        a.masked_fill(&b, 0.0),
        Error::Shape {
            op: "masked_fill",
            ..
        },
        "masked_fill",
        "[4]"
    );
    let o = Tensor::zeros(&[2, 3], &other_device()).unwrap();
    assert_err!(
        a.mul(&o),
        Error::DeviceMismatch { op: "mul", .. },
        "mul",
        "other-cpu"
    );
    assert_err!(
        Tensor::where_cond(&a, &o, &a),
        Error::DeviceMismatch {
            op: "where_cond",
            ..
        },
        "other-cpu"
    );
    assert_err!(
        a.masked_fill(&o, 1.0),
        Error::DeviceMismatch {
            op: "masked_fill",
            ..
        },
        "other-cpu"
    );
}

/// `mul_scalar` and `div_scalar` are the rounded product and nothing else: a -0.0 product stays
/// -0.0, as `x * s` on the host (what a bit-exact reduction compares with).
#[test]
fn scalar_products_keep_the_sign_of_zero() {
    let dev = Device::cpu();
    let xs = [-0.0f32, 0.0, -1.5, 3.0e-39, f32::MIN_POSITIVE, 7.0];
    let x = Tensor::from_vec(xs.to_vec(), &[6], &dev).unwrap();
    for s in [0.5f32, 2.0, -0.25, 0.0] {
        let got = x.mul_scalar(s).unwrap().to_vec().unwrap();
        let want: Vec<u32> = xs.iter().map(|v| (v * s).to_bits()).collect();
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "x * {s}");
        let got = x.div_scalar(4.0).unwrap().to_vec().unwrap();
        let want: Vec<u32> = xs.iter().map(|v| (v * 0.25).to_bits()).collect();
        let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "x / 4");
    }
}
