//! Softmax + cross-entropy of rows of logits as one op (the language-model loss).

use wgpipe_tensor::{Result, Tensor};

use crate::var::Var;

impl Var {
    /// The cross-entropy of each row of logits `self [n, c]` against class ids `targets [n]`:
    /// `-log_softmax(self)[target]`, shape `[n]`. One row kernel forward; the backward,
    /// `g * (softmax - onehot)`, one more. Bit for bit the composed
    /// `-log_softmax(-1).gather(1, targets)` and its backward.
    pub fn cross_entropy_rows(&self, targets: &Tensor) -> Result<Var> {
        let (loss, max, logsum) = self.value.cross_entropy_rows(targets)?;
        let (x, t) = (self.value.clone(), targets.clone());
        Var::from_op("cross_entropy", &[self], loss, move |g, _| {
            Ok(vec![Some(Tensor::cross_entropy_backward(
                &x, &t, &max, &logsum, g,
            )?)])
        })
    }
}
