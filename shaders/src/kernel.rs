//! The registry: [`Kernel`] names one compiled variant, and [`Kernel::spec`] says in one table
//! what its source, entry point, bindings, workgroup size and parameter block are. The sources
//! come from the families (`elementwise.rs`, `rows.rs`, `matmul.rs`) and the plain `.wgsl` files
//! below.

use crate::elementwise::{self, EwLayout};
use crate::half::HalfFormat;
use crate::matmul::{MatmulConfig, OperandLoad, SubgroupMatmulConfig};
use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
use crate::params;
use crate::rows::RowGroup;
use crate::rows::{self, ReduceMode};
use crate::{render, Access, ELEMENTWISE_WG, ROW_SUBGROUP_SIZES, ROW_WG_CHOICES};

use crate::wgsl::{
    ADAM, COMMON, COPY_STRIDED, DROPOUT, FILL, HALF, INDEX, NARROW, PACK, PHILOX, SPATIAL,
    SUM_LEADING, WIDEN,
};

/// Entry points of `index.wgsl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexKernel {
    IndexSelect,
    Gather,
    IndexAdd,
    ScatterAdd,
}

impl IndexKernel {
    pub const ALL: [IndexKernel; 4] = [
        IndexKernel::IndexSelect,
        IndexKernel::Gather,
        IndexKernel::IndexAdd,
        IndexKernel::ScatterAdd,
    ];

    fn entry_point(self) -> &'static str {
        match self {
            IndexKernel::IndexSelect => "index_select",
            IndexKernel::Gather => "gather",
            IndexKernel::IndexAdd => "index_add",
            IndexKernel::ScatterAdd => "scatter_add",
        }
    }
}

/// Entry points of `spatial.wgsl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpatialKernel {
    Im2col,
    Col2im,
    MaxPool2d,
    MaxPool2dBackward,
    AvgPool2d,
    AvgPool2dBackward,
}

impl SpatialKernel {
    pub const ALL: [SpatialKernel; 6] = [
        SpatialKernel::Im2col,
        SpatialKernel::Col2im,
        SpatialKernel::MaxPool2d,
        SpatialKernel::MaxPool2dBackward,
        SpatialKernel::AvgPool2d,
        SpatialKernel::AvgPool2dBackward,
    ];

    fn entry_point(self) -> &'static str {
        match self {
            SpatialKernel::Im2col => "im2col",
            SpatialKernel::Col2im => "col2im",
            SpatialKernel::MaxPool2d => "max_pool2d",
            SpatialKernel::MaxPool2dBackward => "max_pool2d_backward",
            SpatialKernel::AvgPool2d => "avg_pool2d",
            SpatialKernel::AvgPool2dBackward => "avg_pool2d_backward",
        }
    }
}

/// `pack.wgsl`'s source operand in f32.
const PACK_SRC_F32: &str = "@group(0) @binding(1) var<storage, read> src: array<f32>;

fn read_src(i: u32) -> f32 {
    return src[i];
}";

/// A source of packed halves (element `i` in half `i % 2` of word `i / 2`), as `pack.wgsl` and
/// `widen.wgsl` read it.
const HALF_SRC: &str = "@group(0) @binding(1) var<storage, read> src: array<u32>;

fn read_src(i: u32) -> f32 {
    let word = src[i >> 1u];
    return {{FORMAT}}_to_f32((word >> ((i & 1u) * 16u)) & 0xFFFFu);
}";

/// The activations [`Kernel::BiasAct`] is built for (what `Tensor::bias_act` accepts).
pub const BIAS_ACTIVATIONS: [UnaryOp; 3] = [UnaryOp::Relu, UnaryOp::Gelu, UnaryOp::GeluTanh];

/// `body` (an elementwise kernel calling `act` / `act_grad`) with `op` and its derivative as
/// those functions.
fn with_act(op: UnaryOp, body: &str) -> String {
    format!(
        "{body}\nfn act(a: f32, s0: f32, s1: f32) -> f32 {{\n    return {};\n}}\n\
         fn act_grad(a: f32, s0: f32, s1: f32) -> f32 {{\n    return {};\n}}\n",
        op.wgsl(),
        op.wgsl_grad()
    )
}

/// The Adam kernel reading `param`, `grad`, `m_in`, `v_in`, writing either separate outputs or
/// (`in_place`) the parameter and moments it read.
fn adam(in_place: bool) -> String {
    let decl = |b: u32, name: &str, rw: bool| {
        let access = if rw { "read_write" } else { "read" };
        format!("@group(0) @binding({b}) var<storage, {access}> {name}: array<f32>;")
    };
    let (bindings, outs) = if in_place {
        (
            [
                decl(1, "grad", false),
                decl(2, "param", true),
                decl(3, "m_in", true),
                decl(4, "v_in", true),
            ]
            .join("\n"),
            ["param", "m_in", "v_in"],
        )
    } else {
        (
            [
                decl(1, "param", false),
                decl(2, "grad", false),
                decl(3, "m_in", false),
                decl(4, "v_in", false),
                decl(5, "param_out", true),
                decl(6, "m_out", true),
                decl(7, "v_out", true),
            ]
            .join("\n"),
            ["param_out", "m_out", "v_out"],
        )
    };
    render(
        ADAM,
        &[
            ("WG", &ELEMENTWISE_WG.to_string()),
            ("BINDINGS", &bindings),
            ("P_OUT", outs[0]),
            ("M_OUT", outs[1]),
            ("V_OUT", outs[2]),
        ],
    )
}

/// One compute kernel variant: what the runtime compiles and caches a pipeline for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `out = a` (materialises a view).
    Copy {
        layout: EwLayout,
    },
    /// `out = op(a)`; `op`'s scalars are zero here (they travel in the parameter block), see
    /// [`Kernel::unary`].
    Unary {
        op: UnaryOp,
        layout: EwLayout,
    },
    /// `out = b * op'(a)`: the backward of a unary op (`a` its input, `b` the output gradient).
    UnaryGrad {
        op: UnaryOp,
        layout: EwLayout,
    },
    /// `out = op(a, b)` over inputs of one shape.
    Binary {
        op: BinaryOp,
        layout: EwLayout,
    },
    /// `out = op(out, b)`: [`Kernel::Binary`] with its first input read from the output it
    /// writes (an in-place update of a buffer no other tensor sees; `b` at binding 2, as in
    /// `Binary`, and no binding 1).
    BinaryAssign {
        op: BinaryOp,
        layout: EwLayout,
    },
    /// `out = a != 0 ? b : c`.
    Where {
        layout: EwLayout,
    },
    /// `out = op(a + b)`: a bias (`b`, broadcast) and an activation after a matmul, one pass.
    BiasAct {
        op: UnaryOp,
        layout: EwLayout,
    },
    /// `out = c * op'(a + b)`: the backward of [`Kernel::BiasAct`] (`c` the output gradient).
    BiasActGrad {
        op: UnaryOp,
        layout: EwLayout,
    },
    /// Strided-to-strided copy (concat).
    CopyStrided,
    /// `out = value`.
    Fill,
    /// Packed half values to f32.
    Widen(HalfFormat),
    /// f32 values to packed half (round to nearest even).
    Narrow(HalfFormat),
    /// Row reductions, `wg` invocations per row (a power of two).
    Reduce {
        op: ReduceOp,
        mode: ReduceMode,
        wg: u32,
    },
    Softmax {
        log: bool,
        group: RowGroup,
    },
    /// The backward of a (scaled) softmax row.
    SoftmaxBackward {
        group: RowGroup,
    },
    LayerNorm {
        group: RowGroup,
    },
    /// The layer norm of `x + r`, which also writes the sum; mean and rstd in one `[2, rows]`
    /// output.
    AddLayerNorm {
        group: RowGroup,
    },
    /// The gradient of a layer norm's input, optionally added to a carried gradient.
    LayerNormBackward {
        group: RowGroup,
    },
    /// Softmax + cross-entropy of each row: the loss, the max and the log of the sum.
    CrossEntropy {
        group: RowGroup,
    },
    /// The backward of [`Kernel::CrossEntropy`].
    CrossEntropyBackward {
        wg: u32,
    },
    Matmul(MatmulConfig),
    /// Needs the `SUBGROUP` feature and a fixed subgroup size of `sg`.
    MatmulSubgroup(SubgroupMatmulConfig),
    /// Strided matrices to the tiled, padded operand layout of `MatmulSubgroup`.
    Pack,
    /// `Pack` of packed half operands (widened to the f32 tiles).
    PackHalf(HalfFormat),
    /// Column sums of a contiguous matrix over chunks of its rows (`Backend::sum_leading`).
    SumLeading,
    Index(IndexKernel),
    Spatial(SpatialKernel),
    Dropout,
    Adam,
    /// [`Kernel::Adam`] writing the new parameter and moments over the old ones.
    AdamInPlace,
}

/// What [`Kernel::spec`] says of one variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSpec {
    /// The WGSL, without the common prelude ([`Kernel::source`] adds it).
    pub body: String,
    /// The name of the parameter block at binding 0 (a struct of [`params`]).
    pub params: &'static str,
    /// The bindings after the parameter block, `(binding, access)`, inputs first.
    pub bindings: Vec<(u32, Access)>,
    /// Invocations per workgroup.
    pub workgroup: u32,
    pub entry_point: &'static str,
}

impl KernelSpec {
    fn new(
        body: String,
        params: &'static str,
        bindings: Vec<(u32, Access)>,
        workgroup: u32,
    ) -> Self {
        KernelSpec {
            body,
            params,
            bindings,
            workgroup,
            entry_point: "main",
        }
    }
}

impl Kernel {
    /// The kernel of `op` (one per op, whatever its scalars).
    pub fn unary(op: UnaryOp, layout: EwLayout) -> Kernel {
        Kernel::Unary {
            op: op.kernel_key(),
            layout,
        }
    }

    /// The backward kernel of `op` (one per op, whatever its scalars).
    pub fn unary_grad(op: UnaryOp, layout: EwLayout) -> Kernel {
        Kernel::UnaryGrad {
            op: op.kernel_key(),
            layout,
        }
    }

    /// Everything about this variant, from one table: its WGSL (without the common prelude),
    /// parameter block, bindings, workgroup size and entry point. Asked for when a pipeline is
    /// compiled (the runtime keeps what it needs of it beside the pipeline).
    pub fn spec(&self) -> KernelSpec {
        use params::*;
        use Access::{Read as R, ReadWrite as W};
        let wg = ELEMENTWISE_WG.to_string();
        let plain = |src: &str| render(src, &[("WG", &wg)]);
        // `SRC` goes in before `FORMAT`, which fills both the template and the source.
        let half = |template: &str, f: HalfFormat| {
            let vars = [("WG", wg.as_str()), ("SRC", HALF_SRC), ("FORMAT", f.wgsl())];
            format!("{HALF}\n{}", render(template, &vars))
        };
        // `reads` inputs at bindings 1.., then `writes` outputs after them.
        let seq = |reads: u32, writes: u32| -> Vec<(u32, Access)> {
            (1..=reads)
                .map(|b| (b, R))
                .chain((reads + 1..=reads + writes).map(|b| (b, W)))
                .collect()
        };
        let ew = |body: String, bindings| {
            KernelSpec::new(body, EwParams::NAME, bindings, ELEMENTWISE_WG)
        };
        let row = |body: String, params, bindings, group: RowGroup| {
            KernelSpec::new(body, params, bindings, group.wg)
        };
        match *self {
            Kernel::Copy { layout } => ew(elementwise::source(1, layout, "a"), seq(1, 1)),
            Kernel::Unary { op, layout } => {
                ew(elementwise::source(1, layout, op.wgsl()), seq(1, 1))
            }
            Kernel::UnaryGrad { op, layout } => ew(
                elementwise::source(2, layout, &format!("b * ({})", op.wgsl_grad())),
                seq(2, 1),
            ),
            Kernel::Binary { op, layout } => {
                ew(elementwise::source(2, layout, op.wgsl()), seq(2, 1))
            }
            Kernel::BinaryAssign { op, layout } => ew(
                elementwise::source_assign(layout, op.wgsl()),
                vec![(2, R), (3, W)],
            ),
            Kernel::Where { layout } => ew(
                elementwise::source(3, layout, "select(c, b, a != 0.0)"),
                seq(3, 1),
            ),
            Kernel::BiasAct { op, layout } => ew(
                with_act(op, &elementwise::source(2, layout, "act(a + b, s0, s1)")),
                seq(2, 1),
            ),
            Kernel::BiasActGrad { op, layout } => ew(
                with_act(
                    op,
                    &elementwise::source(3, layout, "c * act_grad(a + b, s0, s1)"),
                ),
                seq(3, 1),
            ),
            Kernel::CopyStrided => KernelSpec::new(
                plain(COPY_STRIDED),
                CopyParams::NAME,
                seq(1, 1),
                ELEMENTWISE_WG,
            ),
            Kernel::Fill => {
                KernelSpec::new(plain(FILL), FillParams::NAME, seq(0, 1), ELEMENTWISE_WG)
            }
            Kernel::Widen(f) => {
                KernelSpec::new(half(WIDEN, f), CastParams::NAME, seq(1, 1), ELEMENTWISE_WG)
            }
            Kernel::Narrow(f) => {
                KernelSpec::new(half(NARROW, f), CastParams::NAME, seq(1, 1), ELEMENTWISE_WG)
            }
            Kernel::Reduce { op, mode, wg } => {
                let bindings = match mode {
                    ReduceMode::Direct | ReduceMode::Thin => seq(1, 1),
                    ReduceMode::Partial => seq(1, 2),
                    ReduceMode::Final => seq(2, 1),
                };
                KernelSpec::new(rows::reduce(op, mode, wg), ReduceParams::NAME, bindings, wg)
            }
            Kernel::Softmax { log, group } => row(
                rows::softmax(log, group),
                SoftmaxParams::NAME,
                seq(1, 1),
                group,
            ),
            Kernel::SoftmaxBackward { group } => row(
                rows::softmax_backward(group),
                SoftmaxBackwardParams::NAME,
                seq(2, 1),
                group,
            ),
            Kernel::LayerNorm { group } => row(
                rows::layer_norm(group, false),
                LayerNormParams::NAME,
                seq(3, 3),
                group,
            ),
            // x, gamma, beta, r; then y, the stats, the sum (binding numbers of the template).
            Kernel::AddLayerNorm { group } => row(
                rows::layer_norm(group, true),
                LayerNormParams::NAME,
                vec![(1, R), (2, R), (3, R), (6, R), (4, W), (5, W), (7, W)],
                group,
            ),
            Kernel::LayerNormBackward { group } => row(
                rows::layer_norm_backward(group),
                LayerNormBackwardParams::NAME,
                seq(6, 1),
                group,
            ),
            Kernel::CrossEntropy { group } => row(
                rows::cross_entropy(group),
                CrossEntropyParams::NAME,
                seq(2, 3),
                group,
            ),
            Kernel::CrossEntropyBackward { wg } => KernelSpec::new(
                rows::cross_entropy_backward(wg),
                CrossEntropyBackwardParams::NAME,
                seq(5, 1),
                wg,
            ),
            Kernel::Matmul(cfg) => {
                KernelSpec::new(cfg.source(), MatmulParams::NAME, seq(2, 1), cfg.threads())
            }
            Kernel::MatmulSubgroup(cfg) => {
                KernelSpec::new(cfg.source(), SubgroupMatmulParams::NAME, seq(2, 1), cfg.sg)
            }
            Kernel::Pack => KernelSpec::new(
                render(PACK, &[("WG", &wg), ("SRC", PACK_SRC_F32)]),
                PackParams::NAME,
                seq(1, 1),
                ELEMENTWISE_WG,
            ),
            Kernel::PackHalf(f) => {
                KernelSpec::new(half(PACK, f), PackParams::NAME, seq(1, 1), ELEMENTWISE_WG)
            }
            Kernel::SumLeading => KernelSpec::new(
                plain(SUM_LEADING),
                SumLeadingParams::NAME,
                seq(1, 1),
                ELEMENTWISE_WG,
            ),
            Kernel::Index(k) => KernelSpec {
                entry_point: k.entry_point(),
                ..KernelSpec::new(plain(INDEX), IndexParams::NAME, seq(2, 1), ELEMENTWISE_WG)
            },
            Kernel::Spatial(k) => {
                let bindings = match k {
                    SpatialKernel::MaxPool2d => vec![(1, R), (3, W), (4, W)],
                    SpatialKernel::MaxPool2dBackward => vec![(1, R), (2, R), (3, W)],
                    _ => vec![(1, R), (3, W)],
                };
                KernelSpec {
                    entry_point: k.entry_point(),
                    ..KernelSpec::new(
                        plain(SPATIAL),
                        SpatialParams::NAME,
                        bindings,
                        ELEMENTWISE_WG,
                    )
                }
            }
            Kernel::Dropout => KernelSpec::new(
                format!("{PHILOX}\n{}", plain(DROPOUT)),
                DropoutParams::NAME,
                seq(0, 1),
                ELEMENTWISE_WG,
            ),
            Kernel::Adam => {
                KernelSpec::new(adam(false), AdamParams::NAME, seq(4, 3), ELEMENTWISE_WG)
            }
            Kernel::AdamInPlace => {
                KernelSpec::new(adam(true), AdamParams::NAME, seq(1, 3), ELEMENTWISE_WG)
            }
        }
    }

    /// The complete WGSL of this variant: the common prelude and [`Kernel::spec`]'s body.
    pub fn source(&self) -> String {
        format!("{COMMON}\n{}", self.spec().body)
    }

    /// The name of the parameter block (binding 0): a struct of [`params`] and of the source.
    pub fn params(&self) -> &'static str {
        self.spec().params
    }

    /// Whether the variant needs the `SUBGROUP` device feature (and naga capability).
    pub fn needs_subgroups(&self) -> bool {
        match self {
            Kernel::MatmulSubgroup(_) => true,
            Kernel::Softmax { group, .. }
            | Kernel::SoftmaxBackward { group }
            | Kernel::LayerNorm { group }
            | Kernel::AddLayerNorm { group }
            | Kernel::LayerNormBackward { group }
            | Kernel::CrossEntropy { group } => group.subgroup,
            _ => false,
        }
    }

    /// The entry point to compile.
    pub fn entry_point(&self) -> &'static str {
        self.spec().entry_point
    }

    /// The bindings after the parameter block (binding 0), as `(binding, access)` in the order
    /// the runtime passes buffers: inputs first, then outputs.
    pub fn bindings(&self) -> Vec<(u32, Access)> {
        self.spec().bindings
    }

    /// Invocations per workgroup (the host sizes dispatches with it).
    pub fn workgroup_size(&self) -> u32 {
        self.spec().workgroup
    }

    /// Every variant the runtime can ask for (what the validation test compiles).
    pub fn all() -> Vec<Kernel> {
        let mut v = Vec::new();
        for layout in EwLayout::ALL {
            v.push(Kernel::Copy { layout });
            for op in UnaryOp::ALL {
                v.extend([Kernel::unary(op, layout), Kernel::unary_grad(op, layout)]);
            }
            v.extend(BinaryOp::ALL.map(|op| Kernel::Binary { op, layout }));
            v.extend(BinaryOp::ALL.map(|op| Kernel::BinaryAssign { op, layout }));
            v.push(Kernel::Where { layout });
            for op in BIAS_ACTIVATIONS {
                v.extend([
                    Kernel::BiasAct { op, layout },
                    Kernel::BiasActGrad { op, layout },
                ]);
            }
        }
        v.extend([Kernel::CopyStrided, Kernel::Fill]);
        for f in HalfFormat::ALL {
            v.extend([Kernel::Widen(f), Kernel::Narrow(f), Kernel::PackHalf(f)]);
        }
        for wg in ROW_WG_CHOICES {
            for op in ReduceOp::ALL {
                v.extend(ReduceMode::ALL.map(|mode| Kernel::Reduce { op, mode, wg }));
            }
            v.push(Kernel::CrossEntropyBackward { wg });
        }
        let groups = ROW_WG_CHOICES.map(RowGroup::tree).into_iter();
        for group in groups.chain(ROW_SUBGROUP_SIZES.map(RowGroup::subgroup)) {
            v.extend([
                Kernel::Softmax { log: false, group },
                Kernel::Softmax { log: true, group },
                Kernel::SoftmaxBackward { group },
                Kernel::LayerNorm { group },
                Kernel::AddLayerNorm { group },
                Kernel::LayerNormBackward { group },
                Kernel::CrossEntropy { group },
            ]);
        }
        for (bm, bn, bk, tm, tn) in MatmulConfig::TILES {
            for a in OperandLoad::ALL {
                for b in OperandLoad::ALL {
                    for c_vec in [false, true] {
                        // f32 operands, and half ones where the loads are scalar (`is_valid`).
                        for half in std::iter::once(None).chain(HalfFormat::ALL.map(Some)) {
                            let cfg = MatmulConfig {
                                bm,
                                bn,
                                bk,
                                tm,
                                tn,
                                a,
                                b,
                                c_vec,
                                half,
                            };
                            if cfg.is_valid() {
                                v.push(Kernel::Matmul(cfg));
                            }
                        }
                    }
                }
            }
        }
        for sg in SubgroupMatmulConfig::SUBGROUP_SIZES {
            for (s, q) in SubgroupMatmulConfig::SHAPES {
                for c_vec in [false, true] {
                    for (a_direct, b_direct) in [(false, false), (true, false), (false, true)] {
                        v.push(Kernel::MatmulSubgroup(SubgroupMatmulConfig {
                            sg,
                            s,
                            q,
                            c_vec,
                            a_direct,
                            b_direct,
                        }));
                    }
                }
            }
        }
        v.extend([Kernel::Pack, Kernel::SumLeading]);
        v.extend(IndexKernel::ALL.map(Kernel::Index));
        v.extend(SpatialKernel::ALL.map(Kernel::Spatial));
        v.extend([Kernel::Dropout, Kernel::Adam, Kernel::AdamInPlace]);
        v
    }
}
