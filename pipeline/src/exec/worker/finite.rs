//! Checks for NaN and infinity under the step's [`NonFinite`] policy: where non-finite values
//! first appeared on this device, or the error naming them.

use wgpipe_tensor::Tensor;

use super::{NonFiniteAt, Worker};
use crate::error::{NonFinite, StageCause};
use crate::exec::stage::Stage;

/// Whether every value of `t` is finite: one reduction on its device (x·0 is 0 for finite x and
/// NaN for NaN and ±inf, and the sum of zeros cannot overflow).
fn all_finite(t: &Tensor) -> wgpipe_tensor::Result<bool> {
    Ok(t.mul_scalar(0.0)?.sum_all()?.to_scalar()?.is_finite())
}

impl Worker<'_, '_> {
    /// Checks `t` under the step's [`NonFinite`] policy: `Ok(false)` when it is not finite and
    /// the step goes on (recording the first place on this device), an error naming `what`
    /// under [`NonFinite::Error`]. Callers check only values whose inputs were finite, so what
    /// is found is where non-finite values first appeared.
    pub(super) fn check(
        &mut self,
        t: &Tensor,
        s: usize,
        m: usize,
        what: impl FnOnce() -> String,
    ) -> Result<bool, StageCause> {
        if self.io.non_finite == NonFinite::Ignore {
            return Ok(true);
        }
        let before = self.device.flops();
        let finite = all_finite(t)?;
        self.check_flops += self.device.flops() - before;
        if finite {
            return Ok(true);
        }
        let what = what();
        if self.io.non_finite == NonFinite::Error {
            return Err(StageCause::NonFinite(format!(
                "{what} holds NaN or infinity"
            )));
        }
        self.out.non_finite.get_or_insert(NonFiniteAt {
            stage: s,
            micro_batch: m,
            what,
        });
        Ok(false)
    }

    /// At the end of the step: the accumulated parameter gradients of the device's stages must
    /// be finite (one check per parameter, on the device). Skipped when this device already
    /// found non-finite values or received some (under [`NonFinite::SkipStep`] the earlier
    /// finding stands, here or upstream).
    pub(super) fn check_param_grads(&mut self, stages: &[&Stage]) -> Result<(), StageCause> {
        if self.io.non_finite == NonFinite::Ignore || self.out.non_finite.is_some() || self.tainted
        {
            return Ok(());
        }
        let m = self.pos.micro_batch;
        for stage in stages {
            for (i, layer) in stage.layers.iter().enumerate() {
                for (name, p) in layer.parameters() {
                    let Some(g) = p.grad() else { continue };
                    let what = || {
                        format!(
                            "the gradient of {name} in layer {} ({}), summed over the micro-batches,",
                            stage.first_layer + i,
                            layer.name()
                        )
                    };
                    if !self.check(&g, stage.index, m, what)? {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}
