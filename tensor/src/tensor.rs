//! `Tensor`: f32, f16 or bf16 values on a device, seen through a layout (shape, strides, offset), so that
//! reshape, permute, transpose, narrow and broadcast are free views of the same storage.

use std::sync::Arc;

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::layout::{numel, resolve_axis, Dims, Layout};
use crate::memory::Tag;
use crate::raw::RawTensor;
use crate::storage::Storage;

/// An immutable n-dimensional array of f32 (or f16/bf16, see [`Tensor::dtype`]). Cloning is cheap (shares the storage).
#[derive(Clone)]
pub struct Tensor {
    /// The storage and layout the kernels work on, charged to `device`'s tracker.
    raw: RawTensor,
    device: Device,
}

impl Tensor {
    // ---- construction (crate-internal) ----

    /// `raw` (a kernel's output, or a view) as a tensor on `device`, whose tracker it is
    /// charged to.
    pub(crate) fn from_raw(raw: RawTensor, device: &Device) -> Tensor {
        Tensor {
            raw,
            device: device.clone(),
        }
    }

    /// What the kernels read.
    pub(crate) fn raw(&self) -> &RawTensor {
        &self.raw
    }

    /// What the in-place kernels write.
    pub(crate) fn raw_mut(&mut self) -> &mut RawTensor {
        &mut self.raw
    }

    /// A view of the same storage with another layout.
    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor {
            raw: self.raw.with_layout(layout),
            device: self.device.clone(),
        }
    }

    pub(crate) fn storage(&self) -> &Storage {
        self.raw.storage()
    }

    // ---- creation ----

    /// A tensor of `shape` holding `data` in row-major order.
    pub fn from_vec(data: Vec<f32>, shape: &[usize], device: &Device) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(Error::shape(
                "from_vec",
                format!(
                    "{} values cannot fill shape {shape:?} ({} elements)",
                    data.len(),
                    numel(shape)
                ),
            ));
        }
        let raw = device.kernels().from_vec(device.memory(), data, shape)?;
        Ok(Tensor::from_raw(raw, device))
    }

    /// A mask tensor from booleans: 1.0 for true, 0.0 for false. Tensors are f32 only, and
    /// every op that takes a mask (`masked_fill`, `where_cond`) reads "non-zero" as true.
    pub fn from_bools(data: &[bool], shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::from_vec(
            data.iter().map(|&b| f32::from(u8::from(b))).collect(),
            shape,
            device,
        )
    }

    pub fn from_slice(data: &[f32], shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape, device)
    }

    /// A 0-dimensional tensor.
    pub fn scalar(value: f32, device: &Device) -> Result<Tensor> {
        Tensor::from_vec(vec![value], &[], device)
    }

    pub fn full(shape: &[usize], value: f32, device: &Device) -> Result<Tensor> {
        let raw = device.kernels().fill(device.memory(), shape, value)?;
        Ok(Tensor::from_raw(raw, device))
    }
    pub fn zeros(shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, device)
    }
    pub fn ones(shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, device)
    }
    /// [`Tensor::full`] in `dtype` (`value` rounded once): what a result of an op on `dtype`
    /// operands is made of when it needs no kernel (an empty result, a gradient's padding), so
    /// half graphs stay half and never meet an f32 zero they did not ask for.
    pub fn full_in(shape: &[usize], value: f32, dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full(shape, value, device)?.to_dtype(dtype)
    }
    /// Zeros of `shape` in `dtype` (see [`Tensor::full_in`]).
    pub fn zeros_in(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        Tensor::full_in(shape, 0.0, dtype, device)
    }
    /// Zeros shaped like this tensor, in its dtype and on its device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros_in(self.shape(), self.dtype(), self.device())
    }
    /// `value` everywhere, shaped like this tensor, in its dtype and on its device.
    pub fn full_like(&self, value: f32) -> Result<Tensor> {
        Tensor::full_in(self.shape(), value, self.dtype(), self.device())
    }

    /// `[start, start + step, ...]` below `end` (1-D).
    pub fn arange(start: f32, end: f32, step: f32, device: &Device) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || (end - start) / step < 0.0 {
            return Err(Error::invalid(
                "arange",
                format!("cannot step from {start} to {end} by {step}"),
            ));
        }
        let n = ((end - start) / step).ceil() as usize;
        let v: Vec<f32> = (0..n).map(|i| start + step * i as f32).collect();
        Tensor::from_vec(v, &[n], device)
    }

    /// Uniform values in `[lo, hi)` from the counter-based stream `seed`: the same seed gives
    /// the same values on every backend.
    pub fn rand_uniform(
        shape: &[usize],
        lo: f32,
        hi: f32,
        seed: u64,
        device: &Device,
    ) -> Result<Tensor> {
        Tensor::from_vec(
            crate::rng::uniform_vec(seed, 0, numel(shape), lo, hi),
            shape,
            device,
        )
    }

    /// Normal values (`mean`, `std`) from the counter-based stream `seed`, equal on every backend.
    pub fn rand_normal(
        shape: &[usize],
        mean: f32,
        std: f32,
        seed: u64,
        device: &Device,
    ) -> Result<Tensor> {
        Tensor::from_vec(
            crate::rng::normal_vec(seed, 0, numel(shape), mean, std),
            shape,
            device,
        )
    }

    /// A tensor of `dtype` holding `data` rounded to it (nearest even).
    pub fn from_vec_in(
        data: Vec<f32>,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        Tensor::from_vec(data, shape, device)?.to_dtype(dtype)
    }

    /// Values stored as f16 (e.g. read from a file), widened to f32.
    pub fn from_f16(data: &[half::f16], shape: &[usize], device: &Device) -> Result<Tensor> {
        Tensor::from_vec(data.iter().map(|h| h.to_f32()).collect(), shape, device)
    }

    // ---- inspection ----

    pub fn shape(&self) -> &[usize] {
        self.raw.shape()
    }
    pub fn dims(&self) -> &[usize] {
        self.raw.shape()
    }
    pub fn rank(&self) -> usize {
        self.raw.rank()
    }
    pub fn numel(&self) -> usize {
        self.raw.numel()
    }
    pub fn strides(&self) -> &[usize] {
        self.raw.strides()
    }
    pub fn layout(&self) -> &Layout {
        self.raw.layout()
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The element type. Ops take operands of one dtype and give results in it.
    pub fn dtype(&self) -> DType {
        self.raw.dtype()
    }
    pub fn is_contiguous(&self) -> bool {
        self.raw.is_contiguous()
    }
    /// Size of axis `axis` (negative counts from the end).
    pub fn dim(&self, axis: isize) -> Result<usize> {
        Ok(self.shape()[resolve_axis("dim", axis, self.rank())?])
    }
    /// True when both tensors view the same storage.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(self.raw.shared_storage(), other.raw.shared_storage())
    }
    /// True when writing into this tensor's storage could change no other tensor: this handle
    /// is the storage's only holder (no clone or view of it exists) and it views every element of
    /// it densely from the start. The in-place ops (`add_assign`, the optimizer steps) write only
    /// then, and otherwise make new storage, with the same values either way.
    pub fn is_exclusive(&mut self) -> bool {
        self.exclusive_storage().is_some()
    }

    /// This tensor's storage for writing, when [`Tensor::is_exclusive`]. `&mut self` makes the
    /// check race-free: no other thread can clone this handle while it is borrowed.
    pub(crate) fn exclusive_storage(&mut self) -> Option<&mut Storage> {
        self.raw.exclusive_storage()
    }

    /// Bytes of the storage behind this tensor (what the device's accounting charged).
    pub fn storage_bytes(&self) -> usize {
        self.raw.storage().bytes()
    }

    /// The values in row-major order (reads back from the GPU when needed); half values are
    /// widened to f32, which is exact.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        self.device.kernels().to_host(&self.raw)
    }

    /// The values' bytes where they lie in host memory (f32 values, or a half dtype's 16-bit
    /// patterns; native byte order), for a tensor on the host whose layout is contiguous: what a
    /// transport sends without copying them. `None` for a GPU tensor or a strided view (read
    /// those with [`Tensor::to_vec`]). The storage cannot change while the tensor lives: a
    /// storage is written in place only by its one holder.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        if !self.is_contiguous() {
            return None;
        }
        let at = self.layout().offset..self.layout().offset + self.numel();
        if let Some(values) = self.storage().as_cpu() {
            return Some(bytemuck::cast_slice(&values[at]));
        }
        self.storage()
            .as_cpu_half()
            .map(|bits| bytemuck::cast_slice(&bits[at]))
    }

    /// [`Tensor::to_vec`] with room for `extra` more values, so that appending them (a
    /// message header, say) does not copy the values again.
    pub fn to_vec_reserving(&self, extra: usize) -> Result<Vec<f32>> {
        self.device.kernels().to_host_reserving(&self.raw, extra)
    }

    /// The single value of a tensor with one element.
    pub fn to_scalar(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "to_scalar",
                format!(
                    "tensor of shape {:?} has {} elements, not 1",
                    self.shape(),
                    self.numel()
                ),
            ));
        }
        Ok(self.to_vec()?[0])
    }

    /// The values narrowed to f16 (for compact transfer and storage).
    pub fn to_f16_vec(&self) -> Result<Vec<half::f16>> {
        Ok(self
            .to_vec()?
            .into_iter()
            .map(half::f16::from_f32)
            .collect())
    }

    /// A contiguous copy in `dtype` (rounded to nearest even when narrowing; widening is exact),
    /// or `self` when it already has that dtype. The differentiable version is `Var::to_dtype`.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let from = self.dtype();
        if from == dtype {
            return Ok(self.clone());
        }
        let k = self.device.kernels();
        let wide = if from.is_half() {
            Tensor::from_raw(k.widen(&self.raw)?, &self.device).contiguous()?
        } else {
            self.contiguous()?
        };
        if dtype.is_half() {
            Ok(Tensor::from_raw(k.narrow(&wide.raw, dtype)?, &self.device))
        } else {
            Ok(wide)
        }
    }

    /// Moves this tensor's bytes to accounting tag `tag` (e.g. after building a parameter).
    pub fn retag(&self, tag: Tag) {
        self.storage().retag(tag);
    }

    // ---- views (free) ----

    /// The same elements in a new shape; one dimension may be given as `usize::MAX` to be
    /// inferred. A view (strided, as PyTorch's `reshape` gives, see [`Layout::reshape`]) where
    /// the strides allow one; a contiguous copy only where they do not.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        let shape = infer_shape("reshape", shape, self.numel(), self.shape())?;
        match self.layout().reshape(&shape) {
            Some(l) => Ok(self.with_layout(l)),
            None => Ok(self.contiguous()?.with_layout(Layout::contiguous(&shape))),
        }
    }

    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        Ok(self.with_layout(self.layout().permute("permute", perm)?))
    }

    /// Swaps two axes (negative counts from the end).
    pub fn transpose(&self, a: isize, b: isize) -> Result<Tensor> {
        let r = self.rank();
        let (a, b) = (
            resolve_axis("transpose", a, r)?,
            resolve_axis("transpose", b, r)?,
        );
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Transpose of the last two axes.
    pub fn t(&self) -> Result<Tensor> {
        if self.rank() < 2 {
            return Err(Error::shape(
                "t",
                format!("needs rank >= 2, got shape {:?}", self.shape()),
            ));
        }
        self.transpose(-2, -1)
    }

    /// `len` elements of `axis` starting at `start`.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Tensor> {
        let a = resolve_axis("narrow", axis, self.rank())?;
        Ok(self.with_layout(self.layout().narrow("narrow", a, start, len)?))
    }

    /// Views of consecutive pieces of `axis` with the given lengths, which must add up to the
    /// axis's length (PyTorch's `split` with a list of sizes).
    pub fn split_sizes(&self, sizes: &[usize], axis: isize) -> Result<Vec<Tensor>> {
        let a = resolve_axis("split", axis, self.rank())?;
        let (n, total) = (self.shape()[a], sizes.iter().sum::<usize>());
        if total != n {
            return Err(Error::shape(
                "split",
                format!(
                    "the sizes {sizes:?} add up to {total}, not to the length {n} of axis {a} of shape {:?}",
                    self.shape()
                ),
            ));
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        for &len in sizes {
            out.push(self.narrow(a as isize, start, len)?);
            start += len;
        }
        Ok(out)
    }

    /// Views of `axis` in pieces of `size` (the last may be shorter; PyTorch's `split` with an
    /// int). An empty axis gives one empty piece; `size` 0 is an error on a non-empty axis.
    pub fn split(&self, size: usize, axis: isize) -> Result<Vec<Tensor>> {
        let a = resolve_axis("split", axis, self.rank())?;
        self.split_sizes(&split_lengths(self.shape(), a, size)?, a as isize)
    }

    /// The slices of `axis` as views without that axis (PyTorch's `unbind`): `[2, 3]` along 1
    /// gives three `[2]`; an empty axis gives none.
    pub fn unbind(&self, axis: isize) -> Result<Vec<Tensor>> {
        let a = resolve_axis("unbind", axis, self.rank())?;
        (0..self.shape()[a])
            .map(|i| self.narrow(a as isize, i, 1)?.squeeze(a as isize))
            .collect()
    }

    /// `chunks` views along `axis` as PyTorch's `chunk`: pieces of `ceil(len / chunks)`, so
    /// there may be fewer than `chunks` (an axis of 5 in 4 chunks gives 2, 2, 1); an empty axis
    /// gives `chunks` empty pieces.
    pub fn chunk(&self, chunks: usize, axis: isize) -> Result<Vec<Tensor>> {
        let a = resolve_axis("chunk", axis, self.rank())?;
        self.split_sizes(&chunk_lengths(self.shape(), a, chunks)?, a as isize)
    }

    /// A view broadcast to `shape` (numpy rules; stretched axes get stride 0).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        Ok(self.with_layout(self.layout().broadcast_to("broadcast_to", shape)?))
    }

    /// Alias of [`Tensor::broadcast_to`] (PyTorch's name).
    pub fn expand(&self, shape: &[usize]) -> Result<Tensor> {
        self.broadcast_to(shape)
    }

    /// Inserts an axis of size 1 at `axis` (in `0..=rank`; negative counts from the end).
    pub fn unsqueeze(&self, axis: isize) -> Result<Tensor> {
        let r = self.rank() as isize + 1;
        let a = resolve_axis("unsqueeze", axis, r as usize)?;
        let mut l = self.layout().clone();
        let stride = if a < l.rank() {
            l.strides[a] * l.shape[a]
        } else {
            1
        };
        l.shape.insert(a, 1);
        l.strides.insert(a, stride);
        Ok(self.with_layout(l))
    }

    /// Removes axis `axis`, which must have size 1.
    pub fn squeeze(&self, axis: isize) -> Result<Tensor> {
        let a = resolve_axis("squeeze", axis, self.rank())?;
        if self.shape()[a] != 1 {
            return Err(Error::shape(
                "squeeze",
                format!(
                    "axis {a} of shape {:?} has size {}, not 1",
                    self.shape(),
                    self.shape()[a]
                ),
            ));
        }
        let mut l = self.layout().clone();
        l.shape.remove(a);
        l.strides.remove(a);
        Ok(self.with_layout(l))
    }

    /// Merges axes `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        let r = self.rank();
        if r == 0 {
            return self.reshape(&[1]);
        }
        let (s, e) = (
            resolve_axis("flatten", start, r)?,
            resolve_axis("flatten", end, r)?,
        );
        if s > e {
            return Err(Error::invalid(
                "flatten",
                format!("start axis {s} is after end axis {e}"),
            ));
        }
        let mut shape = self.shape()[..s].to_vec();
        shape.push(self.shape()[s..=e].iter().product());
        shape.extend_from_slice(&self.shape()[e + 1..]);
        self.reshape(&shape)
    }

    /// Fails with `DeviceMismatch` unless `other` is on this tensor's device.
    pub(crate) fn same_device(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device != other.device {
            return Err(Error::DeviceMismatch {
                op,
                a: self.device.name().to_string(),
                b: other.device.name().to_string(),
            });
        }
        Ok(())
    }
}

/// Resolves one `usize::MAX` placeholder and checks the element count.
fn infer_shape(op: &'static str, shape: &[usize], n: usize, from: &[usize]) -> Result<Dims> {
    let mut unknown = (0..shape.len()).filter(|&i| shape[i] == usize::MAX);
    let known: usize = shape.iter().filter(|&&d| d != usize::MAX).product();
    let mut out = Dims::from_slice(shape);
    match (unknown.next(), unknown.next()) {
        (None, _) => {}
        (Some(i), None) if known > 0 && n.is_multiple_of(known) => out[i] = n / known,
        _ => {
            return Err(Error::shape(
                op,
                format!("cannot infer a shape like {shape:?} for {n} elements (from {from:?})"),
            ))
        }
    }
    if numel(&out) != n {
        return Err(Error::shape(
            op,
            format!(
                "cannot view shape {from:?} ({n} elements) as {out:?} ({} elements)",
                numel(&out)
            ),
        ));
    }
    Ok(out)
}

/// The piece lengths of [`Tensor::split`]: `size` each, the last shorter.
fn split_lengths(shape: &[usize], axis: usize, size: usize) -> Result<Vec<usize>> {
    let n = shape[axis];
    if n == 0 {
        return Ok(vec![0]);
    }
    if size == 0 {
        return Err(Error::shape(
            "split",
            format!("a piece size of 0 cannot split axis {axis} of shape {shape:?} (length {n})"),
        ));
    }
    Ok((0..n)
        .step_by(size)
        .map(|start| size.min(n - start))
        .collect())
}

/// The piece lengths of [`Tensor::chunk`].
fn chunk_lengths(shape: &[usize], axis: usize, chunks: usize) -> Result<Vec<usize>> {
    if chunks == 0 {
        return Err(Error::shape(
            "chunk",
            format!("needs at least 1 chunk, got 0 (shape {shape:?}, axis {axis})"),
        ));
    }
    if shape[axis] == 0 {
        return Ok(vec![0; chunks]);
    }
    split_lengths(shape, axis, shape[axis].div_ceil(chunks))
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor(shape={:?}, device={}", self.shape(), self.device)?;
        if self.dtype() != DType::F32 {
            write!(f, ", dtype={}", self.dtype())?;
        }
        if self.numel() <= 16 {
            if let Ok(v) = self.to_vec() {
                write!(f, ", values={v:?}")?;
            }
        }
        write!(f, ")")
    }
}
