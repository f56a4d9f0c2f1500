//! The per-layer profile the planner's cost model runs on: FLOPs and bytes of every layer,
//! measured by a dry run of small micro-batches on a device of the same backend (its FLOP
//! counter and memory accounting), never estimated from shapes.
//!
//! Each quantity is measured at two micro-batch sizes b and 2b and kept as an affine function
//! of the micro-batch size (`fixed + per_sample · b`): FLOPs and activation bytes grow with the
//! samples, while some parts do not (the addition that accumulates a later micro-batch's
//! parameter gradient, per-call scalars). Layers run one at a time, each on the output of the
//! one before, so a model that does not fit anywhere whole can still be profiled.
//!
//! Where asked ([`profile_layers_timed`]), each layer's forward, full backward and the two
//! parts of a split backward (and the loss) are also timed on the profiling device, a few
//! repetitions each, median: [`Profile::with_measured_times`] then plans with those times
//! instead of FLOPs over a rate (real devices, whose rates nobody gave). The repetitions run in
//! rounds over all the layers (each layer's input is kept until they are done), so that a burst
//! of other work on a shared machine falls on one repetition of several layers, which the
//! medians drop, rather than on every repetition of one layer.

use wgpipe_autograd::{Module, SkipEdge};

use crate::error::{PipelineError, Result};

mod dry_run;
mod measure;

pub use dry_run::{profile_layers, profile_layers_timed, ProfileRun};

/// `fixed + per_sample · b` for a micro-batch of b samples.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Affine {
    pub fixed: f64,
    pub per_sample: f64,
}

impl Affine {
    /// The value at `b` samples (never negative: a fit through two noisy-free points can still
    /// give a slightly negative intercept for quantities that are zero at b = 0).
    pub fn at(&self, b: usize) -> f64 {
        (self.fixed + self.per_sample * b as f64).max(0.0)
    }
    /// Bytes at `b` samples, rounded up.
    pub fn bytes(&self, b: usize) -> u64 {
        self.at(b).ceil() as u64
    }
    /// The line through `(b1, v1)` and `(b2, v2)`, `b1 < b2`.
    fn fit(b1: usize, v1: f64, b2: usize, v2: f64) -> Affine {
        let per_sample = (v2 - v1) / (b2 - b1) as f64;
        Affine {
            fixed: v1 - per_sample * b1 as f64,
            per_sample,
        }
    }
}

/// What one layer costs. FLOPs are those the device counts; bytes those its accounting sees.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerProfile {
    pub name: String,
    /// Forward (recorded or not: the same arithmetic).
    pub forward_flops: Affine,
    /// Full backward of a micro-batch whose parameter gradients add to earlier ones.
    pub backward_flops: Affine,
    /// The input part of a split backward.
    pub backward_input_flops: Affine,
    /// The weight part of a split backward (adding to earlier gradients).
    pub backward_weight_flops: Affine,
    /// FLOPs of adding a micro-batch's parameter gradients to the accumulated ones: the first
    /// backward of a step stores them instead.
    pub accumulate_flops: f64,
    /// Backward FLOPs when the layer's input needs no gradient (the model's first layers, before
    /// any parameter, on stage 0 whose input is data).
    pub backward_flops_from_data: Affine,
    /// The input part of a split backward when the input needs no gradient.
    pub backward_input_flops_from_data: Affine,
    pub param_bytes: u64,
    /// The accumulated parameter gradients.
    pub grad_bytes: u64,
    /// Optimizer state after a step (momentum, Adam moments, counters).
    pub optimizer_state_bytes: u64,
    /// Peak bytes an optimizer step adds above parameters, gradients and state (the values and
    /// state kept to undo it, the new values).
    pub optimizer_step_bytes: u64,
    /// Bytes a recorded forward keeps until its backward (saved tensors and the output).
    pub stash_bytes: Affine,
    /// Peak above the stash while a recorded forward runs (temporaries).
    pub forward_extra_bytes: Affine,
    /// Peak of a forward that records nothing, above what was live before it (output included).
    pub no_grad_peak_bytes: Affine,
    /// What a forward leaves behind until the end of the step when its output and tape are
    /// gone (batch norm's statistics, applied by `finish_step`).
    pub forward_residue_bytes: Affine,
    /// Peak of a full backward above what was live before it (stash and output gradient
    /// included there): input gradient, parameter-gradient temporaries and sums.
    pub backward_extra_bytes: Affine,
    /// The same for the input part of a split backward.
    pub backward_input_extra_bytes: Affine,
    /// What the input part keeps for the weight part.
    pub weight_keep_bytes: Affine,
    /// Peak of the weight part above what was live before it.
    pub backward_weight_extra_bytes: Affine,
    /// The output tensor (what goes to the next stage).
    pub output_bytes: Affine,
    /// Measured seconds (zero when not timed): recorded forward, full backward adding to the
    /// gradients, and the input and weight parts of a split backward.
    pub forward_secs: Affine,
    pub backward_secs: Affine,
    pub backward_input_secs: Affine,
    pub backward_weight_secs: Affine,
}

/// The loss on the last stage's device: FLOPs of the loss and its gradient, and its bytes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LossProfile {
    pub flops: Affine,
    /// Peak while the loss and its gradient run, above what was live before (the target copy
    /// and the gradient of the output included).
    pub peak_bytes: Affine,
    /// What stays for the rest of the step (the loss value).
    pub kept_bytes: Affine,
    /// Measured seconds of the loss and its gradient (zero when not timed).
    pub secs: Affine,
}

/// A skip: its producer and consumer layers and the bytes of its stashed tensor (what crosses
/// the skip's link and what the consumer's stage holds until its backward).
#[derive(Debug, Clone, PartialEq)]
pub struct SkipProfile {
    pub edge: SkipEdge,
    pub bytes: Affine,
}

/// Every layer's profile, the loss's, the model's input bytes and its skips.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Profile {
    pub layers: Vec<LayerProfile>,
    /// In [`wgpipe_autograd::resolve_skips`]' order (so [`crate::skips::skip_links`] numbers
    /// their links as the builder does).
    pub skips: Vec<SkipProfile>,
    pub loss: LossProfile,
    pub input_bytes: Affine,
    /// Index of the first layer with trainable parameters: on stage 0, where the input is data,
    /// it and the layers before it compute no input gradient.
    pub first_trainable: usize,
    /// The smaller micro-batch size profiled (the other is twice it).
    pub profiled_at: usize,
    /// Repetitions each time was measured with (median); 0: not timed.
    pub timed_reps: usize,
    /// The device the times were measured on.
    pub timed_on: String,
    /// Tied parameters whose copies sit in more than one layer: after each step the stages
    /// holding them exchange gradients (priced as the simulated cluster prices it).
    pub ties: Vec<TieProfile>,
}

/// One tie group: the layers holding a copy (ascending) and the bytes of its gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct TieProfile {
    pub layers: Vec<usize>,
    pub bytes: u64,
}

/// The tie groups of `layers` with copies in more than one layer.
fn tie_profiles(layers: &[Box<dyn Module>]) -> Vec<TieProfile> {
    let mut params = Vec::new();
    let mut owner = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        for (n, p) in l.parameters() {
            params.push((n, p));
            owner.push(i);
        }
    }
    wgpipe_autograd::tied_groups(&params)
        .into_iter()
        .filter_map(|(_, idx)| {
            let mut holders: Vec<usize> = idx.iter().map(|&i| owner[i]).collect();
            holders.dedup();
            let bytes = (params[idx[0]].1.value().numel() * 4) as u64;
            (holders.len() > 1).then_some(TieProfile {
                layers: holders,
                bytes,
            })
        })
        .collect()
}

impl Profile {
    /// This profile with measured seconds in place of FLOPs, as FLOPs at `rate` per second
    /// (seconds x rate), so that the cost model, whose simulator divides FLOPs by each device's
    /// rate, predicts the measured times on devices of that rate. What was not timed alone
    /// (the addition into accumulated gradients, the backwards of stage 0's first layers whose
    /// input is data) keeps its FLOP share of the full backward it is part of.
    pub fn with_measured_times(&self, rate: f64) -> Result<Profile> {
        if self.timed_reps == 0 {
            return Err(PipelineError::Config(
                "the profile has no measured times (profile with profile_layers_timed)".into(),
            ));
        }
        let (b1, b2) = (self.profiled_at, 2 * self.profiled_at);
        let secs = |a: Affine| Affine {
            fixed: a.fixed * rate,
            per_sample: a.per_sample * rate,
        };
        // `of` scaled at each profiled size as `flops` is to `time` there.
        let like = |of: Affine, flops: Affine, time: Affine| {
            let at = |b: usize| {
                let f = flops.at(b);
                if f > 0.0 {
                    of.at(b) * time.at(b) * rate / f
                } else {
                    0.0
                }
            };
            Affine::fit(b1, at(b1), b2, at(b2))
        };
        let mut out = self.clone();
        for l in &mut out.layers {
            let full = l.backward_flops;
            let ratio = if full.at(b2) > 0.0 {
                l.backward_secs.at(b2) * rate / full.at(b2)
            } else {
                0.0
            };
            l.accumulate_flops *= ratio;
            l.backward_flops_from_data = like(l.backward_flops_from_data, full, l.backward_secs);
            l.backward_input_flops_from_data = like(
                l.backward_input_flops_from_data,
                l.backward_input_flops,
                l.backward_input_secs,
            );
            l.forward_flops = secs(l.forward_secs);
            l.backward_flops = secs(l.backward_secs);
            l.backward_input_flops = secs(l.backward_input_secs);
            l.backward_weight_flops = secs(l.backward_weight_secs);
        }
        out.loss.flops = secs(self.loss.secs);
        Ok(out)
    }

    /// Bytes of stage input `s` for a micro-batch of `b`: the model input or the output of the
    /// layer before `first_layer`.
    pub fn input_bytes_of(&self, first_layer: usize, b: usize) -> u64 {
        if first_layer == 0 {
            self.input_bytes.bytes(b)
        } else {
            self.layers[first_layer - 1].output_bytes.bytes(b)
        }
    }
}
