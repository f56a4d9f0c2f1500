//! What a schedule is synthesized for (costs, placement, memory cap), and why it may not be.

use super::super::validate::check_counts;
use super::super::{Action, Placement, ScheduleError};
use super::Policy;

/// What one micro-batch costs on one virtual stage, in any unit of time (the same for all).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageCosts {
    pub forward: f64,
    /// The input part of the backward (I; "B" in the zero-bubble papers).
    pub input: f64,
    /// The weight part of the backward (W).
    pub weight: f64,
}

/// What a schedule is synthesized for.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// The device of each virtual stage, in model order (K = `memory_cap.len()` devices).
    pub placement: Vec<usize>,
    pub micro_batches: usize,
    /// One entry per virtual stage.
    pub stages: Vec<StageCosts>,
    /// The time a message between stages on two devices takes (activations forward, gradients
    /// back); a hand-over between stages of one device is free.
    pub transfer: f64,
    /// Per device, the most activations it may hold, in micro-batches of its whole share of
    /// the model (see the module docs); at least 1.
    pub memory_cap: Vec<usize>,
}

impl SynthSpec {
    /// K devices in `placement`, each micro-batch costing `device` per device and split evenly
    /// among a device's chunks (the costs of one stage per device, the same on every device).
    pub fn uniform(
        k: usize,
        placement: Placement,
        micro_batches: usize,
        device: StageCosts,
        transfer: f64,
        memory_cap: usize,
    ) -> SynthSpec {
        let placement = placement.devices(k);
        let v = placement.len() as f64 / k.max(1) as f64;
        let stage = StageCosts {
            forward: device.forward / v,
            input: device.input / v,
            weight: device.weight / v,
        };
        SynthSpec {
            stages: vec![stage; placement.len()],
            placement,
            micro_batches,
            transfer,
            memory_cap: vec![memory_cap; k],
        }
    }

    /// K, the number of devices.
    pub fn num_devices(&self) -> usize {
        self.memory_cap.len()
    }

    /// Chunks (stages) on each device.
    pub fn chunks(&self) -> Vec<usize> {
        let mut c = vec![0; self.num_devices()];
        for &d in &self.placement {
            if let Some(n) = c.get_mut(d) {
                *n += 1;
            }
        }
        c
    }

    /// Per device, the cap in (stage, micro-batch) pairs: the declared in-flight limit of the
    /// schedules it gives.
    pub fn cap_pairs(&self) -> Vec<usize> {
        self.chunks()
            .iter()
            .zip(&self.memory_cap)
            .map(|(v, cap)| v * cap)
            .collect()
    }

    /// Checks sizes, placement, costs and caps; the errors name what is wrong.
    pub fn check(&self) -> Result<(), SynthError> {
        let k = self.num_devices();
        check_counts(k, self.micro_batches)?;
        if self.placement.is_empty() {
            return Err(ScheduleError::NoStages.into());
        }
        if let Some((stage, &device)) = self.placement.iter().enumerate().find(|(_, &d)| d >= k) {
            return Err(ScheduleError::PlacementOutOfRange {
                stage,
                device,
                num_devices: k,
            }
            .into());
        }
        if let Some(device) = (0..k).find(|d| !self.placement.contains(d)) {
            return Err(ScheduleError::IdleDevice { device }.into());
        }
        if self.stages.len() != self.placement.len() {
            return Err(SynthError::CostCount {
                given: self.stages.len(),
                stages: self.placement.len(),
            });
        }
        let bad = |x: f64| !x.is_finite() || x < 0.0;
        for (stage, c) in self.stages.iter().enumerate() {
            for (what, value) in [
                ("forward", c.forward),
                ("input", c.input),
                ("weight", c.weight),
            ] {
                if bad(value) {
                    return Err(SynthError::InvalidCost { stage, what, value });
                }
            }
        }
        if bad(self.transfer) {
            return Err(SynthError::InvalidTransfer {
                value: self.transfer,
            });
        }
        if let Some((device, &cap)) = self.memory_cap.iter().enumerate().find(|(_, &c)| c < 1) {
            return Err(SynthError::CapBelowMinimum {
                device,
                cap,
                minimum: 1,
            });
        }
        Ok(())
    }
}

/// Why no schedule could be synthesized.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error("{given} stage costs were given for {stages} stages")]
    CostCount { given: usize, stages: usize },
    #[error("stage {stage}: its {what} cost is {value}; it must be finite and non-negative")]
    InvalidCost {
        stage: usize,
        what: &'static str,
        value: f64,
    },
    #[error("the transfer time is {value}; it must be finite and non-negative")]
    InvalidTransfer { value: f64 },
    #[error(
        "device {device}: a memory cap of {cap} micro-batches' activations is below the minimum \
         of {minimum} (one micro-batch through all of the device's stages)"
    )]
    CapBelowMinimum {
        device: usize,
        cap: usize,
        minimum: usize,
    },
    #[error("no policy to synthesize with was given")]
    NoPolicies,
    #[error("the simulator refused a synthesized schedule: {0}")]
    Simulation(String),
    #[error("the placer got stuck with policy {policy}: device {device} waits at {action}")]
    Stuck {
        policy: Policy,
        device: usize,
        action: Action,
    },
}
