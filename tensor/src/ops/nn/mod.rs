//! Neural-network ops: softmax, layer norm, dropout masks, and (in submodules) convolution and
//! pooling with their adjoints.

mod attention;
mod conv;
mod cross_entropy;
mod norm;
mod pool;

pub use conv::Conv2dParams;
pub use pool::Pool2dParams;

use crate::device::Device;
use crate::dtype_policy::DTypePolicy::WidenThenRound;
use crate::error::{Error, Result};
use crate::layout::resolve_axis;
use crate::tensor::Tensor;

impl Tensor {
    /// Softmax along `axis` (numerically stable).
    pub fn softmax(&self, axis: isize) -> Result<Tensor> {
        self.softmax_impl("softmax", axis, false)
    }

    /// `log(softmax(x))` along `axis`, computed directly (stable for very negative logits).
    pub fn log_softmax(&self, axis: isize) -> Result<Tensor> {
        self.softmax_impl("log_softmax", axis, true)
    }

    /// Moves `axis` last, runs the row kernel on the contiguous view, and moves it back (the
    /// result is then a permuted view unless `axis` already was last).
    fn softmax_impl(&self, op: &'static str, axis: isize, log: bool) -> Result<Tensor> {
        let r = self.rank();
        let a = resolve_axis(op, axis, r)?;
        let dev = self.device();
        if self.numel() == 0 {
            return self.zeros_like();
        }
        let mut perm: Vec<usize> = (0..r).filter(|&i| i != a).collect();
        perm.push(a);
        let x = self.permute(&perm)?.contiguous()?;
        let cols = self.shape()[a];
        let rows = self.numel() / cols;
        let op = if log { "log_softmax" } else { "softmax" };
        let y = dev.run(op, WidenThenRound, [&x], |k, [x]| {
            k.softmax_rows(x, rows, cols, log)
        })?;
        dev.add_flops(self.numel() as u64);
        let mut inverse = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            inverse[p] = i;
        }
        y.reshape(x.shape())?.permute(&inverse)
    }

    /// Layer normalisation over the last axis: `(y, mean, rstd)` with `y = (x - mean) * rstd *
    /// gamma + beta`, biased variance, and `mean`/`rstd` shaped like `x` with the last axis 1
    /// (what the backward needs). `gamma` and `beta` have shape `[d]`.
    pub fn layer_norm(
        &self,
        gamma: &Tensor,
        beta: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "layer_norm";
        self.same_device(OP, gamma)?;
        self.same_device(OP, beta)?;
        let shape = self.shape();
        let Some(&d) = shape.last() else {
            return Err(Error::shape(
                OP,
                "needs rank >= 1, got a 0-d tensor (shape [])",
            ));
        };
        if gamma.shape() != [d] || beta.shape() != [d] {
            return Err(Error::shape(
                OP,
                format!(
                    "gamma {:?} and beta {:?} must both be [{d}] for input {shape:?}",
                    gamma.shape(),
                    beta.shape()
                ),
            ));
        }
        let mut stat_shape = shape.to_vec();
        *stat_shape.last_mut().unwrap() = 1;
        let dev = self.device();
        if self.numel() == 0 {
            return Ok((
                self.zeros_like()?,
                Tensor::zeros_in(&stat_shape, self.dtype(), dev)?,
                Tensor::zeros_in(&stat_shape, self.dtype(), dev)?,
            ));
        }
        let rows = self.numel() / d;
        let (x, gamma, beta) = (self.contiguous()?, gamma.contiguous()?, beta.contiguous()?);
        let (y, mean, rstd) = dev.run(
            "layer_norm",
            WidenThenRound,
            [&x, &gamma, &beta],
            |k, [x, gamma, beta]| k.layer_norm_rows(x, gamma, beta, rows, d, eps),
        )?;
        // mean, variance, normalise, scale, shift: about five passes over x.
        dev.add_flops(5 * self.numel() as u64);
        Ok((
            y.reshape(shape)?,
            mean.reshape(&stat_shape)?,
            rstd.reshape(&stat_shape)?,
        ))
    }

    /// Dropout multipliers: 0 with probability `p`, else `1 / (1 - p)`; element `i` depends only
    /// on `(seed, offset, i)`, so every backend and every re-computation gives the same bits.
    pub fn dropout_mask(
        shape: &[usize],
        p: f32,
        seed: u64,
        offset: u64,
        dev: &Device,
    ) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                "dropout_mask",
                format!("p must be in [0, 1), got {p} (shape {shape:?})"),
            ));
        }
        if shape.iter().product::<usize>() == 0 {
            return Tensor::zeros(shape, dev);
        }
        let out = Tensor::from_raw(
            dev.kernels()
                .dropout_mask(dev.memory(), shape, p, seed, offset)?,
            dev,
        );
        dev.add_flops(out.numel() as u64);
        Ok(out)
    }
}
