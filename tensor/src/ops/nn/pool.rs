//! 2-D max and average pooling (NCHW) and their adjoints. Padding counts as -inf for max and as
//! zeros in the average (divisor always `kh * kw`), as PyTorch's defaults. FLOPs: one per window
//! element read forward, one per `dy` element backward.

use crate::backend::Pool2dGeometry;
use crate::dtype_policy::{DTypePolicy::WidenThenRound, StaysF32};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Window size, stride and zero padding, all `(rows, cols)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Pool2dParams {
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: (usize, usize),
}

/// Validates pooling NCHW `shape` with `p`. Padding may be at most half the window (as PyTorch),
/// so no window lies wholly in the padding.
fn geometry(op: &'static str, shape: &[usize], p: Pool2dParams) -> Result<Pool2dGeometry> {
    let (k, s, pad) = (p.kernel, p.stride, p.padding);
    if k.0 == 0 || k.1 == 0 || s.0 == 0 || s.1 == 0 || 2 * pad.0 > k.0 || 2 * pad.1 > k.1 {
        return Err(Error::invalid(
            op,
            format!(
                "kernel and stride must be >= 1 and padding at most half the kernel \
                 (input {shape:?}, {p:?})"
            ),
        ));
    }
    if shape.len() != 4 {
        return Err(Error::shape(
            op,
            format!("needs a 4-d NCHW input, got shape {shape:?}"),
        ));
    }
    let (h, w) = (shape[2], shape[3]);
    if h + 2 * pad.0 < k.0 || w + 2 * pad.1 < k.1 {
        return Err(Error::shape(
            op,
            format!("the padded input {shape:?} is smaller than the window ({p:?})"),
        ));
    }
    Ok(Pool2dGeometry {
        n: shape[0],
        c: shape[1],
        h,
        w,
        kh: k.0,
        kw: k.1,
        stride: s,
        padding: pad,
        h_out: (h + 2 * pad.0 - k.0) / s.0 + 1,
        w_out: (w + 2 * pad.1 - k.1) / s.1 + 1,
    })
}

fn out_shape(g: &Pool2dGeometry) -> [usize; 4] {
    [g.n, g.c, g.h_out, g.w_out]
}

/// Fails unless `t` has the pooled output shape (`what` names it in the message).
fn check_out(op: &'static str, what: &str, t: &Tensor, g: &Pool2dGeometry) -> Result<()> {
    if t.shape() != out_shape(g) {
        return Err(Error::shape(
            op,
            format!(
                "{what} has shape {:?}, expected the pooled shape {:?}",
                t.shape(),
                out_shape(g)
            ),
        ));
    }
    Ok(())
}

impl Tensor {
    /// Max pooling: `(y, argmax)`, where `argmax` holds (as f32) the flat index `iy * w + ix` of
    /// each maximum inside its `(n, c)` plane, for [`Tensor::max_pool2d_backward`].
    pub fn max_pool2d(&self, p: Pool2dParams) -> Result<(Tensor, Tensor)> {
        let g = geometry("max_pool2d", self.shape(), p)?;
        let dev = self.device();
        if self.numel() == 0 {
            let z = Tensor::zeros_in(&out_shape(&g), self.dtype(), dev)?;
            return Ok((z.clone(), z));
        }
        let x = self.contiguous()?;
        // The argmax positions stay f32, like every index tensor.
        let (y, StaysF32(argmax)) = dev.run("max_pool2d", WidenThenRound, [&x], |k, [x]| {
            let (y, argmax) = k.max_pool2d(x, &g)?;
            Ok((y, StaysF32(argmax)))
        })?;
        dev.add_flops((y.numel() * g.kh * g.kw) as u64);
        Ok((y.reshape(&out_shape(&g))?, argmax.reshape(&out_shape(&g))?))
    }

    /// Adjoint of max pooling: each `dy` goes to the input position its `argmax` names (as
    /// returned by [`Tensor::max_pool2d`]; its values are trusted).
    pub fn max_pool2d_backward(
        dy: &Tensor,
        argmax: &Tensor,
        input_shape: &[usize],
        p: Pool2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "max_pool2d_backward";
        dy.same_device(OP, argmax)?;
        let g = geometry(OP, input_shape, p)?;
        check_out(OP, "dy", dy, &g)?;
        check_out(OP, "argmax", argmax, &g)?;
        let dev = dy.device();
        if dy.numel() == 0 {
            return Tensor::zeros_in(input_shape, dy.dtype(), dev);
        }
        let (dy, argmax) = (dy.contiguous()?, argmax.contiguous()?);
        dev.require_f32("max_pool2d backward (argmax)", &[&argmax])?;
        let dx = dev.run("max_pool2d backward", WidenThenRound, [&dy], |k, [dy]| {
            k.max_pool2d_backward(dy, argmax.raw(), &g)
        })?;
        dev.add_flops(dy.numel() as u64);
        dx.reshape(input_shape)
    }

    /// Average pooling (padding counted as zeros, divisor `kh * kw`).
    pub fn avg_pool2d(&self, p: Pool2dParams) -> Result<Tensor> {
        let g = geometry("avg_pool2d", self.shape(), p)?;
        let dev = self.device();
        if self.numel() == 0 {
            return Tensor::zeros_in(&out_shape(&g), self.dtype(), dev);
        }
        let x = self.contiguous()?;
        let y = dev.run("avg_pool2d", WidenThenRound, [&x], |k, [x]| {
            k.avg_pool2d(x, &g)
        })?;
        dev.add_flops((y.numel() * g.kh * g.kw) as u64);
        y.reshape(&out_shape(&g))
    }

    /// Adjoint of average pooling: each `dy / (kh * kw)` spread over its window.
    pub fn avg_pool2d_backward(
        dy: &Tensor,
        input_shape: &[usize],
        p: Pool2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "avg_pool2d_backward";
        let g = geometry(OP, input_shape, p)?;
        check_out(OP, "dy", dy, &g)?;
        let dev = dy.device();
        if dy.numel() == 0 {
            return Tensor::zeros_in(input_shape, dy.dtype(), dev);
        }
        let dy = dy.contiguous()?;
        let dx = dev.run("avg_pool2d backward", WidenThenRound, [&dy], |k, [dy]| {
            k.avg_pool2d_backward(dy, &g)
        })?;
        dev.add_flops(dy.numel() as u64);
        dx.reshape(input_shape)
    }
}
