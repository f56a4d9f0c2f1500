//! The step communicator of one process: every replica of the job is held here, so agreeing is
//! looking at each replica's result, and the gradient reduction sums with tensor ops on GPUs
//! of one backend (on the host otherwise).

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

/// [`LocalComm::reduce_gradients`] itself: each parameter's gradient becomes the weighted sum
/// over the replicas, in replica order, on every replica.
fn average(held: &[&[Stage]], weights: &[f32]) -> Result<()> {
    let _tag = TagGuard::new(Tag::Gradients);
    let lists: Vec<Vec<_>> = held
        .iter()
        .map(|stages| stages.iter().flat_map(|s| s.named_parameters()).collect())
        .collect();
    for i in 0..lists[0].len() {
        let grads: Vec<(Tensor, f32)> = lists
            .iter()
            .zip(weights)
            .filter_map(|(list, &w)| Some((list[i].1.grad()?, w)))
            .collect();
        if grads.is_empty() {
            continue;
        }
        let shape = lists[0][i].1.value().shape().to_vec();
        let sum = if tensor_ops_fit(&grads) {
            sum_with_tensor_ops(&grads)?
        } else {
            sum_on_host(&grads, &shape)?
        };
        for list in &lists {
            let device: Device = list[i].1.value().device().clone();
            list[i].1.set_grad(Some(sum.to_device(&device)?));
        }
    }
    Ok(())
}

/// Whether the replicas' gradients are summed by tensor ops on their devices: f32 on GPUs of
/// one backend (one adapter's queues), whose gradients would otherwise be read back to host
/// memory and written again. Host devices sum on the host: their memory is the host's already,
/// and the vectors there are scratch no device accounts for (a device-side sum would raise
/// the first replica's accounted peak by two gradients).
fn tensor_ops_fit(grads: &[(Tensor, f32)]) -> bool {
    let first = grads[0].0.device();
    first.is_wgpu()
        && grads
            .iter()
            .all(|(g, _)| g.dtype() == wgpipe_tensor::DType::F32 && g.device().same_backend(first))
}

/// `sum_r w_r g_r` by tensor ops on the first gradient's device, with the host sum's
/// arithmetic (each product rounded, then added in replica order; a -0.0 product kept), so
/// that the bits equal [`sum_on_host`]'s (a GPU may flush subnormals to zero).
fn sum_with_tensor_ops(grads: &[(Tensor, f32)]) -> Result<Tensor> {
    let device = grads[0].0.device().clone();
    let mut sum: Option<Tensor> = None;
    for (g, w) in grads {
        let term = g.mul_scalar(*w)?.to_device(&device)?;
        match &mut sum {
            None => sum = Some(term),
            Some(acc) => acc.add_assign(&term)?,
        }
    }
    Ok(sum.expect("at least one gradient"))
}

/// `sum_r w_r g_r` through host vectors, on the first gradient's device.
fn sum_on_host(grads: &[(Tensor, f32)], shape: &[usize]) -> Result<Tensor> {
    let mut sum = None;
    for (g, w) in grads {
        add_weighted(&mut sum, &g.to_vec()?, *w);
    }
    let sum = sum.expect("at least one gradient");
    Ok(Tensor::from_slice(&sum, shape, grads[0].0.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// Gradients of three replicas with signed zeros, subnormals and values whose sum
    /// depends on the order of the additions.
    fn replica_values() -> Vec<(Vec<f32>, f32)> {
        vec![
            (vec![-0.0, 1.0e8, 3.0e-39, -1.5, 0.1, -0.0], 0.25),
            (vec![-0.0, 1.0, -3.0e-39, 2.5, 0.2, 0.0], 0.5),
            (vec![-0.0, -1.0e8, 1.0e-39, 7.0, 0.3, -0.0], 0.25),
        ]
    }

    /// The device-side sum is the host sum, bit for bit (the reference: `add_weighted`, what
    /// the MPI path computes), -0.0 and subnormals included, on the CPU.
    #[test]
    fn the_tensor_op_sum_is_the_host_sum_bit_for_bit() {
        let dev = Device::cpu();
        let grads: Vec<(Tensor, f32)> = replica_values()
            .into_iter()
            .map(|(v, w)| (Tensor::from_vec(v, &[6], &dev).unwrap(), w))
            .collect();
        let on_host = sum_on_host(&grads, &[6]).unwrap();
        let by_ops = sum_with_tensor_ops(&grads).unwrap();
        assert_eq!(bits(&by_ops), bits(&on_host));
        assert_eq!(bits(&on_host)[0], (-0.0f32).to_bits());
        // Host devices keep the host sum.
        assert!(!tensor_ops_fit(&grads));
    }

    /// On a GPU (lavapipe here) gradients are summed there, with the host sum's bits for
    /// normal values.
    #[test]
    fn gpu_replicas_sum_on_the_gpu_with_the_host_sums_bits() {
        let gpu = match std::panic::catch_unwind(Device::test_wgpu) {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => return eprintln!("SKIPPED: no wgpu device to test on: {e}"),
            Err(_) => return eprintln!("SKIPPED: opening the wgpu test device panicked"),
        };
        let grads: Vec<(Tensor, f32)> = replica_values()
            .into_iter()
            .map(|(v, w)| {
                let normal: Vec<f32> = v
                    .iter()
                    .map(|x| if x.abs() < 1e-30 { 0.0 } else { *x })
                    .collect();
                (Tensor::from_vec(normal, &[6], &gpu).unwrap(), w)
            })
            .collect();
        assert!(tensor_ops_fit(&grads));
        let by_ops = sum_with_tensor_ops(&grads).unwrap();
        assert!(by_ops.device().is_wgpu());
        assert_eq!(bits(&by_ops), bits(&sum_on_host(&grads, &[6]).unwrap()));
    }
}
