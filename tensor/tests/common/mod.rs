//! Shared helpers of the op tests: a naive n-d array for reference results, tensors of given
//! values in several memory layouts, tolerant comparisons, and the GELUs (`gelu_ref`).
#![allow(dead_code)]

pub mod gelu_ref;

use wgpipe_tensor::{Device, Tensor};

/// Row-major strides.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// The multi-index of row-major position `i`.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A plain row-major n-d array: the reference side of every test.
#[derive(Debug, Clone, PartialEq)]
pub struct Nd {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Nd {
    pub fn new(shape: &[usize], data: Vec<f32>) -> Nd {
        assert_eq!(numel(shape), data.len());
        Nd {
            shape: shape.to_vec(),
            data,
        }
    }
    /// `f` of every multi-index, in row-major order.
    pub fn from_fn(shape: &[usize], mut f: impl FnMut(&[usize]) -> f32) -> Nd {
        let data = (0..numel(shape)).map(|i| f(&unravel(i, shape))).collect();
        Nd::new(shape, data)
    }
    /// Uniform random values in [lo, hi) from `seed`.
    pub fn rand(shape: &[usize], seed: u64, lo: f32, hi: f32) -> Nd {
        Nd::new(
            shape,
            wgpipe_tensor::rng::uniform_vec(seed, 0, numel(shape), lo, hi),
        )
    }
    /// Random integers in `0..bound`, as f32.
    pub fn rand_index(shape: &[usize], seed: u64, bound: usize) -> Nd {
        let v = wgpipe_tensor::rng::uniform_vec(seed, 1, numel(shape), 0.0, bound as f32);
        Nd::new(
            shape,
            v.into_iter()
                .map(|x| x.floor().min(bound as f32 - 1.0))
                .collect(),
        )
    }
    pub fn at(&self, idx: &[usize]) -> f32 {
        self.data[ravel(idx, &self.shape)]
    }
    /// The element that broadcasting maps to output index `out_idx` (numpy rules).
    pub fn at_broadcast(&self, out_idx: &[usize]) -> f32 {
        let pad = out_idx.len() - self.shape.len();
        let idx: Vec<usize> = self
            .shape
            .iter()
            .enumerate()
            .map(|(d, &s)| if s == 1 { 0 } else { out_idx[pad + d] })
            .collect();
        self.at(&idx)
    }
    pub fn tensor(&self) -> Tensor {
        Tensor::from_slice(&self.data, &self.shape, &Device::cpu()).unwrap()
    }
    /// A tensor of these values in layout `variant` (see [`layout_variant`]).
    pub fn tensor_as(&self, variant: u8) -> Tensor {
        layout_variant(&self.data, &self.shape, variant)
    }
}

/// Number of layouts [`layout_variant`] knows.
pub const VARIANTS: u8 = 4;

/// A tensor holding `data` (row-major, `shape`) in one of several layouts:
/// 0 contiguous; 1 storage with the axes reversed, permuted back (every stride "wrong");
/// 2 narrowed out of a larger tensor along axis 0 (an offset); 3 narrowed along the last axis
/// (gaps between rows). The padding around a narrowed view holds 1e9 so a kernel that ignores
/// the layout gives visibly wrong results.
pub fn layout_variant(data: &[f32], shape: &[usize], variant: u8) -> Tensor {
    let dev = Device::cpu();
    let r = shape.len();
    match variant % VARIANTS {
        1 if r >= 2 => {
            let rev: Vec<usize> = shape.iter().rev().copied().collect();
            let stored = Nd::from_fn(&rev, |i| {
                let orig: Vec<usize> = i.iter().rev().copied().collect();
                data[ravel(&orig, shape)]
            });
            let perm: Vec<usize> = (0..r).rev().collect();
            let t = stored.tensor().permute(&perm).unwrap();
            assert_eq!(t.shape(), shape);
            t
        }
        v @ (2 | 3) if r >= 1 => {
            let axis = if v == 2 { 0 } else { r - 1 };
            let mut big = shape.to_vec();
            big[axis] += 3;
            let stored = Nd::from_fn(&big, |i| {
                if i[axis] >= 1 && i[axis] < shape[axis] + 1 {
                    let mut j = i.to_vec();
                    j[axis] -= 1;
                    data[ravel(&j, shape)]
                } else {
                    1e9
                }
            });
            stored
                .tensor()
                .narrow(axis as isize, 1, shape[axis])
                .unwrap()
        }
        _ => Tensor::from_slice(data, shape, &dev).unwrap(),
    }
}

/// Element-wise closeness with NaN == NaN and equal infinities.
pub fn close(a: f32, b: f32, rtol: f32, atol: f32) -> bool {
    if a.is_nan() || b.is_nan() {
        return a.is_nan() && b.is_nan();
    }
    if a.is_infinite() || b.is_infinite() {
        return a == b;
    }
    (a - b).abs() <= atol + rtol * b.abs()
}

/// Asserts `t` has `expected`'s shape and values (within tolerance), naming the first mismatch.
pub fn assert_nd(t: &Tensor, expected: &Nd, rtol: f32, atol: f32) {
    assert_eq!(t.shape(), &expected.shape[..], "shape");
    let got = t.to_vec().unwrap();
    assert_close(&got, &expected.data, rtol, atol);
}

pub fn assert_close(got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            close(g, w, rtol, atol),
            "element {i}: got {g}, want {w} (got {got:?}, want {want:?})"
        );
    }
}

/// `<a, b>` in f64 (for adjoint identities).
pub fn dot(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    a.to_vec()
        .unwrap()
        .iter()
        .zip(b.to_vec().unwrap())
        .map(|(&x, y)| x as f64 * y as f64)
        .sum()
}

/// Asserts two inner products agree to a relative tolerance scaled by `scale` (the sum of
/// absolute products, so cancellation does not make the check impossible).
pub fn assert_adjoint(lhs: f64, rhs: f64, scale: f64) {
    assert!(
        (lhs - rhs).abs() <= 1e-4 * scale.max(1.0),
        "adjoint identity broken: {lhs} vs {rhs} (scale {scale})"
    );
}

/// `sum |a_i b_i|`, the scale of `<a, b>`.
pub fn abs_dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_vec()
        .unwrap()
        .iter()
        .zip(b.to_vec().unwrap())
        .map(|(&x, y)| (x as f64 * y as f64).abs())
        .sum()
}

/// Asserts `e` is the expected variant and its message names every string of `needles`.
#[macro_export]
macro_rules! assert_err {
    ($res:expr, $pat:pat, $($needle:expr),+ $(,)?) => {{
        match $res {
            Ok(_) => panic!("expected an error, got Ok"),
            Err(e) => {
                assert!(matches!(e, $pat), "wrong variant: {e:?}");
                let msg = e.to_string();
                $(assert!(msg.contains($needle), "message {msg:?} lacks {:?}", $needle);)+
            }
        }
    }};
}

/// A second CPU device, for device-mismatch errors.
pub fn other_device() -> Device {
    Device::new_cpu("other-cpu")
}

/// A proptest config of `n` cases that keeps no regression files (the tests live outside
/// `src/`, where proptest's default persistence cannot find a home for them).
pub fn cases(n: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases: n,
        failure_persistence: None,
        ..Default::default()
    }
}

/// Numpy broadcast of two shapes (the test's own, independent of the library's).
pub fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|d| {
            let da = if d + a.len() >= r {
                a[d + a.len() - r]
            } else {
                1
            };
            let db = if d + b.len() >= r {
                b[d + b.len() - r]
            } else {
                1
            };
            assert!(da == db || da == 1 || db == 1, "{a:?} vs {b:?}");
            if da == 1 {
                db
            } else {
                da
            }
        })
        .collect()
}
