//! Helpers for a model as a layer sequence (`[Box<dyn Module>]`), run plainly (no pipeline).

use wgpipe_autograd::{layer_param_name, tied_groups, ForwardCtx, Module, Param, SkipRouter, Var};
use wgpipe_tensor::Result;

/// Runs every layer in order; layer `i` sees `ctx.at_layer(i)` (its index in the whole
/// sequence, the same key a pipeline stage gives it, so dropout agrees with pipelined runs).
/// Skips (see [`wgpipe_autograd::skips`]) go by name from the layer that stashes them to the
/// one that pops them: this is the plain reference a pipeline's skip transfers must match.
pub fn forward_all(layers: &[Box<dyn Module>], x: &Var, ctx: &ForwardCtx) -> Result<Var> {
    let mut skips = SkipRouter::new();
    let mut h = x.clone();
    for (i, l) in layers.iter().enumerate() {
        h = skips.forward(l.as_ref(), i, &h, &ctx.at_layer(i as u64))?;
    }
    Ok(h)
}

/// Calls `finish_step` on every layer (once per mini-batch, after all its micro-batches).
pub fn finish_step_all(layers: &[Box<dyn Module>]) -> Result<()> {
    layers.iter().try_for_each(|l| l.finish_step())
}

/// Every parameter, named `"{index}.{name}"` (e.g. `3.attn.q.weight`).
pub fn sequence_parameters(layers: &[Box<dyn Module>]) -> Vec<(String, Param)> {
    prefixed(layers, |l| l.parameters())
}

/// Every buffer, named `"{index}.{name}"` (e.g. `2.bn1.running_mean`).
pub fn sequence_buffers(layers: &[Box<dyn Module>]) -> Vec<(String, Param)> {
    prefixed(layers, |l| l.buffers())
}

fn prefixed(
    layers: &[Box<dyn Module>],
    f: impl Fn(&dyn Module) -> Vec<(String, Param)>,
) -> Vec<(String, Param)> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            f(l.as_ref())
                .into_iter()
                .map(move |(n, p)| (layer_param_name(i, &n), p))
        })
        .collect()
}

/// Number of trainable scalars; tied copies (see [`wgpipe_autograd::tied`]) count once.
pub fn parameter_count(layers: &[Box<dyn Module>]) -> usize {
    let params = sequence_parameters(layers);
    let copies: usize = tied_groups(&params)
        .iter()
        .flat_map(|(_, idx)| idx[1..].iter().map(|&i| params[i].1.value().numel()))
        .sum();
    params
        .iter()
        .map(|(_, p)| p.shape().iter().product::<usize>())
        .sum::<usize>()
        - copies
}
