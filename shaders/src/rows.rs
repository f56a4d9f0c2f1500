//! The row family: one workgroup per row of a contiguous matrix (`reduce.wgsl` and its mode
//! files, `softmax.wgsl`, `softmax_backward.wgsl`, `layer_norm.wgsl` and its backward,
//! `cross_entropy.wgsl` and its backward). The kernels with tree reductions take them from
//! `row_tree.wgsl` or, one subgroup per row, `row_subgroup.wgsl` ([`RowGroup`]).

use crate::ops::ReduceOp;
use crate::render;

use crate::wgsl::{
    CROSS_ENTROPY, CROSS_ENTROPY_BACKWARD, LAYER_NORM, LAYER_NORM_BACKWARD, LAYER_NORM_INPUT,
    LAYER_NORM_RESIDUAL, REDUCE, REDUCE_DIRECT, REDUCE_FINAL, REDUCE_PARTIAL, REDUCE_THIN,
    ROW_SUBGROUP, ROW_TREE, SOFTMAX, SOFTMAX_BACKWARD,
};

/// How the workgroup of a row kernel (softmax, layer norm, cross-entropy and their backwards)
/// combines its invocations' partial values: a tree in workgroup memory over `wg` invocations
/// (`row_tree.wgsl`), or, with `subgroup`, the subgroup operations of a workgroup that is one
/// subgroup of `wg` invocations (`row_subgroup.wgsl`: no workgroup memory, no barriers; needs
/// the `SUBGROUP` feature and a fixed subgroup size of `wg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowGroup {
    pub wg: u32,
    pub subgroup: bool,
}

impl RowGroup {
    /// The workgroup-memory tree over `wg` invocations.
    pub const fn tree(wg: u32) -> RowGroup {
        RowGroup {
            wg,
            subgroup: false,
        }
    }

    /// One subgroup of `sg` invocations.
    pub const fn subgroup(sg: u32) -> RowGroup {
        RowGroup {
            wg: sg,
            subgroup: true,
        }
    }
}

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

pub(crate) fn softmax(log: bool, group: RowGroup) -> String {
    let vars = [("LOG", if log { "true" } else { "false" }.to_string())];
    with_group(SOFTMAX, group, &vars)
}

pub(crate) fn softmax_backward(group: RowGroup) -> String {
    with_group(SOFTMAX_BACKWARD, group, &[])
}

/// The layer norm; with `residual`, of `x + r`, the sum written out too.
pub(crate) fn layer_norm(group: RowGroup, residual: bool) -> String {
    let input = if residual {
        LAYER_NORM_RESIDUAL
    } else {
        LAYER_NORM_INPUT
    };
    with_group(LAYER_NORM, group, &[("INPUT", input.to_string())])
}

pub(crate) fn layer_norm_backward(group: RowGroup) -> String {
    with_group(LAYER_NORM_BACKWARD, group, &[])
}

pub(crate) fn cross_entropy(group: RowGroup) -> String {
    with_group(CROSS_ENTROPY, group, &[])
}

pub(crate) fn cross_entropy_backward(wg: u32) -> String {
    render(CROSS_ENTROPY_BACKWARD, &[("WG", &wg.to_string())])
}

/// `template` after the reductions of `group` (`row_tree.wgsl` or `row_subgroup.wgsl`), both
/// rendered with `WG` and `vars`.
fn with_group(template: &str, group: RowGroup, vars: &[(&str, String)]) -> String {
    let wg = group.wg.to_string();
    let mut all: Vec<(&str, &str)> = vec![("WG", wg.as_str())];
    all.extend(vars.iter().map(|(k, v)| (*k, v.as_str())));
    let reductions = if group.subgroup {
        ROW_SUBGROUP
    } else {
        ROW_TREE
    };
    format!(
        "{}\n{}",
        render(reductions, &all[..1]),
        render(template, &all)
    )
}
