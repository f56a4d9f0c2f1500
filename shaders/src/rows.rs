//! The row family: one workgroup per row of a contiguous matrix (`reduce.wgsl` and its mode
//! files, `softmax.wgsl`, `softmax_backward.wgsl`, `layer_norm.wgsl` and its backward,
//! `cross_entropy.wgsl` and its backward).

use crate::ops::ReduceOp;
use crate::render;

use crate::wgsl::{
    CROSS_ENTROPY, CROSS_ENTROPY_BACKWARD, LAYER_NORM, LAYER_NORM_BACKWARD, LAYER_NORM_INPUT,
    LAYER_NORM_RESIDUAL, REDUCE, REDUCE_DIRECT, REDUCE_FINAL, REDUCE_PARTIAL, REDUCE_THIN,
    ROW_TREE, SOFTMAX, SOFTMAX_BACKWARD,
};

/// Which pass of a row reduction a variant is (see `reduce.wgsl`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceMode {
    /// Whole rows: x -> out.
    Direct,
    /// Segments of rows: x -> (values, indices) partials.
    Partial,
    /// The partials of each row: (values, indices) -> out.
    Final,
    /// Whole short rows, one invocation each (`reduce_thin.wgsl`): x -> out.
    Thin,
}

impl ReduceMode {
    pub const ALL: [ReduceMode; 4] = [
        ReduceMode::Direct,
        ReduceMode::Partial,
        ReduceMode::Final,
        ReduceMode::Thin,
    ];
}

pub(crate) fn reduce(op: ReduceOp, mode: ReduceMode, wg: u32) -> String {
    let (identity, combine, result) = op.wgsl();
    // The workgroup tree takes its mode's file; the one-invocation-per-row kernel has none.
    let (template, mode) = match mode {
        ReduceMode::Direct => (REDUCE, REDUCE_DIRECT),
        ReduceMode::Partial => (REDUCE, REDUCE_PARTIAL),
        ReduceMode::Final => (REDUCE, REDUCE_FINAL),
        ReduceMode::Thin => (REDUCE_THIN, ""),
    };
    render(
        template,
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
    let vars = [
        ("WG", wg.to_string()),
        ("LOG", if log { "true" } else { "false" }.to_string()),
    ];
    with_tree(SOFTMAX, &vars)
}

pub(crate) fn softmax_backward(wg: u32) -> String {
    with_tree(SOFTMAX_BACKWARD, &[("WG", wg.to_string())])
}

/// The layer norm; with `residual`, of `x + r`, the sum written out too.
pub(crate) fn layer_norm(wg: u32, residual: bool) -> String {
    let input = if residual {
        LAYER_NORM_RESIDUAL
    } else {
        LAYER_NORM_INPUT
    };
    let vars = [("WG", wg.to_string()), ("INPUT", input.to_string())];
    with_tree(LAYER_NORM, &vars)
}

pub(crate) fn layer_norm_backward(wg: u32) -> String {
    with_tree(LAYER_NORM_BACKWARD, &[("WG", wg.to_string())])
}

pub(crate) fn cross_entropy(wg: u32) -> String {
    with_tree(CROSS_ENTROPY, &[("WG", wg.to_string())])
}

pub(crate) fn cross_entropy_backward(wg: u32) -> String {
    render(CROSS_ENTROPY_BACKWARD, &[("WG", &wg.to_string())])
}

/// `template` after the workgroup tree reductions (`row_tree.wgsl`), both rendered with `vars`.
fn with_tree(template: &str, vars: &[(&str, String)]) -> String {
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let wg = [vars[0]];
    format!("{}\n{}", render(ROW_TREE, &wg), render(template, &vars))
}
