//! 2-D convolution (NCHW) and its two adjoints, as im2col + batched matmul with the groups as a
//! batch axis: columns `[n, g, R, L]` (`R = c_in/g * kh * kw`, `L = h_out * w_out`) and weights
//! `[1, g, c_out/g, R]` broadcast over the samples. Depthwise convolution is simply `g = c_in`.
//! FLOPs are those of the matmuls (counted by [`Tensor::matmul`]).

use crate::backend::Conv2dGeometry;
use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Stride, zero padding, dilation (all `(rows, cols)`) and groups of a convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    pub stride: (usize, usize),
    pub padding: (usize, usize),
    pub dilation: (usize, usize),
    pub groups: usize,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Conv2dParams {
            stride: (1, 1),
            padding: (0, 0),
            dilation: (1, 1),
            groups: 1,
        }
    }
}

/// Output size of one spatial axis, or None when the dilated kernel does not fit.
fn out_size(size: usize, k: usize, stride: usize, pad: usize, dil: usize) -> Option<usize> {
    let span = dil * (k - 1) + 1;
    (size + 2 * pad)
        .checked_sub(span)
        .map(|room| room / stride + 1)
}

/// Validates a convolution of input `x` `[n, c_in, h, w]` by weight `w`
/// `[c_out, c_in/groups, kh, kw]` and returns its geometry.
fn geometry(op: &'static str, x: &[usize], w: &[usize], p: Conv2dParams) -> Result<Conv2dGeometry> {
    let shapes = || format!("input {x:?}, weight {w:?}, {p:?}");
    if p.groups == 0 || p.stride.0 == 0 || p.stride.1 == 0 || p.dilation.0 == 0 || p.dilation.1 == 0
    {
        return Err(Error::invalid(
            op,
            format!("groups, stride and dilation must be >= 1 ({})", shapes()),
        ));
    }
    if x.len() != 4 || w.len() != 4 {
        return Err(Error::shape(
            op,
            format!("needs a 4-d NCHW input and a 4-d weight ({})", shapes()),
        ));
    }
    let (n, c_in, h, wd) = (x[0], x[1], x[2], x[3]);
    let (c_out, kh, kw) = (w[0], w[2], w[3]);
    let g = p.groups;
    if c_in % g != 0 || c_out % g != 0 || w[1] != c_in / g || kh == 0 || kw == 0 {
        return Err(Error::shape(
            op,
            format!(
                "weight must be [c_out, c_in/groups, kh, kw] with c_in and c_out divisible by \
                 groups and kh, kw >= 1 ({})",
                shapes()
            ),
        ));
    }
    let (Some(h_out), Some(w_out)) = (
        out_size(h, kh, p.stride.0, p.padding.0, p.dilation.0),
        out_size(wd, kw, p.stride.1, p.padding.1, p.dilation.1),
    ) else {
        return Err(Error::shape(
            op,
            format!(
                "the padded input is smaller than the dilated kernel ({})",
                shapes()
            ),
        ));
    };
    Ok(Conv2dGeometry {
        n,
        c_in,
        h,
        w: wd,
        c_out,
        kh,
        kw,
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        groups: g,
        h_out,
        w_out,
    })
}

/// `[n, c_out, h_out, w_out]`, the output (and `dy`) shape.
fn out_shape(g: &Conv2dGeometry) -> [usize; 4] {
    [g.n, g.c_out, g.h_out, g.w_out]
}

/// The weight as `[1, groups, c_out/groups, R]`, broadcast over samples by the matmul.
fn grouped_weight(w: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
    w.reshape(&[1, g.groups, g.c_out / g.groups, g.col_rows()])
}

/// `dy` checked against the output shape and viewed as `[n, groups, c_out/groups, L]`.
fn grouped_dy(op: &'static str, dy: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
    if dy.shape() != out_shape(g) {
        return Err(Error::shape(
            op,
            format!(
                "dy has shape {:?}, expected the convolution output shape {:?}",
                dy.shape(),
                out_shape(g)
            ),
        ));
    }
    dy.reshape(&[g.n, g.groups, g.c_out / g.groups, g.col_cols()])
}

/// im2col of `x`: `[n, groups, R, L]`.
fn columns(x: &Tensor, g: &Conv2dGeometry) -> Result<Tensor> {
    let x = x.contiguous()?;
    let cols = x
        .device()
        .run("conv2d (im2col)", WidenThenRound, [&x], |k, [x]| {
            k.im2col(x, g)
        })?;
    cols.reshape(&[g.n, g.groups, g.col_rows(), g.col_cols()])
}

impl Tensor {
    /// 2-D convolution of NCHW `self` by `weight` `[c_out, c_in/groups, kh, kw]`, plus an
    /// optional `bias` `[c_out]`.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        p: Conv2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d";
        self.same_device(OP, weight)?;
        let g = geometry(OP, self.shape(), weight.shape(), p)?;
        if let Some(b) = bias {
            self.same_device(OP, b)?;
            if b.shape() != [g.c_out] {
                return Err(Error::shape(
                    OP,
                    format!("bias has shape {:?}, expected [{}]", b.shape(), g.c_out),
                ));
            }
        }
        let shape = out_shape(&g);
        let y = if shape.iter().product::<usize>() == 0 || g.col_rows() == 0 {
            Tensor::zeros_in(&shape, self.dtype(), self.device())?
        } else {
            grouped_weight(weight, &g)?
                .matmul(&columns(self, &g)?)?
                .reshape(&shape)?
        };
        match bias {
            Some(b) => y.add(&b.reshape(&[1, g.c_out, 1, 1])?),
            None => Ok(y),
        }
    }

    /// Gradient of `conv2d` with respect to its input (its adjoint in `x`): `W^T @ dy` per group,
    /// then col2im, overlapping windows adding up.
    pub fn conv2d_input_grad(
        dy: &Tensor,
        weight: &Tensor,
        input_shape: &[usize],
        p: Conv2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d_input_grad";
        dy.same_device(OP, weight)?;
        let g = geometry(OP, input_shape, weight.shape(), p)?;
        let dy = grouped_dy(OP, dy, &g)?;
        let dev = dy.device();
        if input_shape.iter().product::<usize>() == 0 || g.c_out == 0 {
            return Tensor::zeros_in(input_shape, dy.dtype(), dev);
        }
        let dcols = grouped_weight(weight, &g)?.t()?.matmul(&dy)?;
        dev.run(
            "conv2d backward (col2im)",
            WidenThenRound,
            [&dcols],
            |k, [c]| k.col2im(c, &g),
        )?
        .reshape(input_shape)
    }

    /// Gradient of `conv2d` with respect to its weight: `dy @ cols^T` per sample and group,
    /// summed over the samples.
    pub fn conv2d_weight_grad(
        x: &Tensor,
        dy: &Tensor,
        weight_shape: &[usize],
        p: Conv2dParams,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d_weight_grad";
        x.same_device(OP, dy)?;
        let g = geometry(OP, x.shape(), weight_shape, p)?;
        let dy = grouped_dy(OP, dy, &g)?;
        if weight_shape.iter().product::<usize>() == 0 || g.n == 0 {
            return Tensor::zeros_in(weight_shape, x.dtype(), x.device());
        }
        dy.matmul(&columns(x, &g)?.t()?)?
            .sum(&[0], false)?
            .reshape(weight_shape)
    }
}
