//! f16 and bf16 tensors on the CPU and on wgpu (lavapipe, or the adapter
//! `WGPIPE_TEST_WGPU` names): storage, casts, memory accounting, the
//! dtype errors, and every half kernel against the f32 kernel of the same device on the same
//! (already rounded) inputs.
//!
//! Tolerance, the same for every op computed by widening (elementwise, reductions, softmax,
//! layer norm, concat, and matmul where there is no native half kernel): one unit in the last
//! place of the half dtype (2^-10 relative for f16, 2^-7 for bf16, plus f16's smallest
//! subnormal 2^-24 absolute) from the f32 result. Widening is exact and the f32 kernel sees the
//! same values, so the only error is the one rounding of the result. The native half matmul
//! (lavapipe: halves packed into the f32 subgroup kernel) may accumulate in another order than
//! the f32 run, and composite ops (conv: im2col, matmul, bias add) round intermediates, so sums
//! of products also get `2^-16 * sum_k |a_ik| |b_kj|` plus one ulp at that scale
//! ([`check_matmul`]). Without a wgpu adapter the wgpu half of each test
//! prints `SKIPPED: ...` and only the CPU runs.

use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use wgpipe_tensor::backend::AdamStep;
use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{DType, Device, Error, Tensor, UnaryOp};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

fn wgpu_device() -> Option<&'static Device> {
    static DEV: OnceLock<Result<Device, String>> = OnceLock::new();
    match DEV.get_or_init(|| Device::test_wgpu().map_err(|e| e.to_string())) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED (wgpu part): no wgpu device to test on ({e})");
            None
        }
    }
}

/// The CPU, then the wgpu test device (lavapipe, or `WGPIPE_TEST_WGPU`) when there is one.
fn devices() -> Vec<Device> {
    let mut v = vec![Device::cpu()];
    v.extend(wgpu_device().cloned());
    v
}

/// One unit in the last place of `dtype` at magnitude `v`, relative: see the module doc.
fn ulp_tol(dtype: DType, v: f32) -> f32 {
    let rel = match dtype {
        DType::F16 => 2f32.powi(-10),
        DType::BF16 => 2f32.powi(-7),
        DType::F32 => 0.0,
    };
    rel * v.abs() + 2f32.powi(-24)
}

/// `got` within `tol(i, want)` of `want`, NaN matching NaN and infinities matching exactly.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize, f32) -> f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= tol(i, w)
        };
        assert!(ok, "{what}: element {i}: half gives {g}, f32 gives {w}");
    }
}

/// Values rounded to `dtype` on the host (what a half tensor of them holds).
fn rounded(v: &[f32], dtype: DType) -> Vec<f32> {
    v.iter().map(|&x| dtype.round(x)).collect()
}

fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    wgpipe_tensor::rng::uniform_vec(seed, 0, n, lo, hi)
}

type Input = (Vec<f32>, Vec<usize>);

/// Runs `op` on inputs of `dtype` and on the same values in f32 (on `dev`), and checks the half
/// result against the f32 one within one half ulp. Panics naming the op.
fn half_vs_f32(
    what: &str,
    dev: &Device,
    dtype: DType,
    inputs: &[Input],
    op: impl Fn(&[Tensor]) -> wgpipe_tensor::Result<Tensor>,
) {
    let inputs: Vec<&Input> = inputs.iter().collect();
    compare(what, dev, dtype, &inputs, op, false);
}

/// [`half_vs_f32`] for sums of products (module doc): on top of the last rounding, the
/// accumulation order (`2^-16 * sum |a| |b|`) and one rounding of an intermediate result at most
/// that large (conv rounds its product before adding the bias); the bound `sum |a| |b|` comes
/// from the same op on the absolute values of the inputs.
fn check_matmul(
    dev: &Device,
    dtype: DType,
    inputs: &[&Input],
    op: impl Fn(&[Tensor]) -> wgpipe_tensor::Result<Tensor>,
) {
    let shapes: Vec<&Vec<usize>> = inputs.iter().map(|i| &i.1).collect();
    compare(&format!("{shapes:?}"), dev, dtype, inputs, op, true);
}

/// The body of [`half_vs_f32`] and [`check_matmul`].
fn compare(
    what: &str,
    dev: &Device,
    dtype: DType,
    inputs: &[&Input],
    op: impl Fn(&[Tensor]) -> wgpipe_tensor::Result<Tensor>,
    sum_of_products: bool,
) {
    let make = |d: DType| -> Vec<Tensor> {
        inputs
            .iter()
            .map(|(v, s)| Tensor::from_vec_in(rounded(v, dtype), s, d, dev).unwrap())
            .collect()
    };
    let want = op(&make(DType::F32)).unwrap();
    let got = op(&make(dtype)).unwrap();
    assert_eq!(got.dtype(), dtype, "{what}: result dtype");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    // The sum-of-products terms of the tolerance, per element (zero for other ops).
    let extra: Vec<f32> = if sum_of_products {
        let abs: Vec<Tensor> = make(DType::F32).iter().map(|t| t.abs().unwrap()).collect();
        let bound = op(&abs).unwrap().to_vec().unwrap();
        bound
            .iter()
            .map(|&b| ulp_tol(dtype, b) + 2f32.powi(-16) * b)
            .collect()
    } else {
        vec![0.0; want.numel()]
    };
    let what = format!("{what} ({dtype} on {})", dev.name());
    // A result past the half range must overflow as rounding the f32 result does (the recip of
    // a value near 0: f32 -74898, f16 -inf; met in a rerun of the proptest).
    let want: Vec<f32> = want
        .to_vec()
        .unwrap()
        .into_iter()
        .map(|w| match dtype.round(w) {
            r if r.is_infinite() => r,
            _ => w,
        })
        .collect();
    assert_close(&what, &got.to_vec().unwrap(), &want, |i, w| {
        ulp_tol(dtype, w) + extra[i]
    });
}

#[test]
fn casts_round_to_nearest_even_and_read_back_exactly() {
    // Halfway cases, overflow, f16 subnormals and underflow, signed zero, NaN; odd count so the
    // packed wgpu storage has a half-filled last word.
    let v = vec![
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        65504.0,
        65520.0,
        -70000.0,
        6.0e-8,
        1.0e-8,
        -0.0,
        f32::NAN,
        3.0e38,
        1.0 + 2f32.powi(-8),
        -2.5,
        0.1,
    ];
    for dev in devices() {
        for dtype in HALVES {
            let t = Tensor::from_vec_in(v.clone(), &[v.len()], dtype, &dev).unwrap();
            assert_eq!(t.dtype(), dtype);
            let got = t.to_vec().unwrap();
            let want = rounded(&v, dtype);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{dtype} on {}: element {i} ({}): got {g:e}, the half crate gives {w:e}",
                    dev.name(),
                    v[i]
                );
            }
            // Back to f32 is exact; across the two half formats rounds once more.
            let wide = t.to_dtype(DType::F32).unwrap();
            assert_eq!(wide.dtype(), DType::F32);
            let w2 = wide.to_vec().unwrap();
            assert!(w2
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan()));
            let other = if dtype == DType::F16 {
                DType::BF16
            } else {
                DType::F16
            };
            let across = t.to_dtype(other).unwrap().to_vec().unwrap();
            let want_across = rounded(&want, other);
            assert!(across
                .iter()
                .zip(&want_across)
                .all(|(a, b)| a.to_bits() == b.to_bits() || a.is_nan()));
        }
    }
}

#[test]
fn half_views_read_like_f32_views() {
    for dev in devices() {
        for dtype in HALVES {
            let v = vals(3 * 5, 3, -4.0, 4.0);
            let r = rounded(&v, dtype);
            let h = Tensor::from_vec_in(v.clone(), &[3, 5], dtype, &dev).unwrap();
            let f = Tensor::from_vec(r, &[3, 5], &dev).unwrap();
            let views = |x: &Tensor| -> Vec<Tensor> {
                vec![
                    x.t().unwrap(),
                    x.narrow(1, 1, 3).unwrap(),
                    x.narrow(0, 1, 2).unwrap().t().unwrap(),
                    x.narrow(0, 2, 1).unwrap().broadcast_to(&[4, 1, 5]).unwrap(),
                ]
            };
            for (hv, fv) in views(&h).iter().zip(views(&f)) {
                assert_eq!(hv.dtype(), dtype);
                assert_eq!(hv.to_vec().unwrap(), fv.to_vec().unwrap());
                let c = hv.contiguous().unwrap();
                assert_eq!(c.dtype(), dtype);
                assert_eq!(c.to_vec().unwrap(), fv.to_vec().unwrap());
                assert_eq!(
                    hv.to_dtype(DType::F32).unwrap().to_vec().unwrap(),
                    fv.to_vec().unwrap()
                );
            }
        }
    }
}

#[test]
fn half_tensors_charge_half_the_bytes() {
    for dev in devices() {
        let dev = dev.virtual_device("accounting", None);
        for (dtype, per) in [(DType::F32, 4), (DType::F16, 2), (DType::BF16, 2)] {
            let before = dev.memory_stats().live;
            let t = Tensor::from_vec_in(vals(1001, 1, -1.0, 1.0), &[1001], dtype, &dev).unwrap();
            assert_eq!(t.storage_bytes(), 1001 * per, "{dtype} on {}", dev.name());
            assert_eq!(dev.memory_stats().live - before, 1001 * per);
            let y = t.exp().unwrap();
            assert_eq!(y.storage_bytes(), 1001 * per);
            drop((t, y));
            assert_eq!(dev.memory_stats().live, before);
        }
    }
}

#[test]
fn a_half_op_on_a_small_view_widens_only_that_view() {
    for dev in devices() {
        let dev = dev.virtual_device("span", None);
        let big = Tensor::from_vec_in(vals(1000 * 64, 5, -1.0, 1.0), &[1000, 64], DType::F16, &dev)
            .unwrap();
        let rows = big.narrow(0, 500, 2).unwrap();
        dev.memory().reset_peak();
        let base = dev.memory_stats().live;
        let y = rows.exp().unwrap();
        // At the peak: the 128 inputs widened to f32 and the 128 f32 results (the widened inputs
        // are freed before the results are narrowed); widening the whole storage would have
        // taken 64000 * 4 bytes.
        let peak = dev.memory_stats().peak - base;
        assert_eq!(peak, 128 * 4 * 2, "on {}", dev.name());
        let want: Vec<f32> = rows
            .to_vec()
            .unwrap()
            .iter()
            .map(|v| DType::F16.round(v.exp()))
            .collect();
        let got = y.to_vec().unwrap();
        assert_close("exp of a view", &got, &want, |_, w| ulp_tol(DType::F16, w));
    }
}

#[test]
fn mixed_dtypes_are_refused_with_the_op_and_both_dtypes() {
    for dev in devices() {
        let a = Tensor::from_vec(vals(6, 1, -1.0, 1.0), &[2, 3], &dev).unwrap();
        let b = a.to_dtype(DType::F16).unwrap();
        let c = a.to_dtype(DType::BF16).unwrap();
        let cases = [
            ("add", a.add(&b).unwrap_err(), DType::F32, DType::F16),
            (
                "matmul",
                b.matmul(&c.t().unwrap()).unwrap_err(),
                DType::F16,
                DType::BF16,
            ),
            ("mul", c.mul(&a).unwrap_err(), DType::BF16, DType::F32),
        ];
        for (op, err, da, db) in cases {
            assert_eq!(
                err,
                Error::DTypeMismatch { op, a: da, b: db },
                "on {}",
                dev.name()
            );
            let msg = err.to_string();
            assert!(
                msg.contains(op) && msg.contains(da.name()) && msg.contains(db.name()),
                "{msg}"
            );
        }
        let g = Tensor::ones(&[3], &dev).unwrap();
        let err = b.layer_norm(&g, &g, 1e-5).unwrap_err();
        assert_eq!(
            err,
            Error::DTypeMismatch {
                op: "layer_norm",
                a: DType::F16,
                b: DType::F32
            }
        );
    }
}

#[test]
fn ops_without_a_half_kernel_name_op_dtype_and_backend() {
    for dev in devices() {
        let backend = if dev.is_cpu() { "cpu" } else { "wgpu" };
        let x = Tensor::from_vec_in(vals(6, 1, -1.0, 1.0), &[2, 3], DType::BF16, &dev).unwrap();
        let idx = Tensor::from_vec(vec![1.0, 0.0], &[2], &dev).unwrap();
        let err = x.index_select(0, &idx).unwrap_err();
        assert_eq!(
            err,
            Error::UnsupportedDType {
                op: "index_select",
                dtype: DType::BF16,
                backend
            }
        );
        assert!(err.to_string().contains("bf16") && err.to_string().contains(backend));
        // Optimizer steps belong on f32 master weights.
        let hp = AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            bias_correction1: 0.1,
            bias_correction2: 0.001,
        };
        let err = Tensor::adam_update(&x, &x, &x, &x, &hp).unwrap_err();
        assert!(
            matches!(
                err,
                Error::UnsupportedDType {
                    op: "adam_update",
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn unary_ops_and_their_gradients_match_f32() {
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Square,
        UnaryOp::Recip,
        UnaryOp::Affine {
            mul: 3.0,
            add: -1.0,
        },
        UnaryOp::Powf(1.5),
    ];
    for dev in devices() {
        for dtype in HALVES {
            // Positive and negative values, one of them strided (the transpose).
            let x = (vals(4 * 33, 7, -3.0, 3.0), vec![4, 33]);
            let g = (vals(4 * 33, 8, -1.0, 1.0), vec![33, 4]);
            for op in ops {
                half_vs_f32(op.name(), &dev, dtype, std::slice::from_ref(&x), |t| {
                    t[0].unary(op)
                });
                half_vs_f32(
                    &format!("{} grad", op.name()),
                    &dev,
                    dtype,
                    &[x.clone(), g.clone()],
                    |t| t[0].unary_grad(op, &t[1].t()?),
                );
            }
        }
    }
}

#[test]
fn binary_ops_broadcast_like_f32() {
    let shapes = (
        1usize..4,
        1usize..5,
        1usize..6,
        any::<[bool; 3]>(),
        any::<u64>(),
    );
    for dev in devices() {
        let mut runner = TestRunner::new(Config {
            cases: 16,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&shapes, |(a, b, c, ones, seed)| {
                // The right operand has size 1 where `ones` says, so it broadcasts there.
                let sa = vec![a, b, c];
                let sb: Vec<usize> = sa
                    .iter()
                    .zip(ones)
                    .map(|(&d, o)| if o { 1 } else { d })
                    .collect();
                let na: usize = sa.iter().product();
                let nb: usize = sb.iter().product();
                for dtype in HALVES {
                    let x = (vals(na, seed, -2.0, 2.0), sa.clone());
                    let y = (vals(nb, seed ^ 1, 0.5, 2.0), sb.clone());
                    for (name, f) in [
                        ("add", Tensor::add as fn(&Tensor, &Tensor) -> _),
                        ("sub", Tensor::sub),
                        ("mul", Tensor::mul),
                        ("div", Tensor::div),
                        ("maximum", Tensor::maximum),
                        ("gt", Tensor::gt),
                    ] {
                        half_vs_f32(name, &dev, dtype, &[x.clone(), y.clone()], |t| {
                            f(&t[0], &t[1])
                        });
                    }
                    half_vs_f32("where_cond", &dev, dtype, &[x.clone(), y.clone()], |t| {
                        Tensor::where_cond(&t[0].gt_scalar(0.0)?, &t[0], &t[1])
                    });
                    half_vs_f32("masked_fill", &dev, dtype, std::slice::from_ref(&x), |t| {
                        t[0].masked_fill(&t[0].gt_scalar(1.0)?, -7.5)
                    });
                }
                Ok::<(), TestCaseError>(())
            })
            .unwrap();
    }
}

#[test]
fn reductions_accumulate_in_f32() {
    for dev in devices() {
        for dtype in HALVES {
            let x = (vals(6 * 5 * 70, 11, -1.0, 1.0), vec![6, 5, 70]);
            for axes in [&[-1isize][..], &[0], &[0, 2], &[]] {
                half_vs_f32("sum", &dev, dtype, std::slice::from_ref(&x), |t| {
                    t[0].sum(axes, false)
                });
                half_vs_f32("mean", &dev, dtype, std::slice::from_ref(&x), |t| {
                    t[0].mean(axes, true)
                });
                half_vs_f32("max", &dev, dtype, std::slice::from_ref(&x), |t| {
                    t[0].max(axes, false)
                });
                half_vs_f32("var", &dev, dtype, std::slice::from_ref(&x), |t| {
                    t[0].var(axes, false)
                });
            }
            let am = |d: DType| {
                let t = Tensor::from_vec_in(x.0.clone(), &x.1, d, &dev).unwrap();
                t.argmax(-1, false).unwrap()
            };
            let (h, f) = (am(dtype), am(DType::F32));
            assert_eq!(h.dtype(), DType::F32, "indices stay f32");
            assert_eq!(h.shape(), f.shape());
        }
        // 4096 values of 1000: their f16 sum (4.1e6) overflows f16, their mean does not.
        let ones = Tensor::from_vec_in(vec![1000.0; 4096], &[4096], DType::F16, &dev).unwrap();
        assert_eq!(ones.mean(&[], false).unwrap().to_scalar().unwrap(), 1000.0);
        assert_eq!(ones.var(&[], false).unwrap().to_scalar().unwrap(), 0.0);
        assert!(ones
            .sum(&[], false)
            .unwrap()
            .to_scalar()
            .unwrap()
            .is_infinite());
        // 2049 ones: an f16 accumulator would stick at 2048 (2049 is not an f16); f32 gets 2049,
        // which rounds to 2048 exactly once, and 4097 ones give 4096.
        let t = Tensor::from_vec_in(vec![1.0; 4099], &[4099], DType::F16, &dev).unwrap();
        assert_eq!(t.sum(&[], false).unwrap().to_scalar().unwrap(), 4100.0);
    }
}

#[test]
fn matmul_matches_f32() {
    for dev in devices() {
        for dtype in HALVES {
            for (m, k, n) in [(1, 1, 1), (7, 33, 5), (64, 128, 48), (3, 300, 2)] {
                let a = (vals(2 * m * k, 21, -1.0, 1.0), vec![2, m, k]);
                let b = (vals(k * n, 22, -1.0, 1.0), vec![k, n]);
                let bt = (vals(k * n, 23, -1.0, 1.0), vec![n, k]);
                check_matmul(&dev, dtype, &[&a, &b], |t| t[0].matmul(&t[1]));
                check_matmul(&dev, dtype, &[&a, &bt], |t| t[0].matmul(&t[1].t()?));
                // Views that start inside their storage (the widened copy starts at 0).
                check_matmul(&dev, dtype, &[&a, &bt], |t| {
                    t[0].narrow(0, 1, 1)?
                        .matmul(&t[1].narrow(0, n / 2, n - n / 2)?.t()?)
                });
            }
        }
    }
}

#[test]
fn softmax_and_layer_norm_match_f32() {
    for dev in devices() {
        for dtype in HALVES {
            let x = (vals(5 * 77, 31, -6.0, 6.0), vec![5, 77]);
            half_vs_f32("softmax", &dev, dtype, std::slice::from_ref(&x), |t| {
                t[0].softmax(-1)
            });
            half_vs_f32(
                "softmax axis 0",
                &dev,
                dtype,
                std::slice::from_ref(&x),
                |t| t[0].softmax(0),
            );
            half_vs_f32("log_softmax", &dev, dtype, std::slice::from_ref(&x), |t| {
                t[0].log_softmax(-1)
            });
            // Rows with a large common offset: the statistics must not lose the small spread.
            let shifted = (vals(5 * 77, 32, 100.0, 104.0), vec![5, 77]);
            let g = (vals(77, 33, 0.5, 1.5), vec![77]);
            let b = (vals(77, 34, -0.5, 0.5), vec![77]);
            for x in [&x, &shifted] {
                for out in 0..3 {
                    half_vs_f32(
                        "layer_norm",
                        &dev,
                        dtype,
                        &[x.clone(), g.clone(), b.clone()],
                        |t| {
                            let (y, m, r) = t[0].layer_norm(&t[1], &t[2], 1e-5)?;
                            Ok([y, m, r][out].clone())
                        },
                    );
                }
            }
            let parts = [
                (vals(2 * 3, 41, -1.0, 1.0), vec![2, 3]),
                (vals(2 * 4, 42, -1.0, 1.0), vec![2, 4]),
            ];
            half_vs_f32("concat", &dev, dtype, &parts, |t| {
                Tensor::concat(&[&t[0], &t[1].clone()], 1)
            });
        }
    }
}

/// The fused kernels (issue 15) take the same widening path as every other op.
#[test]
fn fused_attention_rows_and_bias_activation_match_f32() {
    for dev in devices() {
        for dtype in HALVES {
            let scores = (vals(2 * 9 * 9, 51, -4.0, 4.0), vec![2, 9, 9]);
            half_vs_f32(
                "causal_softmax",
                &dev,
                dtype,
                std::slice::from_ref(&scores),
                |t| t[0].causal_softmax(0.5),
            );
            // The backward's inputs are given (one op, one rounding): softmaxed rows and a gradient.
            let y = Tensor::from_vec(scores.0.clone(), &scores.1, &dev)
                .and_then(|x| x.causal_softmax(0.5))
                .and_then(|y| y.to_vec())
                .unwrap();
            let y = (y, scores.1.clone());
            let g = (vals(2 * 9 * 9, 52, -1.0, 1.0), vec![2, 9, 9]);
            half_vs_f32("softmax_backward", &dev, dtype, &[y, g], |t| {
                Tensor::softmax_backward(&t[0], &t[1], 0.5)
            });
            let z = (vals(6 * 13, 53, -3.0, 3.0), vec![6, 13]);
            let b = (vals(13, 54, -1.0, 1.0), vec![13]);
            let gz = (vals(6 * 13, 55, -1.0, 1.0), vec![6, 13]);
            for op in [UnaryOp::Relu, UnaryOp::Gelu, UnaryOp::GeluTanh] {
                half_vs_f32("bias_act", &dev, dtype, &[z.clone(), b.clone()], |t| {
                    t[0].bias_act(&t[1], op)
                });
                half_vs_f32(
                    "bias_act_grad",
                    &dev,
                    dtype,
                    &[z.clone(), b.clone(), gz.clone()],
                    |t| Tensor::bias_act_grad(&t[0], &t[1], &t[2], op),
                );
            }
        }
    }
}

/// The fused loss and residual norm take the widening path too; targets and the loss's row
/// statistics stay f32 (they are given here as exactly representable values).
#[test]
fn fused_cross_entropy_and_residual_layer_norm_match_f32() {
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    for dev in devices() {
        for dtype in HALVES {
            let x = (vals(6 * 13, 61, -4.0, 4.0), vec![6, 13]);
            let ids = ((0..6).map(|i| ((i * 5) % 13) as f32).collect(), vec![6]);
            half_vs_f32(
                "cross_entropy",
                &dev,
                dtype,
                &[x.clone(), ids.clone()],
                |t| Ok(t[0].cross_entropy_rows(&f32_of(&t[1])?)?.0),
            );
            let stats = Tensor::from_vec(x.0.clone(), &x.1, &dev)
                .and_then(|t| t.cross_entropy_rows(&Tensor::from_vec(ids.0.clone(), &[6], &dev)?))
                .unwrap();
            let max = (stats.1.to_vec().unwrap(), vec![6]);
            let logsum = (stats.2.to_vec().unwrap(), vec![6]);
            let g = (vals(6, 62, -1.0, 1.0), vec![6]);
            half_vs_f32(
                "cross_entropy backward",
                &dev,
                dtype,
                &[x.clone(), ids.clone(), max, logsum, g],
                |t| {
                    let [tt, m, l] = [&t[1], &t[2], &t[3]].map(f32_of);
                    Tensor::cross_entropy_backward(&t[0], &tt?, &m?, &l?, &t[4])
                },
            );
            let r = (vals(6 * 13, 63, -4.0, 4.0), vec![6, 13]);
            let gamma = (vals(13, 64, 0.5, 1.5), vec![13]);
            let beta = (vals(13, 65, -1.0, 1.0), vec![13]);
            let norm_inputs = [x.clone(), r, gamma.clone(), beta];
            half_vs_f32("add_layer_norm (sum)", &dev, dtype, &norm_inputs, |t| {
                Ok(t[0].add_layer_norm(&t[1], &t[2], &t[3], 1e-5)?.0)
            });
            half_vs_f32("add_layer_norm (norm)", &dev, dtype, &norm_inputs, |t| {
                Ok(t[0].add_layer_norm(&t[1], &t[2], &t[3], 1e-5)?.1)
            });
            let mean = (vals(6, 66, -0.5, 0.5), vec![6, 1]);
            let rstd = (vals(6, 67, 0.5, 2.0), vec![6, 1]);
            let gy = (vals(6 * 13, 68, -1.0, 1.0), vec![6, 13]);
            let carry = (vals(6 * 13, 69, -1.0, 1.0), vec![6, 13]);
            half_vs_f32(
                "layer_norm backward",
                &dev,
                dtype,
                &[x.clone(), mean, rstd, gamma.clone(), gy, carry],
                |t| Tensor::layer_norm_backward(&t[0], &t[1], &t[2], &t[3], &t[4], Some(&t[5])),
            );
        }
    }
}

#[test]
fn conv_and_pooling_match_f32() {
    let conv = Conv2dParams {
        stride: (2, 1),
        padding: (1, 1),
        dilation: (1, 1),
        groups: 2,
    };
    let pool = Pool2dParams {
        kernel: (2, 3),
        stride: (2, 2),
        padding: (0, 1),
    };
    for dev in devices() {
        for dtype in HALVES {
            let x = (vals(2 * 4 * 7 * 6, 51, -1.0, 1.0), vec![2, 4, 7, 6]);
            let w = (vals(6 * 2 * 3 * 3, 52, -1.0, 1.0), vec![6, 2, 3, 3]);
            let b = (vals(6, 53, -1.0, 1.0), vec![6]);
            // Sums of products: the matmul tolerance covers their accumulation order.
            check_matmul(&dev, dtype, &[&x, &w, &b], |t| {
                t[0].conv2d(&t[1], Some(&t[2]), conv)
            });
            let y = t_shape(&dev, &x, &w, conv);
            let dy = (vals(y.iter().product(), 54, -1.0, 1.0), y);
            check_matmul(&dev, dtype, &[&dy, &w], |t| {
                Tensor::conv2d_input_grad(&t[0], &t[1], &[2, 4, 7, 6], conv)
            });
            check_matmul(&dev, dtype, &[&x, &dy], |t| {
                Tensor::conv2d_weight_grad(&t[0], &t[1], &[6, 2, 3, 3], conv)
            });
            half_vs_f32("max_pool2d", &dev, dtype, std::slice::from_ref(&x), |t| {
                Ok(t[0].max_pool2d(pool)?.0)
            });
            half_vs_f32("avg_pool2d", &dev, dtype, std::slice::from_ref(&x), |t| {
                t[0].avg_pool2d(pool)
            });
            let py = Tensor::from_vec(x.0.clone(), &x.1, &dev)
                .and_then(|t| t.avg_pool2d(pool))
                .unwrap();
            let dpy = (vals(py.numel(), 55, -1.0, 1.0), py.shape().to_vec());
            half_vs_f32(
                "avg_pool2d backward",
                &dev,
                dtype,
                std::slice::from_ref(&dpy),
                |t| Tensor::avg_pool2d_backward(&t[0], &[2, 4, 7, 6], pool),
            );
            half_vs_f32(
                "max_pool2d backward",
                &dev,
                dtype,
                &[x.clone(), dpy.clone()],
                |t| {
                    let (_, argmax) = t[0].max_pool2d(pool)?;
                    assert_eq!(argmax.dtype(), DType::F32, "argmax positions stay f32");
                    Tensor::max_pool2d_backward(&t[1], &argmax, &[2, 4, 7, 6], pool)
                },
            );
        }
    }
}

/// The output shape of `x` convolved with `w`.
fn t_shape(
    dev: &Device,
    x: &(Vec<f32>, Vec<usize>),
    w: &(Vec<f32>, Vec<usize>),
    p: Conv2dParams,
) -> Vec<usize> {
    let t = |v: &(Vec<f32>, Vec<usize>)| Tensor::from_vec(v.0.clone(), &v.1, dev).unwrap();
    t(x).conv2d(&t(w), None, p).unwrap().shape().to_vec()
}

/// Results that need no kernel (empty ones) and the fill helpers keep the operands' dtype, so a
/// half graph never meets an f32 zero it did not ask for; indices stay f32.
#[test]
fn empty_results_and_fills_keep_the_dtype() {
    for dev in devices() {
        for dtype in HALVES {
            let x = Tensor::from_vec_in(vec![], &[0, 3], dtype, &dev).unwrap();
            let w = Tensor::from_vec_in(vec![0.5; 6], &[3, 2], dtype, &dev).unwrap();
            let results = [
                ("exp", x.exp()),
                ("add", x.add(&x)),
                ("sum", x.sum(&[0], false)),
                ("matmul", x.matmul(&w)),
                ("softmax", x.softmax(-1)),
                ("concat", Tensor::concat(&[&x, &x], 0)),
                ("narrow", w.narrow(0, 0, 0).and_then(|n| n.mul_scalar(2.0))),
            ];
            for (what, y) in results {
                let y = y.unwrap();
                assert_eq!(y.dtype(), dtype, "{what} of an empty {dtype} tensor");
            }
            assert_eq!(x.argmax(1, false).unwrap().dtype(), DType::F32, "indices");
            let z = Tensor::zeros_in(&[2, 3], dtype, &dev).unwrap();
            assert_eq!((z.dtype(), z.to_vec().unwrap()), (dtype, vec![0.0; 6]));
            assert_eq!(w.zeros_like().unwrap().dtype(), dtype);
            // `full_like` rounds its value once, as a cast does: 65520 overflows f16.
            let f = w.full_like(65520.0).unwrap();
            assert_eq!(f.dtype(), dtype);
            let want = dtype.round(65520.0);
            assert!(f.to_vec().unwrap().iter().all(|&v| v == want), "{dtype}");
        }
    }
}

/// Unary ops, reductions, softmax, layer norm and matmul on random shapes (proptest, 12 cases
/// per device), each within the tolerance of the module doc: one half ulp of the f32 result,
/// plus the accumulation terms for matmul ([`check_matmul`]).
#[test]
fn row_ops_and_matmul_match_f32_on_random_shapes() {
    let cases = (1usize..6, 1usize..90, 1usize..9, 0usize..2, any::<u64>());
    for dev in devices() {
        let mut runner = TestRunner::new(Config {
            cases: 12,
            failure_persistence: None,
            ..Config::default()
        });
        runner
            .run(&cases, |(rows, cols, n, axis, seed)| {
                let axis = axis as isize;
                for dtype in HALVES {
                    let x = (vals(rows * cols, seed, -3.0, 3.0), vec![rows, cols]);
                    let one = std::slice::from_ref(&x);
                    for op in [
                        UnaryOp::Exp,
                        UnaryOp::Tanh,
                        UnaryOp::GeluTanh,
                        UnaryOp::Recip,
                    ] {
                        half_vs_f32(op.name(), &dev, dtype, one, |t| t[0].unary(op));
                    }
                    half_vs_f32("sum", &dev, dtype, one, |t| t[0].sum(&[axis], false));
                    half_vs_f32("mean", &dev, dtype, one, |t| t[0].mean(&[axis], true));
                    half_vs_f32("max", &dev, dtype, one, |t| t[0].max(&[axis], false));
                    half_vs_f32("var", &dev, dtype, one, |t| t[0].var(&[axis], false));
                    half_vs_f32("softmax", &dev, dtype, one, |t| t[0].softmax(axis));
                    half_vs_f32("log_softmax", &dev, dtype, one, |t| t[0].log_softmax(-1));
                    let g = (vals(cols, seed ^ 2, 0.5, 1.5), vec![cols]);
                    let b = (vals(cols, seed ^ 3, -0.5, 0.5), vec![cols]);
                    half_vs_f32("layer_norm", &dev, dtype, &[x.clone(), g, b], |t| {
                        Ok(t[0].layer_norm(&t[1], &t[2], 1e-5)?.0)
                    });
                    let w = (vals(cols * n, seed ^ 4, -1.0, 1.0), vec![cols, n]);
                    check_matmul(&dev, dtype, &[&x, &w], |t| t[0].matmul(&t[1]));
                }
                Ok::<(), TestCaseError>(())
            })
            .unwrap();
    }
}
