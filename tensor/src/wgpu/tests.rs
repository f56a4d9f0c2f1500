//! Crate-internal tests of the wgpu kernels, through the `Kernels` trait, against values
//! computed here in plain Rust (independent of the CPU backend). Each test runs on
//! `Device::test_wgpu()` (lavapipe, or the adapter `WGPIPE_TEST_WGPU` names) and prints
//! `SKIPPED: ...` when there is none.

use wgpipe_shaders::{Kernel, MatmulConfig, OperandLoad, RowGroup};

use super::kernels::gpu;
use super::runtime::Arg;
use super::WgpuContext;
use crate::backend::*;
use crate::dtype::DType;
use crate::error::Error;
use crate::layout::Layout;
use crate::raw::RawTensor;
// The tests build their operands through the crate's public types.
use crate::{Device, Tensor};

#[path = "../../tests/common/gelu_ref.rs"]
mod gelu_ref;
use gelu_ref::{gelu_exact_grad_ref, gelu_exact_ref, gelu_tanh, gelu_tanh_grad};

fn device() -> Option<Device> {
    match Device::test_wgpu() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: no wgpu adapter ({e})");
            None
        }
    }
}

fn ctx(d: &Device) -> &WgpuContext {
    d.wgpu_context().expect("a wgpu device")
}

fn k(d: &Device) -> &dyn Kernels {
    d.kernels()
}

fn t(d: &Device, data: &[f32], shape: &[usize]) -> RawTensor {
    k(d).from_host(d.memory(), data, shape).unwrap()
}

fn host(d: &Device, x: &RawTensor) -> Vec<f32> {
    k(d).to_host(x).unwrap()
}

/// Deterministic pseudo-random values in [-1, 1).
fn vals(n: usize, seed: u64) -> Vec<f32> {
    crate::rng::uniform_vec(seed, 0, n, -1.0, 1.0)
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

/// The logical elements of a view, read on the host from the full storage.
fn view_values(storage: &[f32], l: &Layout) -> Vec<f32> {
    l.indices().map(|i| storage[i]).collect()
}

#[test]
fn adapters_are_listed_stably() {
    let a = super::list_adapters();
    let b = super::list_adapters();
    assert_eq!(a, b);
    for (i, info) in a.iter().enumerate() {
        assert_eq!(info.index, i);
        eprintln!("adapter {i}: {info:?}");
    }
}

#[test]
fn upload_read_fill_and_views() {
    let Some(d) = device() else { return };
    let data = vals(24, 1);
    let x = t(&d, &data, &[2, 3, 4]);
    assert_eq!(host(&d, &x), data);
    assert_eq!(
        host(&d, &k(&d).fill(d.memory(), &[3, 5], 2.5).unwrap()),
        vec![2.5; 15]
    );
    // permuted, narrowed, broadcast views read through the strided copy
    let p = x.permute(&[2, 0, 1]).unwrap();
    assert_eq!(host(&d, &p), view_values(&data, p.layout()));
    let n = x.narrow(2, 1, 2).unwrap().narrow(0, 1, 1).unwrap();
    assert_eq!(host(&d, &n), view_values(&data, n.layout()));
    let b = x
        .narrow(1, 2, 1)
        .unwrap()
        .broadcast_to(&[3, 2, 3, 4])
        .unwrap();
    assert_eq!(host(&d, &b), view_values(&data, b.layout()));
    // empty tensors
    let e = t(&d, &[], &[0, 3]);
    assert!(host(&d, &e).is_empty());
    d.synchronize().unwrap();
}

#[test]
fn memory_is_charged_to_the_device() {
    let Some(d) = device() else { return };
    let v = d.virtual_device("sim", Some(1000));
    let before = v.memory_stats().live;
    let x = k(&v).fill(v.memory(), &[100], 1.0).unwrap();
    assert_eq!(v.memory_stats().live - before, 400);
    let e = k(&v).fill(v.memory(), &[200], 1.0).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    drop(x);
    assert_eq!(v.memory_stats().live, before);
}

fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

#[test]
fn every_unary_op() {
    let Some(d) = device() else { return };
    let mut data: Vec<f32> = vals(60, 2).iter().map(|v| v * 3.0).collect();
    data.extend([
        0.0, 1.0, -2.0, 0.5, 30.0, -30.0, 0.25, -0.25, 2.0, -1.0, 1.5, 0.75,
    ]);
    let pos: Vec<f32> = data.iter().map(|v| v.abs() + 0.1).collect();
    let x = t(&d, &data, &[6, 12]);
    let xp = t(&d, &pos, &[6, 12]);
    let b = |v: bool| if v { 1.0 } else { 0.0 };
    #[allow(clippy::type_complexity)]
    let cases: Vec<(UnaryOp, bool, Box<dyn Fn(f32) -> f32>)> = vec![
        (UnaryOp::Neg, false, Box::new(|x| -x)),
        (UnaryOp::Exp, false, Box::new(f32::exp)),
        (UnaryOp::Log, true, Box::new(f32::ln)),
        (UnaryOp::Sqrt, true, Box::new(f32::sqrt)),
        (UnaryOp::Rsqrt, true, Box::new(|x: f32| 1.0 / x.sqrt())),
        (UnaryOp::Abs, false, Box::new(f32::abs)),
        (UnaryOp::Sign, false, Box::new(sign)),
        (UnaryOp::Tanh, false, Box::new(f32::tanh)),
        (
            UnaryOp::Sigmoid,
            false,
            Box::new(|x: f32| 1.0 / (1.0 + (-x).exp())),
        ),
        (UnaryOp::Relu, false, Box::new(|x: f32| x.max(0.0))),
        (UnaryOp::Gelu, false, Box::new(gelu_exact_ref)),
        (UnaryOp::GeluGrad, false, Box::new(gelu_exact_grad_ref)),
        (UnaryOp::GeluTanh, false, Box::new(gelu_tanh)),
        (UnaryOp::GeluTanhGrad, false, Box::new(gelu_tanh_grad)),
        (UnaryOp::Sin, false, Box::new(f32::sin)),
        (UnaryOp::Cos, false, Box::new(f32::cos)),
        (UnaryOp::Square, false, Box::new(|x| x * x)),
        (UnaryOp::Recip, true, Box::new(|x| 1.0 / x)),
        (
            UnaryOp::Affine {
                mul: 2.0,
                add: -1.0,
            },
            false,
            Box::new(|x| x * 2.0 - 1.0),
        ),
        (UnaryOp::Powf(2.0), false, Box::new(|x: f32| x.powf(2.0))),
        (UnaryOp::Powf(3.0), false, Box::new(|x: f32| x.powf(3.0))),
        (UnaryOp::Powf(0.5), true, Box::new(|x: f32| x.powf(0.5))),
        (UnaryOp::Powf(0.0), false, Box::new(|x: f32| x.powf(0.0))),
        (UnaryOp::RDiv(3.0), true, Box::new(|x| 3.0 / x)),
        (UnaryOp::RSub(3.0), false, Box::new(|x| 3.0 - x)),
        (
            UnaryOp::MaxScalar(0.5),
            false,
            Box::new(|x: f32| x.max(0.5)),
        ),
        (
            UnaryOp::MinScalar(0.5),
            false,
            Box::new(|x: f32| x.min(0.5)),
        ),
        (UnaryOp::GtScalar(0.5), false, Box::new(move |x| b(x > 0.5))),
        (
            UnaryOp::EqScalar(1.0),
            false,
            Box::new(move |x| b(x == 1.0)),
        ),
    ];
    for (op, positive, f) in cases {
        let (input, src) = if positive { (&xp, &pos) } else { (&x, &data) };
        // contiguous, and through a transposed view (strided path)
        let got = host(&d, &k(&d).unary(op, input).unwrap());
        let want: Vec<f32> = src.iter().map(|&v| f(v)).collect();
        close(&got, &want, 2e-5, &format!("{op:?}"));
        // vec4 (above), strided (transposed) and contiguous-at-an-odd-offset layouts
        let tv = input.t().unwrap();
        let odd = input.reshape(&[72]).unwrap().narrow(0, 1, 70).unwrap();
        for (view, name) in [(tv, "transposed"), (odd, "offset 1")] {
            let got = host(&d, &k(&d).unary(op, &view).unwrap());
            let want: Vec<f32> = view.layout().indices().map(|i| f(src[i])).collect();
            close(&got, &want, 2e-5, &format!("{op:?} {name}"));
        }
    }
}

/// Strided elementwise ops over views whose last dim is long enough for the rows layout
/// (`EwLayout::StridedRows`, lavapipe): contiguous and aligned along it, offset off a vec4,
/// broadcast (stride 0), transposed; ranks 1 to 4 and one over 4 (the linear layout); binary,
/// in-place, three-input and copy kernels; each against the CPU backend on the same views.
#[test]
fn strided_rows_layout_matches_the_cpu() {
    let Some(d) = device() else { return };
    let cpu = Device::cpu();
    let max = ctx(&d).limits.max_compute_workgroups_per_dimension as usize;
    assert!(super::kernels::rows_grid(&[6, 256], max).is_some());
    assert!(
        super::kernels::rows_grid(&[2, 2, 2, 2, 128], max).is_none(),
        "rank 5"
    );
    assert!(
        super::kernels::rows_grid(&[6, 66], max).is_none(),
        "not whole vec4s"
    );
    assert!(
        super::kernels::rows_grid(&[6, 32], max).is_none(),
        "under a workgroup"
    );
    let on = |dev: &Device, data: &[f32], shape: &[usize]| {
        Tensor::from_vec(data.to_vec(), shape, dev).unwrap()
    };
    // (name, a view, b view) built from the same storage on either device
    type View = Box<dyn Fn(&Device) -> (Tensor, Tensor)>;
    let x = vals(2 * 3 * 5 * 128 + 8, 40);
    let y = vals(2 * 3 * 5 * 128 + 8, 41);
    let (x1, y1) = (x.clone(), y.clone());
    let (x2, y2) = (x.clone(), y.clone());
    let (x3, y3) = (x.clone(), y.clone());
    let (x4, y4) = (x.clone(), y.clone());
    let (x5, y5) = (x.clone(), y.clone());
    let cases: Vec<(&str, View)> = vec![
        (
            "rows + bias (stride 0 rows)",
            Box::new(move |dv| {
                let a = on(dv, &x1[..30 * 128], &[30, 128]);
                let b = on(dv, &y1[..128], &[128]).broadcast_to(&[30, 128]).unwrap();
                (a, b)
            }),
        ),
        (
            "column broadcast (stride 0 along the row), offset 1",
            Box::new(move |dv| {
                let a = on(dv, &x2[..30 * 128 + 1], &[30 * 128 + 1]);
                let a = a
                    .narrow(0, 1, 30 * 128)
                    .unwrap()
                    .reshape(&[30, 128])
                    .unwrap();
                let b = on(dv, &y2[..30], &[30, 1])
                    .broadcast_to(&[30, 128])
                    .unwrap();
                (a, b)
            }),
        ),
        (
            "rank 4 head split (permuted), plus a transposed rank 3",
            Box::new(move |dv| {
                let a = on(dv, &x3[..2 * 3 * 5 * 128], &[2, 5, 3, 128]);
                let a = a.permute(&[0, 2, 1, 3]).unwrap();
                let b = on(dv, &y3[..2 * 3 * 5 * 128], &[2, 3, 128, 5]);
                let b = b.transpose(2, 3).unwrap();
                (a, b)
            }),
        ),
        (
            "rank 1 scalar broadcast",
            Box::new(move |dv| {
                let a = on(dv, &x4[..640], &[640]);
                let b = on(dv, &y4[..1], &[1]).broadcast_to(&[640]).unwrap();
                (a, b)
            }),
        ),
        (
            "rank 5 (linear layout)",
            Box::new(move |dv| {
                let a = on(dv, &x5[..2 * 3 * 2 * 2 * 128], &[2, 3, 2, 2, 128]);
                let a = a.permute(&[1, 0, 2, 3, 4]).unwrap();
                let b = on(dv, &y5[..2 * 2 * 2 * 3 * 128], &[2, 2, 2, 3, 128]);
                let b = b.permute(&[3, 2, 1, 0, 4]).unwrap();
                (a, b)
            }),
        ),
    ];
    for (name, view) in &cases {
        let (ga, gb) = view(&d);
        let (ca, cb) = view(&cpu);
        let cmp = |g: Tensor, c: Tensor, what: &str| {
            close(
                &g.to_vec().unwrap(),
                &c.to_vec().unwrap(),
                1e-5,
                &format!("{name}: {what}"),
            );
        };
        for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub] {
            cmp(
                ga.binary(op, &gb).unwrap(),
                ca.binary(op, &cb).unwrap(),
                &format!("{op:?}"),
            );
        }
        cmp(ga.contiguous().unwrap(), ca.contiguous().unwrap(), "copy a");
        cmp(gb.contiguous().unwrap(), cb.contiguous().unwrap(), "copy b");
        let cond = |a: &Tensor| a.gt_scalar(0.0).unwrap();
        cmp(
            Tensor::where_cond(&cond(&ga), &ga, &gb).unwrap(),
            Tensor::where_cond(&cond(&ca), &ca, &cb).unwrap(),
            "where (three strided inputs)",
        );
        let (mut gs, mut cs) = (ga.contiguous().unwrap(), ca.contiguous().unwrap());
        gs.binary_assign(BinaryOp::Sub, &gb).unwrap();
        cs.binary_assign(BinaryOp::Sub, &cb).unwrap();
        cmp(gs, cs, "in-place sub");
    }
}

#[test]
fn every_binary_op_with_broadcast() {
    let Some(d) = device() else { return };
    let a_data: Vec<f32> = vals(12, 3)
        .iter()
        .map(|v| (v * 4.0).round() / 2.0)
        .collect();
    let b_data: Vec<f32> = vals(4, 4).iter().map(|v| (v * 4.0).round() / 2.0).collect();
    let a = t(&d, &a_data, &[3, 4]);
    let b = t(&d, &b_data, &[4]).broadcast_to(&[3, 4]).unwrap();
    let f = |x: bool| if x { 1.0 } else { 0.0 };
    let pow = |x: f32, y: f32| x.powf(y);
    type BinRef = Box<dyn Fn(f32, f32) -> f32>;
    let ops: Vec<(BinaryOp, BinRef)> = vec![
        (BinaryOp::Add, Box::new(|x, y| x + y)),
        (BinaryOp::Sub, Box::new(|x, y| x - y)),
        (BinaryOp::Mul, Box::new(|x, y| x * y)),
        (BinaryOp::Div, Box::new(|x, y| x / y)),
        (BinaryOp::Maximum, Box::new(f32::max)),
        (BinaryOp::Minimum, Box::new(f32::min)),
        (BinaryOp::Pow, Box::new(pow)),
        (BinaryOp::Eq, Box::new(move |x, y| f(x == y))),
        (BinaryOp::Ne, Box::new(move |x, y| f(x != y))),
        (BinaryOp::Lt, Box::new(move |x, y| f(x < y))),
        (BinaryOp::Le, Box::new(move |x, y| f(x <= y))),
        (BinaryOp::Gt, Box::new(move |x, y| f(x > y))),
        (BinaryOp::Ge, Box::new(move |x, y| f(x >= y))),
    ];
    for (op, g) in ops {
        let got = host(&d, &k(&d).binary(op, &a, &b).unwrap());
        let want: Vec<f32> = (0..12).map(|i| g(a_data[i], b_data[i % 4])).collect();
        // Division by zero gives inf on both sides; compare with a relative tolerance.
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            assert!(
                (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{op:?} element {i}: got {x}, want {y} (a={}, b={})",
                a_data[i],
                b_data[i % 4]
            );
        }
    }
    // where_cond with a broadcast condition
    let c = t(&d, &[1.0, 0.0, 0.0, 2.0], &[4])
        .broadcast_to(&[3, 4])
        .unwrap();
    let got = host(&d, &k(&d).where_cond(&c, &a, &b).unwrap());
    let want: Vec<f32> = (0..12)
        .map(|i| {
            if [1.0, 0.0, 0.0, 2.0][i % 4] != 0.0 {
                a_data[i]
            } else {
                b_data[i % 4]
            }
        })
        .collect();
    assert_eq!(got, want);
}

#[test]
fn reductions_softmax_layer_norm() {
    let Some(d) = device() else { return };
    // every row workgroup the autotune may pick (the adapter's own among them: one subgroup on
    // lavapipe, a tree of ROW_WG on GPUs)
    let own = ctx(&d).row_group();
    for group in ctx(&d).row_group_candidates(700, true) {
        ctx(&d).set_row_group(group);
        reductions_softmax_layer_norm_with(&d);
    }
    ctx(&d).set_row_group(own);
}

fn reductions_softmax_layer_norm_with(d: &Device) {
    let d = d.clone();
    for (rows, cols) in [(3, 5), (2, 700), (1, 1), (5, 256)] {
        let mut data = vals(rows * cols, 5);
        // a tie for argmax/argmin: the first index must win
        if cols > 3 {
            data[3] = 5.0;
            data[1] = 5.0;
            data[2] = -5.0;
            data[cols - 1] = -5.0;
        }
        let x = t(&d, &data, &[rows, cols]);
        let row = |r: usize| &data[r * cols..(r + 1) * cols];
        let first = |r: usize, better: &dyn Fn(f32, f32) -> bool| {
            let mut bi = 0;
            for (j, &v) in row(r).iter().enumerate() {
                if better(v, row(r)[bi]) {
                    bi = j;
                }
            }
            bi as f32
        };
        let cases: Vec<(ReduceOp, Vec<f32>)> = vec![
            (
                ReduceOp::Sum,
                (0..rows).map(|r| row(r).iter().sum()).collect(),
            ),
            (
                ReduceOp::Max,
                (0..rows)
                    .map(|r| row(r).iter().cloned().fold(f32::NEG_INFINITY, f32::max))
                    .collect(),
            ),
            (
                ReduceOp::Min,
                (0..rows)
                    .map(|r| row(r).iter().cloned().fold(f32::INFINITY, f32::min))
                    .collect(),
            ),
            (
                ReduceOp::ArgMax,
                (0..rows).map(|r| first(r, &|a, b| a > b)).collect(),
            ),
            (
                ReduceOp::ArgMin,
                (0..rows).map(|r| first(r, &|a, b| a < b)).collect(),
            ),
        ];
        for (op, want) in cases {
            let got = host(&d, &k(&d).reduce_rows(op, &x, rows, cols).unwrap());
            close(&got, &want, 1e-5, &format!("{op:?} {rows}x{cols}"));
        }
        for log in [false, true] {
            let got = host(&d, &k(&d).softmax_rows(&x, rows, cols, log).unwrap());
            let mut want = Vec::new();
            for r in 0..rows {
                let m = row(r).iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let s: f32 = row(r).iter().map(|v| (v - m).exp()).sum();
                want.extend(row(r).iter().map(|v| {
                    if log {
                        v - m - s.ln()
                    } else {
                        (v - m).exp() / s
                    }
                }));
            }
            close(
                &got,
                &want,
                1e-5,
                &format!("softmax log={log} {rows}x{cols}"),
            );
        }
        let gamma_d = vals(cols, 6);
        let beta_d = vals(cols, 7);
        let (gamma, beta) = (t(&d, &gamma_d, &[cols]), t(&d, &beta_d, &[cols]));
        let (y, mean, rstd) = k(&d)
            .layer_norm_rows(&x, &gamma, &beta, rows, cols, 1e-5)
            .unwrap();
        let (mut wy, mut wm, mut wr) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..rows {
            let m = row(r).iter().sum::<f32>() / cols as f32;
            let var = row(r).iter().map(|v| (v - m) * (v - m)).sum::<f32>() / cols as f32;
            let rs = 1.0 / (var + 1e-5).sqrt();
            wm.push(m);
            wr.push(rs);
            wy.extend(
                row(r)
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (v - m) * rs * gamma_d[j] + beta_d[j]),
            );
        }
        close(&host(&d, &y), &wy, 1e-4, "layer norm y");
        close(&host(&d, &mean), &wm, 1e-5, "layer norm mean");
        close(&host(&d, &rstd), &wr, 1e-3, "layer norm rstd");
    }
    // a contiguous view with an offset (a micro-batch of a mini-batch)
    let data = vals(40, 8);
    let x = t(&d, &data, &[8, 5]).narrow(0, 2, 3).unwrap();
    let got = host(&d, &k(&d).reduce_rows(ReduceOp::Sum, &x, 3, 5).unwrap());
    let want: Vec<f32> = (2..5)
        .map(|r| data[r * 5..r * 5 + 5].iter().sum())
        .collect();
    close(&got, &want, 1e-5, "sum of an offset view");
}

/// Plain triple loop over strided operands.
fn matmul_ref(a: &[f32], la: MatLayout, b: &[f32], lb: MatLayout, d: MatDims) -> Vec<f32> {
    let mut out = vec![0.0; d.batch * d.m * d.n];
    for bi in 0..d.batch {
        for i in 0..d.m {
            for j in 0..d.n {
                let mut s = 0.0f64;
                for kk in 0..d.k {
                    let x = a[la.matrix_offset(bi) + i * la.row_stride + kk * la.col_stride];
                    let y = b[lb.matrix_offset(bi) + kk * lb.row_stride + j * lb.col_stride];
                    s += f64::from(x) * f64::from(y);
                }
                out[(bi * d.m + i) * d.n + j] = s as f32;
            }
        }
    }
    out
}

/// (m, k) operand layout: row-major or transposed storage, with an element offset.
fn layout(rows: usize, cols: usize, transposed: bool, offset: usize, batch: bool) -> MatLayout {
    let bs = if batch { rows * cols } else { 0 };
    if transposed {
        MatLayout::new(offset, bs, 1, rows)
    } else {
        MatLayout::new(offset, bs, cols, 1)
    }
}

#[test]
fn matmul_every_tile_and_operand_layout() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let mut seen = std::collections::HashSet::new();
    // (batch, m, k, n): aligned and ragged shapes
    for (batch, m, kk, n) in [
        (2, 68, 40, 72),
        (1, 33, 17, 9),
        (3, 5, 8, 12),
        (1, 130, 64, 129),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                for offset in [0, 4, 1] {
                    let a_data = vals(offset + batch * m * kk, 11);
                    let b_data = vals(offset + kk * n, 12);
                    let la = layout(m, kk, ta, offset, true);
                    // b broadcast over the batch (batch stride 0)
                    let lb = layout(kk, n, tb, offset, false);
                    let dims = MatDims { batch, m, k: kk, n };
                    let a = t(&d, &a_data, &[a_data.len()]);
                    let b = t(&d, &b_data, &[b_data.len()]);
                    let want = matmul_ref(&a_data, la, &b_data, lb, dims);
                    let auto = c.matmul_config(&la, &lb, &dims);
                    for (bm, bn, bk, tm, tn) in MatmulConfig::TILES {
                        let cfg = MatmulConfig {
                            bm,
                            bn,
                            bk,
                            tm,
                            tn,
                            ..auto
                        };
                        seen.insert((cfg.a, cfg.b, cfg.c_vec));
                        let got = c.matmul_with(&a, la, &b, lb, dims, Some(cfg)).unwrap();
                        assert_eq!(got.shape(), &[batch, m, n]);
                        close(&host(&d, &got), &want, 1e-4, &format!("{dims:?} {cfg:?}"));
                    }
                    // the subgroup kernel, every shape, where the runtime uses it: on CPU-backed
                    // adapters (on a GPU it would only cost the check's time: at subgroup size 32
                    // its accumulators spill)
                    if let Some(sg) = c.subgroup_size.filter(|_| c.info.is_software) {
                        for (s, q) in wgpipe_shaders::SubgroupMatmulConfig::SHAPES {
                            for c_vec in [false, n % 4 == 0] {
                                let cfg = wgpipe_shaders::SubgroupMatmulConfig {
                                    sg,
                                    s,
                                    q,
                                    c_vec,
                                    a_direct: false,
                                    b_direct: false,
                                };
                                let got = c.matmul_subgroup(&a, la, &b, lb, dims, cfg).unwrap();
                                close(&host(&d, &got), &want, 1e-4, &format!("{dims:?} {cfg:?}"));
                            }
                        }
                    }
                    // and the scalar paths on the same operands
                    for (a_load, b_load) in [
                        (OperandLoad::ScalarK, OperandLoad::ScalarK),
                        (OperandLoad::ScalarMn, OperandLoad::ScalarMn),
                    ] {
                        let cfg = MatmulConfig {
                            a: a_load,
                            b: b_load,
                            c_vec: false,
                            ..auto
                        };
                        let got = c.matmul_with(&a, la, &b, lb, dims, Some(cfg)).unwrap();
                        close(&host(&d, &got), &want, 1e-4, &format!("{dims:?} {cfg:?}"));
                    }
                }
            }
        }
    }
    for load in [OperandLoad::VecK, OperandLoad::VecMn] {
        assert!(seen.iter().any(|s| s.0 == load), "A never used {load:?}");
        assert!(seen.iter().any(|s| s.1 == load), "B never used {load:?}");
    }
    // k = 0 gives zeros
    let a = t(&d, &[], &[0]);
    let z = k(&d)
        .matmul(
            &a,
            layout(2, 0, false, 0, false),
            &a,
            layout(0, 3, false, 0, false),
            MatDims {
                batch: 1,
                m: 2,
                k: 0,
                n: 3,
            },
        )
        .unwrap();
    assert_eq!(host(&d, &z), vec![0.0; 6]);
}

/// The subgroup matmul reads row-major operands in place and packs the rest (strided, offset
/// off a vec4, ragged k, a large B); every mix gives the reference product.
#[test]
fn subgroup_matmul_direct_and_packed_operands() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let Some(sg) = c.subgroup_size.filter(|_| c.info.is_software) else {
        eprintln!("SKIPPED: the subgroup matmul runs on CPU-backed adapters with subgroups only");
        return;
    };
    let f32 = DType::F32;
    // (batch, m, k, n), A transposed, A's offset, B transposed, and the (A, B) reads expected
    let cases = [
        ((2, 37, 24, 20), false, 0, false, (true, true)),
        ((2, 37, 24, 20), false, 1, false, (false, true)),
        ((1, 9, 16, 44), true, 0, false, (false, true)),
        ((1, 40, 12, 8), false, 4, true, (true, false)),
        ((2, 8, 18, 12), false, 0, false, (false, false)),
        // B of 2^18 + 512 elements: packed, though row-major
        ((1, 5, 516, 512), false, 0, false, (true, false)),
    ];
    for ((batch, m, kk, n), ta, a_off, tb, want_direct) in cases {
        let dims = MatDims { batch, m, k: kk, n };
        let la = layout(m, kk, ta, a_off, batch > 1);
        let lb = layout(kk, n, tb, 0, false);
        assert_eq!(
            super::matmul::direct_operands((f32, &la), (f32, &lb), &dims),
            want_direct,
            "{dims:?}"
        );
        let a_data = vals(a_off + batch * m * kk, 31);
        let b_data = vals(kk * n, 32);
        let want = matmul_ref(&a_data, la, &b_data, lb, dims);
        let a = t(&d, &a_data, &[a_data.len()]);
        let b = t(&d, &b_data, &[b_data.len()]);
        for (s, q) in wgpipe_shaders::SubgroupMatmulConfig::SHAPES {
            let cfg = wgpipe_shaders::SubgroupMatmulConfig {
                sg,
                s,
                q,
                c_vec: n % 4 == 0,
                a_direct: false,
                b_direct: false,
            };
            let got = c.matmul_subgroup(&a, la, &b, lb, dims, cfg).unwrap();
            close(&host(&d, &got), &want, 1e-4, &format!("{dims:?} {cfg:?}"));
        }
    }
    // half operands are always packed (the pass widens them)
    let l = layout(8, 8, false, 0, false);
    let dims = MatDims {
        batch: 1,
        m: 8,
        k: 8,
        n: 8,
    };
    let half = DType::F16;
    assert_eq!(
        super::matmul::direct_operands((half, &l), (half, &l), &dims),
        (false, false)
    );
}

#[test]
fn index_kernels() {
    let Some(d) = device() else { return };
    let (outer, dim, inner) = (2, 5, 3);
    let x_data = vals(outer * dim * inner, 20);
    let x = t(&d, &x_data, &[outer, dim, inner]);
    let idx_data = [4.0, 0.0, 4.0, 2.0];
    let idx = t(&d, &idx_data, &[4]);
    let n = idx_data.len();
    let got = host(
        &d,
        &k(&d).index_select(&x, &idx, outer, dim, inner).unwrap(),
    );
    let mut want = Vec::new();
    for o in 0..outer {
        for &j in &idx_data {
            for i in 0..inner {
                want.push(x_data[(o * dim + j as usize) * inner + i]);
            }
        }
    }
    assert_eq!(got, want);
    // index_add: adjoint (repeats add up)
    let src_data = vals(outer * n * inner, 21);
    let src = t(&d, &src_data, &[outer, n, inner]);
    let got = host(&d, &k(&d).index_add(&src, &idx, outer, dim, inner).unwrap());
    let mut want = vec![0.0; outer * dim * inner];
    for o in 0..outer {
        for (j, &dj) in idx_data.iter().enumerate() {
            for i in 0..inner {
                want[(o * dim + dj as usize) * inner + i] += src_data[(o * n + j) * inner + i];
            }
        }
    }
    close(&got, &want, 1e-6, "index_add");
    // gather / scatter_add with idx [outer, n, inner]
    let gidx_data: Vec<f32> = (0..outer * n * inner)
        .map(|e| ((e * 7 + 3) % dim) as f32)
        .collect();
    let gidx = t(&d, &gidx_data, &[outer, n, inner]);
    let got = host(&d, &k(&d).gather(&x, &gidx, outer, dim, inner).unwrap());
    let want: Vec<f32> = (0..outer * n * inner)
        .map(|e| {
            let (o, i) = (e / (n * inner), e % inner);
            x_data[(o * dim + gidx_data[e] as usize) * inner + i]
        })
        .collect();
    assert_eq!(got, want);
    let got = host(
        &d,
        &k(&d).scatter_add(&src, &gidx, outer, dim, inner).unwrap(),
    );
    let mut want = vec![0.0; outer * dim * inner];
    for e in 0..outer * n * inner {
        let (o, i) = (e / (n * inner), e % inner);
        want[(o * dim + gidx_data[e] as usize) * inner + i] += src_data[e];
    }
    close(&got, &want, 1e-6, "scatter_add");
}

#[test]
fn concat_of_views() {
    let Some(d) = device() else { return };
    let a_data = vals(6, 30);
    let b_data = vals(12, 31);
    let a = t(&d, &a_data, &[2, 3]);
    let b = t(&d, &b_data, &[3, 4])
        .t()
        .unwrap()
        .narrow(0, 1, 2)
        .unwrap(); // [2, 3] strided
    let out = k(&d).concat(&[&a, &b], 0, &[4, 3]).unwrap();
    let mut want = a_data.clone();
    want.extend(view_values(&b_data, b.layout()));
    assert_eq!(host(&d, &out), want);
    let out = k(&d).concat(&[&a, &b], 1, &[2, 6]).unwrap();
    let bv = view_values(&b_data, b.layout());
    let want: Vec<f32> = (0..2)
        .flat_map(|r| {
            let mut row = a_data[r * 3..r * 3 + 3].to_vec();
            row.extend(&bv[r * 3..r * 3 + 3]);
            row
        })
        .collect();
    assert_eq!(host(&d, &out), want);
}

fn conv_geo(groups: usize, stride: usize, pad: usize, dil: usize) -> Conv2dGeometry {
    let (n, c_in, h, w, c_out, kh, kw) = (2, 4, 6, 5, 4, 3, 2);
    let h_out = (h + 2 * pad - dil * (kh - 1) - 1) / stride + 1;
    let w_out = (w + 2 * pad - dil * (kw - 1) - 1) / stride + 1;
    Conv2dGeometry {
        n,
        c_in,
        h,
        w,
        c_out,
        kh,
        kw,
        stride: (stride, stride),
        padding: (pad, pad),
        dilation: (dil, dil),
        groups,
        h_out,
        w_out,
    }
}

fn im2col_ref(x: &[f32], g: &Conv2dGeometry) -> Vec<f32> {
    let cg = g.c_in / g.groups;
    let mut out = Vec::new();
    for b in 0..g.n {
        for grp in 0..g.groups {
            for cl in 0..cg {
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        for oy in 0..g.h_out {
                            for ox in 0..g.w_out {
                                let iy = (oy * g.stride.0 + ky * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let ix = (ox * g.stride.1 + kx * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                let c = grp * cg + cl;
                                let inside = iy >= 0
                                    && ix >= 0
                                    && (iy as usize) < g.h
                                    && (ix as usize) < g.w;
                                out.push(if inside {
                                    x[((b * g.c_in + c) * g.h + iy as usize) * g.w + ix as usize]
                                } else {
                                    0.0
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn im2col_and_its_adjoint() {
    let Some(d) = device() else { return };
    for g in [
        conv_geo(1, 1, 1, 1),
        conv_geo(2, 2, 1, 1),
        conv_geo(4, 1, 2, 2),
    ] {
        let x_data = vals(g.n * g.c_in * g.h * g.w, 40);
        let x = t(&d, &x_data, &[g.n, g.c_in, g.h, g.w]);
        let cols = k(&d).im2col(&x, &g).unwrap();
        assert_eq!(cols.shape(), &[g.n, g.groups, g.col_rows(), g.col_cols()]);
        let want = im2col_ref(&x_data, &g);
        assert_eq!(host(&d, &cols), want, "{g:?}");
        // adjoint: <im2col(x), c> == <x, col2im(c)>
        let c_data = vals(want.len(), 41);
        let c = t(&d, &c_data, cols.shape());
        let back = host(&d, &k(&d).col2im(&c, &g).unwrap());
        let lhs: f64 = want
            .iter()
            .zip(&c_data)
            .map(|(a, b)| f64::from(a * b))
            .sum();
        let rhs: f64 = x_data
            .iter()
            .zip(&back)
            .map(|(a, b)| f64::from(a * b))
            .sum();
        assert!((lhs - rhs).abs() < 1e-3, "{g:?}: {lhs} vs {rhs}");
    }
}

#[test]
fn pooling_and_adjoints() {
    let Some(d) = device() else { return };
    let (n, c, h, w) = (2, 3, 7, 6);
    for (kk, s, p) in [(2, 2, 0), (3, 2, 1), (3, 1, 1)] {
        let h_out = (h + 2 * p - kk) / s + 1;
        let w_out = (w + 2 * p - kk) / s + 1;
        let g = Pool2dGeometry {
            n,
            c,
            h,
            w,
            kh: kk,
            kw: kk,
            stride: (s, s),
            padding: (p, p),
            h_out,
            w_out,
        };
        let x_data = vals(n * c * h * w, 50);
        let x = t(&d, &x_data, &[n, c, h, w]);
        let (y, arg) = k(&d).max_pool2d(&x, &g).unwrap();
        let avg = k(&d).avg_pool2d(&x, &g).unwrap();
        let (mut wy, mut wa, mut wavg) = (Vec::new(), Vec::new(), Vec::new());
        for plane in 0..n * c {
            for oy in 0..h_out {
                for ox in 0..w_out {
                    let (mut best, mut bi, mut sum) = (f32::NEG_INFINITY, usize::MAX, 0.0);
                    for ky in 0..kk {
                        for kx in 0..kk {
                            let iy = (oy * s + ky) as isize - p as isize;
                            let ix = (ox * s + kx) as isize - p as isize;
                            if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                                continue;
                            }
                            let pos = iy as usize * w + ix as usize;
                            let v = x_data[plane * h * w + pos];
                            sum += v;
                            if bi == usize::MAX || v > best {
                                best = v;
                                bi = pos;
                            }
                        }
                    }
                    wy.push(best);
                    wa.push(bi as f32);
                    wavg.push(sum / (kk * kk) as f32);
                }
            }
        }
        assert_eq!(host(&d, &y), wy);
        assert_eq!(host(&d, &arg), wa);
        close(&host(&d, &avg), &wavg, 1e-6, "avg_pool2d");
        // backward: scatter dy to the argmax / spread over windows
        let dy_data = vals(n * c * h_out * w_out, 51);
        let dy = t(&d, &dy_data, &[n, c, h_out, w_out]);
        let dx = host(&d, &k(&d).max_pool2d_backward(&dy, &arg, &g).unwrap());
        let mut want = vec![0.0; n * c * h * w];
        for (o, (&gd, &a)) in dy_data.iter().zip(&wa).enumerate() {
            let plane = o / (h_out * w_out);
            want[plane * h * w + a as usize] += gd;
        }
        close(&dx, &want, 1e-6, "max_pool2d_backward");
        let dx = host(&d, &k(&d).avg_pool2d_backward(&dy, &g).unwrap());
        let mut want = vec![0.0; n * c * h * w];
        for plane in 0..n * c {
            for oy in 0..h_out {
                for ox in 0..w_out {
                    let gd = dy_data[(plane * h_out + oy) * w_out + ox] / (kk * kk) as f32;
                    for ky in 0..kk {
                        for kx in 0..kk {
                            let iy = (oy * s + ky) as isize - p as isize;
                            let ix = (ox * s + kx) as isize - p as isize;
                            if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                want[plane * h * w + iy as usize * w + ix as usize] += gd;
                            }
                        }
                    }
                }
            }
        }
        close(&dx, &want, 1e-5, "avg_pool2d_backward");
    }
}

#[test]
fn dropout_is_bit_identical_to_the_host_philox() {
    let Some(d) = device() else { return };
    for (n, p, seed, offset) in [
        (1001, 0.25f32, 7u64, 3u64),
        (64, 0.5, u64::MAX, u64::MAX - 1),
        (13, 0.0, 0, 0),
        (4099, 0.9, 0x1234_5678_9abc_def0, 1 << 40),
    ] {
        let got = host(
            &d,
            &k(&d)
                .dropout_mask(d.memory(), &[n], p, seed, offset)
                .unwrap(),
        );
        let want: Vec<f32> = (0..n as u64)
            .map(|i| crate::rng::dropout_value(seed, offset, i, p))
            .collect();
        let gb: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        let wb: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        assert_eq!(gb, wb, "n={n} p={p} seed={seed} offset={offset}");
    }
}

#[test]
fn adam_matches_the_documented_arithmetic() {
    let Some(d) = device() else { return };
    let n = 300;
    let (p, g, m, v) = (vals(n, 60), vals(n, 61), vals(n, 62), vals(n, 63));
    let v: Vec<f32> = v.iter().map(|x| x.abs()).collect();
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
        let (po, mo, vo) = k(&d)
            .adam_update(
                &t(&d, &p, &[n]),
                &t(&d, &g, &[n]),
                &t(&d, &m, &[n]),
                &t(&d, &v, &[n]),
                &hp,
            )
            .unwrap();
        let (mut wp, mut wm, mut wv) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let gi = if decoupled {
                g[i]
            } else {
                g[i] + hp.weight_decay * p[i]
            };
            let mi = hp.beta1 * m[i] + (1.0 - hp.beta1) * gi;
            let vi = hp.beta2 * v[i] + (1.0 - hp.beta2) * gi * gi;
            let mut pi = p[i]
                - hp.lr * (mi / hp.bias_correction1) / ((vi / hp.bias_correction2).sqrt() + hp.eps);
            if decoupled {
                pi -= hp.lr * hp.weight_decay * p[i];
            }
            wp.push(pi);
            wm.push(mi);
            wv.push(vi);
        }
        close(&host(&d, &po), &wp, 1e-5, "adam param");
        close(&host(&d, &mo), &wm, 1e-5, "adam m");
        close(&host(&d, &vo), &wv, 1e-5, "adam v");
    }
}

#[test]
fn dispatches_wider_than_65535_workgroups() {
    let Some(d) = device() else { return };
    // 65536 * 256 + 3 elements: 65537 workgroups of 256, more than one grid row.
    let n = 65536 * 256 + 3;
    let x = k(&d).fill(d.memory(), &[n], 1.5).unwrap();
    let y = k(&d)
        .unary(UnaryOp::Affine { mul: 2.0, add: 1.0 }, &x)
        .unwrap();
    let v = host(&d, &y);
    assert_eq!(v.len(), n);
    assert!(v.iter().all(|&e| e == 4.0));
    let s = host(&d, &k(&d).reduce_rows(ReduceOp::Sum, &y, 1, n).unwrap());
    assert!(
        (s[0] - 4.0 * n as f32).abs() / (4.0 * n as f32) < 1e-4,
        "{s:?}"
    );
}

#[test]
fn pooled_buffer_reuse_keeps_recorded_work_correct() {
    let Some(d) = device() else { return };
    let a = vals(1000, 70);
    let x = t(&d, &a, &[1000]);
    // recorded, not yet submitted: y reads x's buffer
    let y = k(&d).unary(UnaryOp::Neg, &x).unwrap();
    drop(x); // x's buffer goes back to the pool while y's dispatch still reads it
    let b = vals(1000, 71);
    let z = t(&d, &b, &[1000]); // likely the same buffer: the upload must not overtake y
    let want: Vec<f32> = a.iter().map(|v| -v).collect();
    assert_eq!(host(&d, &y), want);
    assert_eq!(host(&d, &z), b);
}

#[test]
fn many_batches_and_threads() {
    let Some(d) = device() else { return };
    // more dispatches than one batch, from two threads at once
    std::thread::scope(|s| {
        for th in 0..2 {
            let d = d.clone();
            s.spawn(move || {
                let mut x = k(&d).fill(d.memory(), &[257], th as f32).unwrap();
                for _ in 0..150 {
                    x = k(&d)
                        .unary(UnaryOp::Affine { mul: 1.0, add: 1.0 }, &x)
                        .unwrap();
                }
                assert!(host(&d, &x).iter().all(|&v| v == th as f32 + 150.0));
            });
        }
    });
}

#[test]
fn wgpu_validation_errors_come_back_as_errors() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let x = k(&d).fill(d.memory(), &[16], 1.0).unwrap();
    // A dispatch past the per-dimension workgroup limit: wgpu rejects it when the batch is
    // submitted; the error must come back from the next sync point, not as a panic.
    let too_many = c.limits.max_compute_workgroups_per_dimension + 1;
    c.dispatch_grid(
        Kernel::Fill,
        &[16, 0],
        &[Arg::of(gpu(&x).unwrap())],
        [too_many, 1, 1],
    )
    .unwrap();
    let e = d.synchronize().unwrap_err();
    assert!(matches!(e, Error::Wgpu { .. }), "{e}");
    eprintln!("caught: {e}");
    // A buffer past the adapter's largest buffer, created directly (bypassing the pool's
    // check): the error scope turns wgpu's validation error into a message.
    let e = c.pool.create(c.limits.max_buffer_size + 4).unwrap_err();
    eprintln!("caught: {e}");
    // ... and through the public path.
    let huge = (c.limits.max_buffer_size / 4 + 1) as usize;
    let e = k(&d).fill(d.memory(), &[huge], 0.0).unwrap_err();
    assert!(matches!(e, Error::Wgpu { .. }), "{e}");
    // The device keeps working afterwards.
    let y = k(&d).fill(d.memory(), &[4], 3.0).unwrap();
    assert_eq!(host(&d, &y), vec![3.0; 4]);
}

/// Row reductions of short rows (one invocation per row), of rows just past that length (a
/// workgroup per row) and of longer ones, against a sequential loop on the host, ties included.
#[test]
fn short_and_mid_rows_reduce_like_a_plain_loop() {
    let Some(d) = device() else { return };
    let thin = super::kernels::thin_row_cols(ctx(&d).info.is_software);
    let plain = |op: ReduceOp, row: &[f32]| -> f32 {
        let first = |better: fn(f32, f32) -> bool| {
            let mut best = 0;
            for (j, &v) in row.iter().enumerate() {
                if better(v, row[best]) {
                    best = j;
                }
            }
            best
        };
        match op {
            ReduceOp::Sum => row.iter().sum(),
            ReduceOp::Max => row.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            ReduceOp::Min => row.iter().copied().fold(f32::INFINITY, f32::min),
            ReduceOp::ArgMax => first(|v, b| v > b) as f32,
            ReduceOp::ArgMin => first(|v, b| v < b) as f32,
        }
    };
    for cols in [1, 2, 7, 32, 33, thin, thin + 1, 1000] {
        for rows in [1, 3, 700] {
            // Eighths in [-1, 1]: many ties for the arg-reductions, and every partial sum of a
            // row is exact in f32, whatever the order.
            let data: Vec<f32> = vals(rows * cols, (rows * 7919 + cols) as u64)
                .iter()
                .map(|v| (v * 8.0).round() / 8.0)
                .collect();
            // A view 5 values into its buffer.
            let buf: Vec<f32> = [9.0; 5].iter().chain(&data).copied().collect();
            let x = t(&d, &buf, &[buf.len()])
                .narrow(0, 5, rows * cols)
                .unwrap()
                .reshape(&[rows, cols])
                .unwrap();
            for op in [
                ReduceOp::Sum,
                ReduceOp::Max,
                ReduceOp::Min,
                ReduceOp::ArgMax,
                ReduceOp::ArgMin,
            ] {
                let got = host(&d, &k(&d).reduce_rows(op, &x, rows, cols).unwrap());
                let want: Vec<f32> = data.chunks(cols).map(|r| plain(op, r)).collect();
                assert_eq!(
                    got, want,
                    "{op:?} over [{rows}, {cols}] (thin up to {thin})"
                );
            }
        }
    }
}

/// Lavapipe ends an invocation after 65535 loop iterations in all; long rows, long k and long
/// index lists must still come out right.
#[test]
fn long_loops_are_split() {
    let Some(d) = device() else { return };
    let n = 256 * 65536 + 1000;
    let mut data = vec![1.0f32; n];
    data[n - 5] = 2.0;
    data[7] = -1.0;
    let x = t(&d, &data, &[1, n]);
    let own = ctx(&d).row_group();
    for wg in wgpipe_shaders::ROW_WG_CHOICES {
        ctx(&d).set_row_group(RowGroup::tree(wg));
        let sum = host(&d, &k(&d).reduce_rows(ReduceOp::Sum, &x, 1, n).unwrap())[0];
        assert!((sum - n as f32).abs() / n as f32 <= 1e-6, "{sum}");
        let am = host(&d, &k(&d).reduce_rows(ReduceOp::ArgMax, &x, 1, n).unwrap())[0];
        assert_eq!(am, (n - 5) as f32);
        let am = host(&d, &k(&d).reduce_rows(ReduceOp::ArgMin, &x, 1, n).unwrap())[0];
        assert_eq!(am, 7.0);
        // two rows of a long reduction with an offset view
        let x2 = t(&d, &data, &[n])
            .narrow(0, 1000, 2 * 600_000)
            .unwrap()
            .reshape(&[2, 600_000])
            .unwrap();
        let got = host(
            &d,
            &k(&d).reduce_rows(ReduceOp::Sum, &x2, 2, 600_000).unwrap(),
        );
        assert_eq!(got, vec![600_000.0, 600_000.0]);
    }
    ctx(&d).set_row_group(own);

    // matmul with a long k
    let (m, kk, nn) = (5, 70_001, 6);
    let a_data = vals(m * kk, 90);
    let b_data = vals(kk * nn, 91);
    let la = layout(m, kk, false, 0, false);
    let lb = layout(kk, nn, true, 0, false);
    let dims = MatDims {
        batch: 1,
        m,
        k: kk,
        n: nn,
    };
    let want = matmul_ref(&a_data, la, &b_data, lb, dims);
    let got = k(&d)
        .matmul(
            &t(&d, &a_data, &[m * kk]),
            la,
            &t(&d, &b_data, &[kk * nn]),
            lb,
            dims,
        )
        .unwrap();
    close(&host(&d, &got), &want, 1e-3, "long-k matmul");

    // index_add over a long index list
    let nidx = 70_000;
    let idx_data: Vec<f32> = (0..nidx).map(|j| (j % 3) as f32).collect();
    let src = t(&d, &vec![1.0; nidx * 2], &[1, nidx, 2]);
    let got = host(
        &d,
        &k(&d)
            .index_add(&src, &t(&d, &idx_data, &[nidx]), 1, 3, 2)
            .unwrap(),
    );
    let c = |r: usize| (0..nidx).filter(|j| j % 3 == r).count() as f32;
    assert_eq!(got, vec![c(0), c(0), c(1), c(1), c(2), c(2)]);
}

/// Row-kernel tuning aid: each row workgroup candidate timed (as the autotune times it) on the
/// decoder block's row kernels: `cargo test -p wgpipe-tensor --release --lib tune_row_groups --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn tune_row_groups() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let own = c.row_group();
    // The block's shapes: 8 x 4 heads of 128 x 128 scores; 1024 tokens of width 256.
    let (sr, sc, lr, lc) = (4096, 128, 1024, 256);
    let scores = t(&d, &vals(sr * sc, 61), &[sr, sc]);
    let p = k(&d).softmax_rows(&scores, sr, sc, false).unwrap();
    let x = t(&d, &vals(lr * lc, 62), &[lr, lc]);
    let g = t(&d, &vals(lr * lc, 63), &[lr, lc]);
    let (gamma, beta) = (t(&d, &vals(lc, 64), &[lc]), t(&d, &vals(lc, 65), &[lc]));
    let (_, mean, rstd) = k(&d)
        .layer_norm_rows(&x, &gamma, &beta, lr, lc, 1e-5)
        .unwrap();
    type Run<'a> = &'a dyn Fn() -> Result<RawTensor, Error>;
    let ops: [(&str, usize, Run); 4] = [
        ("causal softmax 4096x128", sc, &|| {
            k(&d).causal_softmax_rows(&scores, sr, sc, 0.125)
        }),
        ("softmax backward 4096x128", sc, &|| {
            k(&d).softmax_backward_rows(&p, &scores, sr, sc, 0.125)
        }),
        ("layer norm 1024x256", lc, &|| {
            Ok(k(&d).layer_norm_rows(&x, &gamma, &beta, lr, lc, 1e-5)?.0)
        }),
        ("layer norm backward 1024x256", lc, &|| {
            k(&d).layer_norm_backward_rows(&x, &mean, &rstd, &gamma, &g, None, lr, lc)
        }),
    ];
    for (name, cols, run) in ops {
        for group in c.row_group_candidates(cols, true) {
            c.set_row_group(group);
            let secs = c.time_op(run).unwrap();
            eprintln!("{name}: {group:?}: {:.3} ms", secs * 1e3);
        }
    }
    c.set_row_group(own);
}

/// Tile tuning aid: `cargo test -p wgpipe-tensor --lib tune_matmul -- --ignored --nocapture`.
#[test]
#[ignore]
fn tune_matmul_tiles() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let size: usize = std::env::var("TUNE_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let a = t(&d, &vals(size * size, 1), &[size * size]);
    let b = t(&d, &vals(size * size, 2), &[size * size]);
    let l = layout(size, size, false, 0, false);
    let dims = MatDims {
        batch: 1,
        m: size,
        k: size,
        n: size,
    };
    let auto = c.matmul_config(&l, &l, &dims);
    if let Some(sg) = c.subgroup_size {
        for (s, q) in [(4, 1), (2, 1), (2, 2), (4, 2), (8, 1), (3, 1)] {
            let cfg = wgpipe_shaders::SubgroupMatmulConfig {
                sg,
                s,
                q,
                c_vec: true,
                a_direct: false,
                b_direct: false,
            };
            let _ = c.matmul_subgroup(&a, l, &b, l, dims, cfg).unwrap();
            d.synchronize().unwrap();
            let t0 = std::time::Instant::now();
            for _ in 0..3 {
                let _ = c.matmul_subgroup(&a, l, &b, l, dims, cfg).unwrap();
            }
            d.synchronize().unwrap();
            let secs = t0.elapsed().as_secs_f64() / 3.0;
            eprintln!(
                "subgroup s{s} q{q}: {:.1} GFLOP/s",
                2.0 * (size as f64).powi(3) / secs / 1e9
            );
        }
    }
    if std::env::var("TUNE_TILED").is_err() {
        return;
    }
    let extra: Vec<(u32, u32, u32, u32, u32)> = vec![
        (32, 32, 8, 4, 4),
        (32, 64, 8, 4, 8),
        (64, 32, 8, 8, 4),
        (64, 64, 4, 8, 8),
        (64, 64, 16, 8, 8),
        (32, 32, 16, 8, 8),
        (64, 128, 8, 8, 8),
        (128, 64, 8, 8, 8),
        (64, 64, 8, 4, 8),
        (64, 64, 8, 8, 4),
        (128, 128, 8, 8, 16),
        (64, 64, 16, 16, 4),
        (64, 64, 8, 16, 8),
        (64, 64, 8, 8, 16),
    ];
    for (bm, bn, bk, tm, tn) in MatmulConfig::TILES.iter().cloned().chain(extra) {
        let cfg = MatmulConfig {
            bm,
            bn,
            bk,
            tm,
            tn,
            ..auto
        };
        if cfg.threads() > c.limits.max_compute_invocations_per_workgroup {
            continue;
        }
        let _ = c.matmul_with(&a, l, &b, l, dims, Some(cfg)).unwrap();
        d.synchronize().unwrap();
        let reps = 3;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            let _ = c.matmul_with(&a, l, &b, l, dims, Some(cfg)).unwrap();
        }
        d.synchronize().unwrap();
        let s = t0.elapsed().as_secs_f64() / reps as f64;
        eprintln!(
            "{bm}x{bn}x{bk} t{tm}x{tn} ({} thr): {:.1} GFLOP/s",
            cfg.threads(),
            2.0 * (size as f64).powi(3) / s / 1e9
        );
    }
}

/// Times every candidate with `measure` through a fresh tuner, as the autotune does on first use
/// of a shape class, and checks that the one kept is the fastest of those timings. Returns it.
fn tuner_keeps_the_fastest<C: super::autotune::Choice>(
    what: &str,
    candidates: &[C],
    mut measure: impl FnMut(C) -> Result<f64, Error>,
) -> C {
    let tuner = super::autotune::Tuner::new("test adapter", None, false);
    let mut timed = Vec::new();
    let chosen = tuner
        .choose("class", candidates, |ch| {
            let secs = measure(ch)?;
            timed.push((ch, secs));
            Ok(secs)
        })
        .unwrap();
    assert_eq!(
        timed.len(),
        candidates.len(),
        "{what}: every candidate timed"
    );
    assert!(
        timed.iter().all(|&(_, s)| s > 0.0 && s.is_finite()),
        "{what}: {timed:?}"
    );
    let fastest = timed.iter().min_by(|x, y| x.1.total_cmp(&y.1)).unwrap().0;
    assert_eq!(chosen, fastest, "{what}: timings {timed:?}");
    eprintln!("{what}: {timed:?} -> {chosen:?}");
    chosen
}

/// The matmul autotune on a real adapter: every candidate is timed on the op's operands, the one
/// kept is the fastest of those timings, every candidate computes the product right (so any pick
/// is safe), and the public matmul path with the tuner on records its choice for the shape class.
#[test]
fn autotune_keeps_the_fastest_timed_candidate_on_a_real_adapter() {
    use super::autotune::{shape_class, MatmulChoice, Tuner};
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let (m, kk, n) = (96, 256, 128);
    let dims = MatDims {
        batch: 1,
        m,
        k: kk,
        n,
    };
    let (a_data, b_data) = (vals(m * kk, 21), vals(kk * n, 22));
    let (la, lb) = (
        layout(m, kk, false, 0, false),
        layout(kk, n, false, 0, false),
    );
    let (a, b) = (t(&d, &a_data, &[m * kk]), t(&d, &b_data, &[kk * n]));
    let want = matmul_ref(&a_data, la, &b_data, lb, dims);
    let candidates = c.matmul_candidates(&dims);
    assert!(candidates.len() >= 2, "{candidates:?}");
    for &ch in &candidates {
        let got = c.matmul_as(&a, la, &b, lb, dims, ch).unwrap();
        close(&host(&d, &got), &want, 1e-4, &format!("{ch:?}"));
    }
    let what = format!("matmul autotune on {}", c.info.name);
    tuner_keeps_the_fastest(&what, &candidates, |ch| {
        c.time_op(|| c.matmul_as(&a, la, &b, lb, dims, ch))
    });

    c.set_tuner(Some(Tuner::new("test adapter", None, false)));
    let got = k(&d).matmul(&a, la, &b, lb, dims).unwrap();
    close(&host(&d, &got), &want, 1e-4, "tuned matmul");
    let kept = c.tuner().unwrap().chosen(&shape_class(&dims, None));
    assert!(
        kept.is_some_and(|k: MatmulChoice| candidates.contains(&k)),
        "{kept:?}"
    );
    c.set_tuner(None);
}

/// The row kernels' autotune on a real adapter: each candidate workgroup (trees of every size,
/// one subgroup where the adapter's subgroup size is fixed) computes the softmax right, the tuner keeps the fastest of their timings, and with the tuner on the public
/// softmax, layer norm and row sum give the right values and record a choice for their classes.
#[test]
fn autotune_keeps_the_fastest_row_workgroup_on_a_real_adapter() {
    use super::autotune::{row_class, Tuner};
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let own = c.row_group();
    let (rows, cols) = (48, 300);
    let data = vals(rows * cols, 31);
    let x = t(&d, &data, &[rows, cols]);
    let row = |r: usize| &data[r * cols..(r + 1) * cols];
    let softmax_want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let m = row(r).iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let z: f64 = row(r).iter().map(|&v| ((v - m) as f64).exp()).sum();
            row(r)
                .iter()
                .map(move |&v| (((v - m) as f64).exp() / z) as f32)
        })
        .collect();
    let sums: Vec<f32> = (0..rows)
        .map(|r| row(r).iter().map(|&v| v as f64).sum::<f64>() as f32)
        .collect();
    let candidates = c.row_group_candidates(cols, true);
    assert!(candidates.len() >= 2, "{candidates:?}");
    if c.subgroup_size.is_some() {
        assert!(candidates.iter().any(|g| g.subgroup), "{candidates:?}");
    }
    let softmax = |group: RowGroup| {
        c.set_row_group(group);
        k(&d).softmax_rows(&x, rows, cols, false)
    };
    for &group in &candidates {
        let got = host(&d, &softmax(group).unwrap());
        close(&got, &softmax_want, 1e-5, &format!("softmax, {group:?}"));
    }
    let what = format!("row autotune on {}", c.info.name);
    tuner_keeps_the_fastest(&what, &candidates, |g| c.time_op(|| softmax(g)));
    c.set_row_group(own);

    c.set_tuner(Some(Tuner::new("test adapter", None, false)));
    let got = host(&d, &k(&d).softmax_rows(&x, rows, cols, false).unwrap());
    close(&got, &softmax_want, 1e-5, "tuned softmax");
    let got = host(
        &d,
        &k(&d).reduce_rows(ReduceOp::Sum, &x, rows, cols).unwrap(),
    );
    close(&got, &sums, 1e-5, "tuned row sum");
    let (gamma, beta) = (
        t(&d, &vec![1.0; cols], &[cols]),
        t(&d, &vec![0.0; cols], &[cols]),
    );
    let (y, mean, _) = k(&d)
        .layer_norm_rows(&x, &gamma, &beta, rows, cols, 1e-5)
        .unwrap();
    let means: Vec<f32> = sums.iter().map(|s| s / cols as f32).collect();
    close(&host(&d, &mean), &means, 1e-5, "tuned layer norm mean");
    let y = host(&d, &y);
    for r in 0..rows {
        let yr = &y[r * cols..(r + 1) * cols];
        let (m, v) = (
            yr.iter().sum::<f32>() / cols as f32,
            yr.iter().map(|a| a * a).sum::<f32>() / cols as f32,
        );
        assert!(
            m.abs() < 1e-4 && (v - 1.0).abs() < 1e-3,
            "row {r}: mean {m}, var {v}"
        );
    }
    let tuner = c.tuner().unwrap();
    // The row sum has no subgroup variant: its candidates are the trees.
    let trees = c.row_group_candidates(cols, false);
    for (op, candidates) in [
        ("softmax", &candidates),
        ("sum", &trees),
        ("layer_norm", &candidates),
    ] {
        let kept: Option<RowGroup> = tuner.chosen(&row_class(op, rows, cols));
        assert!(
            kept.is_some_and(|k| candidates.contains(&k)),
            "{op}: {kept:?}"
        );
    }
    c.set_tuner(None);
}

/// The half matmul's autotune: every candidate (the tiles with half loads, and the subgroup
/// kernel where the adapter takes it) computes the rounded product, the tuner keeps the fastest
/// of their timings, and the public half matmul with the tuner on records its choice under the
/// dtype's class.
#[test]
fn autotune_of_the_half_matmul_keeps_the_fastest_candidate() {
    use super::autotune::{shape_class, MatmulChoice, Tuner};
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let dtype = DType::F16;
    let (m, kk, n) = (64, 96, 80);
    let dims = MatDims {
        batch: 1,
        m,
        k: kk,
        n,
    };
    let data = |len: usize, seed: u64| -> Vec<f32> {
        vals(len, seed).iter().map(|&x| dtype.round(x)).collect()
    };
    let (a_data, b_data) = (data(m * kk, 41), data(kk * n, 42));
    let (la, lb) = (
        layout(m, kk, false, 0, false),
        layout(kk, n, true, 0, false),
    );
    let half = |v: &[f32]| {
        Tensor::from_vec_in(v.to_vec(), &[v.len()], dtype, &d)
            .unwrap()
            .raw()
            .clone()
    };
    let (a, b) = (half(&a_data), half(&b_data));
    let want = matmul_ref(&a_data, la, &b_data, lb, dims);
    // One f16 rounding of the result, plus the f32 accumulation.
    let tol = 2f32.powi(-10) + kk as f32 * 2f32.powi(-22);
    let candidates = c.matmul_candidates(&dims);
    assert!(candidates.len() >= 2, "{candidates:?}");
    for &ch in &candidates {
        let got = c.matmul_as(&a, la, &b, lb, dims, ch).unwrap();
        assert_eq!(got.dtype(), dtype);
        close(&host(&d, &got), &want, tol, &format!("{ch:?}"));
    }
    let what = format!("half matmul autotune on {}", c.info.name);
    tuner_keeps_the_fastest(&what, &candidates, |ch| {
        c.time_op(|| c.matmul_as(&a, la, &b, lb, dims, ch))
    });

    c.set_tuner(Some(Tuner::new("test adapter", None, false)));
    let got = k(&d).matmul_half(&a, la, &b, lb, dims).unwrap().unwrap();
    close(&host(&d, &got), &want, tol, "tuned half matmul");
    let tuner = c.tuner().unwrap();
    let kept = tuner.chosen(&shape_class(&dims, Some("f16")));
    assert!(
        kept.is_some_and(|k: MatmulChoice| candidates.contains(&k)),
        "{kept:?}"
    );
    // The f32 class of the same shape is another entry: nothing was tuned for it here.
    assert_eq!(
        tuner.chosen::<MatmulChoice>(&shape_class(&dims, None)),
        None
    );
    c.set_tuner(None);
}

/// A kept choice is the variant that runs: on a fresh device (its own pipelines and tuner)
/// whose tuner holds a choice for the class (as read from the cache file), a softmax, an f32 and
/// an f16 matmul each compile exactly the variant kept, none other of their kernel.
#[test]
fn the_kept_choice_is_the_variant_that_runs() {
    use super::autotune::{row_class, shape_class, Choice, MatmulChoice, Tuner};
    let Some(d) = device() else { return };
    let c = ctx(&d);
    let (rows, cols) = (16, 200);
    let dims = MatDims {
        batch: 1,
        m: 40,
        k: 48,
        n: 36,
    };
    // Kept choices other than the heuristic's: a row workgroup not the adapter's own, and a
    // tile (the heuristic takes the 32 x 32 tile for this size, or the subgroup kernel).
    let group = *c
        .row_group_candidates(cols, true)
        .iter()
        .find(|&&g| g != c.row_group())
        .expect("two row candidates");
    let [t64x4, ..] = MatmulConfig::TILES;
    let tile = MatmulChoice::Tile(t64x4.0, t64x4.1, t64x4.2, t64x4.3, t64x4.4);
    let path = std::env::temp_dir().join(format!("wgpipe-kept-{}.tsv", std::process::id()));
    let line = |class: String, label: String| format!("test adapter\t{class}\t{label}\n");
    let text = [
        line(row_class("softmax", rows, cols), group.label()),
        line(shape_class(&dims, None), tile.label()),
        line(shape_class(&dims, Some("f16")), tile.label()),
    ]
    .concat();
    std::fs::write(&path, text).unwrap();
    c.set_tuner(Some(Tuner::new("test adapter", Some(path.clone()), false)));

    let x = t(&d, &vals(rows * cols, 51), &[rows, cols]);
    k(&d).softmax_rows(&x, rows, cols, false).unwrap();
    let softmaxes: Vec<RowGroup> = c
        .compiled_kernels()
        .into_iter()
        .filter_map(|k| match k {
            Kernel::Softmax { group, .. } => Some(group),
            _ => None,
        })
        .collect();
    assert_eq!(softmaxes, vec![group]);

    let (la, lb) = (
        layout(40, 48, false, 0, false),
        layout(48, 36, false, 0, false),
    );
    let (a, b) = (
        t(&d, &vals(40 * 48, 52), &[40 * 48]),
        t(&d, &vals(48 * 36, 53), &[48 * 36]),
    );
    k(&d).matmul(&a, la, &b, lb, dims).unwrap();
    let half = |x: &RawTensor| k(&d).narrow(x, DType::F16).unwrap();
    k(&d)
        .matmul_half(&half(&a), la, &half(&b), lb, dims)
        .unwrap()
        .unwrap();
    let matmuls: Vec<(u32, u32, Option<wgpipe_shaders::HalfFormat>)> = c
        .compiled_kernels()
        .into_iter()
        .filter_map(|k| match k {
            Kernel::Matmul(cfg) => Some((cfg.bm, cfg.tm, cfg.half)),
            Kernel::MatmulSubgroup(_) => Some((0, 0, None)),
            _ => None,
        })
        .collect();
    let mut want = vec![
        (t64x4.0, t64x4.3, None),
        (t64x4.0, t64x4.3, Some(wgpipe_shaders::HalfFormat::F16)),
    ];
    let mut got = matmuls.clone();
    got.sort_by_key(|v| format!("{v:?}"));
    want.sort_by_key(|v| format!("{v:?}"));
    assert_eq!(got, want, "kept {tile:?}");
    c.set_tuner(None);
    let _ = std::fs::remove_file(&path);
}

/// The tiled kernel's half loads, forced on lavapipe (which otherwise takes the subgroup kernel
/// for large products): two tiles, three staging orders, transposed operands, an odd offset
/// (elements in the high half of a word), both half formats, against the f64 product of the
/// same rounded values. The result is rounded once to the half dtype: within one half ulp of
/// `|c|`, plus the f32 accumulation over k terms of magnitude at most 1.
#[test]
fn matmul_half_loads_match_the_rounded_product() {
    let Some(d) = device() else { return };
    let c = ctx(&d);
    for (dtype, format) in [
        (DType::F16, wgpipe_shaders::HalfFormat::F16),
        (DType::BF16, wgpipe_shaders::HalfFormat::Bf16),
    ] {
        let rel = if dtype == DType::F16 {
            2f32.powi(-10)
        } else {
            2f32.powi(-7)
        };
        for (batch, m, kk, n) in [(2, 68, 40, 72), (1, 33, 17, 9), (3, 5, 8, 12)] {
            for (ta, tb, offset) in [
                (false, false, 0),
                (true, false, 1),
                (false, true, 1),
                (true, true, 0),
            ] {
                let data = |len: usize, seed: u64| -> Vec<f32> {
                    vals(len, seed).iter().map(|&x| dtype.round(x)).collect()
                };
                let (a_data, b_data) =
                    (data(offset + batch * m * kk, 11), data(offset + kk * n, 12));
                let la = layout(m, kk, ta, offset, true);
                let lb = layout(kk, n, tb, offset, false);
                let dims = MatDims { batch, m, k: kk, n };
                let half = |v: &[f32]| {
                    Tensor::from_vec_in(v.to_vec(), &[v.len()], dtype, &d)
                        .unwrap()
                        .raw()
                        .clone()
                };
                let (a, b) = (half(&a_data), half(&b_data));
                let want = matmul_ref(&a_data, la, &b_data, lb, dims);
                let tol = rel + kk as f32 * 2f32.powi(-22);
                let auto = c.matmul_config(&la, &lb, &dims);
                // Two tiles (lavapipe compiles each variant slowly); f16 takes every staging
                // order, bf16 (the same loads with another conversion) one.
                let [t64, _, t32, _] = MatmulConfig::TILES;
                let orders: &[(OperandLoad, OperandLoad)] = if dtype == DType::F16 {
                    &[
                        (OperandLoad::ScalarK, OperandLoad::ScalarK),
                        (OperandLoad::ScalarMn, OperandLoad::ScalarMn),
                        (OperandLoad::ScalarK, OperandLoad::ScalarMn),
                    ]
                } else {
                    &[(OperandLoad::ScalarK, OperandLoad::ScalarMn)]
                };
                for (bm, bn, bk, tm, tn) in [t64, t32] {
                    for &(a_load, b_load) in orders {
                        let cfg = MatmulConfig {
                            bm,
                            bn,
                            bk,
                            tm,
                            tn,
                            a: a_load,
                            b: b_load,
                            half: Some(format),
                            ..auto
                        };
                        let got = c
                            .matmul_half_tiled(&a, la, &b, lb, dims, Some(cfg))
                            .unwrap();
                        assert_eq!(got.dtype(), dtype);
                        close(&host(&d, &got), &want, tol, &format!("{dims:?} {cfg:?}"));
                    }
                }
                // The default half variant (what `matmul_half` takes when the subgroup kernel
                // does not apply).
                let got = c.matmul_half_tiled(&a, la, &b, lb, dims, None).unwrap();
                close(&host(&d, &got), &want, tol, &format!("{dims:?} default"));
            }
        }
    }
}
