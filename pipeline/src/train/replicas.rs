//! What R replicas held in one process share besides the step: replica 0's values copied into
//! the others at build, its buffers after each step, and one report over R x K devices. (The
//! step itself, and the gradient reduction through the step communicator, take the same path
//! whether the replicas run here or on other ranks: see [`crate::train::Pipeline`].)
//!
//! In simulation the all-reduce of each device's gradients is modelled as a ring: it starts
//! when that stage has finished its work on every replica and takes
//! 2(R-1)/R x bytes / bandwidth + 2(R-1) x latency (the ring's 2(R-1) steps each pay the link's
//! latency), so it overlaps the backward of earlier stages, as a bucketed all-reduce would.

use wgpipe_tensor::memory::Tag;

use crate::error::{PipelineError, Result};
use crate::sim::collectives::{concat_timelines, replicated_timeline};
use crate::sim::timeline::{Collective, Timeline};
use crate::sim::Topology;
use crate::train::replica::Replica;
use crate::train::report::{SimReport, StepReport};

/// Copies `from`'s parameter values and buffers into `to` (replica `index`), which must have
/// the same parameters and buffers (names and shapes).
pub(crate) fn copy_values(from: &Replica, to: &Replica, index: usize) -> Result<()> {
    for (what, a, b) in [
        ("parameters", from.named_parameters(), to.named_parameters()),
        ("buffers", from.named_buffers(), to.named_buffers()),
    ] {
        let names = |v: &[(String, wgpipe_autograd::Param)]| -> Vec<(String, Vec<usize>)> {
            v.iter()
                .map(|(n, p)| (n.clone(), p.value().shape().to_vec()))
                .collect()
        };
        if names(&a) != names(&b) {
            return Err(PipelineError::Config(format!(
                "replica {index}: the layer factory made a model whose {what} differ from replica 0's ({:?} vs {:?})",
                names(&b),
                names(&a)
            )));
        }
        for ((_, src), (_, dst)) in a.iter().zip(&b) {
            let device = dst.value().device().clone();
            dst.set_value(
                wgpipe_tensor::memory::with_tag(Tag::Parameters, || src.value().to_device(&device))
                    .map_err(|e| PipelineError::Config(format!("replica {index}: {e}")))?,
            );
        }
    }
    Ok(())
}

/// Buffers (batch-norm statistics) follow replica 0 after a step, as DDP broadcasts them, so
/// that every replica evaluates alike.
pub(crate) fn copy_buffers(from: &Replica, to: &Replica) -> Result<()> {
    for ((_, a), (_, b)) in from.named_buffers().iter().zip(to.named_buffers()) {
        b.set_value(a.value().to_device(b.value().device())?);
    }
    Ok(())
}

/// The replicas' reports as one over R x K devices (replica r's device d is row rK + d), with
/// the all-reduce: measured (`reduce`: start and end on the step's clock) on the wall
/// timeline, ring-modelled on the simulated one.
pub(crate) fn merge_reports(
    links: Option<&Topology>,
    k: usize,
    reports: Vec<StepReport>,
    loss: f32,
    reduce: (f64, f64),
) -> StepReport {
    let r = reports.len();
    let grad_bytes: Vec<u64> = reports[0]
        .stages
        .iter()
        .map(|s| 4 * s.num_params as u64)
        .collect();
    let mut wall_timeline = concat_timelines(reports.iter().map(|rep| &rep.wall_timeline), k);
    wall_timeline.makespan = reduce.1;
    for device in 0..r * k {
        wall_timeline.collectives.push(Collective {
            device,
            start: reduce.0,
            end: reduce.1,
            bytes: grad_bytes[device % k],
            replicas: r,
        });
    }
    let simulated = match (links, reports.iter().all(|rep| rep.simulated.is_some())) {
        (Some(links), true) => {
            let parts: Vec<&Timeline> = reports
                .iter()
                .filter_map(|rep| rep.simulated.as_ref().map(|s| &s.timeline))
                .collect();
            let t = replicated_timeline(&parts, k, &grad_bytes, links);
            Some(SimReport {
                makespan_secs: t.makespan,
                bubble_fraction: t.bubble_fraction(),
                steady_bubble_fraction: t.steady_bubble_fraction(),
                timeline: t,
            })
        }
        _ => None,
    };
    let mut stages = Vec::with_capacity(r * k);
    for (i, rep) in reports.iter().enumerate() {
        for s in &rep.stages {
            let mut s = s.clone();
            s.stage += i * k;
            stages.push(s);
        }
    }
    let first = &reports[0];
    StepReport {
        step: first.step,
        loss,
        num_micro_batches: first.num_micro_batches,
        wall_secs: reduce.1,
        wall_bubble_fraction: wall_timeline.bubble_fraction(),
        wall_timeline,
        stages,
        simulated,
        skipped: None,
        loss_scale: None,
    }
}
