//! Walking strided views: the dims of one or more same-shaped views are collapsed jointly (size-1
//! dims dropped, adjacent dims merged where every view is contiguous across them), and the walk
//! hands out runs along the innermost dim, so inner loops see a fixed stride.

use smallvec::SmallVec;

use crate::layout::{Dims, Layout};

/// A joint walk over `N` views of one shape, in row-major logical order.
#[derive(Debug, Clone)]
pub(crate) struct Walk<const N: usize> {
    /// Sizes of the collapsed dims above the innermost one.
    outer_shape: Dims,
    outer_strides: SmallVec<[[usize; N]; 4]>,
    offset: [usize; N],
    /// Length of the innermost collapsed dim (1 for a scalar).
    pub inner: usize,
    /// Stride of each view along the innermost dim.
    pub inner_stride: [usize; N],
}

impl<const N: usize> Walk<N> {
    /// `layouts` must all have `shape` (broadcasts already applied as zero strides).
    pub fn new(shape: &[usize], layouts: [&Layout; N]) -> Self {
        let mut dims: SmallVec<[(usize, [usize; N]); 4]> = SmallVec::new();
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            let s: [usize; N] = std::array::from_fn(|k| layouts[k].strides[i]);
            if let Some(last) = dims.last_mut() {
                if (0..N).all(|k| last.1[k] == s[k] * d) {
                    last.0 *= d;
                    last.1 = s;
                    continue;
                }
            }
            dims.push((d, s));
        }
        let (inner, inner_stride) = dims.pop().unwrap_or((1, [0; N]));
        Walk {
            outer_shape: dims.iter().map(|d| d.0).collect(),
            outer_strides: dims.iter().map(|d| d.1).collect(),
            offset: std::array::from_fn(|k| layouts[k].offset),
            inner,
            inner_stride,
        }
    }

    /// Size and strides of the collapsed dim just above the innermost one, if any.
    pub fn last_outer(&self) -> Option<(usize, [usize; N])> {
        Some((*self.outer_shape.last()?, *self.outer_strides.last()?))
    }

    /// Storage index of the first element of innermost run `row`, for each view.
    #[inline]
    pub fn base(&self, mut row: usize) -> [usize; N] {
        let mut idx = self.offset;
        for (&d, s) in self.outer_shape.iter().zip(&self.outer_strides).rev() {
            let r = row % d;
            row /= d;
            for k in 0..N {
                idx[k] += r * s[k];
            }
        }
        idx
    }

    /// Visits the logical elements `start..start + len` as runs along the innermost dim:
    /// `f(pos, base, count)` where `pos` counts from `start`, `base` is the storage index of the
    /// run's first element in each view, and the run goes on with stride `inner_stride`.
    #[inline]
    pub fn runs(&self, start: usize, len: usize, mut f: impl FnMut(usize, [usize; N], usize)) {
        if self.inner == 0 {
            return;
        }
        let mut pos = 0;
        let mut row = start / self.inner;
        let mut col = start % self.inner;
        while pos < len {
            let count = (self.inner - col).min(len - pos);
            let mut base = self.base(row);
            for (b, s) in base.iter_mut().zip(self.inner_stride) {
                *b += col * s;
            }
            f(pos, base, count);
            pos += count;
            row += 1;
            col = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(w: &Walk<1>, n: usize, start: usize) -> Vec<usize> {
        let mut v = vec![];
        w.runs(start, n - start, |_, [b], c| {
            v.extend((0..c).map(|j| b + j * w.inner_stride[0]))
        });
        v
    }

    #[test]
    fn walks_match_index_of() {
        let cases = [
            Layout::contiguous(&[2, 3, 4])
                .permute("t", &[2, 0, 1])
                .unwrap(),
            Layout::contiguous(&[3, 1])
                .broadcast_to("t", &[2, 3, 4])
                .unwrap(),
            Layout::contiguous(&[4, 6]).narrow("t", 1, 1, 3).unwrap(),
            Layout::contiguous(&[]),
            Layout::contiguous(&[5, 1, 7]),
        ];
        for l in &cases {
            let w = Walk::new(&l.shape, [l]);
            let want: Vec<usize> = l.indices().collect();
            for start in 0..want.len() {
                assert_eq!(
                    flat(&w, want.len(), start),
                    want[start..],
                    "{l:?} from {start}"
                );
            }
        }
    }
}
