//! The profile's entry points: the measurements at two micro-batch sizes fitted into a [`Profile`].

use wgpipe_autograd::optim::Optimizer;
use wgpipe_autograd::{resolve_skips, Module};
use wgpipe_tensor::{DType, Device, Tensor};

use crate::error::{PipelineError, Result};
use crate::LossFn;

use super::measure::{bytes_of, optimizer_bytes, run_at, LossPoint, Point, Stashed};
use super::{tie_profiles, Affine, LayerProfile, LossProfile, Profile, SkipProfile};

/// A profile of `layers` by dry runs of micro-batches of `b` and `2b` samples, the first rows of
/// `inputs` and `targets` (which need at least 2b rows), on a fresh virtual device of `on`'s
/// backend. `optimizer` makes the optimizer whose state and step are measured (none: no state).
/// The layers' parameters, gradients and buffers are as before afterwards, and the layers end up
/// on `on`.
pub fn profile_layers(
    layers: &mut [Box<dyn Module>],
    inputs: &Tensor,
    targets: &Tensor,
    loss_fn: &LossFn,
    optimizer: Option<&dyn Fn() -> Box<dyn Optimizer>>,
    on: &Device,
) -> Result<Profile> {
    profile_layers_timed(
        layers,
        inputs,
        targets,
        loss_fn,
        optimizer,
        on,
        ProfileRun::default(),
    )
}

/// How [`profile_layers_timed`] runs the layers.
#[derive(Debug, Clone, Copy)]
pub struct ProfileRun {
    /// Timed repetitions of each measurement (0: FLOPs and bytes only).
    pub reps: usize,
    /// The dtype the layers compute in (the pipeline's precision): half activations make
    /// half stashes and half links in the profile, as in the pipeline.
    pub compute: DType,
}

impl Default for ProfileRun {
    fn default() -> Self {
        ProfileRun {
            reps: 0,
            compute: DType::F32,
        }
    }
}

/// [`profile_layers`] in `run.compute`, and with `run.reps > 0` each layer's and the loss's
/// times too, measured on `on`'s backend (the median of `reps` runs, after the measurements
/// that warm it up).
pub fn profile_layers_timed(
    layers: &mut [Box<dyn Module>],
    inputs: &Tensor,
    targets: &Tensor,
    loss_fn: &LossFn,
    optimizer: Option<&dyn Fn() -> Box<dyn Optimizer>>,
    on: &Device,
    run: ProfileRun,
) -> Result<Profile> {
    let n = inputs.shape().first().copied().unwrap_or(0);
    if n < 2 || targets.shape().first().copied().unwrap_or(0) < 2 {
        return Err(PipelineError::Config(format!(
            "profiling needs a sample of at least 2 rows; inputs {:?}, targets {:?}",
            inputs.shape(),
            targets.shape()
        )));
    }
    let b1 = (n / 2).min(2);
    let edges = resolve_skips(layers).map_err(|e| PipelineError::Config(e.to_string()))?;
    let dev = on.virtual_device("profile", None);
    for (i, l) in layers.iter_mut().enumerate() {
        l.to_device(&dev).map_err(|e| {
            PipelineError::Config(format!("profiling: placing layer {i} ({}): {e}", l.name()))
        })?;
    }
    let first_trainable = layers
        .iter()
        .position(|l| l.parameters().iter().any(|(_, p)| p.is_trainable()))
        .unwrap_or(layers.len());
    let at = |b: usize| -> Result<(Vec<Point>, LossPoint, f64, Stashed)> {
        let x = inputs.narrow(0, 0, b)?.to_device(&dev)?;
        let y = targets.narrow(0, 0, b)?;
        run_at(layers, &x, &y, loss_fn, first_trainable, &dev, run)
    };
    let (small, loss_small, in_small, skips_small) = at(b1)?;
    let (large, loss_large, in_large, skips_large) = at(2 * b1)?;
    let skip_bytes = |stashed: &Stashed, name: &str| {
        stashed
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0.0, |(_, t)| bytes_of(t))
    };
    let skips = edges
        .into_iter()
        .map(|edge| SkipProfile {
            bytes: Affine::fit(
                b1,
                skip_bytes(&skips_small, &edge.name),
                2 * b1,
                skip_bytes(&skips_large, &edge.name),
            ),
            edge,
        })
        .collect();
    let fit =
        |f: &dyn Fn(&Point) -> f64, i: usize| Affine::fit(b1, f(&small[i]), 2 * b1, f(&large[i]));
    let mut out = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let (state, step) = match optimizer {
            Some(make) => optimizer_bytes(l.as_ref(), make().as_mut(), &dev)?,
            None => (0, 0),
        };
        let s = &large[i];
        out.push(LayerProfile {
            name: l.name(),
            forward_flops: fit(&|p| p.forward_flops, i),
            backward_flops: fit(&|p| p.backward_flops, i),
            backward_input_flops: fit(&|p| p.backward_input_flops, i),
            backward_weight_flops: fit(&|p| p.backward_weight_flops, i),
            accumulate_flops: s.accumulate_flops,
            backward_flops_from_data: fit(&|p| p.backward_flops_from_data, i),
            backward_input_flops_from_data: fit(&|p| p.backward_input_flops_from_data, i),
            param_bytes: s.param_bytes,
            grad_bytes: s.grad_bytes,
            optimizer_state_bytes: state,
            optimizer_step_bytes: step,
            stash_bytes: fit(&|p| p.stash, i),
            forward_extra_bytes: fit(&|p| p.forward_extra, i),
            no_grad_peak_bytes: fit(&|p| p.no_grad_peak, i),
            forward_residue_bytes: fit(&|p| p.forward_residue, i),
            backward_extra_bytes: fit(&|p| p.backward_extra, i),
            backward_input_extra_bytes: fit(&|p| p.backward_input_extra, i),
            weight_keep_bytes: fit(&|p| p.weight_keep, i),
            backward_weight_extra_bytes: fit(&|p| p.backward_weight_extra, i),
            output_bytes: fit(&|p| p.output_bytes, i),
            forward_secs: fit(&|p| p.times[0], i),
            backward_secs: fit(&|p| p.times[1], i),
            backward_input_secs: fit(&|p| p.times[2], i),
            backward_weight_secs: fit(&|p| p.times[3], i),
        });
    }
    let loss = LossProfile {
        flops: Affine::fit(b1, loss_small.flops, 2 * b1, loss_large.flops),
        peak_bytes: Affine::fit(b1, loss_small.peak, 2 * b1, loss_large.peak),
        kept_bytes: Affine::fit(b1, loss_small.kept, 2 * b1, loss_large.kept),
        secs: Affine::fit(b1, loss_small.secs, 2 * b1, loss_large.secs),
    };
    Ok(Profile {
        layers: out,
        skips,
        loss,
        input_bytes: Affine::fit(b1, in_small, 2 * b1, in_large),
        first_trainable,
        profiled_at: b1,
        timed_reps: run.reps,
        timed_on: if run.reps > 0 {
            on.name().to_string()
        } else {
            String::new()
        },
        ties: tie_profiles(layers),
    })
}
