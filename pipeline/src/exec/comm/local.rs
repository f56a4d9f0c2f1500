//! The step communicator of one process: every replica of the job is held here, so agreeing is
//! looking at each replica's result, and the gradient reduction sums on the host.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use wgpipe_autograd::optim::Optimizer;
use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{Device, Tensor};

use crate::error::{PipelineError, Result};
use crate::exec::threads;
use crate::exec::Stage;
use crate::schedule::Schedule;
use crate::sim::collectives::TiedExchange;
use crate::sim::timeline::Collective;

use super::{add_weighted, at_replica, earliest_non_finite, Agreed, ReplicaRun, StepComm};

/// The communicator of a pipeline whose replicas all run in this process.
pub(crate) struct LocalComm;

impl StepComm for LocalComm {
    fn rank(&self) -> usize {
        0
    }

    fn replicas(&self, _k: usize, held: usize) -> (usize, usize) {
        (held, 0)
    }

    fn check(&self, _k: usize) -> Result<()> {
        Ok(())
    }

    fn agree_settings(&self, _settings: &[(String, String)]) -> Result<()> {
        Ok(())
    }

    fn fail_round(&self, _round: u64, _error: &PipelineError) {}

    /// The first failing replica's error (named by replica when there are several), else every
    /// replica's outcomes, the loss weighted by their shares.
    fn agree(
        &self,
        _round: u64,
        _schedule: &Schedule,
        runs: Vec<ReplicaRun<'_>>,
    ) -> Result<Agreed> {
        let r = runs.len();
        let mut outcomes = Vec::with_capacity(r);
        let mut losses = Vec::with_capacity(r);
        let mut weights = Vec::with_capacity(r);
        let mut failure = None;
        for (i, run) in runs.into_iter().enumerate() {
            match run.outcome {
                Ok(o) => outcomes.push(o),
                Err(e) if failure.is_none() => failure = Some(at_replica(e, i, r)),
                Err(_) => {}
            }
            let mut loss = 0.0f32;
            for t in &run.losses {
                loss += t.to_scalar()?;
            }
            losses.push(loss);
            weights.push(run.weight);
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let loss = if r == 1 {
            losses[0]
        } else {
            losses.iter().zip(&weights).map(|(l, w)| l * w).sum()
        };
        let skipped = earliest_non_finite(outcomes.iter().flatten());
        Ok(Agreed {
            outcomes,
            loss,
            memory: None,
            skipped,
        })
    }

    fn exchange_tied(
        &self,
        _round: u64,
        _schedule: &Schedule,
        _stages: &[Stage],
        _clock: Instant,
    ) -> Result<Vec<TiedExchange>> {
        Ok(Vec::new())
    }

    /// Each parameter's gradient summed on the host in replica order, then set on every
    /// replica (a replica without a gradient for it counts as zero). Every new tensor is built
    /// before any is set, so an error (or a panic) changes nothing.
    fn reduce_gradients(
        &self,
        _round: u64,
        _schedule: &Schedule,
        held: &[&[Stage]],
        weights: &[f32],
    ) -> Result<Vec<Collective>> {
        if held.len() < 2 {
            return Ok(Vec::new());
        }
        catch_unwind(AssertUnwindSafe(|| average(held, weights)))
            .unwrap_or_else(|p| {
                Err(PipelineError::Config(format!(
                    "the gradient all-reduce panicked: {}",
                    threads::panic_message(p)
                )))
            })
            .map(|()| Vec::new())
    }

    fn stage_parts(&self, _round: u64, _schedule: &Schedule, mine: Vec<f64>) -> Result<Vec<f64>> {
        Ok(mine)
    }

    fn agree_ok(&self, _round: u64, _k: usize, local: Result<()>) -> Result<()> {
        local
    }

    fn share_output(
        &self,
        _round: u64,
        schedule: &Schedule,
        kept: Option<Tensor>,
    ) -> Result<Tensor> {
        kept.ok_or_else(|| {
            PipelineError::Config(format!(
                "a forward-only round of '{}' ended without the last stage's output",
                schedule.name
            ))
        })
    }

    fn gather_stages(
        &self,
        _round: u64,
        _schedule: &Schedule,
        _stages: &[Stage],
        _optimizers: &mut [Box<dyn Optimizer>],
    ) -> Result<()> {
        Ok(())
    }
}

/// [`LocalComm::reduce_gradients`] itself.
fn average(held: &[&[Stage]], weights: &[f32]) -> Result<()> {
    let _tag = TagGuard::new(Tag::Gradients);
    let lists: Vec<Vec<_>> = held
        .iter()
        .map(|stages| stages.iter().flat_map(|s| s.named_parameters()).collect())
        .collect();
    for i in 0..lists[0].len() {
        let mut sum = None;
        for (list, &w) in lists.iter().zip(weights) {
            let Some(g) = list[i].1.grad() else { continue };
            add_weighted(&mut sum, &g.to_vec()?, w);
        }
        let Some(sum) = sum else { continue };
        let shape = lists[0][i].1.value().shape().to_vec();
        let per_replica = lists
            .iter()
            .map(|list| {
                let device: Device = list[i].1.value().device().clone();
                Tensor::from_slice(&sum, &shape, &device)
            })
            .collect::<wgpipe_tensor::Result<Vec<_>>>()?;
        for (list, g) in lists.iter().zip(per_replica) {
            list[i].1.set_grad(Some(g));
        }
    }
    Ok(())
}
