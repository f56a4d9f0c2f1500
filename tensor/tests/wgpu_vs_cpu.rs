//! Every op on every wgpu adapter (lavapipe included, and any hardware adapter present) against
//! the CPU backend, with random shapes, strided views (permuted, narrowed, offset, broadcast) and
//! values. Without any adapter each test prints `SKIPPED: no wgpu adapter (<reason>)` to stderr
//! and returns.

use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use wgpipe_tensor::backend::AdamStep;
use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{BinaryOp, Device, Error, Tensor, UnaryOp};

/// Cases per property (each case runs on every adapter).
const CASES: u32 = 32;

/// The wgpu devices every test shares (opened once).
fn gpus() -> &'static Result<Vec<Device>, String> {
    static GPUS: OnceLock<Result<Vec<Device>, String>> = OnceLock::new();
    GPUS.get_or_init(open_gpus)
}

/// The shared devices, or `None` after printing why the test is skipped.
fn gpus_or_skip() -> Option<&'static [Device]> {
    match gpus() {
        Ok(d) => Some(d),
        Err(reason) => {
            eprintln!("SKIPPED: no wgpu adapter ({reason})");
            None
        }
    }
}

/// Opens a new device on lavapipe and on every hardware adapter, or says why there is none.
fn open_gpus() -> Result<Vec<Device>, String> {
    let mut devs = Vec::new();
    let mut reason = String::new();
    match Device::software_wgpu() {
        Ok(d) => devs.push(d),
        Err(e) => reason = e.to_string(),
    }
    for a in Device::adapters().iter().filter(|a| !a.is_software) {
        match Device::wgpu(a.index) {
            Ok(d) => devs.push(d),
            Err(e) => reason = format!("{reason}; {}: {e}", a.name),
        }
    }
    if devs.is_empty() {
        Err(reason)
    } else {
        Ok(devs)
    }
}

/// Runs `check` on `CASES` random values of `strategy` for every wgpu device, or says why not.
fn run<S: Strategy>(
    name: &str,
    strategy: S,
    check: impl Fn(&Device, S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: Clone,
{
    let Some(devs) = gpus_or_skip() else {
        return;
    };
    for dev in devs {
        let mut runner = TestRunner::new(Config {
            cases: CASES,
            failure_persistence: None,
            ..Config::default()
        });
        let start = std::time::Instant::now();
        if let Err(e) = runner.run(&strategy, |v| check(dev, v)) {
            panic!("{name} on {dev}: {e}");
        }
        eprintln!("{name}: {CASES} cases on {dev} in {:.2?}", start.elapsed());
    }
}

// ---------------------------------------------------------------- data and views

/// Deterministic values from `seed`: continuous in [-2, 2), or (when `discrete`) half-integers,
/// which make ties for comparisons and arg-reductions.
fn values(n: usize, seed: u64, discrete: bool) -> Vec<f32> {
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32) / (1u64 << 24) as f32; // [0, 1)
            let v = 4.0 * u - 2.0;
            if discrete {
                (v * 2.0).round() / 2.0
            } else {
                v
            }
        })
        .collect()
}

/// How an operand is laid out in memory; its logical shape is always the one asked for.
#[derive(Debug, Clone, Copy)]
enum View {
    Contiguous,
    /// Contiguous, at an element offset inside a larger storage.
    Offset,
    /// Stored with permuted axes (a transpose when rank is 2), permuted back as a view.
    Permuted(u64),
    /// One axis narrowed out of a larger one.
    Narrowed(usize),
    /// Axes chosen by the bits stored with size 1 and broadcast (stride 0).
    Broadcast(u8),
}

fn view() -> impl Strategy<Value = View> {
    prop_oneof![
        Just(View::Contiguous),
        Just(View::Offset),
        any::<u64>().prop_map(View::Permuted),
        (0usize..4).prop_map(View::Narrowed),
        any::<u8>().prop_map(View::Broadcast),
    ]
}

fn permutation(rank: usize, seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..rank).collect();
    let mut s = seed;
    for i in (1..rank).rev() {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
        p.swap(i, (s >> 33) as usize % (i + 1));
    }
    p
}

/// An operand of logical `shape` laid out as `view`, holding values from `seed` (mapped by
/// `f`); the same call on two devices gives the same logical values.
fn operand(dev: &Device, shape: &[usize], view: View, seed: u64, discrete: bool, f: Map) -> Tensor {
    let gen = |n: usize| -> Vec<f32> { values(n, seed, discrete).into_iter().map(f).collect() };
    let n: usize = shape.iter().product();
    let rank = shape.len();
    match view {
        View::Contiguous => Tensor::from_vec(gen(n), shape, dev).unwrap(),
        View::Offset => Tensor::from_vec(gen(n + 3), &[n + 3], dev)
            .unwrap()
            .narrow(0, 3, n)
            .unwrap()
            .reshape(shape)
            .unwrap(),
        View::Permuted(s) if rank >= 2 => {
            let p = permutation(rank, s);
            let stored: Vec<usize> = p.iter().map(|&i| shape[i]).collect();
            let mut inv = vec![0; rank];
            for (i, &pi) in p.iter().enumerate() {
                inv[pi] = i;
            }
            Tensor::from_vec(gen(n), &stored, dev)
                .unwrap()
                .permute(&inv)
                .unwrap()
        }
        View::Narrowed(a) if rank >= 1 => {
            let a = a % rank;
            let mut big = shape.to_vec();
            big[a] += 2;
            let m: usize = big.iter().product();
            Tensor::from_vec(gen(m), &big, dev)
                .unwrap()
                .narrow(a as isize, 1, shape[a])
                .unwrap()
        }
        View::Broadcast(bits) if rank >= 1 => {
            let small: Vec<usize> = shape
                .iter()
                .enumerate()
                .map(|(i, &d)| if bits & (1 << i) != 0 { 1 } else { d })
                .collect();
            let m: usize = small.iter().product();
            Tensor::from_vec(gen(m), &small, dev)
                .unwrap()
                .broadcast_to(shape)
                .unwrap()
        }
        _ => Tensor::from_vec(gen(n), shape, dev).unwrap(),
    }
}

/// A value map applied to generated data (keeps operands in an op's domain).
type Map = fn(f32) -> f32;

fn id(x: f32) -> f32 {
    x
}
fn positive(x: f32) -> f32 {
    x.abs() + 0.25
}

fn shape(max_rank: usize, max_dim: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, 1..=max_rank)
}

/// `got` (wgpu) against `want` (CPU): same shape, `|g - w| <= atol + rtol |w|` (NaN matches NaN,
/// infinities must be equal).
fn close(
    got: &Tensor,
    want: &Tensor,
    rtol: f32,
    atol: f32,
    what: &str,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.shape(), want.shape(), "{}: shapes", what);
    let (g, w) = (got.to_vec().unwrap(), want.to_vec().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan())
            || a == b
            || (a.is_finite() && b.is_finite() && (a - b).abs() <= atol + rtol * b.abs());
        prop_assert!(
            ok,
            "{}: element {} of {:?}: wgpu {} vs cpu {}",
            what,
            i,
            got.shape(),
            a,
            b
        );
    }
    Ok(())
}

fn cpu() -> Device {
    Device::cpu()
}

// ---------------------------------------------------------------- elementwise

/// Every unary op, from `UnaryOp::ALL` (so a new op is covered with no line here), with the
/// scalars it is tested with and the map that keeps its input in its domain. Ops not named
/// below run on [-2, 2) (a NaN on both backends counts as agreement).
fn unary_cases() -> Vec<(UnaryOp, Map)> {
    UnaryOp::ALL
        .into_iter()
        .flat_map(|op| -> Vec<(UnaryOp, Map)> {
            match op {
                UnaryOp::Log
                | UnaryOp::Sqrt
                | UnaryOp::Rsqrt
                | UnaryOp::Recip
                | UnaryOp::SqrtGradOfOutput => vec![(op, positive)],
                UnaryOp::Affine { .. } => vec![(
                    UnaryOp::Affine {
                        mul: -1.5,
                        add: 0.25,
                    },
                    id,
                )],
                UnaryOp::Powf(_) => vec![
                    (UnaryOp::Powf(2.0), id),
                    (UnaryOp::Powf(3.0), id),
                    (UnaryOp::Powf(0.5), positive),
                    (UnaryOp::Powf(-1.5), positive),
                ],
                UnaryOp::RDiv(_) => vec![(UnaryOp::RDiv(2.0), positive)],
                UnaryOp::RSub(_) => vec![(UnaryOp::RSub(1.0), id)],
                UnaryOp::MaxScalar(_) => vec![(UnaryOp::MaxScalar(0.5), id)],
                UnaryOp::MinScalar(_) => vec![(UnaryOp::MinScalar(-0.5), id)],
                UnaryOp::GtScalar(_) => vec![(UnaryOp::GtScalar(0.0), id)],
                UnaryOp::EqScalar(_) => vec![(UnaryOp::EqScalar(0.5), id)],
                op => vec![(op, id)],
            }
        })
        .collect()
}

/// Every unary op's forward kernel on one random shape and view per case.
#[test]
fn unary_ops_on_views() {
    let strat = (shape(4, 5), view(), any::<u64>(), any::<bool>());
    run("unary", strat, |dev, (shape, v, seed, discrete)| {
        for (op, f) in unary_cases() {
            let g = operand(dev, &shape, v, seed, discrete, f)
                .unary(op)
                .unwrap();
            let c = operand(&cpu(), &shape, v, seed, discrete, f)
                .unary(op)
                .unwrap();
            close(&g, &c, 1e-5, 1e-5, &format!("{op:?} {v:?}"))?;
        }
        Ok(())
    });
}

/// The backward kernel of every unary op (`g * op'(x)`, from the op's descriptor), `x` and
/// `g` both laid out as the same kind of view.
#[test]
fn unary_grads_on_views() {
    let strat = (shape(4, 5), view(), any::<u64>());
    run("unary_grad", strat, |dev, (shape, v, seed)| {
        for (op, f) in unary_cases() {
            let on = |d: &Device| {
                let x = operand(d, &shape, v, seed, false, f);
                let g = operand(d, &shape, v, seed ^ 0x5EED, false, id);
                x.unary_grad(op, &g).unwrap()
            };
            close(&on(dev), &on(&cpu()), 1e-4, 1e-4, &format!("{op:?}' {v:?}"))?;
        }
        Ok(())
    });
}

/// silu and its backward kernel on views (values in [-2, 2)).
#[test]
fn silu_and_its_grad_on_views() {
    run(
        "silu",
        (shape(4, 5), view(), any::<u64>()),
        |dev, (shape, v, seed)| {
            let on = |d: &Device| {
                let x = operand(d, &shape, v, seed, false, id);
                let g = operand(d, &shape, v, seed ^ 0x5EED, false, id);
                (x.silu().unwrap(), x.unary_grad(UnaryOp::Silu, &g).unwrap())
            };
            let ((y, dx), (cy, cdx)) = (on(dev), on(&cpu()));
            close(&y, &cy, 1e-5, 1e-5, &format!("silu {v:?}"))?;
            close(&dx, &cdx, 1e-4, 1e-4, &format!("silu' {v:?}"))
        },
    );
}

#[test]
fn binary_ops_with_broadcasting_and_views() {
    let strat = (
        shape(4, 4),
        view(),
        view(),
        any::<u64>(),
        0..BinaryOp::ALL.len(),
        any::<u8>(),
    );
    run("binary", strat, |dev, (shape, va, vb, seed, op, drop)| {
        let op = BinaryOp::ALL[op];
        // b has some axes of size 1 or fewer axes: numpy broadcasting in the op itself.
        let mut bs: Vec<usize> = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| if drop & (1 << i) != 0 { 1 } else { d })
            .collect();
        if drop & 0x80 != 0 && bs.len() > 1 {
            bs.remove(0);
        }
        let (fa, fb): (Map, Map) = match op {
            BinaryOp::Pow => (positive, id),
            BinaryOp::Div => (id, positive),
            _ => (id, id),
        };
        let pair = |d: &Device| {
            let a = operand(d, &shape, va, seed, true, fa);
            let b = operand(d, &bs, vb, seed ^ 1, true, fb);
            a.binary(op, &b).unwrap()
        };
        close(&pair(dev), &pair(&cpu()), 1e-5, 1e-5, &format!("{op:?}"))
    });
}

#[test]
fn scalar_ops_where_and_masked_fill() {
    let strat = (
        shape(3, 5),
        view(),
        view(),
        view(),
        any::<u64>(),
        -2.0f32..2.0,
    );
    run(
        "scalar/where",
        strat,
        |dev, (shape, v1, v2, v3, seed, s)| {
            let all = |d: &Device| -> Vec<Tensor> {
                let x = operand(d, &shape, v1, seed, true, id);
                let y = operand(d, &shape, v2, seed ^ 5, false, id);
                let m = operand(d, &shape, v3, seed ^ 9, true, id)
                    .gt_scalar(0.0)
                    .unwrap();
                vec![
                    x.add_scalar(s).unwrap(),
                    x.sub_scalar(s).unwrap(),
                    x.mul_scalar(s).unwrap(),
                    x.div_scalar(s.abs() + 0.5).unwrap(),
                    x.affine(s, -s).unwrap(),
                    x.maximum_scalar(s).unwrap(),
                    x.minimum_scalar(s).unwrap(),
                    x.rsub_scalar(s).unwrap(),
                    x.gt_scalar(s.round()).unwrap(),
                    x.eq_scalar(0.5).unwrap(),
                    Tensor::where_cond(&m, &x, &y).unwrap(),
                    x.masked_fill(&m, s).unwrap(),
                    x.contiguous().unwrap(),
                ]
            };
            for (i, (g, c)) in all(dev).iter().zip(all(&cpu())).enumerate() {
                close(g, &c, 1e-5, 1e-5, &format!("scalar op #{i}"))?;
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------- reductions, softmax, norm

#[test]
fn reductions_over_random_axes() {
    let strat = (
        shape(4, 6),
        view(),
        any::<u64>(),
        any::<u8>(),
        any::<bool>(),
        any::<bool>(),
    );
    run(
        "reduce",
        strat,
        |dev, (shape, v, seed, axes_bits, keep, discrete)| {
            let rank = shape.len();
            let axes: Vec<isize> = (0..rank)
                .filter(|i| axes_bits & (1 << i) != 0)
                .map(|i| i as isize)
                .collect();
            let one = (axes_bits as usize % rank) as isize - rank as isize; // a negative axis
            let all = |d: &Device| -> Vec<Tensor> {
                let x = operand(d, &shape, v, seed, discrete, id);
                vec![
                    x.sum(&axes, keep).unwrap(),
                    x.mean(&axes, keep).unwrap(),
                    x.max(&axes, keep).unwrap(),
                    x.min(&axes, keep).unwrap(),
                    x.var(&axes, keep).unwrap(),
                    x.argmax(one, keep).unwrap(),
                    x.argmin(one, keep).unwrap(),
                    x.sum_all().unwrap(),
                    x.mean_all().unwrap(),
                ]
            };
            let names = [
                "sum", "mean", "max", "min", "var", "argmax", "argmin", "sum_all", "mean_all",
            ];
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
                close(
                    g,
                    &c,
                    1e-4,
                    1e-4,
                    &format!("{name} axes {axes:?} keep {keep}"),
                )?;
            }
            Ok(())
        },
    );
}

#[test]
fn softmax_log_softmax_layer_norm() {
    let strat = (shape(3, 7), view(), view(), any::<u64>(), any::<u8>());
    run(
        "softmax/layer_norm",
        strat,
        |dev, (mut shape, v, vg, seed, axis)| {
            if axis & 0x80 != 0 {
                // now and then a row longer than one workgroup
                *shape.last_mut().unwrap() = 300 + (seed % 300) as usize;
            }
            let axis = (axis as usize % shape.len()) as isize;
            let d = *shape.last().unwrap();
            let all = |dv: &Device| -> Vec<Tensor> {
                let x = operand(dv, &shape, v, seed, false, |x| 3.0 * x);
                // Rows broadcast from one value have zero variance: y would be rounding noise
                // times 1/sqrt(eps), so layer norm gets a view whose rows vary.
                let xl = match v {
                    View::Broadcast(_) => operand(dv, &shape, View::Offset, seed, false, id),
                    _ => x.clone(),
                };
                let gamma = operand(dv, &[d], vg, seed ^ 2, false, id);
                let beta = operand(dv, &[d], View::Offset, seed ^ 3, false, id);
                let (y, mean, rstd) = xl.layer_norm(&gamma, &beta, 1e-5).unwrap();
                vec![
                    x.softmax(axis).unwrap(),
                    x.log_softmax(axis).unwrap(),
                    y,
                    mean,
                    rstd,
                ]
            };
            let names = ["softmax", "log_softmax", "layer_norm y", "mean", "rstd"];
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
                close(g, &c, 1e-4, 1e-5, &format!("{name} axis {axis}"))?;
            }
            Ok(())
        },
    );
}

#[test]
fn bias_act_and_its_grad() {
    let strat = (shape(3, 9), view(), view(), any::<u64>(), 0usize..3);
    run(
        "bias_act/bias_act_grad",
        strat,
        |dev, (shape, v, vg, seed, which)| {
            let op = wgpipe_tensor::BIAS_ACTIVATIONS[which];
            let n = *shape.last().unwrap();
            let all = |dv: &Device| -> Vec<Tensor> {
                let z = operand(dv, &shape, v, seed, false, |x| 3.0 * x);
                let b = operand(dv, &[n], View::Offset, seed ^ 3, false, id);
                let g = operand(dv, &shape, vg, seed ^ 5, false, id);
                vec![
                    z.bias_act(&b, op).unwrap(),
                    Tensor::bias_act_grad(&z, &b, &g, op).unwrap(),
                ]
            };
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(["y", "dz"]) {
                close(g, &c, 1e-4, 1e-5, &format!("bias_act {} {name}", op.name()))?;
            }
            Ok(())
        },
    );
}

#[test]
fn causal_softmax_and_softmax_backward() {
    let strat = (
        prop::collection::vec(1usize..4, 0..3),
        1usize..40,
        view(),
        view(),
        any::<u64>(),
        any::<bool>(),
    );
    run(
        "causal_softmax/softmax_backward",
        strat,
        |dev, (batch, mut t, v, vg, seed, long)| {
            if long {
                // now and then rows longer than one workgroup
                t = 300 + (seed % 100) as usize;
            }
            let mut shape = batch;
            shape.extend([t, t]);
            let scale = 0.1 + (seed % 29) as f32 / 10.0;
            let all = |dv: &Device| -> Vec<Tensor> {
                let x = operand(dv, &shape, v, seed, false, |x| 3.0 * x);
                let y = x.causal_softmax(scale).unwrap();
                let g = operand(dv, &shape, vg, seed ^ 5, false, id);
                let dx = Tensor::softmax_backward(&y, &g, scale).unwrap();
                vec![y, dx]
            };
            let names = ["causal_softmax", "softmax_backward"];
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
                close(
                    g,
                    &c,
                    1e-4,
                    1e-5,
                    &format!("{name} of {shape:?} scale {scale}"),
                )?;
            }
            Ok(())
        },
    );
}

#[test]
fn cross_entropy_and_its_backward() {
    let strat = (1usize..9, 1usize..40, view(), any::<u64>(), any::<bool>());
    run(
        "cross_entropy/backward",
        strat,
        |dev, (n, mut c, v, seed, long)| {
            if long {
                // now and then rows longer than one workgroup
                c = 300 + (seed % 100) as usize;
            }
            let ids: Vec<f32> = (0..n)
                .map(|i| ((seed as usize + i * 7) % c) as f32)
                .collect();
            let all = |dv: &Device| -> Vec<Tensor> {
                let x = operand(dv, &[n, c], v, seed, false, |x| 4.0 * x);
                let t = Tensor::from_slice(&ids, &[n], dv).unwrap();
                let g = operand(dv, &[n], View::Contiguous, seed ^ 5, false, id);
                let (loss, max, logsum) = x.cross_entropy_rows(&t).unwrap();
                let dx = Tensor::cross_entropy_backward(&x, &t, &max, &logsum, &g).unwrap();
                vec![loss, max, logsum, dx]
            };
            let names = ["loss", "max", "logsum", "dx"];
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
                close(
                    g,
                    &c,
                    1e-4,
                    1e-5,
                    &format!("cross_entropy {name} of [{n}, {c:?}]"),
                )?;
            }
            Ok(())
        },
    );
}

#[test]
fn add_layer_norm_and_layer_norm_backward() {
    let strat = (
        shape(3, 5),
        1usize..40,
        view(),
        view(),
        any::<u64>(),
        any::<bool>(),
    );
    run(
        "add_layer_norm/layer_norm_backward",
        strat,
        |dev, (mut shape, mut d, v, vr, seed, long)| {
            if long {
                d = 300 + (seed % 100) as usize;
            }
            shape.push(d);
            let all = |dv: &Device| -> Vec<Tensor> {
                let x = operand(dv, &shape, v, seed, false, |x| 2.0 * x);
                // Two views both broadcast along the row sum to a constant row: zero variance,
                // so y would be rounding noise times 1/sqrt(eps) (CI met it). The residual gets a
                // view whose rows vary; constant rows have their own exact test below.
                let vr_sum = match vr {
                    View::Broadcast(_) => View::Offset,
                    other => other,
                };
                let r = operand(dv, &shape, vr_sum, seed ^ 1, false, id);
                let gamma = operand(dv, &[d], View::Contiguous, seed ^ 2, false, positive);
                let beta = operand(dv, &[d], View::Offset, seed ^ 3, false, id);
                let g = operand(dv, &shape, vr, seed ^ 4, false, id);
                let carry = operand(dv, &shape, v, seed ^ 6, false, id);
                let (s, y, mean, rstd) = x.add_layer_norm(&r, &gamma, &beta, 1e-5).unwrap();
                let dx = Tensor::layer_norm_backward(&s, &mean, &rstd, &gamma, &g, None).unwrap();
                let dxc = Tensor::layer_norm_backward(&s, &mean, &rstd, &gamma, &g, Some(&carry))
                    .unwrap();
                vec![s, y, mean, rstd, dx, dxc]
            };
            let names = ["sum", "y", "mean", "rstd", "dx", "dx + carry"];
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
                close(g, &c, 1e-4, 1e-4, &format!("{name} of {shape:?}"))?;
            }
            Ok(())
        },
    );
}

/// A constant row has zero variance: y must be exactly beta on every backend (the sum and the
/// mean of equal, representable values are exact when the row length is a power of two).
#[test]
fn add_layer_norm_of_a_constant_row_is_beta() {
    let Some(devs) = gpus_or_skip() else {
        return;
    };
    for d in [8usize, 256, 512] {
        let beta_vals: Vec<f32> = values(d, 11, false);
        let all = |dv: &Device| -> Vec<f32> {
            let x = Tensor::from_vec(vec![1.0; 2 * d], &[2, d], dv).unwrap();
            let r = Tensor::from_vec(vec![0.5; 2 * d], &[2, d], dv).unwrap();
            let gamma = Tensor::from_vec(values(d, 7, false), &[d], dv).unwrap();
            let beta = Tensor::from_slice(&beta_vals, &[d], dv).unwrap();
            let (_, y, _, _) = x.add_layer_norm(&r, &gamma, &beta, 1e-5).unwrap();
            y.to_vec().unwrap()
        };
        let want: Vec<f32> = beta_vals.iter().chain(&beta_vals).copied().collect();
        assert_eq!(all(&cpu()), want, "cpu, row of {d}");
        for dev in devs {
            assert_eq!(all(dev), want, "{dev}, row of {d}");
        }
    }
}

/// Column sums (`sum` over leading axes of a contiguous tensor: bias gradients) go through
/// `sum_leading`, which sums chunks of rows and then the chunks' partials, pass after pass. Tall,
/// narrow matrices take several passes; a view with an offset reads from it. Half-integer values
/// make every partial sum exact, so any order of summation gives the f64 result exactly.
#[test]
fn column_sums_over_several_passes_and_offsets() {
    let Some(devs) = gpus_or_skip() else {
        return;
    };
    for (rows, width, skip) in [
        (70_000usize, 3usize, 0usize),
        (1, 5, 0),
        (300, 1000, 0),
        (2, 65_536, 0),
        (1000, 17, 3),
    ] {
        let total = (rows + skip) * width;
        let vals = values(total, rows as u64, true);
        let want: Vec<f32> = (0..width)
            .map(|j| {
                (skip..rows + skip)
                    .map(|i| f64::from(vals[i * width + j]))
                    .sum::<f64>() as f32
            })
            .collect();
        for dev in devs.iter().chain([&cpu()]) {
            let all = Tensor::from_slice(&vals, &[rows + skip, width], dev).unwrap();
            let x = all.narrow(0, skip, rows).unwrap();
            assert!(x.is_contiguous());
            let got = x.sum(&[0], false).unwrap().to_vec().unwrap();
            assert_eq!(
                got, want,
                "{dev}: columns of [{rows}, {width}] after {skip} rows"
            );
        }
    }
}

// ---------------------------------------------------------------- matmul

#[test]
fn matmul_batched_broadcast_transposed() {
    let strat = (
        1usize..4,
        1usize..70,
        1usize..70,
        1usize..70,
        any::<bool>(),
        any::<bool>(),
        0u8..3,
        any::<u64>(),
    );
    run(
        "matmul",
        strat,
        |dev, (batch, m, k, n, ta, tb, bmode, seed)| {
            let make = |d: &Device| {
                // a: [batch, m, k] (stored transposed when ta); b: [k, n], [1, k, n] or [batch, k, n]
                let a = if ta {
                    operand(d, &[batch, k, m], View::Contiguous, seed, false, id)
                        .transpose(-1, -2)
                        .unwrap()
                } else {
                    operand(d, &[batch, m, k], View::Offset, seed, false, id)
                };
                let bshape: Vec<usize> = match bmode {
                    0 => vec![k, n],
                    1 => vec![1, k, n],
                    _ => vec![batch, k, n],
                };
                let b = if tb {
                    let mut st = bshape.clone();
                    let r = st.len();
                    st.swap(r - 1, r - 2);
                    operand(d, &st, View::Contiguous, seed ^ 7, false, id)
                        .transpose(-1, -2)
                        .unwrap()
                } else {
                    operand(d, &bshape, View::Contiguous, seed ^ 7, false, id)
                };
                a.matmul(&b).unwrap()
            };
            close(
                &make(dev),
                &make(&cpu()),
                1e-4,
                1e-4 * k as f32,
                &format!("{batch}x{m}x{k}x{n}"),
            )
        },
    );
}

// ---------------------------------------------------------------- index ops

#[test]
fn index_gather_scatter_concat() {
    let strat = (shape(3, 5), any::<u64>(), any::<u8>(), 1usize..7, view());
    run("index", strat, |dev, (shape, seed, axis, n, v)| {
        let rank = shape.len();
        let axis = axis as usize % rank;
        let dim = shape[axis];
        let idx_vals: Vec<f32> = values(n, seed ^ 11, false)
            .iter()
            .map(|u| ((u + 2.0) / 4.0 * dim as f32).floor().min(dim as f32 - 1.0))
            .collect();
        let mut gshape = shape.clone();
        gshape[axis] = n;
        let gidx_vals: Vec<f32> = values(gshape.iter().product(), seed ^ 13, false)
            .iter()
            .map(|u| ((u + 2.0) / 4.0 * dim as f32).floor().min(dim as f32 - 1.0))
            .collect();
        let ax = axis as isize;
        let all = |d: &Device| -> Vec<Tensor> {
            let x = operand(d, &shape, v, seed, false, id);
            let idx = Tensor::from_vec(idx_vals.clone(), &[n], d).unwrap();
            let gidx = Tensor::from_vec(gidx_vals.clone(), &gshape, d).unwrap();
            let src = operand(d, &gshape, View::Contiguous, seed ^ 17, false, id);
            let y = operand(d, &shape, View::Contiguous, seed ^ 19, false, id);
            vec![
                x.index_select(ax, &idx).unwrap(),
                Tensor::index_add(ax, &idx, &src, dim).unwrap(),
                x.gather(ax, &gidx).unwrap(),
                Tensor::scatter_add(ax, &gidx, &src, dim).unwrap(),
                idx.one_hot(dim).unwrap(),
                Tensor::concat(&[&x, &y, &x], ax).unwrap(),
                Tensor::stack(&[&x, &y], ax).unwrap(),
            ]
        };
        let names = [
            "index_select",
            "index_add",
            "gather",
            "scatter_add",
            "one_hot",
            "concat",
            "stack",
        ];
        for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
            close(g, &c, 1e-5, 1e-5, &format!("{name} axis {axis}"))?;
        }
        Ok(())
    });
}

// ---------------------------------------------------------------- conv and pooling

#[test]
fn conv2d_and_its_gradients() {
    let strat = (
        1usize..3, // n
        1usize..3, // channels per group in
        1usize..3, // channels per group out
        1usize..3, // groups
        3usize..8, // h
        3usize..8, // w
        1usize..4, // kernel
        1usize..3, // stride
        0usize..2, // padding
        1usize..3, // dilation
        any::<u64>(),
    );
    run(
        "conv2d",
        strat,
        |dev, (n, cig, cog, groups, h, w, k, s, p, dil, seed)| {
            let (c_in, c_out) = (cig * groups, cog * groups);
            prop_assume!(h + 2 * p > dil * (k - 1) && w + 2 * p > dil * (k - 1));
            let params = Conv2dParams {
                stride: (s, s),
                padding: (p, p),
                dilation: (dil, dil),
                groups,
            };
            let all = |d: &Device| -> Vec<Tensor> {
                let x = operand(d, &[n, c_in, h, w], View::Contiguous, seed, false, id);
                let wt = operand(
                    d,
                    &[c_out, cig, k, k],
                    View::Contiguous,
                    seed ^ 3,
                    false,
                    id,
                );
                let bias = operand(d, &[c_out], View::Contiguous, seed ^ 5, false, id);
                let y = x.conv2d(&wt, Some(&bias), params).unwrap();
                let dy = operand(d, y.shape(), View::Contiguous, seed ^ 7, false, id);
                let dx = Tensor::conv2d_input_grad(&dy, &wt, x.shape(), params).unwrap();
                let dw = Tensor::conv2d_weight_grad(&x, &dy, wt.shape(), params).unwrap();
                vec![y, dx, dw]
            };
            for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(["y", "dx", "dw"]) {
                close(g, &c, 1e-4, 1e-4, &format!("conv2d {name}"))?;
            }
            Ok(())
        },
    );
}

#[test]
fn pooling_and_backward() {
    let strat = (
        1usize..3,
        1usize..4,
        2usize..9,
        2usize..9,
        1usize..4,
        1usize..3,
        0usize..2,
        any::<u64>(),
    );
    run("pool", strat, |dev, (n, c, h, w, k, s, p, seed)| {
        prop_assume!(2 * p <= k && h + 2 * p >= k && w + 2 * p >= k);
        let params = Pool2dParams {
            kernel: (k, k),
            stride: (s, s),
            padding: (p, p),
        };
        let shape = [n, c, h, w];
        let all = |d: &Device| -> Vec<Tensor> {
            let x = operand(d, &shape, View::Contiguous, seed, true, id);
            let (y, arg) = x.max_pool2d(params).unwrap();
            let dy = operand(d, y.shape(), View::Contiguous, seed ^ 3, false, id);
            let dx = Tensor::max_pool2d_backward(&dy, &arg, &shape, params).unwrap();
            let ya = x.avg_pool2d(params).unwrap();
            let dxa = Tensor::avg_pool2d_backward(&dy, &shape, params).unwrap();
            vec![y, arg, dx, ya, dxa]
        };
        let names = ["max", "argmax", "max backward", "avg", "avg backward"];
        for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(names) {
            close(g, &c, 1e-5, 1e-5, &format!("pool {name}"))?;
        }
        Ok(())
    });
}

// ---------------------------------------------------------------- dropout and Adam

#[test]
fn dropout_masks_are_bit_identical() {
    let strat = (shape(3, 40), 0.0f32..0.95, any::<u64>(), any::<u64>());
    run("dropout", strat, |dev, (shape, p, seed, offset)| {
        let g = Tensor::dropout_mask(&shape, p, seed, offset, dev)
            .unwrap()
            .to_vec()
            .unwrap();
        let c = Tensor::dropout_mask(&shape, p, seed, offset, &cpu())
            .unwrap()
            .to_vec()
            .unwrap();
        let gb: Vec<u32> = g.iter().map(|v| v.to_bits()).collect();
        let cb: Vec<u32> = c.iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(gb, cb);
        Ok(())
    });
}

#[test]
fn adam_update_matches() {
    let strat = (
        shape(2, 30),
        any::<u64>(),
        1i32..100,
        any::<bool>(),
        0.0f32..0.1,
    );
    run("adam", strat, |dev, (shape, seed, t, decoupled, wd)| {
        let hp = AdamStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: wd,
            decoupled,
            bias_correction1: 1.0 - 0.9f32.powi(t),
            bias_correction2: 1.0 - 0.999f32.powi(t),
        };
        let all = |d: &Device| -> Vec<Tensor> {
            let p = operand(d, &shape, View::Contiguous, seed, false, id);
            let g = operand(d, &shape, View::Contiguous, seed ^ 1, false, id);
            let m = operand(d, &shape, View::Contiguous, seed ^ 2, false, |x| x * 0.1);
            let v = operand(d, &shape, View::Contiguous, seed ^ 3, false, |x| {
                x * x * 0.01
            });
            let (a, b, c) = Tensor::adam_update(&p, &g, &m, &v, &hp).unwrap();
            vec![a, b, c]
        };
        for ((g, c), name) in all(dev).iter().zip(all(&cpu())).zip(["param", "m", "v"]) {
            close(g, &c, 1e-5, 1e-6, &format!("adam {name}"))?;
        }
        Ok(())
    });
}

/// The in-place ops on wgpu: bit for bit the out-of-place kernels on the same device (every
/// elementwise layout: vec4, contiguous, strided operand) and within the usual tolerance of
/// the CPU; a clone taken before keeps its values.
#[test]
fn in_place_updates_match_and_spare_shared_buffers() {
    let Some(devs) = gpus_or_skip() else {
        return;
    };
    let to_bits =
        |t: &Tensor| -> Vec<u32> { t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect() };
    for dev in devs {
        // [8, 12] runs the vec4 layout, [7, 5] the scalar one; the transposed operand the
        // strided one.
        for shape in [[8usize, 12], [7, 5]] {
            let n = shape[0] * shape[1];
            let make = |seed: u64| Tensor::from_vec(values(n, seed, false), &shape, dev).unwrap();
            let xt = Tensor::from_vec(values(n, 5, false), &[shape[1], shape[0]], dev)
                .unwrap()
                .t()
                .unwrap();
            for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul] {
                for x in [make(2), xt.clone()] {
                    let want = make(1).binary(op, &x).unwrap();
                    let mut acc = make(1);
                    assert!(acc.is_exclusive());
                    acc.binary_assign(op, &x).unwrap();
                    assert_eq!(to_bits(&acc), to_bits(&want), "{op:?} {shape:?} on {dev}");
                    let on_cpu = make(1)
                        .to_device(&cpu())
                        .unwrap()
                        .binary(op, &x.to_device(&cpu()).unwrap())
                        .unwrap();
                    close(&acc, &on_cpu, 1e-6, 1e-6, "binary_assign vs cpu").unwrap();
                }
                let mut acc = make(1);
                let kept = acc.clone();
                acc.binary_assign(op, &make(2)).unwrap();
                assert_eq!(
                    to_bits(&kept),
                    to_bits(&make(1)),
                    "a clone changed on {dev}"
                );
            }
            for decoupled in [false, true] {
                let hp = AdamStep {
                    lr: 1e-2,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.05,
                    decoupled,
                    bias_correction1: 1.0 - 0.9f32.powi(3),
                    bias_correction2: 1.0 - 0.999f32.powi(3),
                };
                let g = make(11);
                let moments = || (make(12).mul_scalar(0.1).unwrap(), make(13).abs().unwrap());
                let (m0, v0) = moments();
                let want = Tensor::adam_update(&make(10), &g, &m0, &v0, &hp).unwrap();
                let (mut p, (mut m, mut v)) = (make(10), moments());
                assert!(Tensor::adam_update_in_place(&mut p, &g, &mut m, &mut v, &hp).unwrap());
                for (got, want, name) in
                    [(&p, &want.0, "p"), (&m, &want.1, "m"), (&v, &want.2, "v")]
                {
                    assert_eq!(to_bits(got), to_bits(want), "adam {name} on {dev}");
                }
                let kept = p.clone();
                assert!(!Tensor::adam_update_in_place(&mut p, &g, &mut m, &mut v, &hp).unwrap());
                assert_eq!(
                    to_bits(&kept),
                    to_bits(&want.0),
                    "a kept param changed on {dev}"
                );
            }
        }
        dev.synchronize().unwrap();
    }
}

// ---------------------------------------------------------------- transfers and errors

#[test]
fn transfers_between_devices() {
    let strat = (shape(4, 6), view(), any::<u64>());
    run("transfer", strat, |dev, (shape, v, seed)| {
        let c = operand(&cpu(), &shape, v, seed, false, id);
        let g = c.to_device(dev).unwrap();
        prop_assert_eq!(g.to_vec().unwrap(), c.to_vec().unwrap());
        let back = operand(dev, &shape, v, seed, false, id)
            .to_device(&cpu())
            .unwrap();
        prop_assert_eq!(back.to_vec().unwrap(), c.to_vec().unwrap());
        Ok(())
    });
}

#[test]
fn oversized_allocations_are_errors_not_panics() {
    // Devices of its own: the shared ones' live bytes move with the tests running beside it.
    let devs = match open_gpus() {
        Ok(d) => d,
        Err(reason) => {
            eprintln!("SKIPPED: no wgpu adapter ({reason})");
            return;
        }
    };
    for dev in &devs {
        // 2^33 elements: past every adapter's u32 indexing and buffer limits.
        let before = dev.memory_stats().live;
        match Tensor::zeros(&[1 << 33], dev) {
            Err(Error::Wgpu { device, msg }) => {
                assert_eq!(device, dev.name());
                eprintln!("{device}: {msg}");
            }
            other => panic!("expected Error::Wgpu, got {other:?}"),
        }
        assert_eq!(
            dev.memory_stats().live,
            before,
            "the failed allocation was released"
        );
        // the device still works
        let x = Tensor::ones(&[3], dev).unwrap().add_scalar(1.0).unwrap();
        assert_eq!(x.to_vec().unwrap(), vec![2.0; 3]);
        dev.synchronize().unwrap();
    }
}
