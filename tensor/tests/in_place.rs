//! The in-place ops (`add_assign`, `sub_assign`, `binary_assign`, `adam_update_in_place`,
//! `sgd_update_in_place`) on the CPU: bit for bit the out-of-place ops, no new memory when the
//! tensor is exclusive, and never a write another tensor (a clone or a view taken before) sees.

use wgpipe_tensor::backend::AdamStep;
use wgpipe_tensor::rng::uniform_vec;
use wgpipe_tensor::{BinaryOp, DType, Device, Tensor};

fn tensor(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
    Tensor::from_vec(
        uniform_vec(seed, 0, shape.iter().product(), -2.0, 2.0),
        shape,
        dev,
    )
    .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// A device of its own, so its memory counters see only this test.
fn fresh_device(name: &str) -> Device {
    Device::cpu().virtual_device(name, None)
}

/// `f` run with the device's peak reset: the bytes the peak rose above the live bytes at the start.
fn extra_peak_bytes(dev: &Device, f: impl FnOnce()) -> usize {
    dev.memory().reset_peak();
    let live = dev.memory_stats().live;
    f();
    dev.memory_stats().peak - live
}

fn hp(decoupled: bool, t: u32) -> AdamStep {
    let (b1, b2) = (0.9f32, 0.999f32);
    AdamStep {
        lr: 3e-3,
        beta1: b1,
        beta2: b2,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled,
        bias_correction1: 1.0 - b1.powi(t as i32),
        bias_correction2: 1.0 - b2.powi(t as i32),
    }
}

#[test]
fn binary_assign_is_bit_for_bit_binary_and_allocates_nothing_when_exclusive() {
    let dev = fresh_device("assign");
    // Big enough for the parallel path (over 32 Ki elements) and small.
    for shape in [vec![3, 5], vec![300, 130]] {
        for op in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Maximum,
        ] {
            let b = tensor(&shape, 2, &dev);
            // `other` as a contiguous tensor, a transposed view and a broadcast row.
            let bt = tensor(&[shape[1], shape[0]], 3, &dev).t().unwrap();
            let row = tensor(&[shape[1]], 4, &dev);
            for other in [&b, &bt, &row] {
                let a0 = tensor(&shape, 1, &dev);
                let want = bits(&a0.binary(op, other).unwrap());
                let mut a = tensor(&shape, 1, &dev);
                assert!(a.is_exclusive());
                let extra = extra_peak_bytes(&dev, || a.binary_assign(op, other).unwrap());
                assert_eq!(extra, 0, "{op:?} on {shape:?} allocated {extra} bytes");
                assert_eq!(bits(&a), want, "{op:?} on {shape:?}");
            }
        }
    }
}

#[test]
fn add_assign_never_changes_a_clone_or_a_view_taken_before() {
    let dev = Device::cpu();
    let g = tensor(&[64, 80], 7, &dev);
    let old = tensor(&[64, 80], 8, &dev).to_vec().unwrap();
    let want = bits(&tensor(&[64, 80], 8, &dev).add(&g).unwrap());

    let mut a = tensor(&[64, 80], 8, &dev);
    let clone = a.clone();
    assert!(!a.is_exclusive());
    a.add_assign(&g).unwrap();
    assert_eq!(clone.to_vec().unwrap(), old, "the clone changed");
    assert_eq!(bits(&a), want);
    assert!(!a.shares_storage(&clone));

    let mut a = tensor(&[64, 80], 8, &dev);
    let view = a.narrow(0, 3, 10).unwrap();
    a.sub_assign(&g).unwrap();
    assert_eq!(
        view.to_vec().unwrap(),
        old[3 * 80..13 * 80].to_vec(),
        "the view changed"
    );
    assert_eq!(bits(&a), bits(&tensor(&[64, 80], 8, &dev).sub(&g).unwrap()));

    // A view itself is never written in place, even when it is the storage's only holder.
    let mut v = tensor(&[64, 80], 8, &dev).narrow(1, 0, 40).unwrap();
    assert!(!v.is_exclusive());
    let g2 = tensor(&[64, 40], 9, &dev);
    let want = bits(&v.add(&g2).unwrap());
    v.add_assign(&g2).unwrap();
    assert_eq!(bits(&v), want);

    // A broadcast that grows `self` gives the larger result.
    let mut r = tensor(&[1, 80], 10, &dev);
    let want = bits(&r.add(&g).unwrap());
    r.add_assign(&g).unwrap();
    assert_eq!(r.shape(), &[64, 80]);
    assert_eq!(bits(&r), want);
}

#[test]
fn adam_in_place_is_bit_for_bit_adam_over_steps_and_protects_shared_tensors() {
    let dev = fresh_device("adam");
    for decoupled in [false, true] {
        for n in [7usize, 40_000] {
            let shape = [n];
            let (mut p, mut m, mut v) = (
                tensor(&shape, 1, &dev),
                Tensor::zeros(&shape, &dev).unwrap(),
                Tensor::zeros(&shape, &dev).unwrap(),
            );
            let (mut rp, mut rm, mut rv) = (p.clone(), m.clone(), v.clone());
            for t in 1..=3u32 {
                let g = tensor(&shape, 10 + u64::from(t), &dev);
                let h = hp(decoupled, t);
                // The reference drops its clones of p, m, v here (a new tensor each step).
                (rp, rm, rv) = Tensor::adam_update(&rp, &g, &rm, &rv, &h).unwrap();
                let mut in_place = false;
                let extra = extra_peak_bytes(&dev, || {
                    in_place = Tensor::adam_update_in_place(&mut p, &g, &mut m, &mut v, &h).unwrap()
                });
                assert!(in_place, "step {t}");
                assert_eq!(extra, 0, "the in-place step allocated {extra} bytes");
                assert_eq!(
                    bits(&p),
                    bits(&rp),
                    "param, step {t}, decoupled {decoupled}"
                );
                assert_eq!(bits(&m), bits(&rm), "m, step {t}");
                assert_eq!(bits(&v), bits(&rv), "v, step {t}");
            }
            // A clone of the parameter taken before a step keeps its values, and the step
            // is then made out of place.
            let kept = p.clone();
            let before = kept.to_vec().unwrap();
            let g = tensor(&shape, 99, &dev);
            let h = hp(decoupled, 4);
            let want = Tensor::adam_update(&p, &g, &m, &v, &h).unwrap();
            let in_place = Tensor::adam_update_in_place(&mut p, &g, &mut m, &mut v, &h).unwrap();
            assert!(!in_place);
            assert_eq!(kept.to_vec().unwrap(), before);
            assert_eq!(bits(&p), bits(&want.0));
            assert_eq!(bits(&m), bits(&want.1));
            assert_eq!(bits(&v), bits(&want.2));
        }
    }
}

#[test]
fn adam_in_place_refuses_mismatched_shapes_and_changes_nothing() {
    let dev = Device::cpu();
    let (mut p, mut m, mut v) = (
        tensor(&[4], 1, &dev),
        Tensor::zeros(&[4], &dev).unwrap(),
        Tensor::zeros(&[3], &dev).unwrap(),
    );
    let before = p.to_vec().unwrap();
    let g = tensor(&[4], 2, &dev);
    let e = Tensor::adam_update_in_place(&mut p, &g, &mut m, &mut v, &hp(true, 1)).unwrap_err();
    assert!(e.to_string().contains("[3]"), "{e}");
    assert_eq!(p.to_vec().unwrap(), before);
}

#[test]
fn sgd_in_place_is_bit_for_bit_sgd_and_protects_a_kept_clone() {
    let dev = fresh_device("sgd");
    for n in [5usize, 50_000] {
        let g = tensor(&[n], 2, &dev);
        let want = bits(&Tensor::sgd_update(&tensor(&[n], 1, &dev), &g, 0.125).unwrap());
        let mut p = tensor(&[n], 1, &dev);
        let mut in_place = false;
        let extra = extra_peak_bytes(&dev, || {
            in_place = Tensor::sgd_update_in_place(&mut p, &g, 0.125).unwrap()
        });
        assert!(in_place);
        assert_eq!(extra, 0);
        assert_eq!(bits(&p), want);
        // Also bit for bit the two-op form the fused step stands for.
        let two_op = tensor(&[n], 1, &dev)
            .sub(&g.mul_scalar(0.125).unwrap())
            .unwrap();
        assert_eq!(bits(&p), bits(&two_op));

        let mut p = tensor(&[n], 1, &dev);
        let kept = p.clone();
        assert!(!Tensor::sgd_update_in_place(&mut p, &g, 0.125).unwrap());
        assert_eq!(bits(&p), want);
        assert_eq!(
            kept.to_vec().unwrap(),
            tensor(&[n], 1, &dev).to_vec().unwrap()
        );
    }
}

#[test]
fn half_tensors_take_the_out_of_place_path_with_the_same_values() {
    let dev = Device::cpu();
    for dtype in [DType::F16, DType::BF16] {
        let a0 = tensor(&[33, 7], 1, &dev).to_dtype(dtype).unwrap();
        let b = tensor(&[33, 7], 2, &dev).to_dtype(dtype).unwrap();
        let want = bits(&a0.add(&b).unwrap());
        let mut a = tensor(&[33, 7], 1, &dev).to_dtype(dtype).unwrap();
        a.add_assign(&b).unwrap();
        assert_eq!(a.dtype(), dtype);
        assert_eq!(bits(&a), want);
        // Mixed dtypes are the same clear error as `add`'s.
        let f = tensor(&[33, 7], 2, &dev);
        let e = a.add_assign(&f).unwrap_err();
        assert_eq!(e.to_string(), a.add(&f).unwrap_err().to_string());
    }
}

/// `write_narrow` against the concatenation it stands for: in place (and with no new memory of
/// the buffer's size) into an exclusive host tensor, at the start, the middle and the end of
/// each axis; a copy, with the same values, when the buffer is shared (the clone keeps its own)
/// or a view; and on a wgpu device where there is one.
#[test]
fn write_narrow_equals_the_concatenation_and_writes_in_place_when_it_may() {
    let dev = fresh_device("write_narrow");
    let shape = [2, 3, 8, 4];
    for axis in 0..4 {
        let dim = shape[axis];
        for start in [0, 1, dim - 1] {
            let mut src_shape = shape;
            src_shape[axis] = 1;
            let src = tensor(&src_shape, 7, &dev);
            let want = {
                let buf = tensor(&shape, 3, &dev);
                let a = axis as isize;
                let before = buf.narrow(a, 0, start).unwrap();
                let after = buf.narrow(a, start + 1, dim - start - 1).unwrap();
                let parts: Vec<&Tensor> = [&before, &src, &after]
                    .into_iter()
                    .filter(|t| t.shape()[axis] > 0)
                    .collect();
                bits(&Tensor::concat(&parts, a).unwrap())
            };
            let mut buf = tensor(&shape, 3, &dev);
            let extra = extra_peak_bytes(&dev, || {
                assert!(buf.write_narrow(axis as isize, start, &src).unwrap());
            });
            assert_eq!(bits(&buf), want, "axis {axis} at {start}");
            // The source's host copy only: far below the buffer's 768 bytes.
            assert!(extra <= 4 * 24, "axis {axis}: {extra} bytes");
            let mut shared = tensor(&shape, 3, &dev);
            let clone = shared.clone();
            assert!(!shared.write_narrow(axis as isize, start, &src).unwrap());
            assert_eq!(bits(&shared), want);
            assert_eq!(
                bits(&clone),
                bits(&tensor(&shape, 3, &dev)),
                "the clone saw it"
            );
        }
    }
    let big = tensor(&[2, 3, 16, 4], 3, &dev);
    let mut view = big.narrow(2, 0, 8).unwrap();
    let src = tensor(&[2, 3, 1, 4], 7, &dev);
    assert!(!view.write_narrow(2, 8 - 1, &src).unwrap());
    assert_eq!(
        bits(&view.narrow(2, 7, 1).unwrap()),
        bits(&src),
        "a view is written as a copy"
    );
    let mut buf = tensor(&shape, 3, &dev);
    for (bad, start) in [
        (&[2, 3, 2, 4][..], 7),
        (&[2, 2, 1, 4][..], 0),
        (&[2, 3, 4][..], 0),
    ] {
        let e = buf
            .write_narrow(2, start, &tensor(bad, 1, &dev))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("write_narrow") && e.contains("cannot write"),
            "{e}"
        );
    }
    match Device::test_wgpu() {
        Ok(gpu) => {
            let mut on_gpu = tensor(&shape, 3, &gpu);
            let src_gpu = tensor(&[2, 3, 1, 4], 7, &gpu);
            assert!(!on_gpu.write_narrow(2, 5, &src_gpu).unwrap());
            let mut on_cpu = tensor(&shape, 3, &dev);
            on_cpu
                .write_narrow(2, 5, &tensor(&[2, 3, 1, 4], 7, &dev))
                .unwrap();
            assert_eq!(bits(&on_gpu), bits(&on_cpu));
        }
        Err(e) => eprintln!("SKIPPED (the wgpu half): no wgpu test device: {e}"),
    }
}
