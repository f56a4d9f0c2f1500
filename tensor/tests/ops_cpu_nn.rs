//! Softmax, layer norm and dropout masks on the CPU device against naive references.

mod common;

use common::*;
use proptest::prelude::*;
use wgpipe_tensor::{Device, Error, Tensor, UnaryOp};

/// (log-)softmax along `axis` of `x`, in f64.
fn softmax_ref(x: &Nd, axis: usize, log: bool) -> Nd {
    Nd::from_fn(&x.shape, |idx| {
        let lane: Vec<f64> = (0..x.shape[axis])
            .map(|j| {
                let mut i = idx.to_vec();
                i[axis] = j;
                x.at(&i) as f64
            })
            .collect();
        let m = lane.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = lane.iter().map(|v| (v - m).exp()).sum();
        let v = x.at(idx) as f64 - m;
        (if log { v - z.ln() } else { v.exp() / z }) as f32
    })
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn softmax_matches_naive(
        shape in prop::collection::vec(1usize..6, 1..5),
        axis_seed in 0usize..64,
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let axis = axis_seed % shape.len();
        let x = Nd::rand(&shape, seed, -5.0, 5.0);
        let t = x.tensor_as(variant);
        let ax = if axis_seed % 2 == 0 { axis as isize } else { axis as isize - shape.len() as isize };
        assert_nd(&t.softmax(ax).unwrap(), &softmax_ref(&x, axis, false), 1e-5, 1e-6);
        assert_nd(&t.log_softmax(ax).unwrap(), &softmax_ref(&x, axis, true), 1e-5, 1e-5);
    }

    #[test]
    fn layer_norm_matches_naive(
        lead in prop::collection::vec(1usize..4, 0..3),
        d in 1usize..9,
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let mut shape = lead.clone();
        shape.push(d);
        let x = Nd::rand(&shape, seed, -3.0, 3.0);
        let gamma = Nd::rand(&[d], seed + 1, 0.5, 1.5);
        let beta = Nd::rand(&[d], seed + 2, -1.0, 1.0);
        let eps = 1e-5;
        let (y, mean, rstd) = x.tensor_as(variant).layer_norm(&gamma.tensor(), &beta.tensor(), eps).unwrap();
        let rows = x.data.len() / d;
        let mut stat_shape = lead.clone();
        stat_shape.push(1);
        let (mut wy, mut wm, mut wr) = (vec![], vec![], vec![]);
        for r in 0..rows {
            let row: Vec<f64> = x.data[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            let m = row.iter().sum::<f64>() / d as f64;
            let v = row.iter().map(|x| (x - m).powi(2)).sum::<f64>() / d as f64;
            let rs = 1.0 / (v + eps as f64).sqrt();
            for (j, x) in row.iter().enumerate() {
                wy.push(((x - m) * rs * gamma.data[j] as f64 + beta.data[j] as f64) as f32);
            }
            wm.push(m as f32);
            wr.push(rs as f32);
        }
        assert_nd(&y, &Nd::new(&shape, wy), 1e-4, 1e-4);
        assert_nd(&mean, &Nd::new(&stat_shape, wm), 1e-5, 1e-5);
        assert_nd(&rstd, &Nd::new(&stat_shape, wr), 1e-3, 1e-3);
    }
}

/// `[t, t]` with 1 where key `j` lies after query `i`.
fn future(t: usize) -> Tensor {
    let v = (0..t * t)
        .map(|k| if k % t > k / t { 1.0 } else { 0.0 })
        .collect();
    Tensor::from_vec(v, &[t, t], &Device::cpu()).unwrap()
}

/// A NaN among a row's visible scores makes the whole row NaN, its masked entries too, as the
/// chain the fused softmax replaces makes it; the other rows are untouched.
#[test]
fn causal_softmax_spreads_a_nan_as_the_unfused_chain_does() {
    for t in [3, 9, 20] {
        let mut v = Nd::rand(&[t, t], 5, -2.0, 2.0).tensor().to_vec().unwrap();
        v[t + 1] = f32::NAN; // row 1, key 1: visible
        let x = Tensor::from_vec(v, &[t, t], &Device::cpu()).unwrap();
        let got = x.causal_softmax(0.5).unwrap().to_vec().unwrap();
        let chain = x
            .mul_scalar(0.5)
            .unwrap()
            .masked_fill(&future(t), -1e9)
            .unwrap();
        let want = chain.softmax(-1).unwrap().to_vec().unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{t}: {i}"
            );
        }
        assert!(got[t..2 * t].iter().all(|v| v.is_nan()), "{t}: {got:?}");
        assert!(got[..t].iter().all(|v| !v.is_nan()), "{t}: {got:?}");
    }
}

proptest! {
    #![proptest_config(cases(32))]

    /// The fused scaled causal softmax against an f64 reference, and bit for bit against the
    /// chain it replaces in the attention (scale, `-1e9` mask, softmax).
    #[test]
    fn causal_softmax_matches_naive_and_the_unfused_chain(
        batch in prop::collection::vec(1usize..4, 0..3),
        t in 1usize..40,
        variant in 0..VARIANTS,
        scale in 0.05f32..3.0,
        seed in 0u64..1000,
    ) {
        let mut shape = batch.clone();
        shape.extend([t, t]);
        let x = Nd::rand(&shape, seed, -4.0, 4.0);
        let r = shape.len();
        let want = Nd::from_fn(&shape, |idx| {
            let (i, j) = (idx[r - 2], idx[r - 1]);
            if j > i {
                return 0.0;
            }
            let lane = |jj: usize| {
                let mut k = idx.to_vec();
                k[r - 1] = jj;
                scale as f64 * x.at(&k) as f64
            };
            let m = (0..=i).map(lane).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..=i).map(|jj| (lane(jj) - m).exp()).sum();
            ((lane(j) - m).exp() / z) as f32
        });
        let xt = x.tensor_as(variant);
        let got = xt.causal_softmax(scale).unwrap();
        assert_nd(&got, &want, 1e-5, 1e-6);
        let chain = xt.mul_scalar(scale).unwrap().masked_fill(&future(t), -1e9).unwrap().softmax(-1).unwrap();
        prop_assert_eq!(got.to_vec().unwrap(), chain.to_vec().unwrap());
    }

    /// The fused softmax backward against an f64 reference of `scale * y * (g - sum(g * y))`
    /// and against the unfused ops in the same order (mul, sum, sub, mul, mul_scalar).
    #[test]
    fn softmax_backward_matches_naive_and_the_unfused_ops(
        shape in prop::collection::vec(1usize..9, 1..4),
        variant in 0..VARIANTS,
        scale in 0.05f32..3.0,
        seed in 0u64..1000,
    ) {
        let x = Nd::rand(&shape, seed, -4.0, 4.0);
        let g = Nd::rand(&shape, seed ^ 7, -1.0, 1.0);
        let y = x.tensor().softmax(-1).unwrap();
        let yn = Nd::new(&shape, y.to_vec().unwrap());
        let r = shape.len();
        let want = Nd::from_fn(&shape, |idx| {
            let dot: f64 = (0..shape[r - 1])
                .map(|j| {
                    let mut k = idx.to_vec();
                    k[r - 1] = j;
                    g.at(&k) as f64 * yn.at(&k) as f64
                })
                .sum();
            (scale as f64 * yn.at(idx) as f64 * (g.at(idx) as f64 - dot)) as f32
        });
        let gt = g.tensor_as(variant);
        let got = Tensor::softmax_backward(&y, &gt, scale).unwrap();
        assert_nd(&got, &want, 1e-5, 1e-6);
        let dot = gt.mul(&y).unwrap().sum(&[-1], true).unwrap();
        let unfused = y
            .mul(&gt.sub(&dot).unwrap())
            .unwrap()
            .mul_scalar(scale)
            .unwrap();
        prop_assert_eq!(got.to_vec().unwrap(), unfused.to_vec().unwrap());
    }
}

proptest! {
    #![proptest_config(cases(32))]

    /// The fused bias + activation and its backward bit for bit against the unfused ops (add,
    /// then the activation; unary_grad at the sum), and near an f64 reference.
    #[test]
    fn bias_act_matches_the_unfused_ops(
        shape in prop::collection::vec(1usize..9, 1..4),
        variant in 0..VARIANTS,
        which in 0usize..3,
        seed in 0u64..1000,
    ) {
        let op = wgpipe_tensor::BIAS_ACTIVATIONS[which];
        let n = *shape.last().unwrap();
        let z = Nd::rand(&shape, seed, -3.0, 3.0);
        let b = Nd::rand(&[n], seed ^ 3, -1.0, 1.0);
        let g = Nd::rand(&shape, seed ^ 5, -1.0, 1.0);
        let (zt, bt, gt) = (z.tensor_as(variant), b.tensor(), g.tensor_as(variant));
        let y = zt.bias_act(&bt, op).unwrap();
        let pre = zt.add(&bt).unwrap();
        prop_assert_eq!(y.to_vec().unwrap(), pre.unary(op).unwrap().to_vec().unwrap());
        let dz = Tensor::bias_act_grad(&zt, &bt, &gt, op).unwrap();
        let unfused = pre.unary_grad(op, &gt).unwrap();
        prop_assert_eq!(dz.to_vec().unwrap(), unfused.to_vec().unwrap());
        let r = shape.len();
        let want_y = Nd::from_fn(&shape, |i| op.eval(z.at(i) + b.at(&[i[r - 1]])));
        let want_dz = Nd::from_fn(&shape, |i| g.at(i) * op.grad(z.at(i) + b.at(&[i[r - 1]])));
        assert_nd(&y, &want_y, 1e-6, 1e-7);
        assert_nd(&dz, &want_dz, 1e-6, 1e-7);
    }
}

#[test]
fn softmax_is_stable_and_handles_size_one_axes() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(&[1000.0, 0.0, -1000.0, 1000.0], &[2, 2], &dev).unwrap();
    let ls = x.log_softmax(1).unwrap().to_vec().unwrap();
    assert_close(&ls, &[0.0, -1000.0, -2000.0, 0.0], 1e-6, 1e-3);
    let s = x.softmax(1).unwrap().to_vec().unwrap();
    assert_close(&s, &[1.0, 0.0, 0.0, 1.0], 0.0, 1e-6);
    // Along axis 0 of the transposed view the result is a (free) permuted view.
    let s0 = x.t().unwrap().softmax(0).unwrap();
    assert_close(&s0.to_vec().unwrap(), &[1.0, 0.0, 0.0, 1.0], 0.0, 1e-6);
    let one = Tensor::from_slice(&[3.0, -2.0], &[2, 1], &dev).unwrap();
    assert_eq!(one.softmax(1).unwrap().to_vec().unwrap(), vec![1.0, 1.0]);
    assert_eq!(
        one.log_softmax(-1).unwrap().to_vec().unwrap(),
        vec![0.0, 0.0]
    );
    let e = Tensor::zeros(&[0, 3], &dev).unwrap();
    assert_eq!(e.softmax(1).unwrap().shape(), &[0, 3]);
    assert_eq!(
        Tensor::zeros(&[3, 0], &dev)
            .unwrap()
            .log_softmax(1)
            .unwrap()
            .shape(),
        &[3, 0]
    );
}

#[test]
fn layer_norm_shapes_and_empty() {
    let dev = Device::cpu();
    let g = Tensor::ones(&[4], &dev).unwrap();
    let b = Tensor::zeros(&[4], &dev).unwrap();
    let x = Tensor::from_slice(&[1.0, 2.0, 3.0, 4.0], &[1, 4], &dev).unwrap();
    let (y, m, r) = x.layer_norm(&g, &b, 0.0).unwrap();
    assert_eq!(m.to_vec().unwrap(), vec![2.5]);
    assert_eq!(m.shape(), &[1, 1]);
    let s = 1.0 / 1.25f32.sqrt();
    assert_close(&r.to_vec().unwrap(), &[s], 1e-6, 0.0);
    assert_close(
        &y.to_vec().unwrap(),
        &[-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s],
        1e-5,
        1e-6,
    );
    let (y, m, _) = Tensor::zeros(&[0, 2, 4], &dev)
        .unwrap()
        .layer_norm(&g, &b, 1e-5)
        .unwrap();
    assert_eq!((y.shape(), m.shape()), (&[0, 2, 4][..], &[0, 2, 1][..]));
}

#[test]
fn dropout_mask_is_the_counter_based_stream() {
    let dev = Device::new_cpu("dropout");
    let shape = [3, 50];
    let p = 0.3;
    let m = Tensor::dropout_mask(&shape, p, 42, 7, &dev).unwrap();
    assert_eq!(m.shape(), &shape);
    let want: Vec<f32> = (0..150)
        .map(|i| wgpipe_tensor::rng::dropout_value(42, 7, i, p))
        .collect();
    assert_eq!(m.to_vec().unwrap(), want);
    assert!(want.iter().all(|&v| v == 0.0 || v == 1.0 / (1.0 - p)));
    assert!(want.contains(&0.0));
    assert_eq!(
        Tensor::dropout_mask(&shape, p, 42, 7, &dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        want,
        "same key, same mask"
    );
    assert_ne!(
        Tensor::dropout_mask(&shape, p, 42, 8, &dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        want
    );
    assert_eq!(
        Tensor::dropout_mask(&[4], 0.0, 1, 0, &dev)
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![1.0; 4]
    );
    assert_eq!(
        Tensor::dropout_mask(&[0, 4], 0.5, 1, 0, &dev)
            .unwrap()
            .shape(),
        &[0, 4]
    );
}

#[test]
fn nn_errors_name_op_and_shapes() {
    let dev = Device::cpu();
    let x = Tensor::zeros(&[2, 3], &dev).unwrap();
    let bias = Tensor::zeros(&[3], &dev).unwrap();
    let msg = x.bias_act(&bias, UnaryOp::Exp).unwrap_err().to_string();
    assert!(msg.contains("exp") && msg.contains("relu"), "{msg}");
    let msg = x.bias_act(&x, UnaryOp::Relu).unwrap_err().to_string();
    assert!(msg.contains("[2, 3]"), "{msg}");
    let msg = Tensor::bias_act_grad(&x, &bias, &bias, UnaryOp::Relu)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[3]") && msg.contains("[2, 3]"), "{msg}");
    let msg = x.causal_softmax(1.0).unwrap_err().to_string();
    assert!(
        msg.contains("causal_softmax") && msg.contains("[2, 3]"),
        "{msg}"
    );
    let sq = Tensor::zeros(&[3, 3], &dev).unwrap();
    let msg = sq.causal_softmax(f32::NAN).unwrap_err().to_string();
    assert!(msg.contains("scale"), "{msg}");
    let msg = Tensor::softmax_backward(&x, &sq, 1.0)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[3, 3]"), "{msg}");
    assert_err!(
        x.softmax(2),
        Error::Axis {
            op: "softmax",
            axis: 2,
            rank: 2
        },
        "softmax"
    );
    assert_err!(
        x.log_softmax(-3),
        Error::Axis {
            op: "log_softmax",
            ..
        },
        "log_softmax"
    );
    let g = Tensor::ones(&[4], &dev).unwrap();
    let g3 = Tensor::ones(&[3], &dev).unwrap();
    assert_err!(
        x.layer_norm(&g, &g3, 1e-5),
        Error::Shape {
            op: "layer_norm",
            ..
        },
        "layer_norm",
        "[4]",
        "[2, 3]"
    );
    let s = Tensor::scalar(1.0, &dev).unwrap();
    assert_err!(
        s.layer_norm(&g, &g, 1e-5),
        Error::Shape {
            op: "layer_norm",
            ..
        },
        "[]"
    );
    let o = Tensor::ones(&[3], &other_device()).unwrap();
    assert_err!(
        x.layer_norm(&g3, &o, 1e-5),
        Error::DeviceMismatch {
            op: "layer_norm",
            ..
        },
        "other-cpu"
    );
    for p in [1.0, -0.1, f32::NAN] {
        assert_err!(
            Tensor::dropout_mask(&[2], p, 0, 0, &dev),
            Error::Invalid {
                op: "dropout_mask",
                ..
            },
            "dropout_mask",
            "[2]"
        );
    }
}

/// The composed layer-norm input gradient (the ops `Var::layer_norm` used before the fused
/// kernel), plus `carry` as the tape added it.
fn layer_norm_grad_unfused(
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    g: &Tensor,
    carry: Option<&Tensor>,
) -> Tensor {
    let xhat = x.sub(mean).unwrap().mul(rstd).unwrap();
    let gxhat = g.mul(gamma).unwrap();
    let m1 = gxhat.mean(&[-1], true).unwrap();
    let m2 = gxhat.mul(&xhat).unwrap().mean(&[-1], true).unwrap();
    let d = gxhat
        .sub(&m1)
        .unwrap()
        .sub(&xhat.mul(&m2).unwrap())
        .unwrap()
        .mul(rstd)
        .unwrap();
    match carry {
        Some(c) => c.add(&d).unwrap(),
        None => d,
    }
}

proptest! {
    #![proptest_config(cases(32))]

    #[test]
    fn cross_entropy_matches_naive_and_the_unfused_ops(
        n in 1usize..9,
        c in 1usize..40,
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let x = Nd::rand(&[n, c], seed, -6.0, 6.0);
        let t = Nd::rand_index(&[n], seed ^ 9, c);
        let g = Nd::rand(&[n], seed ^ 4, -1.0, 1.0);
        let (xt, tt, gt) = (x.tensor_as(variant), t.tensor(), g.tensor());
        let (loss, max, logsum) = xt.cross_entropy_rows(&tt).unwrap();
        let idx = tt.reshape(&[n, 1]).unwrap();
        let lp = xt.log_softmax(-1).unwrap();
        let unfused = lp.gather(1, &idx).unwrap().neg().unwrap();
        prop_assert_eq!(loss.to_vec().unwrap(), unfused.to_vec().unwrap());
        let dx = Tensor::cross_entropy_backward(&xt, &tt, &max, &logsum, &gt).unwrap();
        // The composed backward: gather's scatter of the log-prob's gradient (-g), then
        // log_softmax's `G - exp(y) * sum(G)`.
        let scattered = Tensor::scatter_add(1, &idx, &gt.neg().unwrap().reshape(&[n, 1]).unwrap(), c)
            .unwrap();
        let s = scattered.sum(&[-1], true).unwrap();
        let composed = scattered.sub(&lp.exp().unwrap().mul(&s).unwrap()).unwrap();
        prop_assert_eq!(dx.to_vec().unwrap(), composed.to_vec().unwrap());
        let p = softmax_ref(&x, 1, false);
        let want_loss = Nd::from_fn(&[n], |i| {
            -softmax_ref(&x, 1, true).at(&[i[0], t.at(i) as usize])
        });
        let want_dx = Nd::from_fn(&[n, c], |i| {
            let hot = if i[1] == t.at(&[i[0]]) as usize { 1.0 } else { 0.0 };
            g.at(&[i[0]]) * (p.at(i) - hot)
        });
        assert_nd(&loss, &want_loss, 1e-5, 1e-5);
        assert_nd(&dx, &want_dx, 1e-5, 1e-6);
    }

    #[test]
    fn add_layer_norm_and_its_backward_match_naive_and_the_unfused_ops(
        shape in prop::collection::vec(1usize..9, 1..4),
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let d = *shape.last().unwrap();
        let x = Nd::rand(&shape, seed, -3.0, 3.0);
        let r = Nd::rand(&shape, seed ^ 1, -3.0, 3.0);
        let gamma = Nd::rand(&[d], seed ^ 2, 0.5, 1.5);
        let beta = Nd::rand(&[d], seed ^ 3, -1.0, 1.0);
        let g = Nd::rand(&shape, seed ^ 4, -1.0, 1.0);
        let carry = Nd::rand(&shape, seed ^ 5, -1.0, 1.0);
        let (xt, rt) = (x.tensor_as(variant), r.tensor_as(variant));
        let (gm, bt, gt, ct) = (gamma.tensor(), beta.tensor(), g.tensor_as(variant), carry.tensor());
        let (s, y, mean, rstd) = xt.add_layer_norm(&rt, &gm, &bt, 1e-5).unwrap();
        let s2 = xt.add(&rt).unwrap();
        let (y2, mean2, rstd2) = s2.layer_norm(&gm, &bt, 1e-5).unwrap();
        for (a, b) in [(&s, &s2), (&y, &y2), (&mean, &mean2), (&rstd, &rstd2)] {
            prop_assert_eq!(a.shape(), b.shape());
            prop_assert_eq!(a.to_vec().unwrap(), b.to_vec().unwrap());
        }
        for carry in [None, Some(&ct)] {
            let dx = Tensor::layer_norm_backward(&s, &mean, &rstd, &gm, &gt, carry).unwrap();
            let unfused = layer_norm_grad_unfused(&s, &mean, &rstd, &gm, &gt, carry);
            prop_assert_eq!(dx.to_vec().unwrap(), unfused.to_vec().unwrap());
        }
        // An f64 reference of the gradient: dx = rstd * (gh - mean(gh) - xhat * mean(gh * xhat)),
        // from the f32 sums the kernel normalises. Rows of nearly equal values are left to the
        // bit-exact comparison above: their f32 statistics carry rounding of |mean| / std times
        // rstd (CI met a row of two values 1e-3 apart: rstd 2000).
        let dx = Tensor::layer_norm_backward(&s, &mean, &rstd, &gm, &gt, Some(&ct)).unwrap();
        let sums = s.to_vec().unwrap();
        let rows = x.data.len() / d;
        let (mut got, mut want) = (Vec::new(), Vec::new());
        let dxv = dx.to_vec().unwrap();
        for row in 0..rows {
            let sv: Vec<f64> = (0..d).map(|j| sums[row * d + j] as f64).collect();
            let mu = sv.iter().sum::<f64>() / d as f64;
            let var = sv.iter().map(|v| (v - mu).powi(2)).sum::<f64>() / d as f64;
            if d > 1 && var < 0.25 * 0.25 {
                continue;
            }
            let rs = 1.0 / (var + 1e-5).sqrt();
            let xh: Vec<f64> = sv.iter().map(|v| (v - mu) * rs).collect();
            let gh: Vec<f64> = (0..d).map(|j| (g.data[row * d + j] * gamma.data[j]) as f64).collect();
            let m1 = gh.iter().sum::<f64>() / d as f64;
            let m2 = gh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d as f64;
            for j in 0..d {
                let v = rs * (gh[j] - m1 - xh[j] * m2) + carry.data[row * d + j] as f64;
                want.push(v as f32);
                got.push(dxv[row * d + j]);
            }
        }
        assert_close(&got, &want, 1e-4, 1e-4);
    }
}

#[test]
fn fused_loss_and_norm_errors_name_op_and_shapes() {
    let dev = Device::cpu();
    let x = Tensor::zeros(&[2, 3], &dev).unwrap();
    let err = |r: Result<_, Error>| r.err().map(|e| e.to_string()).unwrap_or_default();
    let bad_t = Tensor::from_slice(&[0.0, 3.0], &[2], &dev).unwrap();
    let e = err(x.cross_entropy_rows(&bad_t).map(|_| ()));
    assert!(e.contains("cross_entropy") && e.contains("index 3"), "{e}");
    let short = Tensor::zeros(&[3], &dev).unwrap();
    let e = err(x.cross_entropy_rows(&short).map(|_| ()));
    assert!(e.contains("[2, 3]") && e.contains("[3]"), "{e}");
    let ones = Tensor::ones(&[3], &dev).unwrap();
    let e = err(x
        .add_layer_norm(&Tensor::zeros(&[3, 2], &dev).unwrap(), &ones, &ones, 1e-5)
        .map(|_| ()));
    assert!(e.contains("add_layer_norm") && e.contains("[3, 2]"), "{e}");
    let e = err(x
        .add_layer_norm(&x, &short.reshape(&[1, 3]).unwrap(), &ones, 1e-5)
        .map(|_| ()));
    assert!(e.contains("gamma"), "{e}");
}

/// Inputs big enough to be cut into row chunks run on several threads (when there are several):
/// the same bits as the unfused ops.
#[test]
fn fused_loss_and_norm_split_over_threads_match_the_unfused_ops() {
    let (n, d) = (300, 200);
    let x = Nd::rand(&[n, d], 1, -4.0, 4.0).tensor();
    let r = Nd::rand(&[n, d], 2, -4.0, 4.0).tensor();
    let gamma = Nd::rand(&[d], 3, 0.5, 1.5).tensor();
    let beta = Nd::rand(&[d], 4, -1.0, 1.0).tensor();
    let (s, y, mean, rstd) = x.add_layer_norm(&r, &gamma, &beta, 1e-5).unwrap();
    let s2 = x.add(&r).unwrap();
    let (y2, mean2, rstd2) = s2.layer_norm(&gamma, &beta, 1e-5).unwrap();
    for (a, b) in [(&s, &s2), (&y, &y2), (&mean, &mean2), (&rstd, &rstd2)] {
        assert_eq!(a.to_vec().unwrap(), b.to_vec().unwrap());
    }
    let t = Nd::rand_index(&[n], 5, d).tensor();
    let (loss, _, _) = x.cross_entropy_rows(&t).unwrap();
    let lp = x.log_softmax(-1).unwrap();
    let unfused = lp
        .gather(1, &t.reshape(&[n, 1]).unwrap())
        .unwrap()
        .neg()
        .unwrap();
    assert_eq!(loss.to_vec().unwrap(), unfused.to_vec().unwrap());
}

/// Causal attention composed of the ops the one-kernel path replaces: `(y, p, [gq, gk, gv])`.
fn composed_attention([q, k, v, g]: [&Tensor; 4], scale: f32) -> (Tensor, Tensor, [Tensor; 3]) {
    let p = q
        .matmul(&k.t().unwrap())
        .unwrap()
        .causal_softmax(scale)
        .unwrap();
    let y = p.matmul(v).unwrap();
    let gp = g.matmul(&v.t().unwrap()).unwrap();
    let gs = Tensor::softmax_backward(&p, &gp, scale).unwrap();
    let gq = gs.matmul(k).unwrap();
    let gk = gs.t().unwrap().matmul(q).unwrap();
    let gv = p.t().unwrap().matmul(g).unwrap();
    (y, p, [gq, gk, gv])
}

/// Each output of the one-kernel attention against the composed ops, to rounding.
fn assert_attention_matches_composed(ops: [&Tensor; 4], scale: f32) {
    let [q, k, v, g] = ops;
    let (y, p) = q.causal_attention(k, v, scale).unwrap();
    let grads = q.causal_attention_backward(k, v, &p, g, scale).unwrap();
    let (y0, p0, grads0) = composed_attention(ops, scale);
    let got = [&y, &p, &grads[0], &grads[1], &grads[2]];
    let want = [&y0, &p0, &grads0[0], &grads0[1], &grads0[2]];
    for (name, (got, want)) in ["y", "p", "gq", "gk", "gv"]
        .iter()
        .zip(got.iter().zip(want))
    {
        assert_eq!(got.shape(), want.shape(), "{name}");
        let (got, want) = (got.to_vec().unwrap(), want.to_vec().unwrap());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                "{name} of q {:?}: element {i} is {a}, composed {b}",
                q.shape()
            );
        }
    }
}

proptest! {
    #![proptest_config(cases(32))]

    /// The one-kernel causal attention (forward and backward) against the ops it replaces, on
    /// every layout the operands may come in (strided rows, reversed strides, offsets).
    #[test]
    fn causal_attention_matches_the_composed_ops(
        batch in prop::collection::vec(1usize..4, 0..3),
        t in 1usize..40,
        dh in 1usize..40,
        variant in 0..VARIANTS,
        scale in 0.05f32..1.0,
        seed in 0u64..1000,
    ) {
        let mut shape = batch.clone();
        shape.extend([t, dh]);
        let x: Vec<Tensor> = (0..4)
            .map(|i| Nd::rand(&shape, seed + i, -2.0, 2.0).tensor_as(variant + i as u8))
            .collect();
        assert_attention_matches_composed([&x[0], &x[1], &x[2], &x[3]], scale);
    }
}

/// Heads split out of rows and permuted (`[B, T, H, dh]` viewed as `[B, H, T, dh]`, two batch
/// strides), as attention layers hand them over, at the main job's and a decoder block's sizes;
/// the output and the gradients come back in the operands' layout, so that merging the heads
/// back into rows (`permute(0, 2, 1, 3)`, `reshape`) is a view, not a copy.
#[test]
fn causal_attention_takes_permuted_heads_in_place() {
    let fused = std::env::var("WGPIPE_CPU_ATTENTION").as_deref() != Ok("composed");
    for (b, t, h, dh) in [(2, 64, 4, 16), (1, 128, 2, 64), (3, 5, 3, 7)] {
        let heads = |seed| {
            Nd::rand(&[b, t, h, dh], seed, -2.0, 2.0)
                .tensor()
                .permute(&[0, 2, 1, 3])
                .unwrap()
        };
        let x = [heads(1), heads(2), heads(3), heads(4)];
        assert_attention_matches_composed([&x[0], &x[1], &x[2], &x[3]], 0.25);
        if !fused {
            eprintln!("skipped the layout checks: WGPIPE_CPU_ATTENTION=composed");
            continue;
        }
        let (y, p) = x[0].causal_attention(&x[1], &x[2], 0.25).unwrap();
        let grads = x[0]
            .causal_attention_backward(&x[1], &x[2], &p, &x[3], 0.25)
            .unwrap();
        for (name, out) in ["y", "gq", "gk", "gv"]
            .iter()
            .zip([&y, &grads[0], &grads[1], &grads[2]])
        {
            let rows = out.permute(&[0, 2, 1, 3]).unwrap();
            assert!(
                rows.is_contiguous(),
                "{name} {:?}: strides {:?}, not [B, T, H, dh] rows",
                out.shape(),
                out.strides()
            );
        }
    }
}

#[test]
fn causal_attention_names_bad_shapes() {
    let dev = Device::cpu();
    let q = Tensor::zeros(&[2, 5, 4], &dev).unwrap();
    let k = Tensor::zeros(&[2, 5, 3], &dev).unwrap();
    let msg = q.causal_attention(&k, &q, 1.0).unwrap_err().to_string();
    assert!(
        msg.contains("[2, 5, 4]") && msg.contains("[2, 5, 3]"),
        "{msg}"
    );
    let p = Tensor::zeros(&[2, 5, 4], &dev).unwrap();
    let msg = q
        .causal_attention_backward(&q, &q, &p, &q, 1.0)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("p [2, 5, 4] must be [2, 5, 5]"), "{msg}");
    let msg = q
        .causal_attention(&q, &q, f32::NAN)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("scale must be finite"), "{msg}");
}
