//! Matmul on the CPU device against a naive triple loop.

mod common;

use common::*;
use proptest::prelude::*;
use wgpipe_tensor::{Device, Error, Tensor};

/// `vals` (shape `batch ++ [r, c]`) as a tensor; `transposed` stores it as `[.., c, r]` and
/// returns the `.t()` view, so the kernel gets swapped strides.
fn operand(vals: &Nd, transposed: bool, variant: u8) -> Tensor {
    if !transposed {
        return vals.tensor_as(variant);
    }
    let r = vals.shape.len();
    let mut st = vals.shape.clone();
    st.swap(r - 2, r - 1);
    let stored = Nd::from_fn(&st, |i| {
        let mut j = i.to_vec();
        j.swap(r - 2, r - 1);
        vals.at(&j)
    });
    stored.tensor_as(variant).t().unwrap()
}

fn matmul_ref(a: &Nd, b: &Nd, batch: &[usize]) -> Nd {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    let (m, k, n) = (a.shape[ra - 2], a.shape[ra - 1], b.shape[rb - 1]);
    let mut shape = batch.to_vec();
    shape.extend([m, n]);
    Nd::from_fn(&shape, |idx| {
        let nb = batch.len();
        let bi = &idx[..nb];
        let (i, j) = (idx[nb], idx[nb + 1]);
        let mut acc = 0f64;
        for kk in 0..k {
            let ia: Vec<usize> = bi.iter().copied().chain([i, kk]).collect();
            let ib: Vec<usize> = bi.iter().copied().chain([kk, j]).collect();
            acc += a.at_broadcast(&ia) as f64 * b.at_broadcast(&ib) as f64;
        }
        acc as f32
    })
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn matmul_matches_naive(
        batch in prop::collection::vec((1usize..4, any::<bool>(), any::<bool>()), 0..4),
        drop_a in 0usize..4,
        drop_b in 0usize..4,
        (m, k, n) in (0usize..6, 0usize..6, 0usize..6),
        (ta, tb) in (any::<bool>(), any::<bool>()),
        (va, vb) in (0..VARIANTS, 0..VARIANTS),
        seed in 0u64..1000,
    ) {
        let pick = |drop: usize, one: &dyn Fn(&(usize, bool, bool)) -> bool| -> Vec<usize> {
            batch.iter().skip(drop.min(batch.len())).map(|b| if one(b) { 1 } else { b.0 }).collect()
        };
        let mut sa = pick(drop_a, &|b| b.1);
        let mut sb = pick(drop_b, &|b| b.2);
        let out_batch = broadcast(&sa, &sb);
        sa.extend([m, k]);
        sb.extend([k, n]);
        let a = Nd::rand(&sa, seed, -1.0, 1.0);
        let b = Nd::rand(&sb, seed + 7, -1.0, 1.0);
        let got = operand(&a, ta, va).matmul(&operand(&b, tb, vb)).unwrap();
        assert_nd(&got, &matmul_ref(&a, &b, &out_batch), 1e-4, 1e-5);
    }
}

#[test]
fn hand_computed_and_transposed() {
    let dev = Device::cpu();
    let a = Tensor::from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], &dev).unwrap();
    let b = Tensor::from_slice(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], &[3, 2], &dev).unwrap();
    assert_eq!(
        a.matmul(&b).unwrap().to_vec().unwrap(),
        vec![4.0, 5.0, 10.0, 11.0]
    );
    // a @ a^T with the transpose as a free view.
    let at = a.t().unwrap();
    assert!(!at.is_contiguous());
    assert_eq!(
        a.matmul(&at).unwrap().to_vec().unwrap(),
        vec![14.0, 32.0, 32.0, 77.0]
    );
    assert_eq!(at.matmul(&a).unwrap().shape(), &[3, 3]);
    // A [1, 1] result and a single-row operand.
    let r = Tensor::from_slice(&[1.0, 1.0], &[1, 2], &dev).unwrap();
    assert_eq!(
        r.matmul(&r.t().unwrap()).unwrap().to_vec().unwrap(),
        vec![2.0]
    );
}

#[test]
fn mixed_broadcast_batches_and_weights_shared_over_batch() {
    let dev = Device::cpu();
    // [2, 1] x [1, 3] batches: neither operand's batch walks with one stride.
    let a = Nd::rand(&[2, 1, 2, 3], 1, -1.0, 1.0);
    let b = Nd::rand(&[1, 3, 3, 4], 2, -1.0, 1.0);
    let got = a.tensor().matmul(&b.tensor()).unwrap();
    assert_nd(&got, &matmul_ref(&a, &b, &[2, 3]), 1e-5, 1e-6);
    // A rank-2 weight against a rank-4 activation (linear layer).
    let x = Nd::rand(&[2, 3, 4, 5], 3, -1.0, 1.0);
    let w = Nd::rand(&[5, 6], 4, -1.0, 1.0);
    assert_nd(
        &x.tensor().matmul(&w.tensor()).unwrap(),
        &matmul_ref(&x, &w, &[2, 3]),
        1e-5,
        1e-6,
    );
    // Batch broadcast from a stride-0 view made by broadcast_to.
    let wb = w.tensor().broadcast_to(&[3, 5, 6]).unwrap();
    let x3 = Nd::rand(&[3, 4, 5], 5, -1.0, 1.0);
    assert_nd(
        &x3.tensor().matmul(&wb).unwrap(),
        &matmul_ref(&x3, &w, &[3]),
        1e-5,
        1e-6,
    );
    let _ = dev;
}

#[test]
fn empty_contraction_gives_zeros() {
    let dev = Device::cpu();
    let a = Tensor::ones(&[2, 0], &dev).unwrap();
    let b = Tensor::ones(&[0, 3], &dev).unwrap();
    let y = a.matmul(&b).unwrap();
    assert_eq!(y.shape(), &[2, 3]);
    assert_eq!(y.to_vec().unwrap(), vec![0.0; 6]);
    assert_eq!(
        b.matmul(&Tensor::ones(&[3, 2], &dev).unwrap())
            .unwrap()
            .shape(),
        &[0, 2]
    );
    let z = Tensor::ones(&[0, 2, 2], &dev).unwrap();
    assert_eq!(
        z.matmul(&Tensor::ones(&[2, 2], &dev).unwrap())
            .unwrap()
            .shape(),
        &[0, 2, 2]
    );
}

#[test]
fn matmul_flops_are_2bmkn() {
    let dev = Device::new_cpu("mm-flops");
    let a = Tensor::ones(&[3, 2, 4], &dev).unwrap();
    let b = Tensor::ones(&[4, 5], &dev).unwrap();
    let f0 = dev.flops();
    a.matmul(&b).unwrap();
    assert_eq!(dev.flops() - f0, 2 * 3 * 2 * 4 * 5);
}

#[test]
fn matmul_errors_name_shapes() {
    let dev = Device::cpu();
    let a = Tensor::zeros(&[2, 3], &dev).unwrap();
    let v = Tensor::zeros(&[3], &dev).unwrap();
    assert_err!(
        a.matmul(&v),
        Error::Shape { op: "matmul", .. },
        "matmul",
        "[2, 3]",
        "[3]"
    );
    assert_err!(
        a.matmul(&a),
        Error::Shape { op: "matmul", .. },
        "matmul",
        "[2, 3]"
    );
    let b1 = Tensor::zeros(&[2, 3, 4], &dev).unwrap();
    let b2 = Tensor::zeros(&[3, 4, 5], &dev).unwrap();
    assert_err!(
        b1.matmul(&b2),
        Error::Shape { op: "matmul", .. },
        "[2, 3, 4]",
        "[3, 4, 5]"
    );
    let o = Tensor::zeros(&[3, 2], &other_device()).unwrap();
    assert_err!(
        a.matmul(&o),
        Error::DeviceMismatch { op: "matmul", .. },
        "other-cpu"
    );
}

/// `[b, t, 3 * h * d]` (a packed QKV projection's output) split into three `[b, h, t, d]`
/// views: `narrow` + `reshape` + `permute`, as a model written from primitive ops makes them.
fn heads(qkv: &Tensor, h: usize) -> Vec<Tensor> {
    let (b, t, w) = (qkv.shape()[0], qkv.shape()[1], qkv.shape()[2] / 3);
    (0..3)
        .map(|i| {
            qkv.narrow(2, i * w, w)
                .unwrap()
                .reshape(&[b, t, h, w / h])
                .unwrap()
                .permute(&[0, 2, 1, 3])
                .unwrap()
        })
        .collect()
}

fn nd_of(t: &Tensor) -> Nd {
    Nd::new(t.shape(), t.to_vec().unwrap())
}

/// The attention's two products over permuted head views (batch axes `[b, h]` that no single
/// stride walks) match the naive loop, with the operands read where they lie: the only memory
/// the product takes is its output.
#[test]
fn products_of_permuted_head_views_read_them_in_place() {
    for (b, t, h, d) in [(2, 5, 3, 4), (3, 8, 2, 16), (1, 7, 4, 3)] {
        let dev = Device::new_cpu("mm-heads");
        let qkv = Nd::rand(&[b, t, 3 * h * d], 7, -1.0, 1.0).tensor_as(0);
        let qkv = Tensor::from_vec(qkv.to_vec().unwrap(), &[b, t, 3 * h * d], &dev).unwrap();
        let hv = heads(&qkv, h);
        let (q, k, v) = (&hv[0], &hv[1], &hv[2]);
        assert!(!q.is_contiguous());
        let kt = k.transpose(-2, -1).unwrap();
        dev.memory().reset_peak();
        let live = dev.memory_stats().live;
        let s = q.matmul(&kt).unwrap();
        let out_bytes = 4 * b * h * t * t;
        assert_eq!(
            dev.memory_stats().peak - live,
            out_bytes,
            "the product copied an operand"
        );
        let want = matmul_ref(
            &nd_of(&q.contiguous().unwrap()),
            &nd_of(&kt.contiguous().unwrap()),
            &[b, h],
        );
        assert_nd(&s, &want, 1e-5, 1e-5);
        // scores @ v: a contiguous left operand, a permuted right one.
        let y = s.matmul(v).unwrap();
        let want = matmul_ref(&nd_of(&s), &nd_of(&v.contiguous().unwrap()), &[b, h]);
        assert_nd(&y, &want, 1e-4, 1e-4);
    }
}

/// Batch axes that even two strides do not walk (three permuted axes) still multiply right,
/// through a copy; as do two-stride batches broadcast against a plain one.
#[test]
fn products_of_any_batch_layout_match_naive() {
    let x = Nd::rand(&[3, 2, 4, 5, 6], 11, -1.0, 1.0).tensor_as(0);
    // [4, 2, 3, 5, 6], batch strides (30, 120, 240): no two strides walk it.
    let a = x.permute(&[2, 1, 0, 3, 4]).unwrap();
    let w = Nd::rand(&[6, 2], 12, -1.0, 1.0).tensor_as(0);
    let want = matmul_ref(&nd_of(&a.contiguous().unwrap()), &nd_of(&w), &[4, 2, 3]);
    assert_nd(&a.matmul(&w).unwrap(), &want, 1e-5, 1e-5);
    // [2, 3, 5, 6] (two strides) @ [3, 6, 4] broadcast over the first axis.
    let a2 = x.narrow(1, 1, 1).unwrap().reshape(&[3, 4, 5, 6]).unwrap();
    let a2 = a2.permute(&[1, 0, 2, 3]).unwrap();
    let b2 = Nd::rand(&[3, 6, 4], 13, -1.0, 1.0).tensor_as(0);
    let want = matmul_ref(&nd_of(&a2.contiguous().unwrap()), &nd_of(&b2), &[4, 3]);
    assert_nd(&a2.matmul(&b2).unwrap(), &want, 1e-5, 1e-5);
}
