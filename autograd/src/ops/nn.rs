//! Neural-network ops: (log-)softmax, layer norm, 2-D convolution and pooling, dropout.

use wgpipe_tensor::ops::{Conv2dParams, Pool2dParams};
use wgpipe_tensor::{Result, Tensor};

use super::{same_tape, when};
use crate::module::ForwardCtx;
use crate::tape::CarrySlot;
use crate::var::Var;

impl Var {
    /// Softmax along `axis`: `dx = y * (g - sum(g * y))`, in one fused kernel along the last
    /// axis (the same arithmetic as the four ops used along the others).
    pub fn softmax(&self, axis: isize) -> Result<Var> {
        let y = self.value.softmax(axis)?;
        let yy = y.clone();
        let last = axis == -1 || axis + 1 == self.value.rank() as isize;
        Var::from_op("softmax", &[self], y, move |g, _| {
            if last {
                return Ok(vec![Some(Tensor::softmax_backward(&yy, g, 1.0)?)]);
            }
            let gy = g.mul(&yy)?;
            let s = gy.sum(&[axis], true)?;
            Ok(vec![Some(gy.sub(&yy.mul(&s)?)?)])
        })
    }

    /// Log-softmax along `axis`: `dx = g - exp(y) * sum(g)`.
    pub fn log_softmax(&self, axis: isize) -> Result<Var> {
        let y = self.value.log_softmax(axis)?;
        let yy = y.clone();
        Var::from_op("log_softmax", &[self], y, move |g, _| {
            let s = g.sum(&[axis], true)?;
            Ok(vec![Some(g.sub(&yy.exp()?.mul(&s)?)?)])
        })
    }

    /// Layer norm over the last axis with scale `gamma` and shift `beta`. The backward uses the
    /// mean and `rstd` saved by the forward, in composed ops. (The fused input gradient of
    /// [`Var::add_layer_norm`] would serve here too, but it changes the FLOPs and temporaries the
    /// planner profiles, and on the planner test's MLP the heuristic search then misses the
    /// exhaustive optimum by 7%: left until the planner copes.)
    pub fn layer_norm(&self, gamma: &Var, beta: &Var, eps: f32) -> Result<Var> {
        same_tape("layer_norm", &[self, gamma, beta])?;
        let (y, mean, rstd) = self.value.layer_norm(&gamma.value, &beta.value, eps)?;
        let x = self.value.clone();
        let gm = gamma.value.clone();
        let (sg, sb) = (gamma.shape().to_vec(), beta.shape().to_vec());
        Var::from_op("layer_norm", &[self, gamma, beta], y, move |g, w| {
            let xhat = x.sub(&mean)?.mul(&rstd)?;
            let gx = when(w[0], || {
                // dx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat))
                let gxhat = g.mul(&gm)?;
                let m1 = gxhat.mean(&[-1], true)?;
                let m2 = gxhat.mul(&xhat)?.mean(&[-1], true)?;
                gxhat.sub(&m1)?.sub(&xhat.mul(&m2)?)?.mul(&rstd)
            })?;
            let ggamma = when(w[1], || g.mul(&xhat)?.sum_to_shape(&sg))?;
            let gbeta = when(w[2], || g.sum_to_shape(&sb))?;
            Ok(vec![gx, ggamma, gbeta])
        })
    }

    /// `(s, s.layer_norm(gamma, beta, eps))` with `s = self + r`, both computed in one pass: a
    /// pre-LN block's residual add and the layer norm after it. Bit for bit the two ops. In the
    /// backward, the norm's input gradient is one pass that also adds the gradient `s` already
    /// has (the residual stream's, from the block's second add), as the tape would have.
    pub fn add_layer_norm(&self, r: &Var, gamma: &Var, beta: &Var, eps: f32) -> Result<(Var, Var)> {
        same_tape("add_layer_norm", &[self, r, gamma, beta])?;
        let (s, y, mean, rstd) =
            self.value
                .add_layer_norm(&r.value, &gamma.value, &beta.value, eps)?;
        let s = Var::from_op("add", &[self, r], s, |g, w| {
            Ok(vec![w[0].then(|| g.clone()), w[1].then(|| g.clone())])
        })?;
        let y = layer_norm_node(&s, gamma, beta, y, mean, rstd)?;
        Ok((s, y))
    }

    /// 2-D convolution, NCHW input, weight `[c_out, c_in / groups, kh, kw]`, optional bias
    /// `[c_out]`. Backward via the two adjoint convolutions.
    pub fn conv2d(&self, weight: &Var, bias: Option<&Var>, p: Conv2dParams) -> Result<Var> {
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        same_tape("conv2d", &inputs)?;
        let y = self
            .value
            .conv2d(&weight.value, bias.map(|b| &b.value), p)?;
        let x = weight.requires_grad.then(|| self.value.clone());
        let wt = self.requires_grad.then(|| weight.value.clone());
        let (sx, sw) = (self.shape().to_vec(), weight.shape().to_vec());
        let sb = bias.map(|b| b.shape().to_vec());
        Var::from_op("conv2d", &inputs, y, move |g, w| {
            let gx = when(w[0], || {
                Tensor::conv2d_input_grad(g, wt.as_ref().unwrap(), &sx, p)
            })?;
            let gw = when(w[1], || {
                Tensor::conv2d_weight_grad(x.as_ref().unwrap(), g, &sw, p)
            })?;
            let mut out = vec![gx, gw];
            if let Some(sb) = &sb {
                out.push(when(w[2], || g.sum(&[0, 2, 3], false)?.reshape(sb))?);
            }
            Ok(out)
        })
    }

    /// 2-D max pooling (NCHW); the gradient goes to each window's (first) maximum.
    pub fn max_pool2d(&self, p: Pool2dParams) -> Result<Var> {
        let (y, argmax) = self.value.max_pool2d(p)?;
        let shape = self.shape().to_vec();
        Var::from_op("max_pool2d", &[self], y, move |g, _| {
            Ok(vec![Some(Tensor::max_pool2d_backward(
                g, &argmax, &shape, p,
            )?)])
        })
    }

    /// 2-D average pooling (NCHW, padding counted as zeros, divisor `kh * kw`).
    pub fn avg_pool2d(&self, p: Pool2dParams) -> Result<Var> {
        let y = self.value.avg_pool2d(p)?;
        let shape = self.shape().to_vec();
        Var::from_op("avg_pool2d", &[self], y, move |g, _| {
            Ok(vec![Some(Tensor::avg_pool2d_backward(g, &shape, p)?)])
        })
    }

    /// Inverted dropout with drop probability `p`: the mask comes from the counter-based RNG
    /// stream `ctx.rng_stream(site)`, so a re-run (recompute) with the same `ctx` and `site`
    /// replays it bit for bit. The identity when `!ctx.train` or `p == 0`.
    pub fn dropout(&self, p: f32, ctx: &ForwardCtx, site: u64) -> Result<Var> {
        let Some(mask) = ctx.dropout_mask(self.shape(), p, site, self.device())? else {
            return Ok(self.clone());
        };
        // The multipliers in this var's dtype: `1 / (1 - p)` rounded once for a half var,
        // within the rounding its product gets anyway.
        let mask = mask.to_dtype(self.value.dtype())?;
        let y = self.value.mul(&mask)?;
        Var::from_op("dropout", &[self], y, move |g, _| {
            Ok(vec![Some(g.mul(&mask)?)])
        })
    }
}

/// Records the layer norm of `x` (the sum of [`Var::add_layer_norm`]) whose forward gave
/// `(y, mean, rstd)`. The input's gradient
/// comes from [`Tensor::layer_norm_backward`] with the gradient `x` has so far carried in (see
/// [`Var::from_op_carrying`]); gamma's and beta's from the composed ops.
fn layer_norm_node(
    x: &Var,
    gamma: &Var,
    beta: &Var,
    y: Tensor,
    mean: Tensor,
    rstd: Tensor,
) -> Result<Var> {
    let xv = x.value.clone();
    let gm = gamma.value.clone();
    let (sg, sb) = (gamma.shape().to_vec(), beta.shape().to_vec());
    let slot = CarrySlot::default();
    let carried = slot.clone();
    Var::from_op_carrying("layer_norm", &[x, gamma, beta], y, 0, slot, move |g, w| {
        let gx = when(w[0], || {
            let carry = carried.take();
            Tensor::layer_norm_backward(&xv, &mean, &rstd, &gm, g, carry.as_ref())
        })?;
        let ggamma = when(w[1], || {
            let xhat = xv.sub(&mean)?.mul(&rstd)?;
            g.mul(&xhat)?.sum_to_shape(&sg)
        })?;
        let gbeta = when(w[2], || g.sum_to_shape(&sb))?;
        Ok(vec![gx, ggamma, gbeta])
    })
}
