//! The training loop of the examples, and Ctrl-C.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{AppError, AppResult};
use crate::output::progress_bar;
use crate::pipeline::{LossFn, Pipeline, PipelineError, StepReport, StepsOptions, StepsPath};
use crate::tensor::Tensor;

static STOP: AtomicBool = AtomicBool::new(false);

/// Installs a Ctrl-C (SIGINT/SIGTERM) handler that asks the training loop to stop after the
/// current step (it then saves when `--save` is set). A second Ctrl-C exits at once.
pub fn install_ctrl_c() {
    let _ = ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            eprintln!("\ninterrupted again: exiting without saving");
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: stopping after this step (Ctrl-C again to exit at once)");
    });
}

/// The flag Ctrl-C sets: the examples' `run` functions stop after the step during which it
/// was set (their `run_with` variants take another flag, e.g. in tests).
pub fn ctrl_c_flag() -> &'static AtomicBool {
    &STOP
}

/// How [`train_loop`] runs.
pub struct LoopConfig<'a> {
    /// First step (non-zero when resumed) and total steps.
    pub start: u64,
    pub steps: u64,
    pub base_lr: f32,
    pub schedule: crate::autograd::LrSchedule,
    /// Global gradient-norm clip.
    pub clip: Option<f32>,
    pub quiet: bool,
    /// Items (tokens, images) per step, and their name for the rate ("tok", "img").
    pub items_per_step: usize,
    pub unit: &'static str,
    /// Stop after the step during which this became true (Ctrl-C).
    pub stop: &'a AtomicBool,
    /// Stop when this step is reached (`--stop-at`).
    pub stop_at: Option<u64>,
}

/// What [`train_loop`] did.
pub struct LoopResult {
    pub losses: Vec<f32>,
    /// Every step's figures (for `--metrics` and the loss curve).
    pub metrics: Vec<crate::metrics::StepMetrics>,
    pub last_report: Option<StepReport>,
    pub wall_secs: f64,
    pub items_per_sec: f64,
    /// Stopped by Ctrl-C.
    pub interrupted: bool,
    /// How the steps ran: back to back, or one at a time and why (`None` before any ran).
    pub path: Option<StepsPath>,
}

impl LoopResult {
    /// The step after the last one run.
    pub fn end_step(&self, start: u64) -> u64 {
        start + self.losses.len() as u64
    }
    /// Mean of the last `k` losses.
    pub fn tail_loss(&self, k: usize) -> f32 {
        let k = k.min(self.losses.len()).max(1);
        self.losses.iter().rev().take(k).sum::<f32>() / k as f32
    }
}

/// Steps `cfg.start..cfg.steps` through [`Pipeline::train_steps`] (back to back where the
/// pipeline allows it, else one at a time, with the same results): learning rate from the
/// schedule, `train_step` on `batch(step)`, clip, optimizer step; a progress bar (or, with
/// `quiet`, ten log lines) with loss, throughput and bubble. Stops early after the step during
/// which Ctrl-C was pressed.
pub fn train_loop(
    pipe: &mut Pipeline,
    cfg: &LoopConfig<'_>,
    batch: impl FnMut(u64) -> AppResult<(Tensor, Tensor)>,
    loss_fn: &LossFn,
) -> AppResult<LoopResult> {
    train_loop_evaluated(pipe, cfg, None, batch, loss_fn, |_, _| Ok(()))
}

/// [`train_loop`], calling `evaluate(pipe, step)` after every step that is a multiple of
/// `every` (an epoch's end) and after the last step, `step` being the number of steps done.
/// The steps run back to back between evaluations; the evaluation's time is not counted in
/// the throughput. Not called after a step that Ctrl-C or `--stop-at` stopped the loop at.
pub fn train_loop_evaluated(
    pipe: &mut Pipeline,
    cfg: &LoopConfig<'_>,
    every: Option<u64>,
    mut batch: impl FnMut(u64) -> AppResult<(Tensor, Tensor)>,
    loss_fn: &LossFn,
    mut evaluate: impl FnMut(&mut Pipeline, u64) -> AppResult<()>,
) -> AppResult<LoopResult> {
    let pb = progress_bar(cfg.start, cfg.steps, cfg.quiet);
    let mut r = LoopResult {
        losses: Vec::new(),
        metrics: Vec::new(),
        last_report: None,
        wall_secs: 0.0,
        items_per_sec: 0.0,
        interrupted: false,
        path: None,
    };
    let log_every = (cfg.steps / 10).max(1);
    let mut items = 0usize;
    // Training time only: the evaluations between spans are left out.
    let mut trained_secs = 0.0;
    // One learning rate for every stage of every replica (all step together): replicas with
    // their own rates would drift apart. train_steps sets it before each step from the
    // optimizer steps done; the metrics follow the same count (a skipped step does not add).
    let lr = |done: u64| cfg.schedule.lr_at(cfg.base_lr, done);
    let mut done = pipe.optimizers().first().map(|o| o.steps());
    let mut span_start = cfg.start;
    while span_start < cfg.steps && !r.interrupted {
        let span_end = match every {
            Some(e) if e > 0 => ((span_start / e + 1) * e).min(cfg.steps),
            _ => cfg.steps,
        };
        let clock = std::time::Instant::now();
        let opts = StepsOptions {
            steps: span_end - span_start,
            clip: cfg.clip,
            lr: Some(&lr),
            step_at_a_time: false,
        };
        // The batch's own error comes back as it was (train_steps carries it as text).
        let mut batch_error = None;
        let ran = pipe.train_steps(
            &opts,
            |i| {
                batch(span_start + i).map_err(|e| {
                    let msg = e.to_string();
                    batch_error = Some(e);
                    PipelineError::Config(msg)
                })
            },
            loss_fn,
            |report| {
                let step = cfg.start + r.losses.len() as u64;
                items += cfg.items_per_step;
                r.losses.push(report.loss);
                let elapsed = trained_secs + clock.elapsed().as_secs_f64();
                r.metrics.push(crate::metrics::StepMetrics {
                    step,
                    loss: report.loss,
                    items_per_sec: items as f64 / elapsed,
                    bubble: report.bubble_fraction(),
                    lr: done.map_or(cfg.base_lr, lr),
                    loss_scale: report.loss_scale,
                    skipped: report.skipped.is_some(),
                });
                if report.skipped.is_none() {
                    done = done.map(|d| d + 1);
                }
                let msg = step_message(report, items as f64 / elapsed, cfg.unit);
                pb.set_message(msg.clone());
                pb.set_position(step + 1);
                if cfg.quiet && ((step + 1).is_multiple_of(log_every) || step + 1 == cfg.steps) {
                    crate::say!("step {:>5}/{}  {msg}", step + 1, cfg.steps);
                }
                r.last_report = Some(report.clone());
                let why = if cfg.stop.load(Ordering::SeqCst) {
                    Some("Ctrl-C")
                } else if cfg.stop_at == Some(step + 1) && step + 1 < cfg.steps {
                    Some("--stop-at")
                } else {
                    None
                };
                match why {
                    Some(why) => {
                        r.interrupted = true;
                        pb.abandon();
                        eprintln!("stopped by {why} after step {}", step + 1);
                        ControlFlow::Break(())
                    }
                    None => ControlFlow::Continue(()),
                }
            },
        );
        trained_secs += clock.elapsed().as_secs_f64();
        let ran = match (ran, batch_error) {
            (Ok(ran), _) => ran,
            (Err(_), Some(e)) => return Err(e),
            (Err(e), None) => {
                return Err(AppError(format!("{}: {}", e.context(span_start), e.error)));
            }
        };
        r.path = Some(ran.path);
        if !r.interrupted {
            pb.suspend(|| evaluate(pipe, span_end))?;
        }
        span_start = span_end;
    }
    pb.finish();
    if let Some(s) = pipe.loss_scaler() {
        crate::say!(
            "loss scaling ({}): scale {} at the end, {} of {} steps skipped (overflow)",
            pipe.precision().name(),
            s.scale,
            s.skipped_steps,
            r.losses.len()
        );
    }
    r.wall_secs = trained_secs;
    if r.wall_secs > 0.0 {
        r.items_per_sec = items as f64 / r.wall_secs;
    }
    Ok(r)
}

/// The progress line of a step: loss, throughput, bubble, and an overflow skip.
fn step_message(report: &StepReport, rate: f64, unit: &str) -> String {
    let msg = format!(
        "loss {:.3}  {rate:.0} {unit}/s  bubble {:.0}%{}",
        report.loss,
        report.bubble_fraction() * 100.0,
        if report.simulated.is_some() {
            " (simulated)"
        } else {
            " (measured)"
        }
    );
    // With loss scaling an overflowed step is skipped, not an error.
    match (&report.skipped, report.loss_scale) {
        (Some(at), Some(scale)) => format!(
            "{msg}  skipped: overflow at stage {} (scale {scale} halved)",
            at.stage
        ),
        _ => msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::{AdamW, LrSchedule, Module};
    use crate::models::{mse, Linear, Relu};
    use crate::tensor::Device;

    fn mlp() -> Vec<Box<dyn Module>> {
        let cpu = Device::cpu();
        vec![
            Box::new(Linear::new(4, 8, 1, &cpu).unwrap()),
            Box::new(Relu),
            Box::new(Linear::new(8, 4, 2, &cpu).unwrap()),
        ]
    }

    /// The learning-rate schedule reaches every replica's optimizers: replicas trained by the
    /// loop with a warm-up and cosine decay stay bit-identical (they drifted apart when only
    /// replica 0's optimizers followed the schedule).
    #[test]
    fn every_replica_follows_the_learning_rate_schedule() {
        let cpu = Device::cpu();
        let mut pipe = Pipeline::builder(mlp())
            .devices(vec![cpu.clone(); 4])
            .micro_batches(2)
            .replicas(2, mlp)
            .optimizer(|| Box::new(AdamW::new(0.01)))
            .build()
            .unwrap();
        let x = Tensor::rand_normal(&[8, 4], 0.0, 1.0, 3, &cpu).unwrap();
        let y = Tensor::rand_normal(&[8, 4], 0.0, 1.0, 4, &cpu).unwrap();
        let stop = AtomicBool::new(false);
        let cfg = LoopConfig {
            start: 0,
            steps: 5,
            base_lr: 0.01,
            schedule: LrSchedule::WarmupCosine {
                warmup_steps: 2,
                total_steps: 5,
                min_lr: 0.001,
            },
            clip: Some(1.0),
            quiet: true,
            items_per_step: 8,
            unit: "item",
            stop: &stop,
            stop_at: None,
        };
        train_loop(&mut pipe, &cfg, |_| Ok((x.clone(), y.clone())), &mse).unwrap();
        let values = |i: usize| -> Vec<Vec<f32>> {
            pipe.replicas()[i]
                .named_parameters()
                .iter()
                .map(|(_, p)| p.value().to_vec().unwrap())
                .collect()
        };
        assert!(values(0) == values(1), "the replicas differ after 5 steps");
        // And the schedule was followed: the last rate is the cosine's end.
        for r in pipe.replicas() {
            for o in r.optimizers() {
                assert_eq!(o.lr(), cfg.schedule.lr_at(0.01, 4));
            }
        }
    }
}
