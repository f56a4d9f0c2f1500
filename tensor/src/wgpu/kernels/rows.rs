//! The row kernels (reductions, softmax, layer norm, cross-entropy: one workgroup per row of a
//! `[rows, cols]` matrix): which workgroup runs them, and the one way they are dispatched.

use wgpipe_shaders::{Kernel, RowGroup, ROW_SUBGROUP_SIZES, ROW_WG_CHOICES};

use super::{all_ok, gpu};
use crate::error::{Error, Result};
use crate::raw::RawTensor;
use crate::wgpu::autotune::row_class;
use crate::wgpu::context::WgpuContext;
use crate::wgpu::runtime::Arg;

impl WgpuContext {
    /// Whether rows of `cols` columns stay within lavapipe's loop limit in the one-workgroup-
    /// per-row kernels of `wg` invocations (softmax, layer norm: three passes over the row per
    /// invocation). Always on hardware adapters.
    fn row_fits(&self, cols: usize, wg: u32) -> bool {
        !self.info.is_software || cols <= 20_000 * wg as usize
    }

    /// An error naming the software adapter when its rows are too long for its own row
    /// workgroup size (see [`Self::row_fits`]).
    fn check_row_len(&self, op: &'static str, cols: usize) -> Result<()> {
        let wg = self.row_wg();
        if !self.row_fits(cols, wg) {
            return Err(Error::invalid(
                op,
                format!(
                    "rows of {cols} columns are longer than the {} this software adapter \
                     ({}) can process per row",
                    20_000 * wg as usize,
                    self.info.name
                ),
            ));
        }
        Ok(())
    }

    /// Runs row kernel `op` as `run(group)`, `group` its workgroup: the one the autotune keeps
    /// for the op's shape class when it is on (each candidate that fits the adapter timed on
    /// first use), else the adapter's own ([`WgpuContext::row_group`]). `subgroups`: whether the
    /// op has one-subgroup variants (those with tree reductions); without, only the size counts.
    pub(super) fn with_row_group<R>(
        &self,
        op: &str,
        [rows, cols]: [usize; 2],
        subgroups: bool,
        run: impl Fn(RowGroup) -> Result<R>,
    ) -> Result<R> {
        let own = match self.row_group() {
            g if g.subgroup && !subgroups => RowGroup::tree(g.wg),
            g => g,
        };
        let Some(tuner) = self.tuner().filter(|_| rows > 0 && cols > 0) else {
            return run(own);
        };
        let candidates = self.row_group_candidates(cols, subgroups);
        if candidates.len() < 2 {
            return run(own);
        }
        let class = row_class(op, rows, cols);
        let group = tuner.choose(&class, &candidates, |g| self.time_op(|| run(g)))?;
        run(group)
    }

    /// The row workgroups the autotune times for rows of `cols` columns: a tree over each size
    /// within the adapter's workgroup limits (and, on a software adapter, its loop limit), and
    /// with `subgroups` one subgroup where the adapter's subgroup size is fixed.
    pub(in crate::wgpu) fn row_group_candidates(
        &self,
        cols: usize,
        subgroups: bool,
    ) -> Vec<RowGroup> {
        let l = &self.limits;
        let fits = |wg: u32| {
            wg <= l.max_compute_invocations_per_workgroup
                && wg <= l.max_compute_workgroup_size_x
                && self.row_fits(cols, wg)
        };
        let trees = ROW_WG_CHOICES
            .into_iter()
            .filter(|&wg| fits(wg))
            .map(RowGroup::tree);
        let subgroup = self
            .subgroup_size
            .filter(|&sg| subgroups && ROW_SUBGROUP_SIZES.contains(&sg) && fits(sg))
            .map(RowGroup::subgroup);
        trees.chain(subgroup).collect()
    }

    /// Runs the one-dispatch row kernel of op `op` over `[rows, cols]`: checks the row length
    /// against the adapter's loop limit, makes `inputs` contiguous, and in the workgroup
    /// [`Self::with_row_group`] picks allocates `outputs` (their shapes), binds the inputs then
    /// the outputs in that order, and dispatches one workgroup per row. `launch` gives the
    /// kernel variant for a workgroup and its parameter words, from the contiguous inputs (their
    /// offsets). Outputs that are all empty have nothing to write: nothing is dispatched.
    pub(super) fn row_kernel<const I: usize, const O: usize>(
        &self,
        op: &'static str,
        [rows, cols]: [usize; 2],
        subgroups: bool,
        inputs: [&RawTensor; I],
        outputs: [&[usize]; O],
        launch: impl Fn(RowGroup, &[RawTensor; I]) -> (Kernel, Vec<u32>),
    ) -> Result<[RawTensor; O]> {
        self.check_row_len(op, cols)?;
        let inputs = all_ok(inputs.map(|x| self.packed(x)))?;
        let mem = inputs[0].memory();
        // `op` is the front-end's name (in errors); the autotune's classes, saved in its cache,
        // spell it with underscores ("layer_norm backward" is "layer_norm_backward").
        let class = op.replace(' ', "_");
        self.with_row_group(&class, [rows, cols], subgroups, |group| {
            let outs = all_ok(outputs.map(|shape| self.empty(mem, shape)))?;
            if outs.iter().any(|y| y.numel() > 0) {
                let (kernel, params) = launch(group, &inputs);
                let args = inputs
                    .iter()
                    .chain(&outs)
                    .map(|t| gpu(t).map(Arg::of))
                    .collect::<Result<Vec<_>>>()?;
                self.dispatch(kernel, &params, &args, rows as u64, 1)?;
            }
            self.check()?;
            Ok(outs)
        })
    }
}
