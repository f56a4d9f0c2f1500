//! Data parallelism in one process: R pipelines (replicas), each on its own K devices, train on
//! disjoint shards of every mini-batch; each parameter's gradients are averaged across the
//! replicas in a fixed order (replica 0, 1, ...) on the host, and the one result is given to
//! every replica, so that every replica's optimizer sees bit-identical gradients and the
//! parameters stay bit-identical.
//!
//! In simulation the all-reduce of each device's gradients is modelled as a ring: it starts
//! when that stage has finished its work on every replica and takes
//! 2(R-1)/R x bytes / bandwidth + 2(R-1) x latency (the ring's 2(R-1) steps each pay the link's
//! latency), so it overlaps the backward of earlier stages, as a bucketed all-reduce would.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use wgpipe_tensor::memory::{Tag, TagGuard};
use wgpipe_tensor::{Device, Tensor};

use crate::error::{PipelineError, Result};
use crate::exec::threads;
use crate::microbatch::split_batch;
use crate::sim::collectives::{concat_timelines, replicated_timeline};
use crate::sim::timeline::{Collective, Timeline};
use crate::train::pipeline::{Pipeline, Saved};
use crate::train::report::{SimReport, StepReport};
use crate::LossFn;

/// Copies `from`'s parameter values and buffers into `to` (replica `index`), which must have
/// the same parameters and buffers (names and shapes).
pub(crate) fn copy_values(from: &Pipeline, to: &Pipeline, index: usize) -> Result<()> {
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

/// One data-parallel training step of `pipe` (replica 0, holding the others): shards, the
/// replicas' steps in parallel, the gradient average, and one report over R x K devices. All
/// or nothing: when any replica fails (or skips the step) every replica's gradients and
/// buffers are put back as before the call.
pub(crate) fn train_step(
    pipe: &mut Pipeline,
    inputs: &Tensor,
    targets: &Tensor,
    loss_fn: &LossFn,
) -> Result<StepReport> {
    pipe.settle()?;
    let r = 1 + pipe.replicas.len();
    let n = inputs.shape().first().copied().unwrap_or(0);
    if n < r || targets.shape().first() != Some(&n) {
        return Err(PipelineError::Config(format!(
            "a mini-batch of inputs {:?} and targets {:?} cannot be shared by {r} replicas (each needs at least one sample, and inputs and targets the same number)",
            inputs.shape(),
            targets.shape()
        )));
    }
    let xs = split_batch("inputs", inputs, r)?;
    let ys = split_batch("targets", targets, r)?;
    let weights: Vec<f32> = xs.iter().map(|x| x.shape()[0] as f32 / n as f32).collect();

    let mut others = std::mem::take(&mut pipe.replicas);
    let clock = Instant::now();
    let results = {
        let mut all: Vec<&mut Pipeline> = std::iter::once(&mut *pipe)
            .chain(others.iter_mut())
            .collect();
        let saved: Vec<Saved> = all.iter().map(|p| Saved::take(p)).collect();
        let reports = run_replicas(&mut all, &xs, &ys, loss_fn);
        finish(&all, saved, reports, &weights, clock)
    };
    pipe.replicas = others;
    results
}

/// Runs every replica's own step on a thread of its own.
fn run_replicas(
    all: &mut [&mut Pipeline],
    xs: &[Tensor],
    ys: &[Tensor],
    loss_fn: &LossFn,
) -> Vec<Result<StepReport>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = all
            .iter_mut()
            .zip(xs.iter().zip(ys))
            .map(|(p, (x, y))| scope.spawn(move || p.train_step_one(x, y, loss_fn)))
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| {
                h.join().unwrap_or_else(|payload| {
                    Err(PipelineError::Config(format!(
                        "replica {i}: its step panicked: {}",
                        threads::panic_message(payload)
                    )))
                })
            })
            .collect()
    })
}

/// After the replicas' steps: on any failure or skip, every replica back as before; else the
/// gradient average and the merged report.
fn finish(
    all: &[&mut Pipeline],
    saved: Vec<Saved>,
    reports: Vec<Result<StepReport>>,
    weights: &[f32],
    clock: Instant,
) -> Result<StepReport> {
    let restore_all = |saved: Vec<Saved>| {
        for (p, s) in all.iter().zip(saved) {
            s.restore(&p.stages);
        }
    };
    let mut ok = Vec::with_capacity(reports.len());
    let mut failure = None;
    for (i, r) in reports.into_iter().enumerate() {
        match r {
            Ok(rep) => ok.push(rep),
            Err(e) if failure.is_none() => {
                failure = Some(e.at(&format!(", replica {i} of {}", all.len())))
            }
            Err(_) => {}
        }
    }
    if let Some(e) = failure {
        restore_all(saved);
        return Err(e);
    }
    let skipped = ok
        .iter()
        .filter_map(|r| r.skipped.clone())
        .min_by_key(|at| (at.micro_batch, at.stage));
    let reduce_start = clock.elapsed().as_secs_f64();
    if skipped.is_some() {
        restore_all(saved);
    } else {
        let reduced = catch_unwind(AssertUnwindSafe(|| average_gradients(all, weights)))
            .unwrap_or_else(|p| {
                Err(PipelineError::Config(format!(
                    "the gradient all-reduce panicked: {}",
                    threads::panic_message(p)
                )))
            });
        if let Err(e) = reduced {
            restore_all(saved);
            return Err(e);
        }
        // Buffers (batch-norm statistics) follow replica 0, as DDP broadcasts them, so that
        // every replica evaluates alike.
        for p in &all[1..] {
            copy_buffers(all[0], p)?;
        }
    }
    let wall = clock.elapsed().as_secs_f64();
    let mut report = merge_reports(all, ok, weights, (reduce_start, wall));
    report.skipped = skipped;
    Ok(report)
}

/// Each parameter's gradient: Σ_r weight_r x gradient_r, summed on the host in replica order,
/// then set on every replica (a replica without a gradient for it counts as zero).
fn average_gradients(all: &[&mut Pipeline], weights: &[f32]) -> Result<()> {
    let _tag = TagGuard::new(Tag::Gradients);
    let lists: Vec<_> = all.iter().map(|p| p.named_parameters()).collect();
    for i in 0..lists[0].len() {
        let mut sum: Option<Vec<f32>> = None;
        for (list, &w) in lists.iter().zip(weights) {
            let Some(g) = list[i].1.grad() else { continue };
            let g = g.to_vec()?;
            match &mut sum {
                None => sum = Some(g.iter().map(|v| v * w).collect()),
                Some(acc) => {
                    for (a, v) in acc.iter_mut().zip(&g) {
                        *a += v * w;
                    }
                }
            }
        }
        let Some(sum) = sum else { continue };
        let shape = lists[0][i].1.value().shape().to_vec();
        // Every new tensor is built before any is set, so an error changes nothing here.
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

fn copy_buffers(from: &Pipeline, to: &Pipeline) -> Result<()> {
    for ((_, a), (_, b)) in from.named_buffers().iter().zip(to.named_buffers()) {
        b.set_value(a.value().to_device(b.value().device())?);
    }
    Ok(())
}

/// The replicas' reports as one over R x K devices (replica r's device d is row rK + d), with
/// the all-reduce: measured (`reduce`: start and end on the step's clock) on the wall
/// timeline, ring-modelled on the simulated one.
fn merge_reports(
    all: &[&mut Pipeline],
    reports: Vec<StepReport>,
    weights: &[f32],
    reduce: (f64, f64),
) -> StepReport {
    let r = reports.len();
    let k = all[0].num_devices();
    let loss = reports
        .iter()
        .zip(weights)
        .map(|(rep, w)| rep.loss * w)
        .sum();
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
    let simulated = match (
        &all[0].sim,
        reports.iter().all(|rep| rep.simulated.is_some()),
    ) {
        (Some(cluster), true) => {
            let parts: Vec<&Timeline> = reports
                .iter()
                .filter_map(|rep| rep.simulated.as_ref().map(|s| &s.timeline))
                .collect();
            let t = replicated_timeline(&parts, k, &grad_bytes, &cluster.link());
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
