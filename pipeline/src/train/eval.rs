//! Evaluation: the forward of every micro-batch through every stage, recording nothing.

use std::panic::{catch_unwind, AssertUnwindSafe};

use wgpipe_autograd::{ForwardCtx, SkipRouter, Tape};
use wgpipe_tensor::Tensor;

use crate::error::{Result, StageCause};
use crate::exec::threads::{self};
use crate::microbatch::split_batch;

use super::Pipeline;

impl Pipeline {
    /// Evaluation forward: micro-batch by micro-batch through every stage, recording nothing.
    /// Returns the outputs concatenated along axis 0, on the last stage's device.
    pub fn forward(&self, inputs: &Tensor) -> Result<Tensor> {
        self.check_settled()?;
        let xs = split_batch("inputs", inputs, self.schedule.num_micro_batches)?;
        let mut outs = Vec::with_capacity(xs.len());
        for (mb, x) in xs.into_iter().enumerate() {
            let mut h = x;
            // Skips in flight between stages, by name (moved to each consumer's device).
            let mut skips = SkipRouter::new();
            for s in self.stages() {
                let run = || -> wgpipe_tensor::Result<Tensor> {
                    let tape = Tape::no_grad();
                    let v = tape.constant(h.to_device(&s.device)?);
                    for (_, name) in &s.skips.incoming {
                        if let Some(t) = skips.take(name) {
                            let t = tape.constant(t.value().to_device(&s.device)?);
                            skips.insert(name.clone(), t);
                        }
                    }
                    Ok(s.run_layers(
                        &v,
                        &mut skips,
                        ForwardCtx::eval().with_compute(self.precision),
                        &mut None,
                    )?
                    .value()
                    .clone())
                };
                h = match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => return Err(s.error(mb, "Forward (eval)", StageCause::Tensor(e))),
                    Err(p) => {
                        return Err(s.error(
                            mb,
                            "Forward (eval)",
                            StageCause::Panic(threads::panic_message(p)),
                        ))
                    }
                };
            }
            outs.push(h);
        }
        let refs: Vec<&Tensor> = outs.iter().collect();
        Ok(Tensor::concat(&refs, 0)?)
    }
}
