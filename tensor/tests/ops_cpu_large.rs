//! Ops on tensors large enough to take the CPU backend's parallel paths (> 32K elements),
//! against the same naive references as the small cases.

mod common;

use common::*;
use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{Device, Tensor};

#[test]
fn large_elementwise_on_strided_and_broadcast_views() {
    let a = Nd::rand(&[300, 257], 1, -2.0, 2.0);
    let b = Nd::rand(&[257], 2, -2.0, 2.0);
    let at = a.tensor_as(1);
    let got = at.mul(&b.tensor()).unwrap();
    assert_nd(
        &got,
        &Nd::from_fn(&a.shape, |i| a.at(i) * b.at(&[i[1]])),
        1e-6,
        0.0,
    );
    let e = a.tensor_as(3).exp().unwrap();
    assert_nd(
        &e,
        &Nd::new(&a.shape, a.data.iter().map(|v| v.exp()).collect()),
        1e-6,
        0.0,
    );
    let c = Nd::rand_index(&[300, 1], 3, 2);
    let w = Tensor::where_cond(&c.tensor(), &at, &b.tensor()).unwrap();
    assert_nd(
        &w,
        &Nd::from_fn(&a.shape, |i| {
            if c.at(&[i[0], 0]) != 0.0 {
                a.at(i)
            } else {
                b.at(&[i[1]])
            }
        }),
        0.0,
        0.0,
    );
    let g = at.gelu_tanh().unwrap().to_vec().unwrap();
    let c0 = (2.0f32 / std::f32::consts::PI).sqrt();
    let want: Vec<f32> = a
        .data
        .iter()
        .map(|&x| 0.5 * x * (1.0 + (c0 * (x + 0.044715 * x * x * x)).tanh()))
        .collect();
    assert_close(&g, &want, 1e-5, 1e-6);
}

#[test]
fn large_reductions_and_softmax() {
    let a = Nd::rand(&[300, 257], 4, -2.0, 2.0);
    for variant in 0..VARIANTS {
        let t = a.tensor_as(variant);
        let s0 = t.sum(&[0], false).unwrap().to_vec().unwrap();
        let want0: Vec<f32> = (0..257)
            .map(|j| (0..300).map(|i| a.at(&[i, j]) as f64).sum::<f64>() as f32)
            .collect();
        assert_close(&s0, &want0, 1e-4, 1e-4);
        let m1 = t.max(&[1], false).unwrap().to_vec().unwrap();
        let want1: Vec<f32> = (0..300)
            .map(|i| (0..257).map(|j| a.at(&[i, j])).fold(f32::MIN, f32::max))
            .collect();
        assert_eq!(m1, want1);
        let am = t.argmin(0, false).unwrap().to_vec().unwrap();
        for (j, &k) in am.iter().enumerate() {
            let col: Vec<f32> = (0..300).map(|i| a.at(&[i, j])).collect();
            let min = col.iter().copied().fold(f32::MAX, f32::min);
            assert_eq!(k as usize, col.iter().position(|&v| v == min).unwrap());
        }
        let total = t.sum_all().unwrap().to_scalar().unwrap();
        let want: f64 = a.data.iter().map(|&v| v as f64).sum();
        assert!((total as f64 - want).abs() < 1e-2, "{total} vs {want}");
        let sm = t.softmax(0).unwrap();
        let col_sums = sm.sum(&[0], false).unwrap().to_vec().unwrap();
        assert_close(&col_sums, &vec![1.0; 257], 1e-5, 1e-5);
        let v = t.var(&[1], true).unwrap();
        assert_eq!(v.shape(), &[300, 1]);
    }
}

#[test]
fn large_matmul_and_layer_norm() {
    let a = Nd::rand(&[2, 130, 140], 5, -1.0, 1.0);
    let b = Nd::rand(&[140, 150], 6, -1.0, 1.0);
    let bt = b.tensor().t().unwrap().contiguous().unwrap().t().unwrap();
    let got = a.tensor_as(1).matmul(&bt).unwrap().to_vec().unwrap();
    for (o, &g) in got.iter().enumerate().step_by(97) {
        let (bi, i, j) = (o / (130 * 150), (o / 150) % 130, o % 150);
        let want: f64 = (0..140)
            .map(|k| a.at(&[bi, i, k]) as f64 * b.at(&[k, j]) as f64)
            .sum();
        assert!((g as f64 - want).abs() < 1e-4, "{o}: {g} vs {want}");
    }
    let x = Nd::rand(&[400, 128], 7, -2.0, 2.0);
    let dev = Device::cpu();
    let (y, mean, rstd) = x
        .tensor_as(2)
        .layer_norm(
            &Tensor::ones(&[128], &dev).unwrap(),
            &Tensor::zeros(&[128], &dev).unwrap(),
            1e-5,
        )
        .unwrap();
    let (yv, mv, rv) = (
        y.to_vec().unwrap(),
        mean.to_vec().unwrap(),
        rstd.to_vec().unwrap(),
    );
    for r in (0..400).step_by(37) {
        let row = &x.data[r * 128..(r + 1) * 128];
        let m = row.iter().map(|&v| v as f64).sum::<f64>() / 128.0;
        let var = row.iter().map(|&v| (v as f64 - m).powi(2)).sum::<f64>() / 128.0;
        assert!((mv[r] as f64 - m).abs() < 1e-5);
        assert!((rv[r] as f64 - 1.0 / (var + 1e-5).sqrt()).abs() < 1e-4);
        assert!(((yv[r * 128] as f64) - (row[0] as f64 - m) / (var + 1e-5).sqrt()).abs() < 1e-4);
    }
}

#[test]
fn large_conv_pool_and_adjoints() {
    let p = Conv2dParams {
        stride: (1, 1),
        padding: (1, 1),
        dilation: (1, 1),
        groups: 2,
    };
    let x = Nd::rand(&[4, 8, 32, 32], 8, -1.0, 1.0).tensor();
    let w = Nd::rand(&[16, 4, 3, 3], 9, -1.0, 1.0).tensor();
    let y = x.conv2d(&w, None, p).unwrap();
    assert_eq!(y.shape(), &[4, 16, 32, 32]);
    // Spot-check one interior and one border output against the direct sum.
    let (xv, wv, yv) = (
        x.to_vec().unwrap(),
        w.to_vec().unwrap(),
        y.to_vec().unwrap(),
    );
    for &(b, co, oy, ox) in &[(1usize, 9usize, 10usize, 17usize), (3, 15, 0, 31)] {
        let g = co / 8;
        let mut acc = 0f64;
        for ci in 0..4 {
            for ky in 0..3 {
                for kx in 0..3 {
                    let (iy, ix) = (oy as isize + ky as isize - 1, ox as isize + kx as isize - 1);
                    if iy < 0 || ix < 0 || iy >= 32 || ix >= 32 {
                        continue;
                    }
                    acc += xv[((b * 8 + g * 4 + ci) * 32 + iy as usize) * 32 + ix as usize] as f64
                        * wv[((co * 4 + ci) * 3 + ky) * 3 + kx] as f64;
                }
            }
        }
        let got = yv[((b * 16 + co) * 32 + oy) * 32 + ox] as f64;
        assert!((got - acc).abs() < 1e-4, "{got} vs {acc}");
    }
    let dy = Nd::rand(y.shape(), 10, -1.0, 1.0).tensor();
    let lhs = dot(&y, &dy);
    let dx = Tensor::conv2d_input_grad(&dy, &w, x.shape(), p).unwrap();
    assert_adjoint(lhs, dot(&x, &dx), abs_dot(&y, &dy));
    let dw = Tensor::conv2d_weight_grad(&x, &dy, w.shape(), p).unwrap();
    assert_adjoint(lhs, dot(&w, &dw), abs_dot(&y, &dy));

    let pp = Pool2dParams {
        kernel: (3, 3),
        stride: (2, 2),
        padding: (1, 1),
    };
    let (ym, am) = x.max_pool2d(pp).unwrap();
    let dym = Nd::rand(ym.shape(), 11, -1.0, 1.0).tensor();
    let dxm = Tensor::max_pool2d_backward(&dym, &am, x.shape(), pp).unwrap();
    assert_adjoint(dot(&ym, &dym), dot(&x, &dxm), abs_dot(&ym, &dym));
    let ya = x.avg_pool2d(pp).unwrap();
    let dxa = Tensor::avg_pool2d_backward(&dym, x.shape(), pp).unwrap();
    assert_adjoint(dot(&ya, &dym), dot(&x, &dxa), abs_dot(&ya, &dym));
}

#[test]
fn large_indexing_and_joins() {
    let x = Nd::rand(&[500, 96], 12, -1.0, 1.0);
    let idx = Nd::rand_index(&[700], 13, 500);
    let sel = x.tensor_as(3).index_select(0, &idx.tensor()).unwrap();
    assert_nd(
        &sel,
        &Nd::from_fn(&[700, 96], |i| x.at(&[idx.data[i[0]] as usize, i[1]])),
        0.0,
        0.0,
    );
    let src = Nd::rand(&[700, 96], 14, -1.0, 1.0).tensor();
    let back = Tensor::index_add(0, &idx.tensor(), &src, 500).unwrap();
    assert_adjoint(
        dot(&sel, &src),
        dot(&x.tensor(), &back),
        abs_dot(&sel, &src),
    );
    let gi = Nd::rand_index(&[500, 96], 15, 96);
    let gat = x.tensor().gather(1, &gi.tensor()).unwrap();
    let sg = Nd::rand(&[500, 96], 16, -1.0, 1.0).tensor();
    let sc = Tensor::scatter_add(1, &gi.tensor(), &sg, 96).unwrap();
    assert_adjoint(dot(&gat, &sg), dot(&x.tensor(), &sc), abs_dot(&gat, &sg));
    let parts = [x.tensor_as(1), x.tensor_as(2)];
    let cat = Tensor::concat(&[&parts[0], &parts[1]], 1).unwrap();
    assert_nd(
        &cat,
        &Nd::from_fn(&[500, 192], |i| x.at(&[i[0], i[1] % 96])),
        0.0,
        0.0,
    );
    let oh = idx.tensor().one_hot(500).unwrap();
    assert_eq!(
        oh.sum(&[1], false).unwrap().to_vec().unwrap(),
        vec![1.0; 700]
    );
    assert_eq!(oh.argmax(1, false).unwrap().to_vec().unwrap(), idx.data);
    let m = Tensor::dropout_mask(&[300, 300], 0.1, 5, 6, &Device::cpu())
        .unwrap()
        .to_vec()
        .unwrap();
    let want: Vec<f32> = (0..90_000)
        .map(|i| wgpipe_tensor::rng::dropout_value(5, 6, i, 0.1))
        .collect();
    assert_eq!(m, want);
}
