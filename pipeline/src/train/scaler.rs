//! Dynamic loss scaling with torch's `GradScaler` semantics, for training in half precision.
//!
//! The backward of every micro-batch is seeded with `scale` instead of 1, so that small
//! gradients stay representable in f16. A step whose values overflowed is found by the
//! pipeline's own non-finite checks (`NonFinite::SkipStep`): each stage's verdict travels on the
//! messages that already flow toward stage 0 and on the outcome each device reports at the end
//! of the step, so no collective and no extra message are added. The scaler only keeps the
//! scale: halve it (and skip the optimizer step) after an overflow, double it after
//! `growth_interval` good optimizer steps in a row.

use crate::error::{PipelineError, Result};

/// How the loss scale moves (torch's defaults: 2^16, x2 every 2000 good steps, x0.5 on overflow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaling {
    /// The scale of the first step.
    pub init_scale: f32,
    /// Factor applied after `growth_interval` good steps in a row (> 1).
    pub growth_factor: f32,
    /// Factor applied after a step that overflowed (in (0, 1)).
    pub backoff_factor: f32,
    /// Good optimizer steps in a row before the scale grows (>= 1).
    pub growth_interval: u32,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl LossScaling {
    /// A clear error naming the field out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str| Err(PipelineError::Config(format!("loss scaling: {what}")));
        if !(self.init_scale.is_finite() && self.init_scale > 0.0) {
            return bad(&format!(
                "init_scale must be finite and > 0, got {}",
                self.init_scale
            ));
        }
        if !(self.growth_factor.is_finite() && self.growth_factor > 1.0) {
            return bad(&format!(
                "growth_factor must be finite and > 1, got {}",
                self.growth_factor
            ));
        }
        if !(self.backoff_factor > 0.0 && self.backoff_factor < 1.0) {
            return bad(&format!(
                "backoff_factor must be in (0, 1), got {}",
                self.backoff_factor
            ));
        }
        if self.growth_interval == 0 {
            return bad("growth_interval must be at least 1");
        }
        Ok(())
    }
}

/// Where the scaler stands (for reports and logs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScalerState {
    /// The scale the next step's backward is seeded with.
    pub scale: f32,
    /// Good optimizer steps since the scale last changed.
    pub good_steps: u32,
    /// Optimizer steps skipped because a value overflowed, since the start.
    pub skipped_steps: u64,
}

/// The scaler of a pipeline: its rule and its state.
#[derive(Debug, Clone)]
pub(crate) struct GradScaler {
    pub config: LossScaling,
    pub state: ScalerState,
}

impl GradScaler {
    pub fn new(config: LossScaling) -> Result<GradScaler> {
        config.validate()?;
        Ok(GradScaler {
            config,
            state: ScalerState {
                scale: config.init_scale,
                good_steps: 0,
                skipped_steps: 0,
            },
        })
    }

    /// After an optimizer step that was skipped because a value overflowed.
    pub fn overflowed(&mut self) {
        let s = &mut self.state;
        // Never down to 0: a subnormal scale still seeds a non-zero backward.
        s.scale = (s.scale * self.config.backoff_factor).max(f32::MIN_POSITIVE);
        s.good_steps = 0;
        s.skipped_steps += 1;
    }

    /// After an optimizer step that was applied.
    pub fn stepped(&mut self) {
        let s = &mut self.state;
        s.good_steps += 1;
        if s.good_steps >= self.config.growth_interval {
            let grown = s.scale * self.config.growth_factor;
            // torch keeps the old scale when growing would overflow f32.
            if grown.is_finite() {
                s.scale = grown;
            }
            s.good_steps = 0;
        }
    }
}

/// The state as checkpoint metadata: `"scale good_steps skipped_steps"` (Rust prints an f32
/// so that it reads back to the same bits).
pub(crate) fn encode_state(s: &ScalerState) -> String {
    format!("{} {} {}", s.scale, s.good_steps, s.skipped_steps)
}

/// The inverse of [`encode_state`]; `None` when the text is not one.
pub(crate) fn decode_state(text: &str) -> Option<ScalerState> {
    let mut parts = text.split(' ');
    let scale: f32 = parts.next()?.parse().ok()?;
    let state = ScalerState {
        scale: (scale.is_finite() && scale > 0.0).then_some(scale)?,
        good_steps: parts.next()?.parse().ok()?,
        skipped_steps: parts.next()?.parse().ok()?,
    };
    parts.next().is_none().then_some(state)
}

/// The scaling a pipeline in `precision` gets unless told otherwise: on for f16 (whose range
/// is what underflows), off for bf16 (f32's range) and f32, as torch's autocast.
pub fn default_for(precision: wgpipe_tensor::DType) -> Option<LossScaling> {
    (precision == wgpipe_tensor::DType::F16).then(LossScaling::default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> LossScaling {
        LossScaling {
            init_scale: 8.0,
            growth_interval: 3,
            ..LossScaling::default()
        }
    }

    #[test]
    fn backs_off_on_overflow_and_grows_after_the_interval() {
        let mut s = GradScaler::new(small()).unwrap();
        s.stepped();
        s.stepped();
        assert_eq!((s.state.scale, s.state.good_steps), (8.0, 2));
        s.overflowed();
        assert_eq!((s.state.scale, s.state.good_steps), (4.0, 0));
        assert_eq!(s.state.skipped_steps, 1);
        for _ in 0..3 {
            s.stepped();
        }
        assert_eq!((s.state.scale, s.state.good_steps), (8.0, 0));
    }

    #[test]
    fn growth_stops_short_of_infinity() {
        let mut s = GradScaler::new(LossScaling {
            init_scale: f32::MAX / 1.5,
            growth_interval: 1,
            ..LossScaling::default()
        })
        .unwrap();
        s.stepped();
        assert_eq!(s.state.scale, f32::MAX / 1.5);
    }

    #[test]
    fn bad_settings_name_the_field() {
        for (cfg, field) in [
            (
                LossScaling {
                    init_scale: 0.0,
                    ..small()
                },
                "init_scale",
            ),
            (
                LossScaling {
                    growth_factor: 1.0,
                    ..small()
                },
                "growth_factor",
            ),
            (
                LossScaling {
                    backoff_factor: 1.0,
                    ..small()
                },
                "backoff_factor",
            ),
            (
                LossScaling {
                    growth_interval: 0,
                    ..small()
                },
                "growth_interval",
            ),
        ] {
            let e = GradScaler::new(cfg).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn the_state_reads_back_exactly() {
        let s = ScalerState {
            scale: 65536.0 * 0.5f32.powi(30),
            good_steps: 17,
            skipped_steps: 3,
        };
        assert_eq!(decode_state(&encode_state(&s)), Some(s));
        for bad in ["", "1 2", "x 1 2", "0 1 2", "inf 1 2", "1 2 3 4"] {
            assert_eq!(decode_state(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn on_by_default_for_f16_only() {
        use wgpipe_tensor::DType;
        assert!(default_for(DType::F16).is_some());
        assert!(default_for(DType::BF16).is_none());
        assert!(default_for(DType::F32).is_none());
    }
}
