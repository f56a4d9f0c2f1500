//! The fused residual add + layer norm, and the layer norm's input gradient as one row kernel
//! (which also adds the gradient the input already has, so the tape's sum is no extra pass).

use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Tensor {
    /// `(s, y, mean, rstd)` with `s = self + r` and `(y, mean, rstd) = s.layer_norm(..)`, bit
    /// for bit, in one pass: a pre-LN block's residual add and the layer norm after it.
    pub fn add_layer_norm(
        &self,
        r: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        const OP: &str = "add_layer_norm";
        self.same_device(OP, r)?;
        if self.shape() != r.shape() {
            return Err(Error::shape(
                OP,
                format!(
                    "the residual {:?} and the update {:?} must have one shape",
                    self.shape(),
                    r.shape()
                ),
            ));
        }
        let d = norm_dim(OP, self.shape(), gamma, beta)?;
        self.same_device(OP, gamma)?;
        self.same_device(OP, beta)?;
        let shape = self.shape();
        let mut stat_shape = shape.to_vec();
        *stat_shape.last_mut().unwrap() = 1;
        let dev = self.device();
        if self.numel() == 0 {
            let z = |s: &[usize]| Tensor::zeros(s, dev);
            return Ok((z(shape)?, z(shape)?, z(&stat_shape)?, z(&stat_shape)?));
        }
        let rows = self.numel() / d;
        let (x, r) = (self.contiguous()?, r.contiguous()?);
        let (gamma, beta) = (gamma.contiguous()?, beta.contiguous()?);
        let (s, y, mean, rstd) = dev.run(
            "add_layer_norm",
            WidenThenRound,
            [&x, &r, &gamma, &beta],
            |k, [x, r, gamma, beta]| k.add_layer_norm_rows(x, r, gamma, beta, rows, d, eps),
        )?;
        // The add, then layer norm's five passes.
        dev.add_flops(6 * self.numel() as u64);
        Ok((
            s.reshape(shape)?,
            y.reshape(shape)?,
            mean.reshape(&stat_shape)?,
            rstd.reshape(&stat_shape)?,
        ))
    }

    /// The gradient of `x` for `y = x.layer_norm(gamma, ..)` given `g`, the gradient of `y`, and
    /// the saved `mean` and `rstd` (shaped like `x` with the last axis 1), plus `carry` (shaped
    /// like `x`) when given: one pass with the composed backward's arithmetic,
    /// `carry + rstd * ((gxhat - mean(gxhat)) - xhat * mean(gxhat * xhat))`.
    pub fn layer_norm_backward(
        x: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        gamma: &Tensor,
        g: &Tensor,
        carry: Option<&Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm backward";
        let d = norm_dim(OP, x.shape(), gamma, gamma)?;
        let rows = x.numel() / d.max(1);
        let same = g.shape() == x.shape() && carry.is_none_or(|c| c.shape() == x.shape());
        if !same || mean.numel() != rows || rstd.numel() != rows {
            return Err(Error::shape(
                OP,
                format!(
                    "x {:?}, its gradient {:?} and carry {:?} must have one shape, and mean {:?} \
                     and rstd {:?} one value per row",
                    x.shape(),
                    g.shape(),
                    carry.map(|c| c.shape()),
                    mean.shape(),
                    rstd.shape()
                ),
            ));
        }
        for t in [mean, rstd, gamma, g].into_iter().chain(carry) {
            x.same_device(OP, t)?;
        }
        let dev = x.device();
        if x.numel() == 0 {
            return Tensor::zeros(x.shape(), dev);
        }
        let carry = carry.map(Tensor::contiguous).transpose()?;
        let (x, mean, rstd) = (x.contiguous()?, mean.contiguous()?, rstd.contiguous()?);
        let (gamma, g) = (gamma.contiguous()?, g.contiguous()?);
        let mut operands = vec![&x, &mean, &rstd, &gamma, &g];
        operands.extend(carry.as_ref());
        let dx = dev.run_all(OP, WidenThenRound, &operands, |k, xs| {
            let carry = xs.get(5).copied();
            k.layer_norm_backward_rows(xs[0], xs[1], xs[2], xs[3], xs[4], carry, rows, d)
        })?;
        dev.add_flops(10 * x.numel() as u64);
        dx.reshape(x.shape())
    }
}

/// The normalised size `d` of input `shape [..., d]` with `gamma`, `beta` `[d]`, else an error.
fn norm_dim(op: &'static str, shape: &[usize], gamma: &Tensor, beta: &Tensor) -> Result<usize> {
    match shape.last() {
        Some(&d) if gamma.shape() == [d] && beta.shape() == [d] => Ok(d),
        _ => Err(Error::shape(
            op,
            format!(
                "needs an input [..., d] with gamma and beta [d], got input {shape:?}, gamma {:?}, \
                 beta {:?}",
                gamma.shape(),
                beta.shape()
            ),
        )),
    }
}
