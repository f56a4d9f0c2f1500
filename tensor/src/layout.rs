//! Shapes, strides and offsets: the layout every kernel receives, so that views cost nothing.

use smallvec::SmallVec;

use crate::error::{Error, Result};

/// A shape or its strides: up to four axes live inline (more spill to the heap), so building,
/// cloning and dropping a layout allocates nothing. Every op builds a few layouts (its output's,
/// its operands' broadcast views), and with `Vec`s those allocations were about half of the
/// main job's time in `malloc` and `free`. Four, not six: a tensor is moved often (the tape, its
/// gradients), and with six inline (136 bytes a tensor against 104) the moves' `memcpy` ate half
/// of what the allocations had cost.
pub type Dims = SmallVec<[usize; 4]>;

/// Where the elements of a tensor live in its storage: element (i0, i1, ...) is at
/// `offset + sum(ik * strides[k])`. A stride of 0 repeats an element (broadcast).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    pub shape: Dims,
    pub strides: Dims,
    pub offset: usize,
}

/// Row-major strides of a contiguous tensor of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Dims {
    let mut strides = Dims::from_elem(0, shape.len());
    let mut acc = 1;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc *= d.max(1);
    }
    strides
}

/// Number of elements of a shape (1 for a scalar, 0 if any dimension is 0).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Numpy-style broadcast of two shapes (aligned at the right; 1 stretches).
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Dims> {
    let rank = a.len().max(b.len());
    let mut out = Dims::from_elem(0, rank);
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(
                    op,
                    format!("shapes {a:?} and {b:?} cannot be broadcast together"),
                ))
            }
        };
    }
    Ok(out)
}

/// Resolve a possibly negative axis (-1 = last) against a rank.
pub fn resolve_axis(op: &'static str, axis: isize, rank: usize) -> Result<usize> {
    let a = if axis < 0 { axis + rank as isize } else { axis };
    if a < 0 || a as usize >= rank {
        return Err(Error::Axis { op, axis, rank });
    }
    Ok(a as usize)
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: Dims::from_slice(shape),
            strides: contiguous_strides(shape),
            offset: 0,
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// True when the elements are laid out row-major without gaps (size-1 dims are free).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// Storage elements from `offset` up to and including the last one the view reaches (0 for
    /// an empty view).
    pub fn span(&self) -> usize {
        if self.numel() == 0 {
            return 0;
        }
        1 + self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| (d - 1) * s)
            .sum::<usize>()
    }

    /// Storage index of the element at a row-major linear position `i`.
    pub fn index_of(&self, mut i: usize) -> usize {
        let mut idx = self.offset;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d == 0 {
                return idx;
            }
            idx += (i % d) * s;
            i /= d;
        }
        idx
    }

    /// Iterator over storage indices in row-major logical order.
    pub fn indices(&self) -> StridedIndices<'_> {
        StridedIndices {
            layout: self,
            pos: Dims::from_elem(0, self.rank()),
            next: self.offset,
            remaining: self.numel(),
        }
    }

    /// The view of this layout broadcast to `shape` (zero strides on stretched dims).
    pub fn broadcast_to(&self, op: &'static str, shape: &[usize]) -> Result<Layout> {
        if shape.len() < self.rank() {
            return Err(Error::shape(
                op,
                format!("cannot broadcast shape {:?} to {:?}", self.shape, shape),
            ));
        }
        let pad = shape.len() - self.rank();
        let mut strides = Dims::from_elem(0, shape.len());
        for (i, &d) in shape.iter().enumerate() {
            if i < pad {
                continue;
            }
            let (sd, ss) = (self.shape[i - pad], self.strides[i - pad]);
            strides[i] = if sd == d {
                ss
            } else if sd == 1 {
                0
            } else {
                return Err(Error::shape(
                    op,
                    format!("cannot broadcast shape {:?} to {:?}", self.shape, shape),
                ));
            };
        }
        Ok(Layout {
            shape: Dims::from_slice(shape),
            strides,
            offset: self.offset,
        })
    }

    pub fn permute(&self, op: &'static str, perm: &[usize]) -> Result<Layout> {
        let rank = self.rank();
        let mut seen: SmallVec<[bool; 6]> = SmallVec::from_elem(false, rank);
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            return Err(Error::shape(
                op,
                format!(
                    "{perm:?} is not a permutation of the axes of a tensor of shape {:?}",
                    self.shape
                ),
            ));
        }
        Ok(Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        })
    }

    pub fn narrow(
        &self,
        op: &'static str,
        axis: usize,
        start: usize,
        len: usize,
    ) -> Result<Layout> {
        if axis >= self.rank() {
            return Err(Error::Axis {
                op,
                axis: axis as isize,
                rank: self.rank(),
            });
        }
        if start + len > self.shape[axis] {
            return Err(Error::index(
                op,
                format!(
                    "range {start}..{} is out of bounds for axis {axis} of size {} (shape {:?})",
                    start + len,
                    self.shape[axis],
                    self.shape
                ),
            ));
        }
        let mut l = self.clone();
        l.offset += start * self.strides[axis];
        l.shape[axis] = len;
        Ok(l)
    }

    /// A reshape to `shape` (same element count) that keeps the storage when possible, as
    /// PyTorch's `view` finds strides: contiguous layouts always can; a strided one can when
    /// each run of its axes that is contiguous in memory (stride = next stride x next size) is
    /// split or merged only within itself (a slice of the last axis split into heads, a
    /// broadcast axis split in two). Returns None when the data would have to be copied first.
    pub fn reshape(&self, shape: &[usize]) -> Option<Layout> {
        let view = |strides| {
            Some(Layout {
                shape: Dims::from_slice(shape),
                strides,
                offset: self.offset,
            })
        };
        if self.is_contiguous() || self.numel() == 0 {
            return view(contiguous_strides(shape));
        }
        // Walk the old axes from the last, in chunks that are contiguous in memory; the new
        // axes that multiply to each chunk's size take strides from that chunk's base stride.
        let mut strides = Dims::from_elem(0, shape.len());
        let mut view_d = shape.len();
        let mut base = *self.strides.last()?;
        let (mut chunk_numel, mut view_numel) = (1, 1);
        for d in (0..self.rank()).rev() {
            chunk_numel *= self.shape[d];
            let chunk_ends =
                d == 0 || (self.shape[d - 1] != 1 && self.strides[d - 1] != chunk_numel * base);
            if !chunk_ends {
                continue;
            }
            while view_d > 0 && (view_numel < chunk_numel || shape[view_d - 1] == 1) {
                view_d -= 1;
                strides[view_d] = view_numel * base;
                view_numel *= shape[view_d];
            }
            if view_numel != chunk_numel {
                return None;
            }
            if d > 0 {
                base = self.strides[d - 1];
                (chunk_numel, view_numel) = (1, 1);
            }
        }
        if view_d != 0 {
            return None;
        }
        view(strides)
    }
}

/// Row-major walk over the storage indices of a strided layout, without division per element.
pub struct StridedIndices<'a> {
    layout: &'a Layout,
    pos: Dims,
    next: usize,
    remaining: usize,
}

impl Iterator for StridedIndices<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let cur = self.next;
        let l = self.layout;
        for k in (0..l.rank()).rev() {
            self.pos[k] += 1;
            self.next += l.strides[k];
            if self.pos[k] < l.shape[k] {
                break;
            }
            self.next -= l.strides[k] * l.shape[k];
            self.pos[k] = 0;
        }
        Some(cur)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl ExactSizeIterator for StridedIndices<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_indices_match_index_of() {
        let l = Layout::contiguous(&[2, 3, 4])
            .permute("t", &[2, 0, 1])
            .unwrap();
        let it: Vec<usize> = l.indices().collect();
        let direct: Vec<usize> = (0..l.numel()).map(|i| l.index_of(i)).collect();
        assert_eq!(it, direct);
        assert_eq!(&it[..4], &[0, 4, 8, 12]);
    }

    #[test]
    fn broadcast_rules() {
        assert_eq!(
            broadcast_shapes("t", &[3, 1], &[4]).unwrap().to_vec(),
            vec![3, 4]
        );
        assert_eq!(
            broadcast_shapes("t", &[], &[2, 2]).unwrap().to_vec(),
            vec![2, 2]
        );
        let e = broadcast_shapes("add", &[3], &[4]).unwrap_err().to_string();
        assert!(
            e.contains("add") && e.contains("[3]") && e.contains("[4]"),
            "{e}"
        );
    }

    #[test]
    fn contiguity() {
        assert!(Layout::contiguous(&[2, 3]).is_contiguous());
        assert!(!Layout::contiguous(&[2, 3])
            .permute("t", &[1, 0])
            .unwrap()
            .is_contiguous());
        assert!(Layout::contiguous(&[1, 3])
            .permute("t", &[1, 0])
            .unwrap()
            .is_contiguous());
        assert_eq!(contiguous_strides(&[2, 0, 3]).to_vec(), vec![3, 3, 1]);
    }

    /// Every shape with `n` elements of rank 1 to 4 (factor orders and size-1 axes included).
    fn shapes_of(n: usize) -> Vec<Vec<usize>> {
        let mut out = vec![vec![n]];
        for r in 2..=4 {
            let mut next = Vec::new();
            for s in out.iter().filter(|s| s.len() == r - 1) {
                let last = *s.last().unwrap();
                for f in (1..=last).filter(|f| last % f == 0) {
                    let mut t = s.clone();
                    *t.last_mut().unwrap() = last / f;
                    t.push(f);
                    next.push(t);
                }
            }
            out.extend(next);
        }
        out
    }

    /// A view reshape walks the same storage elements in the same row-major order as the view
    /// it came from, for every target shape of views made by narrowing, permuting and
    /// broadcasting; and the views PyTorch gives are found.
    #[test]
    fn reshape_views_keep_the_element_order() {
        let base = Layout::contiguous(&[4, 6, 8]);
        let views = [
            base.narrow("t", 2, 2, 4).unwrap(),
            base.narrow("t", 1, 1, 4).unwrap(),
            base.permute("t", &[0, 2, 1]).unwrap(),
            base.permute("t", &[1, 0, 2]).unwrap(),
            base.narrow("t", 0, 1, 2)
                .unwrap()
                .permute("t", &[2, 0, 1])
                .unwrap(),
            Layout::contiguous(&[3, 1])
                .broadcast_to("t", &[3, 4])
                .unwrap(),
            Layout::contiguous(&[6]).broadcast_to("t", &[2, 6]).unwrap(),
        ];
        let mut found = 0;
        for v in &views {
            for shape in shapes_of(v.numel()) {
                if let Some(r) = v.reshape(&shape) {
                    found += 1;
                    assert_eq!(r.shape.to_vec(), shape);
                    let (a, b): (Vec<usize>, Vec<usize>) =
                        (r.indices().collect(), v.indices().collect());
                    assert_eq!(a, b, "{v:?} as {shape:?} gave {r:?}");
                }
            }
        }
        assert!(found > 40, "only {found} views");
        // The cases models meet: a slice of the last axis split into heads is a view; the
        // heads permuted back and merged are not; a broadcast axis splits.
        let qkv = Layout::contiguous(&[2, 5, 24])
            .narrow("t", 2, 8, 8)
            .unwrap();
        let heads = qkv.reshape(&[2, 5, 2, 4]).unwrap();
        assert_eq!(
            (heads.strides.to_vec(), heads.offset),
            (vec![120, 24, 4, 1], 8)
        );
        let merged = Layout::contiguous(&[2, 2, 5, 4])
            .permute("t", &[0, 2, 1, 3])
            .unwrap();
        assert!(merged.reshape(&[2, 5, 8]).is_none());
        assert!(merged.reshape(&[2, 5, 2, 2, 2]).is_some());
        let b = Layout::contiguous(&[3, 1])
            .broadcast_to("t", &[3, 4])
            .unwrap();
        assert_eq!(
            b.reshape(&[3, 2, 2]).unwrap().strides.to_vec(),
            vec![1, 0, 0]
        );
        assert!(b.reshape(&[12]).is_none());
    }

    #[test]
    fn bad_permutation_and_narrow() {
        let l = Layout::contiguous(&[2, 3]);
        assert!(l.permute("permute", &[0, 0]).is_err());
        assert!(l.narrow("narrow", 1, 2, 2).is_err());
        assert_eq!(l.narrow("narrow", 1, 1, 2).unwrap().offset, 1);
    }
}
