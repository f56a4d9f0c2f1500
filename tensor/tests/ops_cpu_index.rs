//! Indexing, joining and the optimizer step on the CPU device.

mod common;

use common::*;
use proptest::prelude::*;
use wgpipe_tensor::backend::AdamStep;
use wgpipe_tensor::{Device, Error, Tensor};

fn shape_axis() -> impl Strategy<Value = (Vec<usize>, usize)> {
    prop::collection::vec(1usize..5, 1..4).prop_flat_map(|s| {
        let r = s.len();
        (Just(s), 0..r)
    })
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn index_select_and_index_add(
        (shape, axis) in shape_axis(),
        n_idx in 0usize..7,
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let dim = shape[axis];
        let x = Nd::rand(&shape, seed, -1.0, 1.0);
        let idx = Nd::rand_index(&[n_idx], seed + 1, dim);
        let got = x.tensor_as(variant).index_select(axis as isize, &idx.tensor()).unwrap();
        let mut out_shape = shape.clone();
        out_shape[axis] = n_idx;
        let want = Nd::from_fn(&out_shape, |i| {
            let mut j = i.to_vec();
            j[axis] = idx.data[i[axis]] as usize;
            x.at(&j)
        });
        assert_nd(&got, &want, 0.0, 0.0);
        // index_add is its adjoint, repeated indices adding up.
        let s = Nd::rand(&out_shape, seed + 2, -1.0, 1.0);
        let back = Tensor::index_add(axis as isize - shape.len() as isize, &idx.tensor(), &s.tensor_as(variant), dim).unwrap();
        assert_eq!(back.shape(), &shape[..]);
        let st = s.tensor();
        assert_adjoint(dot(&got, &st), dot(&x.tensor(), &back), abs_dot(&got, &st));
        let mut want_back = Nd::new(&shape, vec![0.0; x.data.len()]);
        for i in 0..s.data.len() {
            let mut j = unravel(i, &out_shape);
            j[axis] = idx.data[j[axis]] as usize;
            want_back.data[ravel(&j, &shape)] += s.data[i];
        }
        assert_nd(&back, &want_back, 1e-6, 1e-6);
    }

    #[test]
    fn gather_and_scatter_add(
        (shape, axis) in shape_axis(),
        n_idx in 0usize..6,
        shrink in any::<bool>(),
        variant in 0..VARIANTS,
        seed in 0u64..1000,
    ) {
        let dim = shape[axis];
        let x = Nd::rand(&shape, seed, -1.0, 1.0);
        // idx: any size along `axis`; on other axes equal, or smaller (torch allows it).
        let idx_shape: Vec<usize> = shape.iter().enumerate()
            .map(|(d, &s)| if d == axis { n_idx } else if shrink { s.div_ceil(2) } else { s })
            .collect();
        let idx = Nd::rand_index(&idx_shape, seed + 1, dim);
        let got = x.tensor_as(variant).gather(axis as isize, &idx.tensor_as(variant)).unwrap();
        let want = Nd::from_fn(&idx_shape, |i| {
            let mut j = i.to_vec();
            j[axis] = idx.at(i) as usize;
            x.at(&j)
        });
        assert_nd(&got, &want, 0.0, 0.0);
        let s = Nd::rand(&idx_shape, seed + 2, -1.0, 1.0);
        let back = Tensor::scatter_add(axis as isize, &idx.tensor(), &s.tensor_as(variant), dim).unwrap();
        let mut back_shape = idx_shape.clone();
        back_shape[axis] = dim;
        let mut want_back = Nd::new(&back_shape, vec![0.0; numel(&back_shape)]);
        for i in 0..s.data.len() {
            let mut j = unravel(i, &idx_shape);
            j[axis] = idx.data[i] as usize;
            want_back.data[ravel(&j, &back_shape)] += s.data[i];
        }
        assert_nd(&back, &want_back, 1e-6, 1e-6);
        if !shrink {
            let st = s.tensor();
            assert_adjoint(dot(&got, &st), dot(&x.tensor(), &back), abs_dot(&got, &st));
        }
    }

    #[test]
    fn concat_and_stack_match_naive(
        (shape, axis) in shape_axis(),
        sizes in prop::collection::vec(0usize..4, 1..4),
        seed in 0u64..1000,
    ) {
        let parts: Vec<Nd> = sizes.iter().enumerate().map(|(i, &n)| {
            let mut s = shape.clone();
            s[axis] = n;
            Nd::rand(&s, seed + i as u64, -1.0, 1.0)
        }).collect();
        let ts: Vec<Tensor> = parts.iter().enumerate().map(|(i, p)| p.tensor_as(i as u8)).collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        let got = Tensor::concat(&refs, axis as isize).unwrap();
        let mut out_shape = shape.clone();
        out_shape[axis] = sizes.iter().sum();
        let want = Nd::from_fn(&out_shape, |i| {
            let mut j = i.to_vec();
            for p in &parts {
                if j[axis] < p.shape[axis] {
                    return p.at(&j);
                }
                j[axis] -= p.shape[axis];
            }
            unreachable!()
        });
        assert_nd(&got, &want, 0.0, 0.0);

        let same: Vec<Nd> = (0..sizes.len()).map(|i| Nd::rand(&shape, seed + 10 + i as u64, -1.0, 1.0)).collect();
        let ts: Vec<Tensor> = same.iter().enumerate().map(|(i, p)| p.tensor_as(i as u8 + 1)).collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        let new_axis = (seed as usize) % (shape.len() + 1);
        let got = Tensor::stack(&refs, new_axis as isize).unwrap();
        let mut st_shape = shape.clone();
        st_shape.insert(new_axis, same.len());
        let want = Nd::from_fn(&st_shape, |i| {
            let mut j = i.to_vec();
            let k = j.remove(new_axis);
            same[k].at(&j)
        });
        assert_nd(&got, &want, 0.0, 0.0);
    }
}

#[test]
fn hand_computed_indexing() {
    let dev = Device::cpu();
    let x = Tensor::arange(0.0, 6.0, 1.0, &dev)
        .unwrap()
        .reshape(&[3, 2])
        .unwrap();
    let idx = Tensor::from_slice(&[2.0, 0.0, 2.0], &[3], &dev).unwrap();
    let s = x.index_select(0, &idx).unwrap();
    assert_eq!(s.to_vec().unwrap(), vec![4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
    let back = Tensor::index_add(0, &idx, &Tensor::ones(&[3, 2], &dev).unwrap(), 4).unwrap();
    assert_eq!(
        back.to_vec().unwrap(),
        vec![1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0]
    );
    let gi = Tensor::from_slice(&[1.0, 0.0, 0.0, 0.0], &[2, 2], &dev).unwrap();
    // Rows 0..2 of x, picking column gi: [[1, 0], [2, 2]].
    assert_eq!(
        x.gather(1, &gi).unwrap().to_vec().unwrap(),
        vec![1.0, 0.0, 2.0, 2.0]
    );
    let sc = Tensor::scatter_add(1, &gi, &Tensor::ones(&[2, 2], &dev).unwrap(), 3).unwrap();
    assert_eq!(sc.to_vec().unwrap(), vec![1.0, 1.0, 0.0, 2.0, 0.0, 0.0]);
    let labels = Tensor::from_slice(&[2.0, 0.0], &[2], &dev).unwrap();
    let oh = labels.one_hot(3).unwrap();
    assert_eq!(oh.shape(), &[2, 3]);
    assert_eq!(oh.to_vec().unwrap(), vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    let oh2 = labels.reshape(&[2, 1]).unwrap().one_hot(4).unwrap();
    assert_eq!(oh2.shape(), &[2, 1, 4]);
    // Empty index lists.
    let none = Tensor::zeros(&[0], &dev).unwrap();
    assert_eq!(x.index_select(1, &none).unwrap().shape(), &[3, 0]);
    assert_eq!(
        Tensor::index_add(0, &none, &Tensor::zeros(&[0, 2], &dev).unwrap(), 3)
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![0.0; 6]
    );
    // Index given as a non-contiguous view.
    let iv = Tensor::from_slice(&[1.0, 9.0, 0.0, 9.0], &[2, 2], &dev)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap()
        .reshape(&[2])
        .unwrap();
    assert_eq!(
        x.index_select(0, &iv).unwrap().to_vec().unwrap(),
        vec![2.0, 3.0, 0.0, 1.0]
    );
}

#[test]
fn concat_stack_edge_cases() {
    let dev = Device::cpu();
    let a = Tensor::ones(&[2, 3], &dev).unwrap();
    let e = Tensor::zeros(&[0, 3], &dev).unwrap();
    let c = Tensor::concat(&[&e, &a, &e], 0).unwrap();
    assert_eq!(c.shape(), &[2, 3]);
    assert_eq!(Tensor::concat(&[&e, &e], -2).unwrap().shape(), &[0, 3]);
    let s = Tensor::stack(&[&a, &a], -1).unwrap();
    assert_eq!(s.shape(), &[2, 3, 2]);
    let sc = Tensor::stack(
        &[
            &Tensor::scalar(1.0, &dev).unwrap(),
            &Tensor::scalar(2.0, &dev).unwrap(),
        ],
        0,
    )
    .unwrap();
    assert_eq!(sc.to_vec().unwrap(), vec![1.0, 2.0]);
    let bc = Tensor::from_slice(&[1.0, 2.0], &[2, 1], &dev)
        .unwrap()
        .broadcast_to(&[2, 2])
        .unwrap();
    assert_eq!(
        Tensor::concat(&[&bc, &bc.t().unwrap()], 1)
            .unwrap()
            .to_vec()
            .unwrap(),
        vec![1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 2.0]
    );
}

/// Piece lengths as PyTorch 2.15 gives them (`torch.split` / `torch.chunk` on the same shapes),
/// each piece a view holding its own elements; `unbind`'s slices.
#[test]
fn split_and_chunk_give_pytorchs_pieces() {
    let dev = Device::cpu();
    let lens =
        |ts: Vec<Tensor>, axis: usize| ts.iter().map(|t| t.shape()[axis]).collect::<Vec<_>>();
    let x = Tensor::arange(0.0, 10.0, 1.0, &dev)
        .unwrap()
        .reshape(&[2, 5])
        .unwrap();
    assert_eq!(lens(x.split(2, 1).unwrap(), 1), vec![2, 2, 1]);
    assert_eq!(lens(x.split(5, -1).unwrap(), 1), vec![5]);
    assert_eq!(lens(x.split(7, 1).unwrap(), 1), vec![5]);
    assert_eq!(lens(x.chunk(3, 1).unwrap(), 1), vec![2, 2, 1]);
    assert_eq!(lens(x.chunk(4, 1).unwrap(), 1), vec![2, 2, 1]);
    assert_eq!(lens(x.chunk(1, 0).unwrap(), 0), vec![2]);
    let six = Tensor::zeros(&[6], &dev).unwrap();
    assert_eq!(lens(six.chunk(4, 0).unwrap(), 0), vec![2, 2, 2]);
    let pieces = x.split_sizes(&[2, 0, 3], 1).unwrap();
    assert_eq!(lens(pieces.clone(), 1), vec![2, 0, 3]);
    assert_eq!(pieces[0].to_vec().unwrap(), vec![0.0, 1.0, 5.0, 6.0]);
    assert_eq!(
        pieces[2].to_vec().unwrap(),
        vec![2.0, 3.0, 4.0, 7.0, 8.0, 9.0]
    );
    assert!(pieces.iter().all(|p| p.shares_storage(&x)));
    let empty = Tensor::zeros(&[0, 3], &dev).unwrap();
    assert_eq!(lens(empty.split(2, 0).unwrap(), 0), vec![0]);
    assert_eq!(lens(empty.split(0, 0).unwrap(), 0), vec![0]);
    assert_eq!(lens(empty.chunk(2, 0).unwrap(), 0), vec![0, 0]);

    let rows = x.unbind(0).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].shape(), &[5]);
    assert_eq!(rows[1].to_vec().unwrap(), vec![5.0, 6.0, 7.0, 8.0, 9.0]);
    let cols = x.unbind(-1).unwrap();
    assert_eq!(cols.len(), 5);
    assert_eq!(cols[3].to_vec().unwrap(), vec![3.0, 8.0]);
    assert!(empty.unbind(0).unwrap().is_empty());
    assert_err!(x.unbind(2), Error::Axis { op: "unbind", .. }, "unbind");

    assert_err!(
        x.split(0, 1),
        Error::Shape { op: "split", .. },
        "[2, 5]",
        "size of 0"
    );
    assert_err!(
        x.chunk(0, 1),
        Error::Shape { op: "chunk", .. },
        "[2, 5]",
        "0"
    );
    assert_err!(
        x.split_sizes(&[2, 2], 1),
        Error::Shape { op: "split", .. },
        "[2, 2]",
        "add up to 4",
        "length 5"
    );
    assert_err!(
        x.split(1, 2),
        Error::Axis {
            op: "split",
            axis: 2,
            rank: 2
        },
        "split"
    );
    assert_err!(x.chunk(2, -3), Error::Axis { op: "chunk", .. }, "chunk");
}

#[test]
fn index_errors_name_op_and_shapes() {
    let dev = Device::cpu();
    let x = Tensor::zeros(&[3, 2], &dev).unwrap();
    let bad = Tensor::from_slice(&[0.0, 3.0], &[2], &dev).unwrap();
    assert_err!(
        x.index_select(0, &bad),
        Error::Index {
            op: "index_select",
            ..
        },
        "index_select",
        "3",
        "0..3"
    );
    let frac = Tensor::from_slice(&[0.5], &[1], &dev).unwrap();
    assert_err!(
        x.index_select(1, &frac),
        Error::Index {
            op: "index_select",
            ..
        },
        "0.5"
    );
    let neg = Tensor::from_slice(&[-1.0], &[1], &dev).unwrap();
    assert_err!(
        x.gather(0, &neg.reshape(&[1, 1]).unwrap()),
        Error::Index { op: "gather", .. },
        "-1"
    );
    assert_err!(
        x.index_select(2, &bad),
        Error::Axis {
            op: "index_select",
            axis: 2,
            rank: 2
        },
        "index_select"
    );
    assert_err!(
        x.index_select(0, &x),
        Error::Shape {
            op: "index_select",
            ..
        },
        "[3, 2]"
    );
    let src = Tensor::zeros(&[3, 2], &dev).unwrap();
    assert_err!(
        Tensor::index_add(0, &bad, &src, 5),
        Error::Shape {
            op: "index_add",
            ..
        },
        "[3, 2]",
        "[2]"
    );
    assert_err!(
        Tensor::index_add(1, &bad, &src, 3),
        Error::Index {
            op: "index_add",
            ..
        },
        "0..3"
    );
    let gi = Tensor::zeros(&[4, 2], &dev).unwrap();
    assert_err!(
        x.gather(1, &gi),
        Error::Shape { op: "gather", .. },
        "gather",
        "[4, 2]",
        "[3, 2]"
    );
    assert_err!(x.gather(1, &bad), Error::Shape { op: "gather", .. }, "[2]");
    assert_err!(
        Tensor::scatter_add(0, &gi, &x, 4),
        Error::Shape {
            op: "scatter_add",
            ..
        },
        "[4, 2]",
        "[3, 2]"
    );
    assert_err!(
        Tensor::scatter_add(
            0,
            &bad.reshape(&[2, 1]).unwrap(),
            &Tensor::zeros(&[2, 1], &dev).unwrap(),
            2
        ),
        Error::Index {
            op: "scatter_add",
            ..
        },
        "0..2"
    );
    assert_err!(bad.one_hot(3), Error::Index { op: "one_hot", .. }, "0..3");
    let o = Tensor::zeros(&[2], &other_device()).unwrap();
    assert_err!(
        x.index_select(0, &o),
        Error::DeviceMismatch {
            op: "index_select",
            ..
        },
        "other-cpu"
    );
    assert_err!(
        Tensor::concat(&[&x, &o], 0),
        Error::DeviceMismatch { op: "concat", .. },
        "other-cpu"
    );
    assert_err!(
        Tensor::concat(&[], 0),
        Error::Invalid { op: "concat", .. },
        "concat"
    );
    let y = Tensor::zeros(&[3, 3], &dev).unwrap();
    assert_err!(
        Tensor::concat(&[&x, &y], 0),
        Error::Shape { op: "concat", .. },
        "[3, 2]",
        "[3, 3]"
    );
    assert_err!(
        Tensor::stack(&[&x, &y], 0),
        Error::Shape { op: "stack", .. },
        "[3, 2]",
        "[3, 3]"
    );
    assert_err!(
        Tensor::concat(&[&x, &y], 2),
        Error::Axis {
            op: "concat",
            axis: 2,
            ..
        },
        "concat"
    );
    assert_err!(
        Tensor::stack(&[&x], 3),
        Error::Axis {
            op: "stack",
            axis: 3,
            rank: 3
        },
        "stack"
    );
    let s = Tensor::scalar(0.0, &dev).unwrap();
    assert_err!(
        Tensor::concat(&[&s, &s], 0),
        Error::Shape { op: "concat", .. },
        "[]"
    );
}

#[test]
fn adam_update_matches_the_formula() {
    let dev = Device::new_cpu("adam");
    let n = 10;
    let p = Nd::rand(&[2, 5], 1, -1.0, 1.0);
    let g = Nd::rand(&[2, 5], 2, -1.0, 1.0);
    let m = Nd::rand(&[2, 5], 3, -0.1, 0.1);
    let v = Nd::rand(&[2, 5], 4, 0.0, 0.1);
    for decoupled in [false, true] {
        let hp = AdamStep {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            decoupled,
            bias_correction1: 1.0 - 0.9f32.powi(3),
            bias_correction2: 1.0 - 0.999f32.powi(3),
        };
        let t = |x: &Nd| Tensor::from_slice(&x.data, &x.shape, &dev).unwrap();
        // The gradient as a transposed view: the front-end makes it contiguous.
        let g_stored: Vec<f32> = (0..n).map(|i| g.data[(i % 2) * 5 + i / 2]).collect();
        let gt = Tensor::from_slice(&g_stored, &[5, 2], &dev)
            .unwrap()
            .t()
            .unwrap();
        assert!(!gt.is_contiguous());
        let (p2, m2, v2) = Tensor::adam_update(&t(&p), &gt, &t(&m), &t(&v), &hp).unwrap();
        let (mut wp, mut wm, mut wv) = (vec![], vec![], vec![]);
        for i in 0..n {
            let (pp, gg) = (p.data[i], g.data[i]);
            let g2 = if decoupled {
                gg
            } else {
                gg + hp.weight_decay * pp
            };
            let mm = hp.beta1 * m.data[i] + (1.0 - hp.beta1) * g2;
            let vv = hp.beta2 * v.data[i] + (1.0 - hp.beta2) * g2 * g2;
            let mut np = pp
                - hp.lr * (mm / hp.bias_correction1) / ((vv / hp.bias_correction2).sqrt() + hp.eps);
            if decoupled {
                np -= hp.lr * hp.weight_decay * pp;
            }
            wp.push(np);
            wm.push(mm);
            wv.push(vv);
        }
        assert_close(&p2.to_vec().unwrap(), &wp, 1e-5, 1e-6);
        assert_close(&m2.to_vec().unwrap(), &wm, 1e-5, 1e-7);
        assert_close(&v2.to_vec().unwrap(), &wv, 1e-5, 1e-8);
    }
    let hp = AdamStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: true,
        bias_correction1: 0.1,
        bias_correction2: 0.01,
    };
    let a = Tensor::zeros(&[2, 5], &dev).unwrap();
    let b = Tensor::zeros(&[5, 2], &dev).unwrap();
    assert_err!(
        Tensor::adam_update(&a, &b, &a, &a, &hp),
        Error::Shape {
            op: "adam_update",
            ..
        },
        "[2, 5]",
        "[5, 2]"
    );
    let o = Tensor::zeros(&[2, 5], &other_device()).unwrap();
    assert_err!(
        Tensor::adam_update(&a, &a, &o, &a, &hp),
        Error::DeviceMismatch {
            op: "adam_update",
            ..
        },
        "other-cpu"
    );
    // Non-contiguous operands are accepted.
    let tv = b.t().unwrap();
    let (p3, _, _) = Tensor::adam_update(&tv, &tv, &tv, &tv, &hp).unwrap();
    assert_eq!(p3.shape(), &[2, 5]);
}
