//! Kernel-level tests of the CPU backend against naive references.

use super::elementwise::{binary_scalar, unary_scalar};
use super::*;
use crate::error::Error;
use crate::layout::Layout;
use crate::rng::uniform_vec;
use crate::{Device, Tensor};

const K: CpuKernels = CpuKernels;

fn dev() -> Device {
    Device::new_cpu("cpu-test")
}

fn rand(n: usize, seed: u64) -> Vec<f32> {
    uniform_vec(seed, 0, n, -2.0, 2.0)
}

/// What the kernels take: the storage and layout of a tensor of `v`.
fn t(v: Vec<f32>, shape: &[usize], d: &Device) -> RawTensor {
    Tensor::from_vec(v, shape, d).unwrap().raw().clone()
}

/// A tensor of `v`, for the tests of whole ops.
fn tensor(v: Vec<f32>, shape: &[usize], d: &Device) -> Tensor {
    Tensor::from_vec(v, shape, d).unwrap()
}

/// The logical elements of a view, read one by one through `index_of`.
fn naive(x: &RawTensor) -> Vec<f32> {
    let d = data(x);
    (0..x.numel()).map(|i| d[x.layout().index_of(i)]).collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "lengths differ");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= tol * (1.0 + y.abs());
        assert!(ok, "element {i}: {x} vs {y}");
    }
}

/// Bit-for-bit equality, NaN equal to NaN.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// A few views of the same shape `[4, 6, 5]`: contiguous, permuted, narrowed, broadcast.
fn views(d: &Device, seed: u64) -> Vec<RawTensor> {
    let base = t(rand(120, seed), &[4, 6, 5], d);
    let permuted = t(rand(120, seed + 1), &[5, 4, 6], d)
        .permute(&[1, 2, 0])
        .unwrap();
    let narrowed = t(rand(4 * 8 * 5, seed + 2), &[4, 8, 5], d)
        .narrow(1, 1, 6)
        .unwrap();
    let row = t(rand(5, seed + 3), &[5], d)
        .broadcast_to(&[4, 6, 5])
        .unwrap();
    let col = t(rand(6, seed + 4), &[6, 1], d)
        .broadcast_to(&[4, 6, 5])
        .unwrap();
    let scalar = t(vec![0.75], &[], d).broadcast_to(&[4, 6, 5]).unwrap();
    vec![base, permuted, narrowed, row, col, scalar]
}

#[test]
fn unary_ops_on_strided_views() {
    let d = dev();
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluGrad,
        UnaryOp::GeluTanh,
        UnaryOp::GeluTanhGrad,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Square,
        UnaryOp::Recip,
        UnaryOp::Affine {
            mul: 2.0,
            add: -1.0,
        },
        UnaryOp::Powf(3.0),
        UnaryOp::RDiv(2.0),
        UnaryOp::RSub(1.0),
        UnaryOp::MaxScalar(0.5),
        UnaryOp::MinScalar(0.5),
        UnaryOp::GtScalar(0.0),
        UnaryOp::EqScalar(0.75),
    ];
    for x in views(&d, 1) {
        let xs = naive(&x);
        for op in ops {
            let y = K.unary(op, &x).unwrap();
            assert!(y.is_contiguous());
            assert_eq!(y.shape(), x.shape());
            let want: Vec<f32> = xs.iter().map(|&v| unary_scalar(op, v)).collect();
            let got = K.to_host(&y).unwrap();
            assert!(same(&got, &want), "{op:?} on {:?}", x.layout());
        }
    }
    // Hand values.
    let x = t(vec![-1.0, 0.0, 2.0], &[3], &d);
    let g = K.to_host(&K.unary(UnaryOp::Gelu, &x).unwrap()).unwrap();
    close(&g, &[-0.158_655_25, 0.0, 1.954_499_7], 1e-6);
    let g = K.to_host(&K.unary(UnaryOp::GeluTanh, &x).unwrap()).unwrap();
    close(&g, &[-0.158_808, 0.0, 1.954_598], 1e-5);
    let s = K.to_host(&K.unary(UnaryOp::Sign, &x).unwrap()).unwrap();
    assert_eq!(s, vec![-1.0, 0.0, 1.0]);
    // GeluGrad is the derivative of Gelu, GeluTanhGrad that of GeluTanh.
    let h = 1e-3f32;
    for (f, df) in [
        (UnaryOp::Gelu, UnaryOp::GeluGrad),
        (UnaryOp::GeluTanh, UnaryOp::GeluTanhGrad),
    ] {
        for v in [-2.0f32, -0.5, 0.3, 1.7] {
            let num = (unary_scalar(f, v + h) - unary_scalar(f, v - h)) / (2.0 * h);
            assert!((num - unary_scalar(df, v)).abs() < 1e-3, "{df:?} at {v}");
        }
    }
}

#[test]
fn binary_and_where_on_strided_views() {
    let d = dev();
    let (va, vb) = (views(&d, 10), views(&d, 20));
    for a in &va {
        for b in &vb {
            let (xa, xb) = (naive(a), naive(b));
            for op in BinaryOp::ALL {
                let y = K.to_host(&K.binary(op, a, b).unwrap()).unwrap();
                let want: Vec<f32> = xa
                    .iter()
                    .zip(&xb)
                    .map(|(&p, &q)| binary_scalar(op, p, q))
                    .collect();
                assert!(same(&y, &want), "{op:?} {:?} {:?}", a.layout(), b.layout());
            }
            let c = K
                .binary(BinaryOp::Gt, a, b)
                .unwrap()
                .permute(&[0, 1, 2])
                .unwrap();
            let w = K.to_host(&K.where_cond(&c, a, b).unwrap()).unwrap();
            let want: Vec<f32> = xa.iter().zip(&xb).map(|(&p, &q)| p.max(q)).collect();
            assert_eq!(w, want);
        }
    }
    // where with a strided (transposed) condition.
    let c = t(vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0], &[3, 2], &d)
        .t()
        .unwrap();
    let a = t(vec![1.0; 6], &[2, 3], &d);
    let b = t(vec![0.0], &[], &d).broadcast_to(&[2, 3]).unwrap();
    let w = K.to_host(&K.where_cond(&c, &a, &b).unwrap()).unwrap();
    assert_eq!(w, vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
}

#[test]
fn big_elementwise_runs_in_parallel_and_matches() {
    let d = dev();
    let n = 300 * 257;
    let a = t(rand(n, 3), &[257, 300], &d).t().unwrap(); // [300, 257], strided
    let b = t(rand(257, 4), &[257], &d)
        .broadcast_to(&[300, 257])
        .unwrap();
    let y = K
        .to_host(&K.binary(BinaryOp::Mul, &a, &b).unwrap())
        .unwrap();
    let want: Vec<f32> = naive(&a)
        .iter()
        .zip(naive(&b))
        .map(|(x, y)| x * y)
        .collect();
    assert!(same(&y, &want));
    let e = K.to_host(&K.unary(UnaryOp::Exp, &a).unwrap()).unwrap();
    let want: Vec<f32> = naive(&a).iter().map(|&v| super::math::exp(v)).collect();
    assert!(same(&e, &want));
    let c = K.contiguous(&a).unwrap();
    assert!(c.is_contiguous());
    assert!(same(&K.to_host(&c).unwrap(), &naive(&a)));
}

#[test]
fn fill_from_host_contiguous_and_concat() {
    let d = dev();
    let f = K.fill(d.memory(), &[2, 3], 1.5).unwrap();
    assert_eq!(K.to_host(&f).unwrap(), vec![1.5; 6]);
    let h = K.from_host(d.memory(), &[1.0, 2.0], &[2]).unwrap();
    assert_eq!(K.to_host(&h).unwrap(), vec![1.0, 2.0]);
    // Transposed copies (tiled path), with tiles that cross batch boundaries and an offset.
    let x = t(rand(3 * 50 * 41, 9), &[3, 50, 41], &d);
    for v in [
        x.permute(&[0, 2, 1]).unwrap(),
        x.narrow(2, 1, 39).unwrap().permute(&[0, 2, 1]).unwrap(),
        x.permute(&[2, 1, 0]).unwrap(),
    ] {
        let c = K.contiguous(&v).unwrap();
        assert!(
            same(&K.to_host(&c).unwrap(), &naive(&v)),
            "{:?}",
            v.layout()
        );
    }
    // Concatenate along axis 1: a contiguous [2,2,3], a transposed [2,1,3], a broadcast [2,3,3].
    let a = t(rand(12, 1), &[2, 2, 3], &d);
    let b = t(rand(6, 2), &[3, 1, 2], &d).permute(&[2, 1, 0]).unwrap();
    let c = t(rand(3, 3), &[3], &d).broadcast_to(&[2, 3, 3]).unwrap();
    let y = K.concat(&[&a, &b, &c], 1, &[2, 6, 3]).unwrap();
    assert_eq!(y.shape(), &[2, 6, 3]);
    let got = K.to_host(&y).unwrap();
    let (na, nb, nc) = (naive(&a), naive(&b), naive(&c));
    let mut want = vec![];
    for o in 0..2 {
        want.extend_from_slice(&na[o * 6..(o + 1) * 6]);
        want.extend_from_slice(&nb[o * 3..(o + 1) * 3]);
        want.extend_from_slice(&nc[o * 9..(o + 1) * 9]);
    }
    assert_eq!(got, want);
    // Concatenating a stride-2 view along axis 0 of a 1-D result.
    let s = t(rand(8, 4), &[8], &d);
    let s2 = s.with_layout(Layout {
        shape: [4][..].into(),
        strides: [2][..].into(),
        offset: 1,
    });
    let y = K.to_host(&K.concat(&[&s2, &s2], 0, &[8]).unwrap()).unwrap();
    let n2 = naive(&s2);
    assert_eq!(y, [n2.clone(), n2].concat());
}

fn naive_reduce(op: ReduceOp, row: &[f32]) -> f32 {
    match op {
        ReduceOp::Sum => row.iter().map(|&v| v as f64).sum::<f64>() as f32,
        ReduceOp::Max => row.iter().cloned().fold(f32::NEG_INFINITY, f32::max),
        ReduceOp::Min => row.iter().cloned().fold(f32::INFINITY, f32::min),
        ReduceOp::ArgMax => {
            let m = naive_reduce(ReduceOp::Max, row);
            row.iter().position(|&v| v == m).unwrap() as f32
        }
        ReduceOp::ArgMin => {
            let m = naive_reduce(ReduceOp::Min, row);
            row.iter().position(|&v| v == m).unwrap() as f32
        }
    }
}

#[test]
fn reductions_small_many_and_long_rows() {
    let d = dev();
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::ArgMax,
        ReduceOp::ArgMin,
    ];
    for &(rows, cols) in &[(3, 7), (1, 1), (500, 130), (1, 100_003), (2, 70_001)] {
        // Coarse values make ties, so "first index" is exercised.
        let v: Vec<f32> = rand(rows * cols, 5)
            .iter()
            .map(|x| (x * 8.0).round())
            .collect();
        let x = t(v.clone(), &[rows, cols], &d);
        for op in ops {
            let y = K
                .to_host(&K.reduce_rows(op, &x, rows, cols).unwrap())
                .unwrap();
            let want: Vec<f32> = v.chunks(cols).map(|r| naive_reduce(op, r)).collect();
            close(&y, &want, 1e-6);
        }
    }
    let x = t(vec![1.0, f32::NAN, 3.0], &[1, 3], &d);
    let m = K
        .to_host(&K.reduce_rows(ReduceOp::Max, &x, 1, 3).unwrap())
        .unwrap();
    assert!(m[0].is_nan());
}

#[test]
fn softmax_is_stable_and_normalised() {
    let d = dev();
    let x = t(vec![1000.0, 1001.0], &[1, 2], &d);
    let y = K
        .to_host(&K.softmax_rows(&x, 1, 2, false).unwrap())
        .unwrap();
    close(&y, &[0.268_941_43, 0.731_058_6], 1e-6);
    let l = K.to_host(&K.softmax_rows(&x, 1, 2, true).unwrap()).unwrap();
    close(&l, &[-1.313_261_7, -0.313_261_7], 1e-6);
    let (rows, cols) = (300, 257);
    let v = rand(rows * cols, 9);
    let x = t(v.clone(), &[rows, cols], &d);
    let y = K
        .to_host(&K.softmax_rows(&x, rows, cols, false).unwrap())
        .unwrap();
    let l = K
        .to_host(&K.softmax_rows(&x, rows, cols, true).unwrap())
        .unwrap();
    for r in 0..rows {
        let row = &v[r * cols..(r + 1) * cols];
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f64 = row.iter().map(|&a| ((a - m) as f64).exp()).sum();
        let want: Vec<f32> = row
            .iter()
            .map(|&a| (((a - m) as f64).exp() / s) as f32)
            .collect();
        close(&y[r * cols..(r + 1) * cols], &want, 1e-5);
        let lw: Vec<f32> = want.iter().map(|p| p.ln()).collect();
        close(&l[r * cols..(r + 1) * cols], &lw, 1e-5);
    }
}

#[test]
fn layer_norm_mean_rstd_and_output() {
    let d = dev();
    for &(rows, cols) in &[(3, 5), (200, 300)] {
        let v: Vec<f32> = rand(rows * cols, 11)
            .iter()
            .map(|x| x * 3.0 + 1.0)
            .collect();
        let (gv, bv) = (rand(cols, 12), rand(cols, 13));
        let (x, g, b) = (
            t(v.clone(), &[rows, cols], &d),
            t(gv.clone(), &[cols], &d),
            t(bv.clone(), &[cols], &d),
        );
        let (y, mean, rstd) = K.layer_norm_rows(&x, &g, &b, rows, cols, 1e-5).unwrap();
        assert_eq!(
            (y.shape(), mean.shape(), rstd.shape()),
            (&[rows, cols][..], &[rows][..], &[rows][..])
        );
        let (y, mean, rstd) = (
            K.to_host(&y).unwrap(),
            K.to_host(&mean).unwrap(),
            K.to_host(&rstd).unwrap(),
        );
        for r in 0..rows {
            let row: Vec<f64> = v[r * cols..(r + 1) * cols]
                .iter()
                .map(|&a| a as f64)
                .collect();
            let m = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / cols as f64;
            let rs = 1.0 / (var + 1e-5).sqrt();
            close(&[mean[r]], &[m as f32], 1e-5);
            close(&[rstd[r]], &[rs as f32], 1e-5);
            let want: Vec<f32> = (0..cols)
                .map(|c| ((row[c] - m) * rs * gv[c] as f64 + bv[c] as f64) as f32)
                .collect();
            close(&y[r * cols..(r + 1) * cols], &want, 1e-4);
        }
    }
}

/// `out[b, i, j] = sum_p A(b, i, p) B(b, p, j)` straight from the layouts.
fn naive_matmul(a: &[f32], la: MatLayout, b: &[f32], lb: MatLayout, d: MatDims) -> Vec<f32> {
    let mut out = vec![0.0; d.batch * d.m * d.n];
    for bi in 0..d.batch {
        for i in 0..d.m {
            for j in 0..d.n {
                let mut s = 0f64;
                for p in 0..d.k {
                    let x = a[la.matrix_offset(bi) + i * la.row_stride + p * la.col_stride];
                    let y = b[lb.matrix_offset(bi) + p * lb.row_stride + j * lb.col_stride];
                    s += x as f64 * y as f64;
                }
                out[(bi * d.m + i) * d.n + j] = s as f32;
            }
        }
    }
    out
}

#[test]
fn matmul_transposed_and_broadcast_operands() {
    let dv = dev();
    let cases = [
        (1, 3, 4, 5),
        (2, 7, 1, 3),
        (3, 130, 70, 150),
        (64, 8, 9, 10),
        (1, 200, 200, 200),
        // Big enough for a transposed right operand to be copied to row-major a panel at a
        // time. On 2 threads: panels shared out over the threads (144 + 116 columns; 3 x 80 +
        // 60; 6 x 64 + 16), then panels one after another, each over all threads (one panel;
        // 64 + 36 columns), where the threads' shares would be under 64 columns.
        (1, 130, 256, 260),
        (1, 40, 1024, 300),
        (1, 9, 2500, 400),
        (1, 100, 1000, 100),
        (1, 30, 3000, 100),
        (2, 0, 3, 4),
        (2, 3, 0, 4),
    ];
    for &(batch, m, k, n) in &cases {
        for (ta, tb, bca, bcb) in [
            (false, false, false, false),
            (true, false, false, true),
            (false, true, true, false),
            (true, true, false, false),
        ] {
            let off = 3;
            let av = rand(off + batch * m * k, 30);
            let bv = rand(off + batch * k * n, 31);
            let la = MatLayout::new(
                off,
                if bca { 0 } else { m * k },
                if ta { 1 } else { k },
                if ta { m } else { 1 },
            );
            let lb = MatLayout::new(
                off,
                if bcb { 0 } else { k * n },
                if tb { 1 } else { n },
                if tb { k } else { 1 },
            );
            let dims = MatDims { batch, m, k, n };
            let a = t(av.clone(), &[av.len()], &dv);
            let b = t(bv.clone(), &[bv.len()], &dv);
            let y = K.matmul(&a, la, &b, lb, dims).unwrap();
            assert_eq!(y.shape(), &[batch, m, n]);
            let want = naive_matmul(&av, la, &bv, lb, dims);
            // f32 rounding grows with the length of the sums (k = 2500: ~1.6e-4 here, row-major
            // operands or not); a wrong panel or stride is off by O(1).
            let tol = 1e-4 * (k as f32 / 256.0).max(1.0);
            close(&K.to_host(&y).unwrap(), &want, tol);
        }
    }
}

fn conv_geometry(n: usize, c_in: usize, h: usize, w: usize, groups: usize) -> Conv2dGeometry {
    let (kh, kw, stride, padding, dilation) = (3, 2, (2, 1), (1, 2), (2, 1));
    let h_out = (h + 2 * padding.0 - dilation.0 * (kh - 1) - 1) / stride.0 + 1;
    let w_out = (w + 2 * padding.1 - dilation.1 * (kw - 1) - 1) / stride.1 + 1;
    Conv2dGeometry {
        n,
        c_in,
        h,
        w,
        c_out: 4,
        kh,
        kw,
        stride,
        padding,
        dilation,
        groups,
        h_out,
        w_out,
    }
}

#[test]
fn im2col_matches_definition_and_col2im_is_its_adjoint() {
    let d = dev();
    for &(n, c, h, w, groups) in &[(2, 4, 7, 6, 2), (3, 8, 33, 40, 1)] {
        let g = conv_geometry(n, c, h, w, groups);
        let xv = rand(n * c * h * w, 40);
        let x = t(xv.clone(), &[n, c, h, w], &d);
        let cols = K.im2col(&x, &g).unwrap();
        assert_eq!(cols.shape(), &[n, groups, g.col_rows(), g.col_cols()]);
        let cv = K.to_host(&cols).unwrap();
        let mut want = vec![0.0; cv.len()];
        for ni in 0..n {
            for ci in 0..c {
                for ky in 0..g.kh {
                    for kx in 0..g.kw {
                        for oy in 0..g.h_out {
                            for ox in 0..g.w_out {
                                let iy = (oy * g.stride.0 + ky * g.dilation.0) as isize
                                    - g.padding.0 as isize;
                                let ix = (ox * g.stride.1 + kx * g.dilation.1) as isize
                                    - g.padding.1 as isize;
                                let r = ((ni * c + ci) * g.kh + ky) * g.kw + kx;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    want[r * g.col_cols() + oy * g.w_out + ox] =
                                        xv[((ni * c + ci) * h + iy as usize) * w + ix as usize];
                                }
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(cv, want);
        let yv = rand(cv.len(), 41);
        let y = t(yv.clone(), cols.shape(), &d);
        let back = K.to_host(&K.col2im(&y, &g).unwrap()).unwrap();
        let (lhs, rhs) = (dot(&cv, &yv), dot(&xv, &back));
        assert!(
            (lhs - rhs).abs() < 1e-3 * (1.0 + lhs.abs()),
            "{lhs} vs {rhs}"
        );
    }
}

fn pool_geometry(n: usize, c: usize, h: usize, w: usize) -> Pool2dGeometry {
    let (kh, kw, stride, padding) = (3, 2, (2, 2), (1, 1));
    Pool2dGeometry {
        n,
        c,
        h,
        w,
        kh,
        kw,
        stride,
        padding,
        h_out: (h + 2 * padding.0 - kh) / stride.0 + 1,
        w_out: (w + 2 * padding.1 - kw) / stride.1 + 1,
    }
}

#[test]
fn pools_match_naive_and_backwards_are_adjoint() {
    let d = dev();
    for &(n, c, h, w) in &[(2, 3, 5, 6), (4, 16, 40, 41)] {
        let g = pool_geometry(n, c, h, w);
        let xv: Vec<f32> = rand(n * c * h * w, 50)
            .iter()
            .map(|v| (v * 4.0).round())
            .collect();
        let x = t(xv.clone(), &[n, c, h, w], &d);
        let (y, am) = K.max_pool2d(&x, &g).unwrap();
        let avg = K.to_host(&K.avg_pool2d(&x, &g).unwrap()).unwrap();
        let (y, am) = (K.to_host(&y).unwrap(), K.to_host(&am).unwrap());
        let ohw = g.h_out * g.w_out;
        for p in 0..n * c {
            for oy in 0..g.h_out {
                for ox in 0..g.w_out {
                    let (mut best, mut at, mut s) = (f32::NEG_INFINITY, usize::MAX, 0.0f32);
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let iy = (oy * g.stride.0 + ky) as isize - g.padding.0 as isize;
                            let ix = (ox * g.stride.1 + kx) as isize - g.padding.1 as isize;
                            if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                                continue;
                            }
                            let f = iy as usize * w + ix as usize;
                            let v = xv[p * h * w + f];
                            s += v;
                            if v > best || at == usize::MAX {
                                best = v;
                                at = f;
                            }
                        }
                    }
                    let o = p * ohw + oy * g.w_out + ox;
                    assert_eq!((y[o], am[o]), (best, at as f32));
                    close(&[avg[o]], &[s / (g.kh * g.kw) as f32], 1e-6);
                }
            }
        }
        // Adjoints: <pool(x), dy> == <x, pool_backward(dy)> for avg; for max, with the mask fixed.
        let dyv = rand(n * c * ohw, 51);
        let dy = t(dyv.clone(), &[n, c, g.h_out, g.w_out], &d);
        let dxa = K.to_host(&K.avg_pool2d_backward(&dy, &g).unwrap()).unwrap();
        let (l, r) = (dot(&avg, &dyv), dot(&xv, &dxa));
        assert!((l - r).abs() < 1e-3 * (1.0 + l.abs()), "{l} vs {r}");
        let amt = t(am.clone(), &[n, c, g.h_out, g.w_out], &d);
        let dxm = K
            .to_host(&K.max_pool2d_backward(&dy, &amt, &g).unwrap())
            .unwrap();
        let mut want = vec![0.0; n * c * h * w];
        for (o, (&dv, &a)) in dyv.iter().zip(&am).enumerate() {
            want[(o / ohw) * h * w + a as usize] += dv;
        }
        close(&dxm, &want, 1e-6);
    }
}

#[test]
fn index_select_add_gather_scatter() {
    let d = dev();
    for &(outer, dim, inner, n) in &[(2, 5, 3, 7), (1, 300, 256, 400), (6, 40, 50, 30)] {
        let xv = rand(outer * dim * inner, 60);
        let x = t(xv.clone(), &[outer, dim, inner], &d);
        let iv: Vec<f32> = (0..n).map(|j| ((j * 7 + 3) % dim) as f32).collect();
        let idx = t(iv.clone(), &[n], &d);
        let y = K
            .to_host(&K.index_select(&x, &idx, outer, dim, inner).unwrap())
            .unwrap();
        let mut want = vec![];
        for o in 0..outer {
            for &j in &iv {
                let s = (o * dim + j as usize) * inner;
                want.extend_from_slice(&xv[s..s + inner]);
            }
        }
        assert_eq!(y, want);
        let sv = rand(outer * n * inner, 61);
        let src = t(sv.clone(), &[outer, n, inner], &d);
        let back = K
            .to_host(&K.index_add(&src, &idx, outer, dim, inner).unwrap())
            .unwrap();
        let mut want = vec![0.0f32; outer * dim * inner];
        for o in 0..outer {
            for (j, &r) in iv.iter().enumerate() {
                for i in 0..inner {
                    want[(o * dim + r as usize) * inner + i] += sv[(o * n + j) * inner + i];
                }
            }
        }
        close(&back, &want, 1e-6);
        // gather / scatter_add with a per-element index.
        let gv: Vec<f32> = (0..outer * n * inner)
            .map(|e| ((e * 13 + 5) % dim) as f32)
            .collect();
        let gi = t(gv.clone(), &[outer, n, inner], &d);
        let y = K
            .to_host(&K.gather(&x, &gi, outer, dim, inner).unwrap())
            .unwrap();
        let mut want = vec![0.0; outer * n * inner];
        let mut sc = vec![0.0f32; outer * dim * inner];
        for o in 0..outer {
            for j in 0..n {
                for i in 0..inner {
                    let e = (o * n + j) * inner + i;
                    let at = (o * dim + gv[e] as usize) * inner + i;
                    want[e] = xv[at];
                    sc[at] += sv[e];
                }
            }
        }
        assert_eq!(y, want);
        let s = K
            .to_host(&K.scatter_add(&src, &gi, outer, dim, inner).unwrap())
            .unwrap();
        close(&s, &sc, 1e-6);
    }
}

#[test]
fn adam_matches_hand_computed_values() {
    let d = dev();
    let p = t(vec![1.0, -2.0], &[2], &d);
    let g = t(vec![0.5, 0.1], &[2], &d);
    let m = t(vec![0.1, 0.0], &[2], &d);
    let v = t(vec![0.01, 0.0], &[2], &d);
    let mut hp = AdamStep {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        decoupled: false,
        bias_correction1: 1.0 - 0.9f32.powi(2),
        bias_correction2: 1.0 - 0.999f32.powi(2),
    };
    // Coupled (Adam + L2), element 0: g' = 0.5 + 0.1 = 0.6; m' = 0.09 + 0.06 = 0.15;
    // v' = 0.00999 + 0.00036 = 0.01035; p' = 1 - 0.1 * (0.15 / 0.19) / (sqrt(0.01035 / 0.001999) + 1e-8).
    let (p2, m2, v2) = K.adam_update(&p, &g, &m, &v, &hp).unwrap();
    let (p2, m2, v2) = (
        K.to_host(&p2).unwrap(),
        K.to_host(&m2).unwrap(),
        K.to_host(&v2).unwrap(),
    );
    let p0 = 1.0 - 0.1 * (0.15 / 0.19) / ((0.01035f64 / 0.001999).sqrt() + 1e-8);
    // Element 1: g' = 0.1 - 0.2 = -0.1; m' = -0.01; v' = 1e-5.
    let p1 = -2.0 - 0.1 * (-0.01 / 0.19) / ((1e-5f64 / 0.001999).sqrt() + 1e-8);
    close(&m2, &[0.15, -0.01], 1e-6);
    close(&v2, &[0.01035, 1e-5], 1e-5);
    close(&p2, &[p0 as f32, p1 as f32], 1e-6);
    // Decoupled (AdamW), element 0: g' = 0.5; m' = 0.14; v' = 0.00999 + 0.00025 = 0.01024;
    // p' = 1 - 0.1 * (0.14 / 0.19) / (sqrt(0.01024 / 0.001999) + 1e-8) - 0.1 * 0.1 * 1.
    hp.decoupled = true;
    let (p2, m2, v2) = K.adam_update(&p, &g, &m, &v, &hp).unwrap();
    let want = 1.0 - 0.1 * (0.14 / 0.19) / ((0.01024f64 / 0.001999).sqrt() + 1e-8) - 0.01;
    close(&K.to_host(&m2).unwrap()[..1], &[0.14], 1e-6);
    close(&K.to_host(&v2).unwrap()[..1], &[0.01024], 1e-5);
    close(&K.to_host(&p2).unwrap()[..1], &[want as f32], 1e-6);
    // Large tensors (parallel path) agree with the scalar formula.
    let n = 100_001;
    let (pv, gv, mv) = (rand(n, 70), rand(n, 71), rand(n, 72));
    let vv: Vec<f32> = rand(n, 73).iter().map(|x| x.abs()).collect();
    let (pt, gt, mt, vt) = (
        t(pv.clone(), &[n], &d),
        t(gv.clone(), &[n], &d),
        t(mv.clone(), &[n], &d),
        t(vv.clone(), &[n], &d),
    );
    let (p2, _, _) = K.adam_update(&pt, &gt, &mt, &vt, &hp).unwrap();
    let p2 = K.to_host(&p2).unwrap();
    for i in (0..n).step_by(997) {
        assert_eq!(
            p2[i],
            super::optim::adam_scalar(pv[i], gv[i], mv[i], vv[i], &hp).0
        );
    }
}

#[test]
fn dropout_mask_equals_rng_dropout_value() {
    let d = dev();
    for &(n, p) in &[
        (1usize, 0.5f32),
        (7, 0.25),
        (70, 0.3),
        (100_003, 0.1),
        (64, 0.0),
    ] {
        let y = K
            .to_host(&K.dropout_mask(d.memory(), &[n], p, 42, 9).unwrap())
            .unwrap();
        let want: Vec<f32> = (0..n as u64)
            .map(|i| crate::rng::dropout_value(42, 9, i, p))
            .collect();
        assert_eq!(y, want, "n = {n}, p = {p}");
    }
    // The portable path too (the AVX2 one runs above where the CPU has it), and counters whose
    // high word changes inside one group of blocks.
    for first in [0u64, (1u64 << 32) - 3] {
        let mut out = vec![0.0; 64];
        super::random::fill_blocks_portable(&mut out, first, 5, [7, 8], 0.3, 1.0 / 0.7);
        let mut fast = vec![0.0; 64];
        super::random::fill_blocks(&mut fast, first, 5, [7, 8], 0.3, 1.0 / 0.7);
        let seed = 7 | (8u64 << 32);
        let want: Vec<f32> = (0..64)
            .map(|i| crate::rng::dropout_value(seed, 5, first * 4 + i, 0.3))
            .collect();
        assert_eq!(out, want);
        assert_eq!(fast, want);
    }
    let y = K
        .dropout_mask(d.memory(), &[3, 5], 0.5, 1, 1u64 << 40)
        .unwrap();
    assert_eq!(y.shape(), &[3, 5]);
    let want: Vec<f32> = (0..15)
        .map(|i| crate::rng::dropout_value(1, 1 << 40, i, 0.5))
        .collect();
    assert_eq!(K.to_host(&y).unwrap(), want);
}

#[test]
fn capped_device_refuses_without_leaking() {
    let d = Device::cpu().virtual_device("capped", Some(1000));
    let x = t(vec![1.0; 128], &[128], &d); // 512 bytes
    let live = d.memory_stats().live;
    assert_eq!(live, 512);
    let e = K.unary(UnaryOp::Exp, &x).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    // Multi-output kernels fail whole: nothing stays charged.
    let small = t(vec![0.5; 64], &[64], &d); // 256 bytes, 768 live
    let e = K.adam_update(
        &small,
        &small,
        &small,
        &small,
        &AdamStep {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: true,
            bias_correction1: 0.1,
            bias_correction2: 0.01,
        },
    );
    assert!(matches!(e, Err(Error::OutOfMemory { .. })));
    let g = t(vec![1.0; 8], &[8], &d);
    let e = K.layer_norm_rows(&small, &g, &g, 8, 8, 1e-5);
    assert!(matches!(e, Err(Error::OutOfMemory { .. })));
    assert_eq!(d.memory_stats().live, 800);
    assert!(K
        .matmul(
            &x,
            MatLayout::new(0, 0, 16, 1),
            &x,
            MatLayout::new(0, 0, 16, 1),
            MatDims {
                batch: 1,
                m: 8,
                k: 16,
                n: 16
            }
        )
        .is_err());
    // A small op that fits still works, and its bytes are charged then freed.
    let y = K.unary(UnaryOp::Neg, &g).unwrap();
    assert_eq!(d.memory_stats().live, 800 + 32);
    drop(y);
    assert_eq!(d.memory_stats().live, 800);
}

/// Matmul throughput (run: `cargo test -p wgpipe-tensor --release --lib cpu::tests::bench_matmul
/// -- --ignored --nocapture`).
#[test]
#[ignore]
fn bench_matmul() {
    let d = dev();
    for n in [256usize, 512, 1024, 2048] {
        let a = t(rand(n * n, 1), &[n, n], &d);
        let b = t(rand(n * n, 2), &[n, n], &d);
        let l = MatLayout::new(0, 0, n, 1);
        let dims = MatDims {
            batch: 1,
            m: n,
            k: n,
            n,
        };
        let flops = 2.0 * (n * n * n) as f64;
        let reps = ((2e10 / flops) as usize).clamp(3, 200);
        for _ in 0..2 {
            K.matmul(&a, l, &b, l, dims).unwrap();
        }
        let mut best = f64::MAX;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            let s = std::time::Instant::now();
            std::hint::black_box(K.matmul(&a, l, &b, l, dims).unwrap());
            best = best.min(s.elapsed().as_secs_f64());
        }
        let mean = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "matmul {n}x{n}x{n}: best {:.0} GFLOP/s, mean {:.0} GFLOP/s ({reps} reps)",
            flops / best / 1e9,
            flops / mean / 1e9
        );
    }
}

/// Throughput of the memory-bound kernels (same command as `bench_matmul`, `bench_kernels`).
#[test]
#[ignore]
fn bench_kernels() {
    let d = dev();
    let time = |name: &str, bytes: usize, f: &dyn Fn()| {
        f();
        let s = std::time::Instant::now();
        let reps = 10;
        for _ in 0..reps {
            f();
        }
        let dt = s.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{name:<32} {:>8.2} ms {:>6.1} GB/s",
            dt * 1e3,
            bytes as f64 / dt / 1e9
        );
    };
    let (r, c) = (4096, 1024);
    let n = r * c;
    let x = t(rand(n, 1), &[r, c], &d);
    let y = t(rand(n, 2), &[r, c], &d);
    let row = t(rand(c, 3), &[c], &d).broadcast_to(&[r, c]).unwrap();
    let xt = t(rand(n, 4), &[c, r], &d).t().unwrap();
    let g = t(rand(c, 5), &[c], &d);
    let xs = rand(n, 8);
    let mut buf = vec![0.0f32; n];
    let bp = std::cell::RefCell::new(&mut buf);
    time("1 thread: std exp loop", 8 * n, &|| {
        let mut b = bp.borrow_mut();
        for (o, &v) in b.iter_mut().zip(std::hint::black_box(&xs)) {
            *o = v.exp();
        }
        std::hint::black_box(&mut **b);
    });
    time("1 thread: math::exp loop", 8 * n, &|| {
        let mut b = bp.borrow_mut();
        for (o, &v) in b.iter_mut().zip(std::hint::black_box(&xs)) {
            *o = super::math::exp(v);
        }
        std::hint::black_box(&mut **b);
    });
    let (mut b1, mut b2, mut b3) = (vec![0.0f32; n], vec![0.0f32; n], vec![0.0f32; n]);
    let bufs = std::cell::RefCell::new((&mut b1, &mut b2, &mut b3));
    let hp0 = AdamStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
    };
    time("into buffers: adam", 28 * n, &|| {
        let mut b = bufs.borrow_mut();
        let (p, m, v) = &mut *b;
        super::optim::adam(p, m, v, Some((&xs, &xs, &xs)), &xs, &hp0);
    });
    time("into buffers: dropout", 4 * n, &|| {
        let mut b = bufs.borrow_mut();
        super::random::dropout_mask(b.0, 0.1, 1, 2);
    });
    time("into buffers: exp", 8 * n, &|| {
        let mut b = bufs.borrow_mut();
        super::elementwise::unary(UnaryOp::Exp, b.0, &xs, &Layout::contiguous(&[n]));
    });
    time("unary exp", 8 * n, &|| {
        drop(K.unary(UnaryOp::Exp, &x).unwrap())
    });
    time("unary affine", 8 * n, &|| {
        drop(K.unary(UnaryOp::Affine { mul: 2.0, add: 1.0 }, &x).unwrap())
    });
    time("binary add", 12 * n, &|| {
        drop(K.binary(BinaryOp::Add, &x, &y).unwrap())
    });
    time("binary add row-broadcast", 8 * n, &|| {
        drop(K.binary(BinaryOp::Add, &x, &row).unwrap())
    });
    time("contiguous of transpose", 8 * n, &|| {
        drop(K.contiguous(&xt).unwrap())
    });
    time("reduce sum rows", 4 * n, &|| {
        drop(K.reduce_rows(ReduceOp::Sum, &x, r, c).unwrap())
    });
    time("reduce max 1 row", 4 * n, &|| {
        drop(K.reduce_rows(ReduceOp::Max, &x, 1, n).unwrap())
    });
    time("softmax rows", 8 * n, &|| {
        drop(K.softmax_rows(&x, r, c, false).unwrap())
    });
    time("layer norm rows", 8 * n, &|| {
        drop(K.layer_norm_rows(&x, &g, &g, r, c, 1e-5).unwrap())
    });
    time("dropout mask", 4 * n, &|| {
        drop(K.dropout_mask(d.memory(), &[n], 0.1, 1, 2).unwrap())
    });
    let hp = AdamStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        decoupled: true,
        bias_correction1: 0.1,
        bias_correction2: 0.001,
    };
    time("adam", 28 * n, &|| {
        drop(K.adam_update(&x, &y, &x, &y, &hp).unwrap())
    });
    let cg = conv_geometry(16, 64, 32, 32, 1);
    let img = t(rand(16 * 64 * 32 * 32, 6), &[16, 64, 32, 32], &d);
    let cols = K.im2col(&img, &cg).unwrap();
    let cb = cols.numel() * 4;
    time("im2col 16x64x32x32 k3x2", cb, &|| {
        drop(K.im2col(&img, &cg).unwrap())
    });
    time("col2im", cb, &|| drop(K.col2im(&cols, &cg).unwrap()));
    let pg = pool_geometry(16, 64, 32, 32);
    let imgv = rand(16 * 64 * 32 * 32, 6);
    let (mut py, mut pa) = (
        vec![0.0f32; 16 * 64 * 17 * 16],
        vec![0.0f32; 16 * 64 * 17 * 16],
    );
    let pbuf = std::cell::RefCell::new((&mut py, &mut pa));
    time("into buffers: max pool", 4 * img.numel(), &|| {
        let mut b = pbuf.borrow_mut();
        let (y, a) = &mut *b;
        super::pool::max_pool2d(y, a, &imgv, &pg);
    });
    time("max pool", 4 * img.numel(), &|| {
        drop(K.max_pool2d(&img, &pg).unwrap())
    });
    let idx = t((0..4096).map(|i| (i % 1000) as f32).collect(), &[4096], &d);
    let emb = t(rand(1000 * 1024, 7), &[1, 1000, 1024], &d);
    time("index_select 4096 rows", 8 * n, &|| {
        drop(K.index_select(&emb, &idx, 1, 1000, 1024).unwrap())
    });
    time("index_add 4096 rows", 8 * n, &|| {
        drop(K.index_add(&x, &idx, 1, 1000, 1024).unwrap())
    });
}

#[test]
fn sums_over_leading_axes_are_column_sums() {
    let dv = dev();
    let (a, b, c) = (37, 5, 70);
    let v = rand(a * b * c, 77);
    let x = tensor(v.clone(), &[a, b, c], &dv);
    let s01 = x.sum(&[0, 1], false).unwrap();
    assert_eq!(s01.shape(), &[c]);
    let want: Vec<f32> = (0..c)
        .map(|j| (0..a * b).map(|i| v[i * c + j] as f64).sum::<f64>() as f32)
        .collect();
    close(&s01.to_vec().unwrap(), &want, 1e-6);
    let s0 = x.sum(&[0], true).unwrap();
    assert_eq!(s0.shape(), &[1, b, c]);
    let want: Vec<f32> = (0..b * c)
        .map(|j| (0..a).map(|i| v[i * b * c + j] as f64).sum::<f64>() as f32)
        .collect();
    close(&s0.to_vec().unwrap(), &want, 1e-6);
    // A non-contiguous input takes the general path and agrees.
    let xt = x.permute(&[0, 2, 1]).unwrap();
    let st = xt.sum(&[0], false).unwrap().t().unwrap();
    close(&st.to_vec().unwrap(), &want, 1e-5);
}

#[test]
fn transposed_copies_match_elementwise_reads_for_whole_partial_and_batch_spanning_tiles() {
    let dv = dev();
    // [rows, cols] transposed, and batches whose tiles span two matrices (rows not a multiple
    // of 32), with whole 32 x 32 tiles, partial ones and 8 x 8 blocks at every edge.
    for &(batch, r, c) in &[
        (1, 64, 96),
        (1, 70, 45),
        (3, 40, 33),
        (2, 32, 256),
        (1, 9, 300),
    ] {
        let x = t(rand(batch * r * c, 40), &[batch, r, c], &dv);
        let xt = x.t().unwrap();
        let y = K.contiguous(&xt).unwrap();
        assert!(
            same(&K.to_host(&y).unwrap(), &naive(&xt)),
            "[{batch}, {r}, {c}] transposed"
        );
    }
}

/// Restores the widest SIMD build when dropped, also when an assertion fails.
struct WidestBuildAfter;

impl Drop for WidestBuildAfter {
    fn drop(&mut self) {
        simd::set_max_level(simd::Level::Avx512);
    }
}

/// The baseline, AVX2 + FMA and AVX-512 builds of the hot loops run the same operations on each
/// element (no reassociation, `mul_add` fused in all three), so every op gives the same bits in
/// each. On a machine with AVX-512 this is also what runs the two narrower builds at all.
#[test]
fn every_simd_build_gives_the_same_bits() {
    let d = dev();
    let (rows, cols) = (67, 131); // odd sizes: every loop has a tail
    let x = tensor(rand(rows * cols, 11), &[rows, cols], &d);
    let g = tensor(rand(rows * cols, 12), &[rows, cols], &d);
    let bias = tensor(rand(cols, 13), &[cols], &d);
    let gamma = tensor(rand(cols, 14), &[cols], &d);
    let beta = tensor(rand(cols, 15), &[cols], &d);
    let targets: Vec<f32> = (0..rows).map(|r| (r * 7 % cols) as f32).collect();
    let targets = tensor(targets, &[rows], &d);
    let row_g = tensor(rand(rows, 16), &[rows], &d);
    let run = || -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        let mut keep = |name: String, y: Tensor| out.push((name, y.to_vec().unwrap()));
        for op in UnaryOp::ALL {
            keep(format!("{op:?}"), x.unary(op).unwrap());
            keep(format!("{op:?} grad"), x.unary_grad(op, &g).unwrap());
            keep(
                format!("{op:?} on a transposed view"),
                x.t().unwrap().unary(op).unwrap(),
            );
        }
        for op in [UnaryOp::Gelu, UnaryOp::GeluTanh, UnaryOp::Relu] {
            keep(format!("bias_act {op:?}"), x.bias_act(&bias, op).unwrap());
            let gb = Tensor::bias_act_grad(&x, &bias, &g, op).unwrap();
            keep(format!("bias_act_grad {op:?}"), gb);
        }
        keep("softmax".into(), x.softmax(-1).unwrap());
        keep("log_softmax".into(), x.log_softmax(-1).unwrap());
        let p = x.narrow(1, 0, rows).unwrap().causal_softmax(0.3).unwrap();
        let gp = g.narrow(1, 0, rows).unwrap();
        keep(
            "softmax backward".into(),
            Tensor::softmax_backward(&p, &gp, 0.3).unwrap(),
        );
        keep("causal_softmax".into(), p);
        // Fused attention: 2 batches of [t, dh] = [67, 19] (dh not whole lanes, rows read
        // through strides), and [67, 32] (whole lanes, read in place).
        for dh in [19, 32] {
            let part = |x: &Tensor, i| x.narrow(1, i * dh, dh).unwrap().unsqueeze(0).unwrap();
            let (q, k, v) = (part(&x, 0), part(&x, 1), part(&g, 2));
            let gy = part(&g, 3);
            let (y, p) = q.causal_attention(&k, &v, 0.2).unwrap();
            let [gq, gk, gv] = q.causal_attention_backward(&k, &v, &p, &gy, 0.2).unwrap();
            for (name, y) in [("y", y), ("p", p), ("gq", gq), ("gk", gk), ("gv", gv)] {
                keep(format!("causal_attention {name}, dh {dh}"), y);
            }
        }
        keep("column sums".into(), x.sum(&[0], false).unwrap());
        keep("row sums".into(), x.sum(&[1], false).unwrap());
        keep("row max".into(), x.max(&[1], false).unwrap());
        let (y, mean, rstd) = x.layer_norm(&gamma, &beta, 1e-5).unwrap();
        keep("layer_norm".into(), y);
        let gx = Tensor::layer_norm_backward(&x, &mean, &rstd, &gamma, &g, None).unwrap();
        keep("layer_norm backward".into(), gx);
        let (s, y, _, _) = x.add_layer_norm(&g, &gamma, &beta, 1e-5).unwrap();
        keep("add_layer_norm sum".into(), s);
        keep("add_layer_norm".into(), y);
        let (loss, max, logsum) = x.cross_entropy_rows(&targets).unwrap();
        keep("cross_entropy".into(), loss.clone());
        let gl = Tensor::cross_entropy_backward(&x, &targets, &max, &logsum, &row_g).unwrap();
        keep("cross_entropy backward".into(), gl);
        out
    };
    let _restore = WidestBuildAfter;
    let want = run();
    for level in [simd::Level::Avx2, simd::Level::Baseline] {
        simd::set_max_level(level);
        for ((name, got), (_, want)) in run().iter().zip(&want) {
            assert!(
                same(got, want),
                "{name}: the {level:?} build differs from the widest"
            );
        }
    }
}

/// The GELUs' loops run their polynomials over runs of values that all lie inside `|x| <= 2`
/// and the far forms elsewhere (`UnaryOpT::NEAR`); per element that is what the scalar op
/// does, so every loop gives the scalar op's bits whichever runs were inside: runs wholly
/// inside, runs with one value outside at the start, middle or end, values on the bound and
/// just past it, NaN and infinities, a tail shorter than a run; in each build.
#[test]
fn near_forms_run_only_where_a_whole_run_is_inside_and_give_the_scalar_bits() {
    let d = dev();
    let run = 16;
    let mut xs: Vec<f32> = rand(run * 3, 21); // three runs inside
    for (r, at) in [(0, 0), (1, 7), (2, 15)] {
        let mut v = rand(run, 22 + r);
        v[at] = [2.5, -3.75, 7.0][r as usize];
        xs.extend(v);
    }
    let edge = 2.0f32;
    xs.extend(
        [edge, -edge, edge.next_up(), -edge.next_up()]
            .iter()
            .cycle()
            .take(run),
    );
    xs.extend((0..run).map(|i| [f32::NAN, 0.5, f32::INFINITY, f32::NEG_INFINITY][i % 4]));
    xs.extend(rand(9, 30)); // a tail
    let n = xs.len();
    let zero_bias = tensor(vec![0.0; n], &[n], &d);
    let x = tensor(xs.clone(), &[n], &d);
    let g = tensor(rand(n, 31), &[n], &d);
    let gs = g.to_vec().unwrap();
    let _restore = WidestBuildAfter;
    for level in [
        simd::Level::Avx512,
        simd::Level::Avx2,
        simd::Level::Baseline,
    ] {
        simd::set_max_level(level);
        let ops = [
            UnaryOp::Gelu,
            UnaryOp::GeluGrad,
            UnaryOp::GeluTanh,
            UnaryOp::GeluTanhGrad,
        ];
        for op in ops {
            let f: Vec<f32> = xs.iter().map(|&v| op.eval(v)).collect();
            let df: Vec<f32> = xs.iter().zip(&gs).map(|(&v, &g)| g * op.grad(v)).collect();
            let got = |y: Tensor| y.to_vec().unwrap();
            assert!(same(&got(x.unary(op).unwrap()), &f), "{op:?}, {level:?}");
            let y = x.unary_grad(op, &g).unwrap();
            assert!(same(&got(y), &df), "{op:?} grad, {level:?}");
            if matches!(op, UnaryOp::Gelu | UnaryOp::GeluTanh) {
                // `x + 0` is `x` but for -0 (none here).
                let y = x.bias_act(&zero_bias, op).unwrap();
                assert!(same(&got(y), &f), "bias_act {op:?}, {level:?}");
                let y = Tensor::bias_act_grad(&x, &zero_bias, &g, op).unwrap();
                assert!(same(&got(y), &df), "bias_act_grad {op:?}, {level:?}");
            }
        }
    }
    // A run with a value outside taken near would show: the near form is far off out there.
    use wgpipe_shaders::ops::math::{gelu, gelu_near};
    assert!((gelu_near(7.0) - gelu(7.0)).abs() > 1.0);
}

/// Where splitting an elementwise or row kernel over the threads starts to pay (same command as
/// `bench_matmul`, `bench_par_threshold`): each kernel at each size on a one-thread pool and
/// on a two-thread pool, called from inside the pool as a training loop's kernels are
/// (`on_cpu_pool`); the median of many calls. Where two threads are not faster, the hand-off
/// to the other thread (waking it, stealing, joining) costs what the split saves.
#[test]
#[ignore]
fn bench_par_threshold() {
    let d = dev();
    let pools = [1usize, 2].map(|n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    });
    let median_us = |pool: &rayon::ThreadPool, f: &(dyn Fn() + Sync)| {
        pool.install(|| {
            let reps = 400;
            let mut times: Vec<f64> = (0..reps)
                .map(|_| {
                    let s = std::time::Instant::now();
                    f();
                    s.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            times[reps / 2] * 1e6
        })
    };
    println!("| kernel | elements | 1 thread (us) | 2 threads (us) | 2 / 1 |");
    println!("|---|---|---|---|---|");
    for n in [
        4usize << 10,
        8 << 10,
        16 << 10,
        32 << 10,
        64 << 10,
        128 << 10,
        256 << 10,
    ] {
        let x = t(rand(n, 1), &[n / 64, 64], &d);
        let y = t(rand(n, 2), &[n / 64, 64], &d);
        let add = || drop(std::hint::black_box(K.binary(BinaryOp::Add, &x, &y)));
        let gelu = || drop(std::hint::black_box(K.unary(UnaryOp::Gelu, &x)));
        let softmax = || drop(std::hint::black_box(K.softmax_rows(&x, n / 64, 64, false)));
        let kernels: [(&str, &(dyn Fn() + Sync)); 3] = [
            ("add", &add),
            ("gelu", &gelu),
            ("softmax rows of 64", &softmax),
        ];
        for (name, f) in &kernels {
            let [one, two] = [&pools[0], &pools[1]].map(|p| median_us(p, *f));
            println!("| {name} | {n} | {one:.1} | {two:.1} | {:.2} |", two / one);
        }
    }
}
