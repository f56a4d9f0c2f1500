//! Elementwise kernels over strided views: unary and binary ops, `where`, and strided copies
//! (materialising a view, concatenation). Contiguous inputs take a plain slice loop; other views
//! are walked run by run (see [`Walk`]), with unit and zero inner strides special-cased.

use wgpipe_shaders::ops::{BinaryOpT, BinaryVisitor, UnaryOpT, UnaryVisitor};

use crate::backend::{BinaryOp, UnaryOp};
use crate::layout::Layout;

use super::par::for_rows;
use super::simd;
use super::strided::Walk;

/// `out[i] = f(x[i])`, `x` a view of `out.len()` elements.
pub(crate) fn map1<F>(out: &mut [f32], x: &[f32], lx: &Layout, f: F)
where
    F: Fn(f32) -> f32 + Sync + Send,
{
    if lx.is_contiguous() {
        let xs = &x[lx.offset..lx.offset + out.len()];
        for_rows(out, 1, |s, o| {
            let e = s + o.len();
            simd::map(o, &xs[s..e], &f)
        });
        return;
    }
    let w = Walk::new(&lx.shape, [lx]);
    for_rows(out, 1, |s, o| {
        w.runs(s, o.len(), |p, [b], c| {
            let o = &mut o[p..p + c];
            match w.inner_stride[0] {
                1 => simd::map(o, &x[b..b + c], &f),
                0 => o.fill(f(x[b])),
                st => simd::fill_with(o, &|j| f(x[b + j * st])),
            }
        })
    });
}

/// `out[i] = f(a[i], b[i])` for two views of `out.len()` elements.
pub(crate) fn map2<F>(out: &mut [f32], a: &[f32], la: &Layout, b: &[f32], lb: &Layout, f: F)
where
    F: Fn(f32, f32) -> f32 + Sync + Send,
{
    if la.is_contiguous() && lb.is_contiguous() {
        let n = out.len();
        let (as_, bs) = (&a[la.offset..la.offset + n], &b[lb.offset..lb.offset + n]);
        for_rows(out, 1, |s, o| {
            let e = s + o.len();
            simd::zip(o, &as_[s..e], &bs[s..e], &f)
        });
        return;
    }
    let w = Walk::new(&la.shape, [la, lb]);
    for_rows(out, 1, |s, o| {
        w.runs(s, o.len(), |p, [ba, bb], c| {
            let o = &mut o[p..p + c];
            match w.inner_stride {
                [1, 1] => simd::zip(o, &a[ba..ba + c], &b[bb..bb + c], &f),
                [1, 0] => simd::zip_scalar(o, &a[ba..ba + c], b[bb], &f),
                [0, 1] => {
                    let x = a[ba];
                    simd::zip_scalar(o, &b[bb..bb + c], x, &|y, x| f(x, y))
                }
                [sa, sb] => simd::fill_with(o, &|j| f(a[ba + j * sa], b[bb + j * sb])),
            }
        })
    });
}

/// `acc[i] = f(acc[i], b[i])`, `b` a view of `acc.len()` elements: [`map2`] writing into its
/// first operand (which the caller holds exclusively), with the same `f` per element.
pub(crate) fn map2_assign<F>(acc: &mut [f32], b: &[f32], lb: &Layout, f: F)
where
    F: Fn(f32, f32) -> f32 + Sync + Send,
{
    if lb.is_contiguous() {
        let bs = &b[lb.offset..lb.offset + acc.len()];
        for_rows(acc, 1, |s, o| {
            let e = s + o.len();
            simd::zip_assign(o, &bs[s..e], &f)
        });
        return;
    }
    let w = Walk::new(&lb.shape, [lb]);
    for_rows(acc, 1, |s, o| {
        w.runs(s, o.len(), |p, [bb], c| {
            let o = &mut o[p..p + c];
            match w.inner_stride[0] {
                1 => simd::zip_assign(o, &b[bb..bb + c], &f),
                st => {
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = f(*o, b[bb + j * st]);
                    }
                }
            }
        })
    });
}

/// `out[i] = f(x[i], y[i], z[i])` for three views of `out.len()` elements.
#[allow(clippy::too_many_arguments)]
pub(crate) fn map3<F>(
    out: &mut [f32],
    x: &[f32],
    lx: &Layout,
    y: &[f32],
    ly: &Layout,
    z: &[f32],
    lz: &Layout,
    f: F,
) where
    F: Fn(f32, f32, f32) -> f32 + Sync + Send,
{
    let w = Walk::new(&lx.shape, [lx, ly, lz]);
    for_rows(out, 1, |s, o| {
        w.runs(s, o.len(), |p, [bx, by, bz], c| {
            let o = &mut o[p..p + c];
            // Runs of values, or one value repeated along the run (a scalar or a broadcast
            // operand: `masked_fill`'s value, `where_cond(c, x, 0.0)`), each kind its own loop:
            // through the general strides the compiler does not vectorise the loop.
            let (xs, ys, zs) = (&x[bx..], &y[by..], &z[bz..]);
            match w.inner_stride {
                [1, 1, 1] => fill3(o, &xs[..c], &ys[..c], &zs[..c], &f),
                [1, 0, 1] => fill3(o, &xs[..c], ys[0], &zs[..c], &f),
                [1, 1, 0] => fill3(o, &xs[..c], &ys[..c], zs[0], &f),
                [1, 0, 0] => fill3(o, &xs[..c], ys[0], zs[0], &f),
                [sx, sy, sz] => {
                    simd::fill_with(o, &|j| f(x[bx + j * sx], y[by + j * sy], z[bz + j * sz]))
                }
            }
        })
    });
}

/// One operand of [`map3`] along a run: its values, or one value repeated.
trait Lane: Copy {
    fn at(self, j: usize) -> f32;
}

impl Lane for &[f32] {
    #[inline(always)]
    fn at(self, j: usize) -> f32 {
        self[j]
    }
}

impl Lane for f32 {
    #[inline(always)]
    fn at(self, _: usize) -> f32 {
        self
    }
}

/// `o[j] = f(x[j], y[j], z[j])` along one run of [`map3`].
#[inline(always)]
fn fill3<X: Lane, Y: Lane, Z: Lane, F: Fn(f32, f32, f32) -> f32>(
    o: &mut [f32],
    x: X,
    y: Y,
    z: Z,
    f: &F,
) {
    simd::fill_with(o, &|j| f(x.at(j), y.at(j), z.at(j)));
}

/// Copies ranges of one view: the walk over its strides is worked out once, not per range
/// (`concat` copies each input row by row: a walk per row cost more than its copy).
pub(crate) enum ViewReader {
    Contiguous(usize),
    Strided(Walk<1>),
}

impl ViewReader {
    pub(crate) fn new(lx: &Layout) -> ViewReader {
        if lx.is_contiguous() {
            ViewReader::Contiguous(lx.offset)
        } else {
            ViewReader::Strided(Walk::new(&lx.shape, [lx]))
        }
    }

    /// Copies the elements `start..start + out.len()` (row-major logical positions) of the view
    /// (whose storage is `x`).
    pub(crate) fn copy_range(&self, out: &mut [f32], x: &[f32], start: usize) {
        match self {
            ViewReader::Contiguous(offset) => {
                let b = offset + start;
                out.copy_from_slice(&x[b..b + out.len()]);
            }
            ViewReader::Strided(w) => w.runs(start, out.len(), |p, [b], c| {
                let o = &mut out[p..p + c];
                match w.inner_stride[0] {
                    1 => o.copy_from_slice(&x[b..b + c]),
                    0 => o.fill(x[b]),
                    st => {
                        for (j, o) in o.iter_mut().enumerate() {
                            *o = x[b + j * st];
                        }
                    }
                }
            }),
        }
    }
}

/// Materialises view `x` into `out` (in parallel when big).
pub(crate) fn copy(out: &mut [f32], x: &[f32], lx: &Layout) {
    if !lx.is_contiguous() {
        let w = Walk::new(&lx.shape, [lx]);
        if let Some((rows, [1])) = w.last_outer() {
            if w.inner_stride[0] > 1 && w.inner >= 8 && rows >= 8 {
                copy_transposed(out, x, &w);
                return;
            }
        }
    }
    let reader = ViewReader::new(lx);
    for_rows(out, 1, |s, o| reader.copy_range(o, x, s));
}

/// A view whose two innermost dims are swapped (the dim above the innermost has stride 1):
/// copied in strips of 8 output rows, each strip in 8 x 8 blocks that read 8 runs of 8 source
/// values and write 8 runs of 8 output values. The strip's 8 output rows are written front to
/// back, so each output cache line is filled whole while it is in L1 (writing one value per
/// output row at a time, rows 4 KiB apart, kept missing L1 on one cache set: a fifth of an MLP
/// training step).
fn copy_transposed(out: &mut [f32], x: &[f32], w: &Walk<1>) {
    const B: usize = 8;
    let (q, s) = (w.inner, w.inner_stride[0]);
    for_rows(out, q, |r0, chunk| {
        let rows = chunk.len() / q;
        let mut r = 0;
        while r < rows {
            let nr = B.min(rows - r);
            let b0 = w.base(r0 + r)[0];
            // The strip's rows are consecutive in the source unless it spans two batches.
            let run = nr == B && w.base(r0 + r + B - 1)[0] == b0 + B - 1;
            let strip = &mut chunk[r * q..(r + nr) * q];
            if run {
                transpose_strip(strip, q, x, b0, s);
            } else {
                for (i, row) in strip.chunks_mut(q).enumerate() {
                    let b = w.base(r0 + r + i)[0];
                    for (j, o) in row.iter_mut().enumerate() {
                        *o = x[b + j * s];
                    }
                }
            }
            r += nr;
        }
    });
}

/// `strip[i * q + j] = x[b0 + i + j * s]` for `i < 8`, `j < q`.
fn transpose_strip(strip: &mut [f32], q: usize, x: &[f32], b0: usize, s: usize) {
    const B: usize = 8;
    assert!(strip.len() == B * q && q > 0 && b0 + B - 1 + (q - 1) * s < x.len());
    let whole = q / B * B;
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2() {
        // SAFETY: AVX was just detected; the assert above bounds every index the blocks read
        // (`b0 + i + j * s`, i < 8, j < whole <= q) and write (`i * q + j`).
        unsafe { transpose_blocks_avx(strip, q, whole, x, b0, s) };
    } else {
        for j0 in (0..whole).step_by(B) {
            for i in 0..B {
                for j in j0..j0 + B {
                    strip[i * q + j] = x[b0 + i + j * s];
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for j0 in (0..whole).step_by(B) {
        for i in 0..B {
            for j in j0..j0 + B {
                strip[i * q + j] = x[b0 + i + j * s];
            }
        }
    }
    for i in 0..B {
        for j in whole..q {
            strip[i * q + j] = x[b0 + i + j * s];
        }
    }
}

/// The 8 x 8 blocks of [`transpose_strip`] for `j < whole`, each transposed in registers.
///
/// # Safety
/// AVX must be available; `x[b0 + i + j * s]` and `strip[i * q + j]` must be in bounds for
/// `i < 8`, `j < whole`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose_blocks_avx(
    strip: &mut [f32],
    q: usize,
    whole: usize,
    x: &[f32],
    b0: usize,
    s: usize,
) {
    use std::arch::x86_64::*;
    let (src, dst) = (x.as_ptr(), strip.as_mut_ptr());
    for j0 in (0..whole).step_by(8) {
        // Ask for the block after the next now: rows 4 KiB apart are beyond what the hardware
        // prefetcher follows.
        if j0 + 16 < whole {
            for j in 0..8 {
                _mm_prefetch::<_MM_HINT_T0>(src.add(b0 + (j0 + 16 + j) * s) as *const i8);
            }
        }
        let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src.add(b0 + (j0 + j) * s)));
        let cols = super::simd::transpose_8x8(r);
        for (i, c) in cols.into_iter().enumerate() {
            _mm256_storeu_ps(dst.add(i * q + j0), c);
        }
    }
}

/// The scalar function of a unary op (the reference the vector loops are checked against).
#[cfg(test)]
pub(crate) fn unary_scalar(op: UnaryOp, x: f32) -> f32 {
    op.eval(x)
}

/// `out = op(x)`. Each op gets its own monomorphised loop: the descriptor's function is a type
/// parameter of the loop, chosen once outside it (on a contiguous `x`, `simd::unary`, which
/// also runs an op's near form where it can).
pub(crate) fn unary(op: UnaryOp, out: &mut [f32], x: &[f32], lx: &Layout) {
    struct Run<'a>(&'a mut [f32], &'a [f32], &'a Layout);
    impl UnaryVisitor for Run<'_> {
        type Out = ();
        fn visit<T: UnaryOpT>(self, s: [f32; 2]) {
            let Run(out, x, lx) = self;
            if lx.is_contiguous() {
                let xs = &x[lx.offset..lx.offset + out.len()];
                for_rows(out, 1, |st, o| {
                    simd::unary::<T>(o, &xs[st..st + o.len()], s)
                });
                return;
            }
            map1(out, x, lx, move |v| T::f(v, s))
        }
    }
    op.visit(Run(out, x, lx))
}

/// `out = g * op'(x)` (the backward of a unary op) on two views of one shape.
pub(crate) fn unary_grad(
    op: UnaryOp,
    out: &mut [f32],
    x: &[f32],
    lx: &Layout,
    g: &[f32],
    lg: &Layout,
) {
    op.visit(Map2(out, x, lx, g, lg))
}

/// The arguments of [`map2`], waiting for a descriptor: `g * op'(x)` for a unary op (the
/// second view is the gradient), `op(a, b)` for a binary one.
struct Map2<'a>(&'a mut [f32], &'a [f32], &'a Layout, &'a [f32], &'a Layout);

impl UnaryVisitor for Map2<'_> {
    type Out = ();
    fn visit<T: UnaryOpT>(self, s: [f32; 2]) {
        let Map2(out, x, lx, g, lg) = self;
        if lx.is_contiguous() && lg.is_contiguous() {
            let n = out.len();
            let (xs, gs) = (&x[lx.offset..lx.offset + n], &g[lg.offset..lg.offset + n]);
            for_rows(out, 1, |st, o| {
                let e = st + o.len();
                simd::unary_grad::<T>(o, &xs[st..e], &gs[st..e], s)
            });
            return;
        }
        map2(out, x, lx, g, lg, move |v, g| g * T::df(v, s))
    }
}

impl BinaryVisitor for Map2<'_> {
    type Out = ();
    fn visit<T: BinaryOpT>(self) {
        map2(self.0, self.1, self.2, self.3, self.4, T::f)
    }
}

/// The scalar function of a binary op (test reference).
#[cfg(test)]
pub(crate) fn binary_scalar(op: BinaryOp, a: f32, b: f32) -> f32 {
    op.eval(a, b)
}

/// `out = a op b` on two views of the same shape.
pub(crate) fn binary(
    op: BinaryOp,
    out: &mut [f32],
    a: &[f32],
    la: &Layout,
    b: &[f32],
    lb: &Layout,
) {
    op.visit(Map2(out, a, la, b, lb))
}

/// `acc = acc op b`, written into `acc`; `b` a view of its shape.
pub(crate) fn binary_assign(op: BinaryOp, acc: &mut [f32], b: &[f32], lb: &Layout) {
    struct Run<'a>(&'a mut [f32], &'a [f32], &'a Layout);
    impl BinaryVisitor for Run<'_> {
        type Out = ();
        fn visit<T: BinaryOpT>(self) {
            map2_assign(self.0, self.1, self.2, T::f)
        }
    }
    op.visit(Run(acc, b, lb))
}

/// `out = cond != 0 ? a : b` on three views of the same shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn where_cond(
    out: &mut [f32],
    c: &[f32],
    lc: &Layout,
    a: &[f32],
    la: &Layout,
    b: &[f32],
    lb: &Layout,
) {
    map3(
        out,
        c,
        lc,
        a,
        la,
        b,
        lb,
        |c, a, b| if c != 0.0 { a } else { b },
    );
}
