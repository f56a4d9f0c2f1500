//! Matmul: the variant for each problem and adapter. GPUs take the workgroup- and
//! register-tiled kernel (`matmul.wgsl`) reading the strided operands directly, with vec4 loads
//! where the layout allows (half operands: scalar loads unpacking two halves per word);
//! CPU-backed adapters (lavapipe) pack both operands and run the subgroup kernel
//! (`matmul_subgroup.wgsl`), which suits how llvmpipe executes shaders.

use wgpipe_shaders::params::{MatmulParams, PackParams, ParamBlock, SubgroupMatmulParams};
use wgpipe_shaders::{HalfFormat, Kernel, MatmulConfig, OperandLoad, SubgroupMatmulConfig};

use super::autotune::{shape_class, MatmulChoice};
use super::context::WgpuContext;
use super::kernels::{gpu, groups_for, u, LOOP_BUDGET};
use super::runtime::Arg;
use crate::backend::{Kernels, MatDims, MatLayout};
use crate::dtype::DType;
use crate::error::Result;
use crate::raw::RawTensor;

/// The most elements of B the subgroup matmul reads in place (1 MiB of f32, about a core's L2):
/// larger ones are packed (see `direct_operands`).
const DIRECT_B_MAX: usize = 1 << 18;

/// Which operands of the subgroup matmul are read where they lie (A, B): row-major f32 ones with
/// k (and B's n) in whole vec4s; B only while it is small: walking down a large B's columns
/// strides a whole row per k, which thrashes the cache where its packed panel streams (at 1024^2
/// the direct read took 2.6x as long as packing and reading the panel on llvmpipe; at 256^2
/// packing cost more than it saved).
pub(super) fn direct_operands(
    (a_dtype, la): (DType, &MatLayout),
    (b_dtype, lb): (DType, &MatLayout),
    d: &MatDims,
) -> (bool, bool) {
    let a4 = |v: usize| v.is_multiple_of(4);
    let vec4_rows = |dtype: DType, l: &MatLayout, cols: usize| {
        dtype == DType::F32
            && l.col_stride == 1
            && a4(d.k)
            && a4(cols)
            && a4(l.row_stride)
            && a4(l.offset)
            && a4(l.batch_stride)
    };
    (
        vec4_rows(a_dtype, la, d.k),
        vec4_rows(b_dtype, lb, d.n) && d.k * d.n <= DIRECT_B_MAX,
    )
}

/// How to stage one operand (see `OperandLoad`): vec4 loads along the axis of stride 1 when
/// offsets, strides and that extent allow, else scalar loads walking the smaller stride.
/// `ks`, `os` are its strides along k and along its other axis, `k`, `o` those extents.
fn operand_load(
    ks: usize,
    os: usize,
    k: usize,
    o: usize,
    l: &MatLayout,
    prefer_mn: bool,
) -> OperandLoad {
    let a4 = |v: usize| v.is_multiple_of(4);
    let aligned = a4(l.offset) && a4(l.batch_stride);
    let vec_k = ks == 1 && a4(k) && a4(os) && aligned;
    let vec_mn = os == 1 && a4(o) && a4(ks) && aligned;
    match (prefer_mn, vec_k, vec_mn) {
        (false, true, _) | (true, true, false) => OperandLoad::VecK,
        (_, _, true) => OperandLoad::VecMn,
        (false, ..) if ks <= os => OperandLoad::ScalarK,
        (true, ..) if os > ks => OperandLoad::ScalarK,
        _ => OperandLoad::ScalarMn,
    }
}

/// An error for operands whose batch needs two strides: the shaders walk the batch with one per
/// operand (`matmul_grouped_batches` is false here, so the front-end copies such operands first).
pub(super) fn one_batch_stride(la: &MatLayout, lb: &MatLayout) -> Result<()> {
    if la.groups.is_some() || lb.groups.is_some() {
        return Err(crate::error::Error::invalid(
            "matmul",
            "the wgpu backend takes one batch stride per operand, not MatLayout::groups",
        ));
    }
    Ok(())
}

impl WgpuContext {
    /// The matmul variant for these operands on this adapter.
    pub(super) fn matmul_config(
        &self,
        la: &MatLayout,
        lb: &MatLayout,
        d: &MatDims,
    ) -> MatmulConfig {
        // A's k axis is its columns, B's its rows; A prefers k-major staging, B n-major.
        let a = operand_load(la.col_stride, la.row_stride, d.k, d.m, la, false);
        let b = operand_load(lb.row_stride, lb.col_stride, d.k, d.n, lb, true);
        let (bm, bn, bk, tm, tn) = self.matmul_tile(d);
        MatmulConfig {
            bm,
            bn,
            bk,
            tm,
            tn,
            a,
            b,
            c_vec: d.n.is_multiple_of(4),
            half: None,
        }
    }

    /// Whether tile `t` = `(bm, bn, bk, tm, tn)` fits the adapter's workgroup limits.
    fn tile_fits(&self, t: (u32, u32, u32, u32, u32)) -> bool {
        let cfg = MatmulConfig {
            bm: t.0,
            bn: t.1,
            bk: t.2,
            tm: t.3,
            tn: t.4,
            a: OperandLoad::ScalarK,
            b: OperandLoad::ScalarK,
            c_vec: false,
            half: None,
        };
        let limits = &self.limits;
        cfg.threads() <= limits.max_compute_invocations_per_workgroup
            && cfg.threads() <= limits.max_compute_workgroup_size_x
            && cfg.shared_bytes() <= limits.max_compute_workgroup_storage_size
    }

    /// Tile shape per adapter and problem size, when no autotune picks it: small problems get
    /// small tiles (more workgroups); software adapters (one CPU thread per workgroup) prefer
    /// 64 x 64 tiles with 8 x 8 outputs per invocation; GPUs take 128 x 128 tiles when the
    /// problem is large.
    fn matmul_tile(&self, d: &MatDims) -> (u32, u32, u32, u32, u32) {
        let [t64x4, t64x8, t32, t128] = MatmulConfig::TILES;
        let work = d.batch * d.m.div_ceil(64) * d.n.div_ceil(64);
        let pick = if d.m <= 32 || d.n <= 32 {
            t32
        } else if self.info.is_software {
            t64x8
        } else if work >= 256 && self.tile_fits(t128) && d.m >= 512 && d.n >= 512 {
            t128
        } else {
            t64x4
        };
        if self.tile_fits(pick) {
            pick
        } else {
            t32
        }
    }

    /// The variants the autotune times for `d`: every tile that fits, and the subgroup kernel
    /// where the heuristic could pick it (CPU-backed adapters: the only ones it is tested on).
    pub(super) fn matmul_candidates(&self, d: &MatDims) -> Vec<MatmulChoice> {
        let mut v: Vec<MatmulChoice> = MatmulConfig::TILES
            .into_iter()
            .filter(|&t| self.tile_fits(t))
            .map(|(bm, bn, bk, tm, tn)| MatmulChoice::Tile(bm, bn, bk, tm, tn))
            .collect();
        if self.subgroup_matmul_config(d).is_some() {
            v.push(MatmulChoice::Subgroup);
        }
        v
    }

    /// The variant for `d` and operands of `dtype`: the autotune's when it is on (`measure`
    /// times a candidate; each half dtype has shape classes of its own), else the heuristic's.
    fn matmul_choice(
        &self,
        d: MatDims,
        dtype: DType,
        measure: impl FnMut(MatmulChoice) -> Result<f64>,
    ) -> Result<MatmulChoice> {
        if let Some(tuner) = self.tuner() {
            let candidates = self.matmul_candidates(&d);
            let class = shape_class(&d, dtype.is_half().then(|| dtype.name()));
            return tuner.choose(&class, &candidates, measure);
        }
        Ok(if self.subgroup_matmul_config(&d).is_some() {
            MatmulChoice::Subgroup
        } else {
            let (bm, bn, bk, tm, tn) = self.matmul_tile(&d);
            MatmulChoice::Tile(bm, bn, bk, tm, tn)
        })
    }

    /// The matmul of `a` and `b` (f32, or both of one half dtype) with the variant the autotune
    /// keeps for its shape class, or the heuristic's.
    pub(super) fn matmul_tuned(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        d: MatDims,
    ) -> Result<RawTensor> {
        let choice = self.matmul_choice(d, a.dtype(), |c| {
            self.time_op(|| self.matmul_as(a, la, b, lb, d, c))
        })?;
        self.matmul_as(a, la, b, lb, d, choice)
    }

    /// The matmul as `choice` (f32 operand layouts normalised). Half operands (one half dtype)
    /// are read as such: the subgroup kernel's packing pass widens them (reading half the bytes),
    /// the tiled kernel unpacks them as it stages its slabs ([`Self::half_tiled_config`]); both
    /// accumulate in f32 and round the result once.
    pub(super) fn matmul_as(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        d: MatDims,
        choice: MatmulChoice,
    ) -> Result<RawTensor> {
        let dtype = a.dtype();
        match choice {
            MatmulChoice::Subgroup => {
                let cfg = self.subgroup_matmul_config(&d).ok_or_else(|| {
                    self.err(format!("no subgroup matmul for {d:?} on this adapter"))
                })?;
                let c = self.matmul_subgroup(a, la, b, lb, d, cfg)?;
                if dtype.is_half() {
                    self.narrow(&c, dtype)
                } else {
                    Ok(c)
                }
            }
            MatmulChoice::Tile(bm, bn, bk, tm, tn) => {
                let variant = if dtype.is_half() {
                    self.half_tiled_config(dtype, &la, &lb, &d)?
                } else {
                    self.matmul_config(&la, &lb, &d)
                };
                let cfg = MatmulConfig {
                    bm,
                    bn,
                    bk,
                    tm,
                    tn,
                    ..variant
                };
                if dtype.is_half() {
                    self.matmul_half_tiled(a, la, b, lb, d, Some(cfg))
                } else {
                    self.matmul_tiled(a, la, b, lb, d, cfg)
                }
            }
        }
    }

    /// Batched matmul with the variant chosen for the operands, or `forced` (tests).
    pub(super) fn matmul_with(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
        forced: Option<MatmulConfig>,
    ) -> Result<RawTensor> {
        if dims.batch == 0 || dims.m == 0 || dims.n == 0 {
            return self.empty(a.memory(), &[dims.batch, dims.m, dims.n]);
        }
        if dims.k == 0 {
            return self.fill(a.memory(), &[dims.batch, dims.m, dims.n], 0.0);
        }
        // Strides of size-1 axes never matter; zero them so that they do not block vec4 loads.
        let norm = |l: MatLayout, rows: usize, cols: usize| MatLayout {
            offset: l.offset,
            batch_stride: if dims.batch == 1 { 0 } else { l.batch_stride },
            row_stride: if rows == 1 { 0 } else { l.row_stride },
            col_stride: if cols == 1 { 0 } else { l.col_stride },
            groups: None,
        };
        let la = norm(la, dims.m, dims.k);
        let lb = norm(lb, dims.k, dims.n);
        match forced {
            Some(cfg) => self.matmul_tiled(a, la, b, lb, dims, cfg),
            None => self.matmul_tuned(a, la, b, lb, dims),
        }
    }

    /// The tiled kernel as `cfg` on normalised operands (`m`, `n`, `k`, `batch` non-zero).
    fn matmul_tiled(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
        cfg: MatmulConfig,
    ) -> Result<RawTensor> {
        let out = self.empty(a.memory(), &[dims.batch, dims.m, dims.n])?;
        let tiles_n = dims.n.div_ceil(cfg.bn as usize);
        let tiles = dims.m.div_ceil(cfg.bm as usize) * tiles_n;
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let (ba, bb, bo) = (gpu(a)?, gpu(b)?, gpu(&out)?);
        // k in chunks small enough for lavapipe's loop limit (one chunk elsewhere); later chunks
        // add to the output.
        let per_slab = 1 + cfg.bk + (cfg.bm + cfg.bn) * cfg.bk / cfg.threads() + 1;
        let k_chunk = if self.info.is_software {
            (LOOP_BUDGET / per_slab as usize).max(1) * cfg.bk as usize
        } else {
            dims.k
        };
        let mut base = 0;
        while base < dims.batch {
            let z = (dims.batch - base).min(max);
            let mut k0 = 0;
            while k0 < dims.k {
                let k1 = (k0 + k_chunk).min(dims.k);
                let params = MatmulParams {
                    m: u(dims.m),
                    k_end: u(k1),
                    n: u(dims.n),
                    tiles_n: u(tiles_n),
                    a_off: u(la.offset),
                    a_bs: u(la.batch_stride),
                    a_rs: u(la.row_stride),
                    a_cs: u(la.col_stride),
                    b_off: u(lb.offset),
                    b_bs: u(lb.batch_stride),
                    b_rs: u(lb.row_stride),
                    b_cs: u(lb.col_stride),
                    batch_base: u(base),
                    k_begin: u(k0),
                    accumulate: u32::from(k0 > 0),
                };
                self.dispatch(
                    Kernel::Matmul(cfg),
                    &params.words(&[]),
                    &[Arg::of(ba), Arg::of(bb), Arg::of(bo)],
                    tiles as u64,
                    z as u32,
                )?;
                k0 = k1;
            }
            base += z;
        }
        self.check()?;
        Ok(out)
    }

    /// The subgroup matmul for CPU-backed adapters (lavapipe), when it applies: a fixed
    /// subgroup size and a problem big enough to repay packing the operands.
    fn subgroup_matmul_config(&self, d: &MatDims) -> Option<SubgroupMatmulConfig> {
        let sg = self.subgroup_size?;
        if !self.info.is_software
            || !SubgroupMatmulConfig::SUBGROUP_SIZES.contains(&sg)
            || d.m * d.n * d.k < 16 * 16 * 16
        {
            return None;
        }
        let s = if d.m <= 2 * sg as usize { 2 } else { 4 };
        let cfg = SubgroupMatmulConfig {
            sg,
            s,
            q: 1,
            c_vec: d.n.is_multiple_of(4),
            // `matmul_subgroup` reads an operand in place where its layout allows.
            a_direct: false,
            b_direct: false,
        };
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let fits =
            d.m.div_ceil(cfg.rows() as usize) <= max && d.n.div_ceil(cfg.cols() as usize) <= max;
        fits.then_some(cfg)
    }

    /// Packs `x` (a strided batch of r x c matrices) into tiles of t0 x t1, t1 a power of two of
    /// at least 4 (see `pack.wgsl`): one workgroup row per (matrix, padded row), in dispatches of
    /// at most the adapter's grid height.
    #[allow(clippy::too_many_arguments)]
    fn pack(
        &self,
        x: &RawTensor,
        l: &MatLayout,
        batch: usize,
        (r, c): (usize, usize),
        (t0, t1): (usize, usize),
        (n0, n1): (usize, usize),
        col_outer: bool,
    ) -> Result<RawTensor> {
        if !t1.is_power_of_two() || t1 < 4 {
            return Err(self.err(format!(
                "pack: tile {t0} x {t1}: its width must be a power of two of at least 4"
            )));
        }
        let (padded_rows, padded_cols) = (n0 * t0, n1 * t1);
        let out = self.empty(x.memory(), &[batch * padded_rows * padded_cols])?;
        let kernel = match x.dtype() {
            DType::F32 => Kernel::Pack,
            DType::F16 => Kernel::PackHalf(HalfFormat::F16),
            DType::BF16 => Kernel::PackHalf(HalfFormat::Bf16),
        };
        let (bx, bo) = (gpu(x)?, gpu(&out)?);
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let groups_x = groups_for(padded_cols / 4) as usize;
        if groups_x > max {
            return Err(self.err(format!(
                "pack: {padded_cols} columns need {groups_x} workgroups across, over the limit {max}"
            )));
        }
        let groups_x = u(groups_x);
        let rows = batch * padded_rows;
        let mut y0 = 0;
        while y0 < rows {
            let ys = (rows - y0).min(max);
            let params = PackParams {
                rows: u(r),
                cols: u(c),
                t0: u(t0),
                lg_t1: t1.trailing_zeros(),
                n_t0: u(n0),
                n_t1: u(n1),
                col_outer: u32::from(col_outer),
                off: u(l.offset),
                bs: u(l.batch_stride),
                rs: u(l.row_stride),
                cs: u(l.col_stride),
                y_base: u(y0),
            };
            self.dispatch_grid(
                kernel,
                &params.words(&[]),
                &[Arg::of(bx), Arg::of(bo)],
                [groups_x, u(ys), 1],
            )?;
            y0 += ys;
        }
        Ok(out)
    }

    /// The tiled kernel's variant for half operands of `dtype`: the f32 variant's tile, its
    /// vec4 loads made scalar (a vec4 of packed halves would straddle words).
    fn half_tiled_config(
        &self,
        dtype: DType,
        la: &MatLayout,
        lb: &MatLayout,
        dims: &MatDims,
    ) -> Result<MatmulConfig> {
        let format = match dtype {
            DType::F16 => HalfFormat::F16,
            DType::BF16 => HalfFormat::Bf16,
            DType::F32 => return Err(self.err("the half matmul needs half operands")),
        };
        let scalar = |l: OperandLoad| match l {
            OperandLoad::VecK => OperandLoad::ScalarK,
            OperandLoad::VecMn => OperandLoad::ScalarMn,
            other => other,
        };
        let auto = self.matmul_config(la, lb, dims);
        Ok(MatmulConfig {
            a: scalar(auto.a),
            b: scalar(auto.b),
            half: Some(format),
            ..auto
        })
    }

    /// The tiled kernel on half operands (`a`, `b` of one half dtype): their scalar loads
    /// unpack the packed words as they stage the slabs (half the bytes read), the slabs and
    /// FMAs are f32, and the f32 result is rounded once. `forced` (tests, the autotune) picks
    /// the variant; by default [`Self::half_tiled_config`].
    pub(super) fn matmul_half_tiled(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
        forced: Option<MatmulConfig>,
    ) -> Result<RawTensor> {
        let cfg = match forced {
            Some(cfg) => cfg,
            None => self.half_tiled_config(a.dtype(), &la, &lb, &dims)?,
        };
        let c = self.matmul_with(a, la, b, lb, dims, Some(cfg))?;
        self.narrow(&c, a.dtype())
    }

    /// Matmul through packed operands and the subgroup kernel.
    pub(super) fn matmul_subgroup(
        &self,
        a: &RawTensor,
        la: MatLayout,
        b: &RawTensor,
        lb: MatLayout,
        dims: MatDims,
        cfg: SubgroupMatmulConfig,
    ) -> Result<RawTensor> {
        let MatDims { batch, m, k, n } = dims;
        let out = self.empty(a.memory(), &[batch, m, n])?;
        if batch == 0 || m == 0 || n == 0 {
            return Ok(out);
        }
        let (tm, cw) = (cfg.rows() as usize, cfg.cols() as usize);
        let (mb, nb, k4) = (m.div_ceil(tm), n.div_ceil(cw), k.div_ceil(4));
        let (a_direct, b_direct) = direct_operands((a.dtype(), &la), (b.dtype(), &lb), &dims);
        let cfg = SubgroupMatmulConfig {
            a_direct,
            b_direct,
            ..cfg
        };
        let a_batch = if la.batch_stride == 0 { 1 } else { batch };
        let b_batch = if lb.batch_stride == 0 { 1 } else { batch };
        // (buffer, batch stride, offset, row stride), the last three in vec4s
        let a_op = if cfg.a_direct {
            (None, la.batch_stride / 4, la.offset / 4, la.row_stride / 4)
        } else {
            let ap = self.pack(a, &la, a_batch, (m, k), (tm, 4), (mb, k4), false)?;
            let bs = if a_batch == 1 { 0 } else { mb * k4 * tm };
            (Some(ap), bs, 0, 0)
        };
        let b_op = if cfg.b_direct {
            (None, lb.batch_stride / 4, lb.offset / 4, lb.row_stride / 4)
        } else {
            let bp = self.pack(b, &lb, b_batch, (k, n), (1, cw), (k4 * 4, nb), true)?;
            let bs = if b_batch == 1 { 0 } else { nb * k4 * cw };
            (Some(bp), bs, 0, 0)
        };
        let bap = gpu(a_op.0.as_ref().unwrap_or(a))?;
        let bbp = gpu(b_op.0.as_ref().unwrap_or(b))?;
        let bo = gpu(&out)?;
        let max = self.limits.max_compute_workgroups_per_dimension as usize;
        let mut base = 0;
        while base < batch {
            let z = (batch - base).min(max);
            let mut k0 = 0;
            while k0 < k4.max(1) {
                let k1 = (k0 + LOOP_BUDGET).min(k4);
                let params = SubgroupMatmulParams {
                    m: u(m),
                    n: u(n),
                    k4_begin: u(k0),
                    k4_end: u(k1),
                    accumulate: u32::from(k0 > 0),
                    a_bs: u(a_op.1),
                    b_bs: u(b_op.1),
                    batch_base: u(base),
                    k4: u(k4),
                    a_off: u(a_op.2),
                    a_rs: u(a_op.3),
                    b_off: u(b_op.2),
                    b_rs: u(b_op.3),
                };
                self.dispatch_grid(
                    Kernel::MatmulSubgroup(cfg),
                    &params.words(&[]),
                    &[Arg::of(bap), Arg::of(bbp), Arg::of(bo)],
                    [u(nb), u(mb), u(z)],
                )?;
                k0 = k1.max(k0 + 1);
            }
            base += z;
        }
        self.check()?;
        Ok(out)
    }
}
