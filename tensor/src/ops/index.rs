//! Indexing ops and their adjoints (index_select / index_add, gather / scatter_add), one_hot,
//! concat and stack. Index tensors are f32 tensors holding integers; their range is checked by
//! [`check_indices`] (always on the CPU, on a GPU only when small: see its doc). Every op views
//! its operands as `[outer, dim, inner]` around the indexed axis, the shape the kernels take.
//! FLOPs: one per source element for the adds; the pure copies (select, gather, concat) count
//! none, like `contiguous`.

use crate::dtype_policy::DTypePolicy::{F32Only, WidenThenRound};
use crate::error::{Error, Result};
use crate::layout::resolve_axis;
use crate::ops::{check_indices, split_at_axis};
use crate::tensor::Tensor;

/// `shape` with axis `axis` set to `size`.
fn with_axis(shape: &[usize], axis: usize, size: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s[axis] = size;
    s
}

/// Fails unless `idx` is 1-D (index_select and index_add take a list of rows).
fn check_list(op: &'static str, idx: &Tensor, other: &[usize]) -> Result<()> {
    if idx.rank() != 1 {
        return Err(Error::shape(
            op,
            format!(
                "index must be 1-d, got shape {:?} (tensor {other:?})",
                idx.shape()
            ),
        ));
    }
    Ok(())
}

impl Tensor {
    /// The rows `idx[j]` of axis `axis`: the output has `idx.len()` there.
    pub fn index_select(&self, axis: isize, idx: &Tensor) -> Result<Tensor> {
        const OP: &str = "index_select";
        self.same_device(OP, idx)?;
        let a = resolve_axis(OP, axis, self.rank())?;
        check_list(OP, idx, self.shape())?;
        let (outer, dim, inner) = split_at_axis(self.shape(), a);
        check_indices(OP, idx, dim)?;
        let shape = with_axis(self.shape(), a, idx.numel());
        let dev = self.device();
        if shape.iter().product::<usize>() == 0 {
            return Tensor::zeros_in(&shape, self.dtype(), dev);
        }
        let (x, idx) = (self.contiguous()?, idx.contiguous()?);
        let out = dev.run("index_select", F32Only, [&x, &idx], |k, [x, idx]| {
            k.index_select(x, idx, outer, dim, inner)
        })?;
        out.reshape(&shape)
    }

    /// Adjoint of `index_select`: zeros with `dim_size` rows along `axis`, and `src`'s row `j`
    /// added at row `idx[j]` (repeated indices add up).
    pub fn index_add(axis: isize, idx: &Tensor, src: &Tensor, dim_size: usize) -> Result<Tensor> {
        const OP: &str = "index_add";
        src.same_device(OP, idx)?;
        let a = resolve_axis(OP, axis, src.rank())?;
        check_list(OP, idx, src.shape())?;
        if src.shape()[a] != idx.numel() {
            return Err(Error::shape(
                OP,
                format!(
                    "src {:?} has {} rows along axis {a}, index {:?} has {}",
                    src.shape(),
                    src.shape()[a],
                    idx.shape(),
                    idx.numel()
                ),
            ));
        }
        add_along(OP, src, idx, a, dim_size, false)
    }

    /// Torch-style gather: `out[.., j, ..] = x[.., idx[.., j, ..], ..]` along `axis`. `idx` has
    /// the rank of `self`, and on the other axes no more than `self`'s sizes (`self` is narrowed
    /// to them, as torch reads only that corner); the output has `idx`'s shape.
    pub fn gather(&self, axis: isize, idx: &Tensor) -> Result<Tensor> {
        const OP: &str = "gather";
        self.same_device(OP, idx)?;
        let a = resolve_axis(OP, axis, self.rank())?;
        let fits = idx.rank() == self.rank()
            && (0..self.rank()).all(|d| d == a || idx.shape()[d] <= self.shape()[d]);
        if !fits {
            return Err(Error::shape(
                OP,
                format!(
                    "index {:?} must have the rank of {:?} and no larger sizes off axis {a}",
                    idx.shape(),
                    self.shape()
                ),
            ));
        }
        let dim = self.shape()[a];
        check_indices(OP, idx, dim)?;
        let dev = self.device();
        if idx.numel() == 0 {
            return Tensor::zeros_in(idx.shape(), self.dtype(), dev);
        }
        let mut x = self.clone();
        for d in (0..self.rank()).filter(|&d| d != a) {
            x = x.narrow(d as isize, 0, idx.shape()[d])?;
        }
        let (outer, _, inner) = split_at_axis(idx.shape(), a);
        let (x, idx) = (x.contiguous()?, idx.contiguous()?);
        let out = dev.run(OP, F32Only, [&x, &idx], |k, [x, idx]| {
            k.gather(x, idx, outer, dim, inner)
        })?;
        out.reshape(idx.shape())
    }

    /// Adjoint of `gather`: zeros shaped like `idx` but with `dim_size` along `axis`, and each
    /// `src` element added at the position its index names.
    pub fn scatter_add(axis: isize, idx: &Tensor, src: &Tensor, dim_size: usize) -> Result<Tensor> {
        const OP: &str = "scatter_add";
        src.same_device(OP, idx)?;
        let a = resolve_axis(OP, axis, src.rank())?;
        if idx.shape() != src.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "index {:?} and src {:?} must have the same shape",
                    idx.shape(),
                    src.shape()
                ),
            ));
        }
        add_along(OP, src, idx, a, dim_size, true)
    }

    /// One-hot encoding of an index tensor: a new last axis of size `classes`, 1.0 at the index.
    pub fn one_hot(&self, classes: usize) -> Result<Tensor> {
        check_indices("one_hot", self, classes)?;
        let range = Tensor::arange(0.0, classes as f32, 1.0, self.device())?;
        self.unsqueeze(-1)?.eq(&range)
    }

    /// Joins tensors of equal shape except along `axis` into one.
    pub fn concat(xs: &[&Tensor], axis: isize) -> Result<Tensor> {
        join("concat", xs, axis, false)
    }

    /// Stacks tensors of equal shape along a new axis `axis` (in `0..=rank`).
    pub fn stack(xs: &[&Tensor], axis: isize) -> Result<Tensor> {
        join("stack", xs, axis, true)
    }

    /// Sets positions `start..start + src.shape()[axis]` of `self` along `axis` to `src` (of
    /// `self`'s shape elsewhere), keeping the others: written into `self`'s storage when it is
    /// an [exclusive](Tensor::is_exclusive), contiguous f32 tensor on the host (no allocation
    /// of `self`'s size, and no other tensor sees the change: a KV cache's append), else
    /// replaced by a new tensor of the same values (the parts around `src` concatenated with
    /// it). Returns whether it was written in place.
    pub fn write_narrow(&mut self, axis: isize, start: usize, src: &Tensor) -> Result<bool> {
        const OP: &str = "write_narrow";
        self.same_device(OP, src)?;
        let a = resolve_axis(OP, axis, self.rank())?;
        let (dst_shape, src_shape) = (self.shape().to_vec(), src.shape().to_vec());
        let len = src_shape.get(a).copied().unwrap_or(0);
        if src.rank() != self.rank()
            || with_axis(&src_shape, a, 0) != with_axis(&dst_shape, a, 0)
            || start + len > dst_shape[a]
        {
            return Err(Error::shape(
                OP,
                format!("cannot write {src_shape:?} at {start} along axis {a} of {dst_shape:?}"),
            ));
        }
        if len == 0 {
            return Ok(true);
        }
        let (outer, dim) = (dst_shape[..a].iter().product::<usize>(), dst_shape[a]);
        let inner = dst_shape[a + 1..].iter().product::<usize>();
        let host = self.device().is_cpu()
            && self.dtype() == crate::DType::F32
            && self.is_contiguous()
            && self.layout().offset == 0;
        if host && self.is_exclusive() {
            let values = src.to_vec()?;
            if let Some(dst) = self
                .exclusive_storage()
                .and_then(crate::storage::Storage::as_cpu_mut)
            {
                let run = len * inner;
                for (o, part) in values.chunks_exact(run).enumerate() {
                    let at = (o * dim + start) * inner;
                    dst[at..at + run].copy_from_slice(part);
                }
                debug_assert_eq!(values.len(), outer * run);
                return Ok(true);
            }
        }
        let before = self.narrow(a as isize, 0, start)?;
        let after = self.narrow(a as isize, start + len, dim - start - len)?;
        let src = src.to_dtype(self.dtype())?;
        let parts: Vec<&Tensor> = [&before, &src, &after]
            .into_iter()
            .filter(|t| t.shape()[a] > 0)
            .collect();
        *self = Tensor::concat(&parts, a as isize)?;
        Ok(false)
    }
}

/// Shared body of concat and stack (`new_axis`: insert `axis` in every input first).
fn join(op: &'static str, xs: &[&Tensor], axis: isize, new_axis: bool) -> Result<Tensor> {
    let Some(first) = xs.first() else {
        return Err(Error::invalid(op, "needs at least one tensor, got none"));
    };
    let shapes: Vec<&[usize]> = xs.iter().map(|x| x.shape()).collect();
    let rank = first.rank() + new_axis as usize;
    if rank == 0 {
        return Err(Error::shape(
            op,
            "cannot concatenate 0-d tensors (shapes [])",
        ));
    }
    let a = resolve_axis(op, axis, rank)?;
    let xs: Vec<Tensor> = xs
        .iter()
        .map(|x| {
            first.same_device(op, x)?;
            if new_axis {
                if x.shape() != first.shape() {
                    return Err(mismatch(op, &shapes, "all shapes must be equal"));
                }
                x.unsqueeze(a as isize)
            } else {
                Ok((*x).clone())
            }
        })
        .collect::<Result<_>>()?;
    let mut out_shape = xs[0].shape().to_vec();
    out_shape[a] = 0;
    for x in &xs {
        let s = x.shape();
        if s.len() != rank || (0..rank).any(|d| d != a && s[d] != out_shape[d]) {
            return Err(mismatch(
                op,
                &shapes,
                "shapes must agree off the joined axis",
            ));
        }
        out_shape[a] += s[a];
    }
    let dev = first.device();
    if out_shape.iter().product::<usize>() == 0 {
        return Tensor::zeros_in(&out_shape, first.dtype(), dev);
    }
    let refs: Vec<&Tensor> = xs.iter().filter(|x| x.numel() > 0).collect();
    dev.run_all("concat", WidenThenRound, &refs, |k, xs| {
        k.concat(xs, a, &out_shape)
    })
}

fn mismatch(op: &'static str, shapes: &[&[usize]], why: &str) -> Error {
    Error::shape(op, format!("{why}, got shapes {shapes:?}"))
}

/// The shared tail of `index_add` and `scatter_add` (shapes already checked): zeros of `src`'s
/// shape with axis `a` resized to `dim_size`, `src` added in at the indexed rows (`scatter`:
/// one index per element, else one per row along `a`).
fn add_along(
    op: &'static str,
    src: &Tensor,
    idx: &Tensor,
    a: usize,
    dim_size: usize,
    scatter: bool,
) -> Result<Tensor> {
    check_indices(op, idx, dim_size)?;
    let shape = with_axis(src.shape(), a, dim_size);
    let dev = src.device();
    if src.numel() == 0 {
        return Tensor::zeros_in(&shape, src.dtype(), dev);
    }
    let (outer, _, inner) = split_at_axis(src.shape(), a);
    let (src, idx) = (src.contiguous()?, idx.contiguous()?);
    let out = dev.run(op, F32Only, [&src, &idx], |k, [src, idx]| {
        if scatter {
            k.scatter_add(src, idx, outer, dim_size, inner)
        } else {
            k.index_add(src, idx, outer, dim_size, inner)
        }
    })?;
    dev.add_flops(src.numel() as u64);
    out.reshape(&shape)
}
