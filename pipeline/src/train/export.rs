//! Files the ranks write together, each its own devices' part: an export of the trained model
//! to another library's format (a Hugging Face folder, one shard per device), as
//! [`Pipeline::save_sharded`] is the export to wgpipe's own. No rank gathers the model.

use wgpipe_autograd::Param;

use crate::error::{PipelineError, Result};
use crate::train::pipeline::Pipeline;
use crate::train::shards::from_pipeline;

impl Pipeline {
    /// Runs `write(d, tensors)` for each device `d` of replica 0 that this process runs (in
    /// one process, every device; under MPI, its own), `tensors` the parameters and buffers of
    /// the device's stages under their global names (`{layer}.{name}`); then, once every
    /// rank's part succeeded, `finish()` on rank 0 (say, the index naming every part). Every
    /// rank must call it at the same point, and every rank returns the same verdict: an error
    /// of any rank's part, or of `finish`, names that rank and fails every rank.
    pub fn write_by_device(
        &mut self,
        mut write: impl FnMut(usize, &[(String, Param)]) -> std::result::Result<(), String>,
        finish: impl FnOnce() -> std::result::Result<(), String>,
    ) -> Result<()> {
        let k = self.num_devices();
        let local = self.check_settled().and_then(|_| {
            if self.replicas()[0].index() != 0 {
                return Ok(()); // another replica's ranks hold the same values
            }
            let placement = self.schedule().placement.clone();
            for d in (0..k).filter(|&d| self.transport.runs_device(d, k)) {
                let stages: Vec<_> = self
                    .stages()
                    .iter()
                    .filter(|s| placement[s.index] == d)
                    .collect();
                if let Some(s) = stages.iter().find(|s| !s.is_held()) {
                    return Err(PipelineError::Config(format!(
                        "stage {} of device {d} is not held by this process",
                        s.index
                    )));
                }
                let tensors: Vec<(String, Param)> = stages
                    .iter()
                    .flat_map(|s| s.named_parameters().into_iter().chain(s.named_buffers()))
                    .collect();
                write(d, &tensors).map_err(|e| {
                    PipelineError::Config(format!("writing device {d}'s part: {e}"))
                })?;
            }
            Ok(())
        });
        self.agree(k, local)?;
        let finished = if self.rank() == 0 {
            finish().map_err(PipelineError::Config)
        } else {
            Ok(())
        };
        self.agree(k, finished)
    }

    /// Every rank's `local` outcome, agreed: an error on any rank fails every rank.
    fn agree(&mut self, k: usize, local: Result<()>) -> Result<()> {
        self.round += 1;
        let agreed = self.comm.agree_ok(
            self.round,
            k,
            local.as_ref().map(|_| ()).map_err(to_pipeline_error),
        );
        local?;
        agreed.map_err(|e| PipelineError::Config(from_pipeline(e)))
    }
}

fn to_pipeline_error(e: &PipelineError) -> PipelineError {
    PipelineError::Config(e.to_string())
}
