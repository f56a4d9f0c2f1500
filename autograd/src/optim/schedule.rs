//! Learning-rate schedules.

use super::Optimizer;

/// A learning rate as a function of the step. `step` counts the optimizer steps already taken
/// (`Optimizer::steps()`), so `lr_at(base, step)` is the rate of step number `step + 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// `base_lr` throughout.
    Constant,
    /// Linear warm-up: `base_lr * (step + 1) / warmup_steps` for the first `warmup_steps`
    /// steps (the first step already moves), then `base_lr`.
    LinearWarmup { warmup_steps: u64 },
    /// Linear warm-up as [`LrSchedule::LinearWarmup`], then a half cosine from `base_lr` (at
    /// step `warmup_steps`) down to `min_lr` (at step `total_steps`), then `min_lr`.
    WarmupCosine {
        warmup_steps: u64,
        total_steps: u64,
        min_lr: f32,
    },
}

impl LrSchedule {
    pub fn lr_at(&self, base_lr: f32, step: u64) -> f32 {
        let warm = |w: u64| -> Option<f32> {
            (step < w).then(|| (base_lr as f64 * (step + 1) as f64 / w as f64) as f32)
        };
        match *self {
            LrSchedule::Constant => base_lr,
            LrSchedule::LinearWarmup { warmup_steps } => warm(warmup_steps).unwrap_or(base_lr),
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_lr,
            } => warm(warmup_steps).unwrap_or_else(|| {
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let progress = ((step - warmup_steps) as f64 / span).min(1.0);
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (min_lr as f64 + (base_lr as f64 - min_lr as f64) * cos) as f32
            }),
        }
    }

    /// Sets `opt`'s learning rate for its next step: `lr_at(base_lr, opt.steps())`.
    pub fn apply(&self, opt: &mut dyn Optimizer, base_lr: f32) -> f32 {
        let lr = self.lr_at(base_lr, opt.steps());
        opt.set_lr(lr);
        lr
    }
}
