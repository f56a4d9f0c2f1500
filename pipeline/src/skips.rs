//! Skips of a pipelined model: which stage stashes and which pops each skip that crosses a stage
//! boundary (skips inside one stage stay inside it), as the links of the schedule
//! ([`SkipLink`]) and each stage's view ([`StageSkips`]), routed as [`SkipRoute`] asks.

use std::ops::Range;

use wgpipe_autograd::{resolve_skips, Module, SkipEdge};

use crate::error::{PipelineError, Result};
use crate::schedule::SkipLink;

/// How a skip crossing several stages travels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SkipRoute {
    /// Straight from the producer's stage to the consumer's (torchgpipe's portals): the stages
    /// between hold nothing of it.
    #[default]
    Direct,
    /// Hop by hop through every stage between, each passing it on after its forward and its
    /// gradient back (unchanged) after its backward: only neighbouring stages talk, at the cost
    /// of each stage between holding the skip from its forward to its backward.
    Relay,
}

/// The skips that enter and leave one stage, as (skip link id, skip name), in link-id order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StageSkips {
    /// Popped here, stashed on an earlier stage.
    pub incoming: Vec<(usize, String)>,
    /// Stashed here, popped on a later stage.
    pub outgoing: Vec<(usize, String)>,
}

/// The skips of `layers` cut into stages of `ranges` (global layer indices): the links between
/// stages and each stage's ends. A sequence whose skips do not pair up is a configuration error
/// naming both layers (see [`wgpipe_autograd::SkipError`]).
pub fn plan_skips(
    layers: &[Box<dyn Module>],
    ranges: &[Range<usize>],
    route: SkipRoute,
) -> Result<(Vec<SkipLink>, Vec<StageSkips>)> {
    let edges = resolve_skips(layers).map_err(|e| PipelineError::Config(e.to_string()))?;
    Ok(skip_links(&edges, ranges, route))
}

/// [`plan_skips`] of already paired skips (the planner keeps them in its profile). Relayed, a
/// skip from stage `a` to `b` is one link per hop; each stage between has it both incoming and
/// outgoing under its name, and as no layer there pops it, the stage passes the received value
/// on (see `Stage::run_with_skips`), so its gradient comes back through it unchanged.
pub fn skip_links<'e>(
    edges: impl IntoIterator<Item = &'e SkipEdge>,
    ranges: &[Range<usize>],
    route: SkipRoute,
) -> (Vec<SkipLink>, Vec<StageSkips>) {
    let stage_of = |layer: usize| {
        ranges
            .iter()
            .position(|r| r.contains(&layer))
            .expect("the ranges cover every layer")
    };
    let mut links = Vec::new();
    let mut stages = vec![StageSkips::default(); ranges.len()];
    for e in edges {
        let (from, to) = (stage_of(e.producer), stage_of(e.consumer));
        if from == to {
            continue;
        }
        let hops: Vec<(usize, usize)> = match route {
            SkipRoute::Direct => vec![(from, to)],
            SkipRoute::Relay => (from..to).map(|s| (s, s + 1)).collect(),
        };
        for (from, to) in hops {
            let id = links.len();
            links.push(SkipLink { id, from, to });
            stages[from].outgoing.push((id, e.name.clone()));
            stages[to].incoming.push((id, e.name.clone()));
        }
    }
    (links, stages)
}

/// Bytes of the skips each layer pops, for an input of `input_shape` to the whole sequence (the
/// layers' cost hints give each layer's input shape, [`Module::stash_bytes`] each stash's size).
/// A skip's bytes are held by the consumer's stage (received, or made in the stage itself when
/// both ends are there) until the consumer's backward, so a cost model charges them to the
/// consumer; the stages between hold none.
pub fn popped_bytes(layers: &[Box<dyn Module>], input_shape: &[usize]) -> Result<Vec<usize>> {
    let edges = resolve_skips(layers).map_err(|e| PipelineError::Config(e.to_string()))?;
    let mut shape = input_shape.to_vec();
    let mut stashed: Vec<(String, usize)> = Vec::new();
    for l in layers {
        let names = l.skips().stashes;
        stashed.extend(names.into_iter().zip(l.stash_bytes(&shape)));
        shape = l.cost(&shape).output_shape;
    }
    let mut popped = vec![0; layers.len()];
    for e in edges {
        if let Some((_, b)) = stashed.iter().find(|(n, _)| *n == e.name) {
            popped[e.consumer] += b;
        }
    }
    Ok(popped)
}
