//! Reductions on the CPU device against naive references.

mod common;

use common::*;
use proptest::prelude::*;
use wgpipe_tensor::{Device, Error, Tensor};

/// The elements of each output group (row-major over kept axes), each group in input order,
/// plus the output shape.
fn groups(x: &Nd, axes: &[usize], keepdim: bool) -> (Vec<usize>, Vec<Vec<f32>>) {
    let r = x.shape.len();
    let kept: Vec<usize> = (0..r).filter(|a| !axes.contains(a)).collect();
    let kept_shape: Vec<usize> = kept.iter().map(|&a| x.shape[a]).collect();
    let mut g = vec![Vec::new(); numel(&kept_shape)];
    for i in 0..x.data.len() {
        let idx = unravel(i, &x.shape);
        let k: Vec<usize> = kept.iter().map(|&a| idx[a]).collect();
        g[ravel(&k, &kept_shape)].push(x.data[i]);
    }
    let out = if keepdim {
        (0..r)
            .map(|a| if axes.contains(&a) { 1 } else { x.shape[a] })
            .collect()
    } else {
        kept_shape
    };
    (out, g)
}

fn reduce_ref(x: &Nd, axes: &[usize], keepdim: bool, f: impl Fn(&[f32]) -> f32) -> Nd {
    let (shape, g) = groups(x, axes, keepdim);
    Nd::new(&shape, g.iter().map(|v| f(v)).collect())
}

fn sum(v: &[f32]) -> f32 {
    v.iter().map(|&x| x as f64).sum::<f64>() as f32
}
fn mean(v: &[f32]) -> f32 {
    sum(v) / v.len() as f32
}
fn var(v: &[f32]) -> f32 {
    let m = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    (v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64) as f32
}
fn max(v: &[f32]) -> f32 {
    v.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}
fn min(v: &[f32]) -> f32 {
    v.iter().copied().fold(f32::INFINITY, f32::min)
}
/// First index of the extreme (`better(a, b)`: a strictly beats b).
fn arg(v: &[f32], better: fn(f32, f32) -> bool) -> f32 {
    let mut best = 0;
    for i in 1..v.len() {
        if better(v[i], v[best]) {
            best = i;
        }
    }
    best as f32
}

fn shape_and_axes() -> impl Strategy<Value = (Vec<usize>, Vec<bool>)> {
    prop::collection::vec(1usize..5, 0..5).prop_flat_map(|s| {
        let r = s.len();
        (Just(s), prop::collection::vec(any::<bool>(), r))
    })
}

/// The chosen axes as a user would pass them: some negative, in scrambled order.
fn as_isize(axes: &[usize], rank: usize, seed: u64) -> Vec<isize> {
    let mut v: Vec<isize> = axes
        .iter()
        .map(|&a| {
            if (a as u64 + seed).is_multiple_of(2) {
                a as isize - rank as isize
            } else {
                a as isize
            }
        })
        .collect();
    if seed.is_multiple_of(3) {
        v.reverse();
    }
    v
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn reductions_match_naive(
        (shape, mask) in shape_and_axes(),
        keepdim in any::<bool>(),
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let r = shape.len();
        let chosen: Vec<usize> = (0..r).filter(|&a| mask[a]).collect();
        // Empty list = all axes, as the API says.
        let axes = if chosen.is_empty() { (0..r).collect() } else { chosen.clone() };
        let arg_axes = as_isize(&chosen, r, seed);
        let x = Nd::rand(&shape, seed, -2.0, 2.0);
        let t = x.tensor_as(variant);
        assert_nd(&t.sum(&arg_axes, keepdim).unwrap(), &reduce_ref(&x, &axes, keepdim, sum), 1e-5, 1e-5);
        assert_nd(&t.mean(&arg_axes, keepdim).unwrap(), &reduce_ref(&x, &axes, keepdim, mean), 1e-5, 1e-5);
        assert_nd(&t.max(&arg_axes, keepdim).unwrap(), &reduce_ref(&x, &axes, keepdim, max), 0.0, 0.0);
        assert_nd(&t.min(&arg_axes, keepdim).unwrap(), &reduce_ref(&x, &axes, keepdim, min), 0.0, 0.0);
        assert_nd(&t.var(&arg_axes, keepdim).unwrap(), &reduce_ref(&x, &axes, keepdim, var), 1e-4, 1e-5);
    }

    #[test]
    fn argmax_argmin_match_naive(
        shape in prop::collection::vec(1usize..5, 1..5),
        axis_seed in 0usize..100,
        keepdim in any::<bool>(),
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let r = shape.len();
        let axis = axis_seed % r;
        // Few distinct values so that ties occur: the first index must win.
        let x = Nd::rand_index(&shape, seed, 3);
        let t = x.tensor_as(variant);
        let neg = if axis_seed % 2 == 0 { axis as isize } else { axis as isize - r as isize };
        assert_nd(&t.argmax(neg, keepdim).unwrap(), &reduce_ref(&x, &[axis], keepdim, |v| arg(v, |a, b| a > b)), 0.0, 0.0);
        assert_nd(&t.argmin(neg, keepdim).unwrap(), &reduce_ref(&x, &[axis], keepdim, |v| arg(v, |a, b| a < b)), 0.0, 0.0);
    }

    #[test]
    fn sum_to_shape_undoes_broadcast(
        target in prop::collection::vec((1usize..4, any::<bool>()), 0..4),
        lead in prop::collection::vec(1usize..4, 0..3),
        seed in 0u64..1000,
    ) {
        // small: the operand shape; big: what it was broadcast to.
        let small: Vec<usize> = target.iter().map(|&(d, one)| if one { 1 } else { d }).collect();
        let big: Vec<usize> = lead.iter().copied().chain(target.iter().map(|t| t.0)).collect();
        let g = Nd::rand(&big, seed, -1.0, 1.0);
        let got = g.tensor_as((seed % 4) as u8).sum_to_shape(&small).unwrap();
        // Reference: every big element adds into the small element it was broadcast from.
        let mut want = Nd::new(&small, vec![0.0; numel(&small)]);
        for i in 0..g.data.len() {
            let idx = unravel(i, &big);
            let s: Vec<usize> = small.iter().enumerate()
                .map(|(d, &n)| if n == 1 { 0 } else { idx[lead.len() + d] }).collect();
            want.data[ravel(&s, &small)] += g.data[i];
        }
        assert_nd(&got, &want, 1e-5, 1e-5);
    }
}

#[test]
fn hand_computed_reductions() {
    let x = Tensor::from_slice(&[1.0, 5.0, 3.0, 4.0, 2.0, 6.0], &[2, 3], &Device::cpu()).unwrap();
    assert_eq!(
        x.sum(&[1], false).unwrap().to_vec().unwrap(),
        vec![9.0, 12.0]
    );
    assert_eq!(x.sum(&[0], true).unwrap().shape(), &[1, 3]);
    assert_eq!(
        x.sum(&[-2], true).unwrap().to_vec().unwrap(),
        vec![5.0, 7.0, 9.0]
    );
    assert_eq!(
        x.max(&[1], false).unwrap().to_vec().unwrap(),
        vec![5.0, 6.0]
    );
    assert_eq!(x.min(&[], false).unwrap().to_vec().unwrap(), vec![1.0]);
    assert_eq!(
        x.argmax(1, false).unwrap().to_vec().unwrap(),
        vec![1.0, 2.0]
    );
    assert_eq!(
        x.argmin(0, true).unwrap().to_vec().unwrap(),
        vec![0.0, 1.0, 0.0]
    );
    assert_eq!(x.argmin(0, true).unwrap().shape(), &[1, 3]);
    let s = x.sum_all().unwrap();
    assert_eq!(s.shape(), &[] as &[usize]);
    assert_eq!(s.to_scalar().unwrap(), 21.0);
    assert_eq!(x.mean_all().unwrap().to_scalar().unwrap(), 3.5);
    assert_eq!(
        x.var(&[0], false).unwrap().to_vec().unwrap(),
        vec![2.25, 2.25, 2.25]
    );
    // Transposed view: rows become columns.
    assert_eq!(
        x.t().unwrap().sum(&[1], false).unwrap().to_vec().unwrap(),
        vec![5.0, 7.0, 9.0]
    );
    // 0-d tensors reduce to themselves.
    let z = Tensor::scalar(4.0, &Device::cpu()).unwrap();
    assert_eq!(z.sum(&[], false).unwrap().to_scalar().unwrap(), 4.0);
    assert_eq!(z.max(&[], true).unwrap().shape(), &[] as &[usize]);
}

#[test]
fn reductions_over_broadcast_views() {
    let dev = Device::cpu();
    let row = Tensor::from_slice(&[1.0, 2.0, 3.0], &[3], &dev).unwrap();
    let b = row.broadcast_to(&[4, 3]).unwrap();
    assert_eq!(
        b.sum(&[0], false).unwrap().to_vec().unwrap(),
        vec![4.0, 8.0, 12.0]
    );
    assert_eq!(b.sum(&[1], false).unwrap().to_vec().unwrap(), vec![6.0; 4]);
    assert_eq!(b.argmax(1, false).unwrap().to_vec().unwrap(), vec![2.0; 4]);
}

#[test]
fn empty_reductions() {
    let dev = Device::cpu();
    let e = Tensor::zeros(&[2, 0], &dev).unwrap();
    assert_eq!(
        e.sum(&[1], false).unwrap().to_vec().unwrap(),
        vec![0.0, 0.0]
    );
    assert_eq!(e.sum(&[1], true).unwrap().shape(), &[2, 1]);
    assert!(e
        .mean(&[1], false)
        .unwrap()
        .to_vec()
        .unwrap()
        .iter()
        .all(|v| v.is_nan()));
    assert_eq!(e.sum(&[0], false).unwrap().shape(), &[0]);
    assert_eq!(e.max(&[0], false).unwrap().shape(), &[0]);
    assert_eq!(e.sum_all().unwrap().to_scalar().unwrap(), 0.0);
    assert_err!(
        e.max(&[1], false),
        Error::Shape { op: "max", .. },
        "max",
        "[2, 0]"
    );
    assert_err!(
        e.argmin(1, false),
        Error::Shape { op: "argmin", .. },
        "argmin",
        "[2, 0]"
    );
    // Size-1 axes.
    let one = Tensor::from_slice(&[7.0], &[1, 1, 1], &dev).unwrap();
    assert_eq!(one.var(&[1], false).unwrap().to_vec().unwrap(), vec![0.0]);
    assert_eq!(one.argmax(2, false).unwrap().to_vec().unwrap(), vec![0.0]);
    assert_eq!(one.sum_to_shape(&[1]).unwrap().to_vec().unwrap(), vec![7.0]);
    assert_eq!(one.sum_to_shape(&[]).unwrap().shape(), &[] as &[usize]);
}

#[test]
fn reduction_flops_are_counted() {
    let dev = Device::new_cpu("reduce-flops");
    let x = Tensor::ones(&[3, 4], &dev).unwrap();
    let f0 = dev.flops();
    x.max(&[0], false).unwrap();
    assert_eq!(dev.flops() - f0, 12);
}

#[test]
fn reduction_errors_name_op_and_shapes() {
    let x = Tensor::zeros(&[2, 3], &Device::cpu()).unwrap();
    assert_err!(
        x.sum(&[2], false),
        Error::Axis {
            op: "sum",
            axis: 2,
            rank: 2
        },
        "sum"
    );
    assert_err!(
        x.mean(&[-3], false),
        Error::Axis { op: "mean", .. },
        "mean",
        "-3"
    );
    assert_err!(
        x.var(&[1, -1], false),
        Error::Invalid { op: "var", .. },
        "var",
        "[1, -1]"
    );
    assert_err!(
        x.argmax(5, true),
        Error::Axis {
            op: "argmax",
            axis: 5,
            ..
        },
        "argmax"
    );
    assert_err!(
        x.sum_to_shape(&[4]),
        Error::Shape {
            op: "sum_to_shape",
            ..
        },
        "sum_to_shape",
        "[2, 3]",
        "[4]"
    );
    assert_err!(
        x.sum_to_shape(&[1, 2, 3]),
        Error::Shape {
            op: "sum_to_shape",
            ..
        },
        "[1, 2, 3]"
    );
}
