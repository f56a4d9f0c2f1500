//! The row family: one workgroup per row of a contiguous matrix (`reduce.wgsl` and its mode
//! files, `softmax.wgsl`, `layer_norm.wgsl`).

use crate::ops::ReduceOp;
use crate::render;

const REDUCE: &str = include_str!("reduce.wgsl");
const REDUCE_DIRECT: &str = include_str!("reduce_direct.wgsl");
const REDUCE_PARTIAL: &str = include_str!("reduce_partial.wgsl");
const REDUCE_FINAL: &str = include_str!("reduce_final.wgsl");
const SOFTMAX: &str = include_str!("softmax.wgsl");
const LAYER_NORM: &str = include_str!("layer_norm.wgsl");

/// Which pass of a row reduction a variant is (see `reduce.wgsl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceMode {
    /// Whole rows: x -> out.
    Direct,
    /// Segments of rows: x -> (values, indices) partials.
    Partial,
    /// The partials of each row: (values, indices) -> out.
    Final,
}

impl ReduceMode {
    pub const ALL: [ReduceMode; 3] = [ReduceMode::Direct, ReduceMode::Partial, ReduceMode::Final];
}

pub(crate) fn reduce(op: ReduceOp, mode: ReduceMode, wg: u32) -> String {
    let (identity, combine, result) = op.wgsl();
    let mode = match mode {
        ReduceMode::Direct => REDUCE_DIRECT,
        ReduceMode::Partial => REDUCE_PARTIAL,
        ReduceMode::Final => REDUCE_FINAL,
    };
    render(
        REDUCE,
        &[
            ("WG", &wg.to_string()),
            ("IDENTITY", identity),
            ("COMBINE", combine),
            ("RESULT", result),
            ("MODE", mode),
        ],
    )
}

pub(crate) fn softmax(log: bool, wg: u32) -> String {
    render(
        SOFTMAX,
        &[
            ("WG", &wg.to_string()),
            ("LOG", if log { "true" } else { "false" }),
        ],
    )
}

pub(crate) fn layer_norm(wg: u32) -> String {
    render(LAYER_NORM, &[("WG", &wg.to_string())])
}
