//! Views and layout ops (their gradients are views or reshapes of the output gradient),
//! `concat` and `stack`.

use wgpipe_tensor::{DType, Result, Tensor};

use super::{resolve_axis, same_tape, zero_scalar};
use crate::var::Var;

/// Records a view-like op whose gradient is `bwd(g)`.
fn view(
    op: &'static str,
    x: &Var,
    y: Tensor,
    bwd: impl FnMut(&Tensor) -> Result<Tensor> + 'static,
) -> Result<Var> {
    let mut bwd = bwd;
    Var::from_op(op, &[x], y, move |g, _| Ok(vec![Some(bwd(g)?)]))
}

impl Var {
    /// The values cast to `dtype` (a no-op when they already have it); the gradient is cast
    /// back to this var's dtype, so each side of the cast back-propagates in its own precision.
    pub fn to_dtype(&self, dtype: DType) -> Result<Var> {
        let from = self.value.dtype();
        if from == dtype {
            return Ok(self.clone());
        }
        let y = self.value.to_dtype(dtype)?;
        self.cast_to(y)
    }

    /// Records `y`, this var's value already cast to another dtype (e.g. a param's cached half
    /// copy), as [`Var::to_dtype`] does: the gradient is cast back to this var's dtype.
    pub(crate) fn cast_to(&self, y: Tensor) -> Result<Var> {
        let from = self.value.dtype();
        view("to_dtype", self, y, move |g| g.to_dtype(from))
    }

    /// The same elements in a new shape (`usize::MAX` infers one dimension).
    pub fn reshape(&self, shape: &[usize]) -> Result<Var> {
        let y = self.value.reshape(shape)?;
        let s = self.shape().to_vec();
        view("reshape", self, y, move |g| g.reshape(&s))
    }

    pub fn permute(&self, perm: &[usize]) -> Result<Var> {
        let y = self.value.permute(perm)?;
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        view("permute", self, y, move |g| g.permute(&inv))
    }

    pub fn transpose(&self, a: isize, b: isize) -> Result<Var> {
        let y = self.value.transpose(a, b)?;
        view("transpose", self, y, move |g| g.transpose(a, b))
    }

    /// Transpose of the last two axes.
    pub fn t(&self) -> Result<Var> {
        let y = self.value.t()?;
        view("t", self, y, |g| g.t())
    }

    /// `len` elements of `axis` from `start`; the gradient is zero outside that range.
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<Var> {
        let y = self.value.narrow(axis, start, len)?;
        let a = resolve_axis("narrow", axis, self.rank())?;
        let shape = self.shape().to_vec();
        view("narrow", self, y, move |g| {
            let after = shape[a] - start - len;
            if start == 0 && after == 0 {
                return Ok(g.clone());
            }
            // In the gradient's dtype, so a half graph's narrow back-propagates in half; a
            // broadcast zero (no memory of its own) that `concat` reads as it writes its output,
            // rather than zero-filled tensors it would copy.
            let zeros = |n: usize| {
                let mut s = shape.clone();
                s[a] = n;
                zero_scalar(g)?.broadcast_to(&s)
            };
            let mut parts = Vec::with_capacity(3);
            if start > 0 {
                parts.push(zeros(start)?);
            }
            parts.push(g.clone());
            if after > 0 {
                parts.push(zeros(after)?);
            }
            Tensor::concat(&parts.iter().collect::<Vec<_>>(), a as isize)
        })
    }

    /// Consecutive pieces of `axis` with the given lengths (PyTorch's `split` with a list): views
    /// recorded as one node, whose backward writes each piece's gradient into its slice of the
    /// input's gradient in one pass (zeros where a piece got none), where one `narrow` per piece
    /// would pad each gradient to the input's size and sum them.
    pub fn split_sizes(&self, sizes: &[usize], axis: isize) -> Result<Vec<Var>> {
        let pieces = self.value.split_sizes(sizes, axis)?;
        self.record_split(pieces, axis)
    }

    /// Pieces of `size` along `axis`, the last shorter (PyTorch's `split` with an int); see
    /// [`Var::split_sizes`].
    pub fn split(&self, size: usize, axis: isize) -> Result<Vec<Var>> {
        let pieces = self.value.split(size, axis)?;
        self.record_split(pieces, axis)
    }

    /// `chunks` pieces along `axis` as PyTorch's `chunk` ([`Tensor::chunk`]); see
    /// [`Var::split_sizes`].
    pub fn chunk(&self, chunks: usize, axis: isize) -> Result<Vec<Var>> {
        let pieces = self.value.chunk(chunks, axis)?;
        self.record_split(pieces, axis)
    }

    /// The slices of `axis` with that axis removed (PyTorch's `unbind`): views recorded as one
    /// node, whose backward stacks the slices' gradients in one pass, as `split`'s does.
    pub fn unbind(&self, axis: isize) -> Result<Vec<Var>> {
        let pieces = self.value.unbind(axis)?;
        self.record_pieces("unbind", pieces, axis, true)
    }

    /// Records `pieces`, views of this var's value that cover `axis` in order (each without the
    /// axis when `stacked`): the input's gradient joins the pieces' (zeros for those that got
    /// none) along `axis`.
    fn record_split(&self, pieces: Vec<Tensor>, axis: isize) -> Result<Vec<Var>> {
        self.record_pieces("split", pieces, axis, false)
    }

    fn record_pieces(
        &self,
        op: &'static str,
        pieces: Vec<Tensor>,
        axis: isize,
        stacked: bool,
    ) -> Result<Vec<Var>> {
        let a = resolve_axis(op, axis, self.rank())? as isize;
        let shapes: Vec<Vec<usize>> = pieces.iter().map(|p| p.shape().to_vec()).collect();
        Var::from_op_multi(op, &[self], pieces, move |gs, _| {
            let like = gs.iter().flatten().next().ok_or_else(|| {
                crate::tape::invalid(op, "backward run without a gradient".to_string())
            })?;
            // In the gradients' dtype, so a half graph's split back-propagates in half.
            let parts: Vec<Tensor> = gs
                .iter()
                .zip(&shapes)
                .map(|(g, s)| match g {
                    Some(g) => Ok(g.clone()),
                    // A broadcast zero, as in `narrow`'s backward.
                    None => zero_scalar(like)?.broadcast_to(s),
                })
                .collect::<Result<_>>()?;
            let parts: Vec<&Tensor> = parts.iter().collect();
            Ok(vec![Some(match (stacked, parts.as_slice()) {
                (false, [one]) => (*one).clone(),
                (false, _) => Tensor::concat(&parts, a)?,
                (true, _) => Tensor::stack(&parts, a)?,
            })])
        })
    }

    /// A view broadcast to `shape`; the gradient is summed back.
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Var> {
        let y = self.value.broadcast_to(shape)?;
        let s = self.shape().to_vec();
        view("broadcast_to", self, y, move |g| {
            if g.shape() == s.as_slice() {
                Ok(g.clone())
            } else {
                g.sum_to_shape(&s)
            }
        })
    }

    /// Alias of [`Var::broadcast_to`].
    pub fn expand(&self, shape: &[usize]) -> Result<Var> {
        self.broadcast_to(shape)
    }

    pub fn unsqueeze(&self, axis: isize) -> Result<Var> {
        let y = self.value.unsqueeze(axis)?;
        let s = self.shape().to_vec();
        view("unsqueeze", self, y, move |g| g.reshape(&s))
    }

    pub fn squeeze(&self, axis: isize) -> Result<Var> {
        let y = self.value.squeeze(axis)?;
        let s = self.shape().to_vec();
        view("squeeze", self, y, move |g| g.reshape(&s))
    }

    /// Merges axes `start..=end`.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Var> {
        let y = self.value.flatten(start, end)?;
        let s = self.shape().to_vec();
        view("flatten", self, y, move |g| g.reshape(&s))
    }

    /// A contiguous copy (the gradient passes through).
    pub fn contiguous(&self) -> Result<Var> {
        let y = self.value.contiguous()?;
        view("contiguous", self, y, |g| Ok(g.clone()))
    }

    /// Concatenates `vars` along `axis`; each gets its slice of the gradient.
    pub fn concat(vars: &[&Var], axis: isize) -> Result<Var> {
        same_tape("concat", vars)?;
        let y = Tensor::concat(&vars.iter().map(|v| &v.value).collect::<Vec<_>>(), axis)?;
        let a = resolve_axis("concat", axis, y.rank())?;
        let sizes: Vec<usize> = vars.iter().map(|v| v.shape()[a]).collect();
        Var::from_op("concat", vars, y, move |g, w| {
            let mut start = 0;
            let mut out = Vec::with_capacity(sizes.len());
            for (&n, &want) in sizes.iter().zip(w) {
                out.push(if want {
                    Some(g.narrow(a as isize, start, n)?)
                } else {
                    None
                });
                start += n;
            }
            Ok(out)
        })
    }

    /// Stacks same-shaped `vars` along a new axis `axis`.
    pub fn stack(vars: &[&Var], axis: isize) -> Result<Var> {
        same_tape("stack", vars)?;
        let y = Tensor::stack(&vars.iter().map(|v| &v.value).collect::<Vec<_>>(), axis)?;
        let a = resolve_axis("stack", axis, y.rank())?;
        let shapes: Vec<Vec<usize>> = vars.iter().map(|v| v.shape().to_vec()).collect();
        Var::from_op("stack", vars, y, move |g, w| {
            shapes
                .iter()
                .zip(w)
                .enumerate()
                .map(|(i, (s, &want))| {
                    if want {
                        Ok(Some(g.narrow(a as isize, i, 1)?.reshape(s)?))
                    } else {
                        Ok(None)
                    }
                })
                .collect()
        })
    }
}
