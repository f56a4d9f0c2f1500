//! The parameter blocks: binding 0 of every kernel, one `#[repr(C)]` struct here per WGSL struct
//! of the same name in the kernel's `.wgsl` file (`tests/params.rs` parses each kernel with naga
//! and checks that member names, offsets and sizes agree).
//!
//! Every member is a 4-byte scalar (`u32`, `f32`), so the WGSL storage layout is the C layout.
//! Two blocks end in a run-time sized `dims: array<u32>` (shapes and strides of any rank): the
//! host appends those words after the struct ([`ParamBlock::words`]).

use bytemuck::{Pod, Zeroable};

/// One member of a parameter block: name, byte offset, byte size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// A parameter block: the fixed part of a kernel's binding 0.
pub trait ParamBlock: Pod {
    /// The WGSL struct name.
    const NAME: &'static str;
    /// The members, in order.
    const FIELDS: &'static [Field];
    /// Whether the WGSL struct ends in `dims: array<u32>` after these fields.
    const HAS_DIMS: bool = false;

    /// The block as u32 words, `dims` appended (empty unless [`Self::HAS_DIMS`]).
    fn words(&self, dims: &[u32]) -> Vec<u32> {
        debug_assert!(
            Self::HAS_DIMS || dims.is_empty(),
            "{} has no dims",
            Self::NAME
        );
        let mut w: Vec<u32> = bytemuck::cast_slice(bytemuck::bytes_of(self)).to_vec();
        w.extend_from_slice(dims);
        w
    }
}

/// Defines a parameter block and its field table.
macro_rules! param_block {
    ($(#[$m:meta])* $name:ident $(+ $dims:ident)? { $($(#[$fm:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty,)*
        }
        impl ParamBlock for $name {
            const NAME: &'static str = stringify!($name);
            const FIELDS: &'static [Field] = &[$(Field {
                name: stringify!($field),
                offset: std::mem::offset_of!($name, $field),
                size: std::mem::size_of::<$ty>(),
            },)*];
            $(const HAS_DIMS: bool = { let _ = stringify!($dims); true };)?
        }
    };
}

param_block! {
    /// `fill.wgsl`.
    FillParams {
        numel: u32, value: f32,
    }
}

param_block! {
    /// `widen.wgsl` and `narrow.wgsl`: `numel` elements; `offset` is where the f32 side starts.
    CastParams {
        numel: u32, offset: u32,
    }
}

param_block! {
    /// `elementwise.wgsl`. `dims`: `shape[rank]`, then per input `offset, strides[rank]`
    /// (`rank` 0 for the contiguous layouts: just the offsets). `count` is elements, or vec4s
    /// for the vec4 layout.
    EwParams + dims {
        count: u32,
        rank: u32, s0: f32, s1: f32,
    }
}

param_block! {
    /// `copy_strided.wgsl`. `dims`: `shape[rank], in_offset, in_strides[rank], out_offset,
    /// out_strides[rank]`.
    CopyParams + dims {
        numel: u32, rank: u32,
    }
}

param_block! {
    /// `reduce.wgsl`: workgroup g handles row `g / segments`, columns
    /// `[(g % segments) * seg_len, min(that + seg_len, cols))`.
    ReduceParams {
        rows: u32, cols: u32, x_offset: u32, segments: u32, seg_len: u32,
    }
}

param_block! {
    /// `softmax.wgsl`.
    SoftmaxParams {
        rows: u32, cols: u32, x_offset: u32, scale: f32,
        /// Nonzero: causal attention scores, row r sees columns `0..=r % cols`.
        causal: u32,
    }
}

param_block! {
    /// `softmax_backward.wgsl`.
    SoftmaxBackwardParams {
        rows: u32, cols: u32, scale: f32, y_offset: u32, g_offset: u32,
    }
}

param_block! {
    /// `layer_norm.wgsl`.
    LayerNormParams {
        rows: u32, cols: u32, eps: f32, x_offset: u32, gamma_offset: u32,
        beta_offset: u32,
        /// The residual's offset (the fused residual add only).
        r_offset: u32,
    }
}

param_block! {
    /// `layer_norm_backward.wgsl`.
    LayerNormBackwardParams {
        rows: u32, cols: u32, x_offset: u32, mean_offset: u32, rstd_offset: u32,
        gamma_offset: u32, g_offset: u32, carry_offset: u32,
        /// Nonzero: add `carry` (otherwise the host binds `g` in its place).
        has_carry: u32,
    }
}

param_block! {
    /// `cross_entropy.wgsl`.
    CrossEntropyParams {
        rows: u32, cols: u32, x_offset: u32, t_offset: u32,
    }
}

param_block! {
    /// `cross_entropy_backward.wgsl`.
    CrossEntropyBackwardParams {
        rows: u32, cols: u32, x_offset: u32, t_offset: u32, max_offset: u32,
        logsum_offset: u32, g_offset: u32,
    }
}

param_block! {
    /// `matmul.wgsl`: element (b, i, j) of an operand is at `off + b * bs + i * rs + j * cs`;
    /// one dispatch covers k in `[k_begin, k_end)`, adding to c when `accumulate` is non-zero.
    MatmulParams {
        m: u32, k_end: u32, n: u32, tiles_n: u32,
        a_off: u32, a_bs: u32, a_rs: u32, a_cs: u32,
        b_off: u32, b_bs: u32, b_rs: u32, b_cs: u32,
        batch_base: u32, k_begin: u32, accumulate: u32,
    }
}

param_block! {
    /// `matmul_subgroup.wgsl` (k counted in groups of 4).
    SubgroupMatmulParams {
        m: u32, n: u32, k4_begin: u32, k4_end: u32, accumulate: u32,
        a_bs: u32, b_bs: u32, batch_base: u32, k4: u32,
        a_off: u32, a_rs: u32, b_off: u32, b_rs: u32,
    }
}

param_block! {
    /// `pack.wgsl`.
    PackParams {
        rows: u32, cols: u32, t0: u32, lg_t1: u32, n_t0: u32, n_t1: u32, col_outer: u32,
        off: u32, bs: u32, rs: u32, cs: u32, y_base: u32,
    }
}

param_block! {
    /// `sum_leading.wgsl`.
    SumLeadingParams {
        rows: u32, width: u32, chunk: u32, chunks: u32, x_offset: u32,
    }
}

param_block! {
    /// `index.wgsl`: tensors `[outer, dim, inner]`, `n` indices, this dispatch's `j` range.
    IndexParams {
        outer: u32, dim: u32, inner: u32, n: u32,
        j_begin: u32, j_end: u32,
    }
}

param_block! {
    /// `spatial.wgsl` (pooling passes dilation 1 and one group).
    SpatialParams {
        n: u32, c: u32, h: u32, w: u32,
        kh: u32, kw: u32, sh: u32, sw: u32, ph: u32, pw: u32, dh: u32, dw: u32,
        groups: u32, h_out: u32, w_out: u32,
    }
}

param_block! {
    /// `dropout.wgsl`: the Philox key is the seed, the counter carries the offset.
    DropoutParams {
        numel: u32, seed_lo: u32, seed_hi: u32, offset_lo: u32, offset_hi: u32,
        p: f32, scale: f32,
    }
}

param_block! {
    /// `adam.wgsl` (see `wgpipe_tensor::backend::AdamStep`).
    AdamParams {
        numel: u32, lr: f32, beta1: f32, beta2: f32, eps: f32,
        weight_decay: f32,
        decoupled: u32,
        bc1: f32, bc2: f32,
    }
}

/// Lists every block in [`ALL`].
macro_rules! all_blocks {
    ($($p:ident),* $(,)?) => {
        /// Every block's name, fields and whether it has `dims` (what the layout test walks).
        pub const ALL: &[(&str, &[Field], bool)] = &[$(entry::<$p>()),*];
    };
}

all_blocks! {
    FillParams, CastParams, EwParams, CopyParams, ReduceParams, SoftmaxParams, SoftmaxBackwardParams,
    LayerNormParams, LayerNormBackwardParams, CrossEntropyParams, CrossEntropyBackwardParams,
    MatmulParams, SubgroupMatmulParams, PackParams, SumLeadingParams, IndexParams, SpatialParams, DropoutParams,
    AdamParams,
}

const fn entry<P: ParamBlock>() -> (&'static str, &'static [Field], bool) {
    (P::NAME, P::FIELDS, P::HAS_DIMS)
}
