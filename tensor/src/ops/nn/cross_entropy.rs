//! Softmax + cross-entropy as one row kernel and its backward as one: the language-model loss
//! without the log-probability matrix, the gather, and the four-op log-softmax backward.

use crate::dtype_policy::{DTypePolicy::WidenThenRound, StaysF32};
use crate::error::{Error, Result};
use crate::ops::check_indices;
use crate::tensor::Tensor;

impl Tensor {
    /// The cross-entropy of each row of logits `self [n, c]` against class ids `targets [n]`
    /// (f32 holding integers in `0..c`): `(loss, max, logsum)`, each `[n]`, with
    /// `loss = -log_softmax(self)[target]` bit for bit, and the row statistics
    /// [`Tensor::cross_entropy_backward`] needs.
    pub fn cross_entropy_rows(&self, targets: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "cross_entropy";
        self.same_device(OP, targets)?;
        let (n, c) = rows_and_classes(OP, self, targets)?;
        check_indices(OP, targets, c)?;
        let dev = self.device();
        if n == 0 {
            let z = || Tensor::zeros(&[0], dev);
            return Ok((z()?, z()?, z()?));
        }
        let (x, t) = (self.contiguous()?, targets.contiguous()?);
        // The targets and the saved row statistics stay f32 (indices, and what the backward
        // recomputes the probabilities from); half logits are widened and the loss rounded.
        dev.require_f32("cross_entropy (targets)", &[&t])?;
        let (loss, StaysF32(max), StaysF32(logsum)) =
            dev.run(OP, WidenThenRound, [&x], |k, [x]| {
                let (loss, max, logsum) = k.cross_entropy_rows(x, t.raw(), n, c)?;
                Ok((loss, StaysF32(max), StaysF32(logsum)))
            })?;
        let out = (loss, max, logsum);
        // max, exp, sum per element.
        dev.add_flops(3 * self.numel() as u64);
        Ok(out)
    }

    /// The gradient of the logits for [`Tensor::cross_entropy_rows`], given `g [n]`, the gradient
    /// of each row's loss: `g * (softmax(logits) - onehot(target))`, one pass, equal bit for bit
    /// to the composed backward (scatter into zeros, then `G - exp(log_softmax) * sum(G)`).
    pub fn cross_entropy_backward(
        logits: &Tensor,
        targets: &Tensor,
        max: &Tensor,
        logsum: &Tensor,
        g: &Tensor,
    ) -> Result<Tensor> {
        const OP: &str = "cross_entropy backward";
        for t in [targets, max, logsum, g] {
            logits.same_device(OP, t)?;
        }
        let (n, c) = rows_and_classes(OP, logits, targets)?;
        if [max, logsum, g].iter().any(|t| t.shape() != [n]) {
            return Err(Error::shape(
                OP,
                format!(
                    "max {:?}, logsum {:?} and the loss gradient {:?} must all be [{n}] for logits \
                     {:?}",
                    max.shape(),
                    logsum.shape(),
                    g.shape(),
                    logits.shape()
                ),
            ));
        }
        let dev = logits.device();
        if n == 0 {
            return Tensor::zeros(logits.shape(), dev);
        }
        let (x, t) = (logits.contiguous()?, targets.contiguous()?);
        let (max, logsum, g) = (max.contiguous()?, logsum.contiguous()?, g.contiguous()?);
        let statistics = "cross_entropy backward (targets, statistics)";
        dev.require_f32(statistics, &[&t, &max, &logsum])?;
        let dx = dev.run(OP, WidenThenRound, [&x, &g], |k, [x, g]| {
            k.cross_entropy_backward_rows(x, t.raw(), max.raw(), logsum.raw(), g, n, c)
        })?;
        dev.add_flops(4 * logits.numel() as u64);
        Ok(dx)
    }
}

/// `(n, c)` for logits `[n, c]` with `c >= 1` and targets `[n]`, else an error naming the shapes.
fn rows_and_classes(op: &'static str, logits: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    match (logits.shape(), targets.shape()) {
        (&[n, c], &[t]) if n == t && c > 0 => Ok((n, c)),
        (l, t) => Err(Error::shape(
            op,
            format!("needs logits [n, c] with c >= 1 and targets [n], got logits {l:?} and targets {t:?}"),
        )),
    }
}
