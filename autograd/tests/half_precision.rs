//! Gradients through half-precision layers. Each op runs in f16 or bf16 between two casts
//! (`x.to_dtype(half)`, op forward and backward in half, `.to_dtype(F32)`), with the loss
//! `sum(y * W)` in f32, and its input gradients are compared with the same graph run entirely in
//! f32 (whose gradients `gradcheck.rs` checks against finite differences). Tolerance: 4 units in
//! the last place of the half dtype at the largest gradient magnitude of that input (backward
//! chains of a few rounded ops, with cancellation in softmax and layer norm). The cast's own
//! gradient is checked exactly: it is the output gradient rounded to the half dtype.
//! On the CPU and, when there is one, on `Device::test_wgpu()` (lavapipe, or the adapter
//! `WGPIPE_TEST_WGPU` names; else `SKIPPED`).

use wgpipe_autograd::tensor::{DType, Device, Result, Tensor};
use wgpipe_autograd::{Tape, Var};

fn devices() -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    match Device::test_wgpu() {
        Ok(d) => v.push(d),
        Err(e) => eprintln!("SKIPPED (wgpu part): no wgpu device to test on ({e})"),
    }
    v
}

fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    wgpipe_autograd::tensor::rng::uniform_vec(seed, 0, n, lo, hi)
}

/// Input gradients of `sum(f(inputs cast to dtype), cast back to f32) * W)`, `W` fixed.
fn grads(
    dev: &Device,
    dtype: DType,
    inputs: &[(Vec<f32>, Vec<usize>)],
    f: &dyn Fn(&[Var]) -> Result<Var>,
) -> Vec<Vec<f32>> {
    let tape = Tape::new();
    let leaves: Vec<Var> = inputs
        .iter()
        .map(|(v, s)| {
            let rounded: Vec<f32> = v.iter().map(|&x| dtype.round(x)).collect();
            tape.leaf(Tensor::from_vec(rounded, s, dev).unwrap())
        })
        .collect();
    let cast: Vec<Var> = leaves.iter().map(|x| x.to_dtype(dtype).unwrap()).collect();
    let y = f(&cast).unwrap();
    assert_eq!(y.value().dtype(), dtype, "the op runs in {dtype}");
    let y = y.to_dtype(DType::F32).unwrap();
    let w = Tensor::from_vec(vals(y.numel(), 99, -1.0, 1.0), y.shape(), dev).unwrap();
    let loss = y.mul(&tape.constant(w)).unwrap().sum(&[], false).unwrap();
    let g = tape.backward(&loss).unwrap();
    leaves
        .iter()
        .map(|x| {
            let gx = g.get(x).expect("a gradient for every input");
            assert_eq!(gx.dtype(), DType::F32, "the cast returns an f32 gradient");
            gx.to_vec().unwrap()
        })
        .collect()
}

fn check(name: &str, inputs: &[(Vec<f32>, Vec<usize>)], f: impl Fn(&[Var]) -> Result<Var>) {
    for dev in devices() {
        let want = grads(&dev, DType::F32, inputs, &f);
        for dtype in [DType::F16, DType::BF16] {
            let got = grads(&dev, dtype, inputs, &f);
            let ulp = if dtype == DType::F16 {
                2f32.powi(-10)
            } else {
                2f32.powi(-7)
            };
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                let tol = 4.0 * ulp * scale;
                let worst = g
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= tol,
                    "{name} ({dtype} on {}): input {i}: max error {worst:e} over tolerance {tol:e}",
                    dev.name()
                );
            }
        }
    }
}

#[test]
fn the_cast_passes_the_gradient_back_rounded() {
    for dev in devices() {
        for dtype in [DType::F16, DType::BF16] {
            let tape = Tape::new();
            let x = tape.leaf(Tensor::from_vec(vals(9, 1, -2.0, 2.0), &[9], &dev).unwrap());
            let w = vals(9, 2, -3.0, 3.0);
            let wt = tape.constant(Tensor::from_vec(w.clone(), &[9], &dev).unwrap());
            let y = x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let loss = y.mul(&wt).unwrap().sum(&[], false).unwrap();
            let g = tape.backward(&loss).unwrap();
            let gx = g.get(&x).unwrap();
            assert_eq!(gx.dtype(), DType::F32);
            let want: Vec<f32> = w.iter().map(|&v| dtype.round(v)).collect();
            assert_eq!(gx.to_vec().unwrap(), want, "{dtype} on {}", dev.name());
            // A half leaf gets a half gradient.
            let tape = Tape::new();
            let h =
                tape.leaf(Tensor::from_vec_in(vals(9, 1, -2.0, 2.0), &[9], dtype, &dev).unwrap());
            let loss = h
                .to_dtype(DType::F32)
                .unwrap()
                .mul(&tape.constant(Tensor::from_vec(w.clone(), &[9], &dev).unwrap()))
                .unwrap()
                .sum(&[], false)
                .unwrap();
            let g = tape.backward(&loss).unwrap();
            assert_eq!(g.get(&h).unwrap().dtype(), dtype);
            // A loss that is itself half seeds a half gradient.
            let tape = Tape::new();
            let h =
                tape.leaf(Tensor::from_vec_in(vals(9, 1, -2.0, 2.0), &[9], dtype, &dev).unwrap());
            let g = tape
                .backward(&h.square().unwrap().sum(&[], false).unwrap())
                .unwrap();
            let got = g.get(&h).unwrap();
            assert_eq!(got.dtype(), dtype);
            let want: Vec<f32> = h
                .value()
                .to_vec()
                .unwrap()
                .iter()
                .map(|v| dtype.round(2.0 * v))
                .collect();
            assert_eq!(got.to_vec().unwrap(), want);
        }
    }
}

#[test]
fn elementwise_gradients_in_half_match_f32() {
    let a = (vals(4 * 6, 3, -2.0, 2.0), vec![4, 6]);
    let b = (vals(6, 4, 0.5, 2.0), vec![6]);
    check("add/mul/div broadcast", &[a.clone(), b.clone()], |v| {
        v[0].add(&v[1])?.mul(&v[1])?.div(&v[1].add_scalar(1.0)?)
    });
    check("tanh, gelu, exp, relu", std::slice::from_ref(&a), |v| {
        v[0].tanh()?
            .add(&v[0].gelu()?)?
            .add(&v[0].mul_scalar(0.5)?.exp()?)?
            .add(&v[0].relu()?)
    });
    check("sigmoid, square, sqrt", &[b], |v| {
        v[0].sigmoid()?.add(&v[0].square()?)?.mul(&v[0].sqrt()?)
    });
}

#[test]
fn reduction_gradients_in_half_match_f32() {
    let a = (vals(5 * 40, 5, -2.0, 2.0), vec![5, 40]);
    check("sum axis -1", std::slice::from_ref(&a), |v| {
        v[0].sum(&[-1], true)
    });
    check("mean axis 0", std::slice::from_ref(&a), |v| {
        v[0].mean(&[0], false)
    });
}

#[test]
fn matmul_gradients_in_half_match_f32() {
    let a = (vals(2 * 7 * 30, 6, -1.0, 1.0), vec![2, 7, 30]);
    let b = (vals(30 * 5, 7, -1.0, 1.0), vec![30, 5]);
    check("matmul", &[a.clone(), b.clone()], |v| v[0].matmul(&v[1]));
    let bt = (vals(5 * 30, 8, -1.0, 1.0), vec![5, 30]);
    check("matmul transposed", &[a, bt], |v| v[0].matmul(&v[1].t()?));
}

#[test]
fn softmax_and_layer_norm_gradients_in_half_match_f32() {
    let x = (vals(6 * 50, 9, -4.0, 4.0), vec![6, 50]);
    check("softmax", std::slice::from_ref(&x), |v| v[0].softmax(-1));
    check("log_softmax", std::slice::from_ref(&x), |v| {
        v[0].log_softmax(-1)
    });
    let g = (vals(50, 10, 0.5, 1.5), vec![50]);
    let b = (vals(50, 11, -0.5, 0.5), vec![50]);
    check("layer_norm", &[x, g, b], |v| {
        v[0].layer_norm(&v[1], &v[2], 1e-5)
    });
}

#[test]
fn conv_and_pooling_gradients_in_half_match_f32() {
    use wgpipe_autograd::tensor::ops::{Conv2dParams, Pool2dParams};
    let conv = Conv2dParams {
        stride: (1, 2),
        padding: (1, 0),
        dilation: (1, 1),
        groups: 1,
    };
    let pool = Pool2dParams {
        kernel: (2, 2),
        stride: (2, 2),
        padding: (0, 0),
    };
    let x = (vals(2 * 3 * 6 * 6, 12, -1.0, 1.0), vec![2, 3, 6, 6]);
    let w = (vals(4 * 3 * 3 * 3, 13, -1.0, 1.0), vec![4, 3, 3, 3]);
    let b = (vals(4, 14, -1.0, 1.0), vec![4]);
    check("conv2d", &[x.clone(), w, b], |v| {
        v[0].conv2d(&v[1], Some(&v[2]), conv)
    });
    check("max_pool2d", std::slice::from_ref(&x), |v| {
        v[0].max_pool2d(pool)
    });
    check("avg_pool2d", &[x], |v| v[0].avg_pool2d(pool));
}

/// The backwards that build a tensor rather than compute one: `narrow` pads its gradient with
/// zeros and `split` fills the pieces that got none with them (in the gradient's dtype), dropout
/// multiplies by its mask (cast to the input's dtype).
#[test]
fn narrow_and_dropout_gradients_in_half_match_f32() {
    let x = (vals(24, 5, -2.0, 2.0), vec![2, 3, 4]);
    check("narrow", std::slice::from_ref(&x), |v| v[0].narrow(2, 1, 2));
    check("narrow twice", std::slice::from_ref(&x), |v| {
        v[0].narrow(1, 1, 2)?.narrow(2, 0, 3)
    });
    check("split, a piece unused", std::slice::from_ref(&x), |v| {
        let p = v[0].split(3, -1)?;
        Var::concat(&[&p[1], &p[1]], 1)
    });
    let ctx = wgpipe_autograd::ForwardCtx::train(1, 0, 0);
    check("dropout", std::slice::from_ref(&x), |v| {
        v[0].dropout(0.25, &ctx, 0)
    });
}
