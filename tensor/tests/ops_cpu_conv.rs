//! Convolution and pooling on the CPU device: forward against naive direct loops, adjoints by
//! the identity <A x, y> = <x, A^T y>.

mod common;

use common::*;
use proptest::prelude::*;
use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{Device, Error, Tensor};

/// Direct convolution, NCHW, weight `[c_out, c_in/g, kh, kw]`.
fn conv_ref(x: &Nd, w: &Nd, bias: Option<&Nd>, p: Conv2dParams) -> Nd {
    let (n, c_in, h, wd) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let (c_out, cig, kh, kw) = (w.shape[0], w.shape[1], w.shape[2], w.shape[3]);
    let cog = c_out / p.groups;
    let ho = (h + 2 * p.padding.0 - p.dilation.0 * (kh - 1) - 1) / p.stride.0 + 1;
    let wo = (wd + 2 * p.padding.1 - p.dilation.1 * (kw - 1) - 1) / p.stride.1 + 1;
    assert_eq!(cig * p.groups, c_in);
    Nd::from_fn(&[n, c_out, ho, wo], |i| {
        let (b, co, oy, ox) = (i[0], i[1], i[2], i[3]);
        let g = co / cog;
        let mut acc = bias.map_or(0.0, |b| b.data[co] as f64);
        for ci in 0..cig {
            for ky in 0..kh {
                for kx in 0..kw {
                    let iy = (oy * p.stride.0 + ky * p.dilation.0) as isize - p.padding.0 as isize;
                    let ix = (ox * p.stride.1 + kx * p.dilation.1) as isize - p.padding.1 as isize;
                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                        continue;
                    }
                    acc += x.at(&[b, g * cig + ci, iy as usize, ix as usize]) as f64
                        * w.at(&[co, ci, ky, kx]) as f64;
                }
            }
        }
        acc as f32
    })
}

#[derive(Debug, Clone)]
struct ConvCase {
    n: usize,
    groups: usize,
    cig: usize,
    cog: usize,
    h: usize,
    w: usize,
    k: (usize, usize),
    p: Conv2dParams,
}

fn conv_case() -> impl Strategy<Value = ConvCase> {
    (
        (1usize..3, 1usize..4, 1usize..3, 1usize..3),
        (1usize..8, 1usize..8, 1usize..4, 1usize..4),
        (
            (1usize..3, 1usize..3),
            (0usize..3, 0usize..3),
            (1usize..3, 1usize..3),
        ),
    )
        .prop_map(
            |((n, groups, cig, cog), (h, w, kh, kw), (stride, padding, dilation))| ConvCase {
                n,
                groups,
                cig,
                cog,
                h,
                w,
                k: (kh, kw),
                p: Conv2dParams {
                    stride,
                    padding,
                    dilation,
                    groups,
                },
            },
        )
        .prop_filter("kernel must fit", |c| {
            c.h + 2 * c.p.padding.0 > c.p.dilation.0 * (c.k.0 - 1)
                && c.w + 2 * c.p.padding.1 > c.p.dilation.1 * (c.k.1 - 1)
        })
}

impl ConvCase {
    fn x_shape(&self) -> Vec<usize> {
        vec![self.n, self.groups * self.cig, self.h, self.w]
    }
    fn w_shape(&self) -> Vec<usize> {
        vec![self.groups * self.cog, self.cig, self.k.0, self.k.1]
    }
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn conv2d_matches_direct_convolution(
        c in conv_case(),
        with_bias in any::<bool>(),
        (vx, vw) in (0..VARIANTS, 0..VARIANTS),
        seed in 0u64..1000,
    ) {
        let x = Nd::rand(&c.x_shape(), seed, -1.0, 1.0);
        let w = Nd::rand(&c.w_shape(), seed + 1, -1.0, 1.0);
        let b = Nd::rand(&[c.groups * c.cog], seed + 2, -1.0, 1.0);
        let bt = b.tensor();
        let y = x.tensor_as(vx).conv2d(&w.tensor_as(vw), with_bias.then_some(&bt), c.p).unwrap();
        assert_nd(&y, &conv_ref(&x, &w, with_bias.then_some(&b), c.p), 1e-4, 1e-5);
    }

    #[test]
    fn conv2d_adjoints(c in conv_case(), seed in 0u64..1000) {
        let x = Nd::rand(&c.x_shape(), seed, -1.0, 1.0).tensor();
        let w = Nd::rand(&c.w_shape(), seed + 1, -1.0, 1.0).tensor();
        let y = x.conv2d(&w, None, c.p).unwrap();
        let dy = Nd::rand(y.shape(), seed + 2, -1.0, 1.0).tensor_as((seed % 4) as u8);
        let lhs = dot(&y, &dy);
        let dx = Tensor::conv2d_input_grad(&dy, &w, x.shape(), c.p).unwrap();
        assert_eq!(dx.shape(), x.shape());
        assert_adjoint(lhs, dot(&x, &dx), abs_dot(&x, &dx) + abs_dot(&y, &dy));
        let dw = Tensor::conv2d_weight_grad(&x, &dy, w.shape(), c.p).unwrap();
        assert_eq!(dw.shape(), w.shape());
        assert_adjoint(lhs, dot(&w, &dw), abs_dot(&w, &dw) + abs_dot(&y, &dy));
    }
}

#[test]
fn depthwise_and_pointwise_convolutions() {
    // Depthwise: groups = c_in = c_out, padding 1, stride 2.
    let p = Conv2dParams {
        stride: (2, 2),
        padding: (1, 1),
        dilation: (1, 1),
        groups: 4,
    };
    let x = Nd::rand(&[2, 4, 7, 6], 11, -1.0, 1.0);
    let w = Nd::rand(&[4, 1, 3, 3], 12, -1.0, 1.0);
    let y = x.tensor().conv2d(&w.tensor(), None, p).unwrap();
    assert_nd(&y, &conv_ref(&x, &w, None, p), 1e-5, 1e-6);
    // Depthwise with a channel multiplier of 2.
    let w2 = Nd::rand(&[8, 1, 3, 3], 13, -1.0, 1.0);
    let y2 = x.tensor().conv2d(&w2.tensor(), None, p).unwrap();
    assert_nd(&y2, &conv_ref(&x, &w2, None, p), 1e-5, 1e-6);
    // 1x1 convolution = per-pixel matmul.
    let w1 = Nd::rand(&[3, 4, 1, 1], 14, -1.0, 1.0);
    let y1 = x
        .tensor()
        .conv2d(&w1.tensor(), None, Conv2dParams::default())
        .unwrap();
    assert_nd(
        &y1,
        &conv_ref(&x, &w1, None, Conv2dParams::default()),
        1e-5,
        1e-6,
    );
    // Hand-computed: all-ones 2x2 kernel sums each window.
    let dev = Device::cpu();
    let xs = Tensor::arange(0.0, 9.0, 1.0, &dev)
        .unwrap()
        .reshape(&[1, 1, 3, 3])
        .unwrap();
    let k = Tensor::ones(&[1, 1, 2, 2], &dev).unwrap();
    let b = Tensor::from_slice(&[0.5], &[1], &dev).unwrap();
    let ys = xs.conv2d(&k, Some(&b), Conv2dParams::default()).unwrap();
    assert_eq!(ys.shape(), &[1, 1, 2, 2]);
    assert_eq!(ys.to_vec().unwrap(), vec![8.5, 12.5, 20.5, 24.5]);
}

#[test]
fn conv_flops_are_those_of_the_matmul() {
    let dev = Device::new_cpu("conv-flops");
    let x = Tensor::ones(&[2, 4, 5, 5], &dev).unwrap();
    let w = Tensor::ones(&[6, 2, 3, 3], &dev).unwrap();
    let f0 = dev.flops();
    let p = Conv2dParams {
        groups: 2,
        ..Default::default()
    };
    x.conv2d(&w, None, p).unwrap();
    // batch n*g = 4, m = c_out/g = 3, k = 2*3*3 = 18, n = 3*3 = 9.
    assert_eq!(dev.flops() - f0, 2 * 4 * 3 * 18 * 9);
}

fn pool_ref(x: &Nd, p: Pool2dParams, max: bool) -> Nd {
    let (n, c, h, w) = (x.shape[0], x.shape[1], x.shape[2], x.shape[3]);
    let ho = (h + 2 * p.padding.0 - p.kernel.0) / p.stride.0 + 1;
    let wo = (w + 2 * p.padding.1 - p.kernel.1) / p.stride.1 + 1;
    Nd::from_fn(&[n, c, ho, wo], |i| {
        let mut acc = if max { f32::NEG_INFINITY } else { 0.0 };
        for ky in 0..p.kernel.0 {
            for kx in 0..p.kernel.1 {
                let iy = (i[2] * p.stride.0 + ky) as isize - p.padding.0 as isize;
                let ix = (i[3] * p.stride.1 + kx) as isize - p.padding.1 as isize;
                if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                    continue;
                }
                let v = x.at(&[i[0], i[1], iy as usize, ix as usize]);
                acc = if max { acc.max(v) } else { acc + v };
            }
        }
        if max {
            acc
        } else {
            acc / (p.kernel.0 * p.kernel.1) as f32
        }
    })
}

fn pool_case() -> impl Strategy<Value = (Vec<usize>, Pool2dParams)> {
    (
        (1usize..3, 1usize..4, 1usize..8, 1usize..8),
        (1usize..4, 1usize..4),
        (1usize..4, 1usize..4),
        (0usize..2, 0usize..2),
    )
        .prop_map(|((n, c, h, w), kernel, stride, (py, px))| {
            let padding = (py.min(kernel.0 / 2), px.min(kernel.1 / 2));
            (
                vec![n, c, h, w],
                Pool2dParams {
                    kernel,
                    stride,
                    padding,
                },
            )
        })
        .prop_filter("window must fit", |(s, p)| {
            s[2] + 2 * p.padding.0 >= p.kernel.0 && s[3] + 2 * p.padding.1 >= p.kernel.1
        })
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn pools_match_naive_and_their_adjoints_hold(
        (shape, p) in pool_case(),
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let xn = Nd::rand(&shape, seed, -1.0, 1.0);
        let x = xn.tensor_as(variant);
        let (y, am) = x.max_pool2d(p).unwrap();
        assert_nd(&y, &pool_ref(&xn, p, true), 0.0, 0.0);
        // Each argmax names an input element holding the maximum.
        let (yv, av) = (y.to_vec().unwrap(), am.to_vec().unwrap());
        let plane = shape[2] * shape[3];
        for (o, (&yy, &a)) in yv.iter().zip(&av).enumerate() {
            let nc = o / (y.shape()[2] * y.shape()[3]);
            prop_assert!(a >= 0.0 && (a as usize) < plane && a.fract() == 0.0);
            prop_assert_eq!(xn.data[nc * plane + a as usize], yy);
        }
        let dy = Nd::rand(y.shape(), seed + 3, -1.0, 1.0).tensor_as(variant);
        let dx = Tensor::max_pool2d_backward(&dy, &am, &shape, p).unwrap();
        assert_eq!(dx.shape(), &shape[..]);
        assert_adjoint(dot(&y, &dy), dot(&x, &dx), abs_dot(&y, &dy));

        let ya = x.avg_pool2d(p).unwrap();
        assert_nd(&ya, &pool_ref(&xn, p, false), 1e-5, 1e-6);
        let dxa = Tensor::avg_pool2d_backward(&dy, &shape, p).unwrap();
        assert_adjoint(dot(&ya, &dy), dot(&x, &dxa), abs_dot(&ya, &dy));
    }
}

#[test]
fn hand_computed_pools() {
    let dev = Device::cpu();
    let x = Tensor::from_slice(
        &[1.0, 2.0, 5.0, 3.0, 4.0, 0.0, 9.0, 8.0, 7.0],
        &[1, 1, 3, 3],
        &dev,
    )
    .unwrap();
    let p = Pool2dParams {
        kernel: (2, 2),
        stride: (1, 1),
        padding: (0, 0),
    };
    let (y, am) = x.max_pool2d(p).unwrap();
    assert_eq!(y.to_vec().unwrap(), vec![4.0, 5.0, 9.0, 8.0]);
    assert_eq!(am.to_vec().unwrap(), vec![4.0, 2.0, 6.0, 7.0]);
    // Overlapping windows: position 4 is the max of one window only; 5 gets none.
    let dy = Tensor::from_slice(&[1.0, 10.0, 100.0, 1000.0], &[1, 1, 2, 2], &dev).unwrap();
    let dx = Tensor::max_pool2d_backward(&dy, &am, &[1, 1, 3, 3], p).unwrap();
    assert_eq!(
        dx.to_vec().unwrap(),
        vec![0.0, 0.0, 10.0, 0.0, 1.0, 0.0, 100.0, 1000.0, 0.0]
    );
    // Average with zero padding counted in the divisor.
    let pa = Pool2dParams {
        kernel: (2, 2),
        stride: (2, 2),
        padding: (1, 1),
    };
    let ya = x.avg_pool2d(pa).unwrap();
    assert_eq!(ya.to_vec().unwrap(), vec![0.25, 1.75, 3.0, 4.75]);
    let da = Tensor::avg_pool2d_backward(
        &Tensor::ones(&[1, 1, 2, 2], &dev).unwrap(),
        &[1, 1, 3, 3],
        pa,
    )
    .unwrap();
    assert_eq!(da.to_vec().unwrap(), vec![0.25; 9]);
}

#[test]
fn conv_and_pool_errors_name_op_and_shapes() {
    let dev = Device::cpu();
    let x = Tensor::zeros(&[1, 4, 5, 5], &dev).unwrap();
    let w = Tensor::zeros(&[6, 2, 3, 3], &dev).unwrap();
    let d = Conv2dParams::default();
    assert_err!(
        x.conv2d(&w, None, d),
        Error::Shape { op: "conv2d", .. },
        "conv2d",
        "[1, 4, 5, 5]",
        "[6, 2, 3, 3]"
    );
    let g3 = Conv2dParams { groups: 3, ..d };
    assert_err!(
        x.conv2d(&w, None, g3),
        Error::Shape { op: "conv2d", .. },
        "[6, 2, 3, 3]"
    );
    let g2 = Conv2dParams { groups: 2, ..d };
    let big = Tensor::zeros(&[6, 2, 7, 7], &dev).unwrap();
    assert_err!(
        x.conv2d(&big, None, g2),
        Error::Shape { op: "conv2d", .. },
        "smaller",
        "[6, 2, 7, 7]"
    );
    assert_err!(
        x.conv2d(
            &w,
            None,
            Conv2dParams {
                stride: (0, 1),
                ..g2
            }
        ),
        Error::Invalid { op: "conv2d", .. },
        "stride"
    );
    assert_err!(
        x.conv2d(&w, None, Conv2dParams { groups: 0, ..d }),
        Error::Invalid { op: "conv2d", .. },
        "groups"
    );
    let b = Tensor::zeros(&[5], &dev).unwrap();
    assert_err!(
        x.conv2d(&w, Some(&b), g2),
        Error::Shape { op: "conv2d", .. },
        "bias",
        "[5]"
    );
    let x3 = Tensor::zeros(&[4, 5, 5], &dev).unwrap();
    assert_err!(
        x3.conv2d(&w, None, g2),
        Error::Shape { op: "conv2d", .. },
        "[4, 5, 5]"
    );
    let o = Tensor::zeros(&[6, 2, 3, 3], &other_device()).unwrap();
    assert_err!(
        x.conv2d(&o, None, g2),
        Error::DeviceMismatch { op: "conv2d", .. },
        "other-cpu"
    );
    let dy = Tensor::zeros(&[1, 6, 2, 2], &dev).unwrap();
    assert_err!(
        Tensor::conv2d_input_grad(&dy, &w, &[1, 4, 5, 5], g2),
        Error::Shape {
            op: "conv2d_input_grad",
            ..
        },
        "[1, 6, 2, 2]",
        "[1, 6, 3, 3]"
    );
    assert_err!(
        Tensor::conv2d_weight_grad(&x, &dy, &[6, 2, 3, 3], g2),
        Error::Shape {
            op: "conv2d_weight_grad",
            ..
        },
        "[1, 6, 2, 2]"
    );
    assert_err!(
        Tensor::conv2d_weight_grad(&x, &o, &[6, 2, 3, 3], g2),
        Error::DeviceMismatch {
            op: "conv2d_weight_grad",
            ..
        },
        "other-cpu"
    );

    let p = Pool2dParams {
        kernel: (2, 2),
        stride: (2, 2),
        padding: (0, 0),
    };
    assert_err!(
        x3.max_pool2d(p),
        Error::Shape {
            op: "max_pool2d",
            ..
        },
        "[4, 5, 5]"
    );
    let wide = Pool2dParams {
        kernel: (2, 2),
        stride: (1, 1),
        padding: (2, 0),
    };
    assert_err!(
        x.avg_pool2d(wide),
        Error::Invalid {
            op: "avg_pool2d",
            ..
        },
        "padding"
    );
    let huge = Pool2dParams {
        kernel: (9, 9),
        stride: (1, 1),
        padding: (0, 0),
    };
    assert_err!(
        x.avg_pool2d(huge),
        Error::Shape {
            op: "avg_pool2d",
            ..
        },
        "[1, 4, 5, 5]"
    );
    let (y, am) = x.max_pool2d(p).unwrap();
    assert_err!(
        Tensor::max_pool2d_backward(&y, &am, &[1, 4, 6, 6], p),
        Error::Shape {
            op: "max_pool2d_backward",
            ..
        },
        "[1, 4, 2, 2]",
        "[1, 4, 3, 3]"
    );
    assert_err!(
        Tensor::avg_pool2d_backward(&x, &[1, 4, 5, 5], p),
        Error::Shape {
            op: "avg_pool2d_backward",
            ..
        },
        "[1, 4, 5, 5]"
    );
}

#[test]
fn empty_batches() {
    let dev = Device::cpu();
    let x = Tensor::zeros(&[0, 2, 4, 4], &dev).unwrap();
    let w = Tensor::ones(&[3, 2, 3, 3], &dev).unwrap();
    let y = x.conv2d(&w, None, Conv2dParams::default()).unwrap();
    assert_eq!(y.shape(), &[0, 3, 2, 2]);
    let dw = Tensor::conv2d_weight_grad(&x, &y, w.shape(), Conv2dParams::default()).unwrap();
    assert_eq!(dw.to_vec().unwrap(), vec![0.0; 54]);
    let p = Pool2dParams {
        kernel: (2, 2),
        stride: (2, 2),
        padding: (0, 0),
    };
    assert_eq!(x.max_pool2d(p).unwrap().0.shape(), &[0, 2, 2, 2]);
}
