//! The matmul family: the tiled matmul of GPUs (`matmul.wgsl` with its operand-load and store
//! files) and the subgroup matmul of CPU-backed adapters (`matmul_subgroup.wgsl`).
//!
//! What is generated here is only the register tile, which WGSL cannot unroll by itself: one
//! accumulator declaration, one FMA line and one `store4` call per (row, vec4 column) of the
//! tile. Everything else is in the `.wgsl` files.

use crate::half::HalfFormat;
use crate::render;

use crate::wgsl::{
    HALF, MATMUL, MATMUL_LOAD_SCALAR as LOAD_SCALAR, MATMUL_LOAD_VEC_K as LOAD_VEC_K,
    MATMUL_LOAD_VEC_MN as LOAD_VEC_MN, MATMUL_STORE_SCALAR as STORE_SCALAR,
    MATMUL_STORE_VEC as STORE_VEC, MATMUL_SUBGROUP,
};

/// How a matmul operand is staged: scalar loads with `k` (or the other axis) fastest, or aligned
/// vec4 loads along the axis with stride 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OperandLoad {
    /// Scalar loads, consecutive invocations walk `k`.
    ScalarK,
    /// Scalar loads, consecutive invocations walk the non-`k` axis (m for A, n for B).
    ScalarMn,
    /// vec4 loads along `k` (stride 1 along k; offsets, strides and k multiples of 4).
    VecK,
    /// vec4 loads along m for A or n for B (stride 1 there; offsets, strides, extent multiples of 4).
    VecMn,
}

impl OperandLoad {
    pub const ALL: [OperandLoad; 4] = [
        OperandLoad::ScalarK,
        OperandLoad::ScalarMn,
        OperandLoad::VecK,
        OperandLoad::VecMn,
    ];
    fn is_vec(self) -> bool {
        matches!(self, OperandLoad::VecK | OperandLoad::VecMn)
    }
}

/// One matmul variant: tile shape and operand staging.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatmulConfig {
    /// Rows of c per workgroup.
    pub bm: u32,
    /// Columns of c per workgroup.
    pub bn: u32,
    /// Depth of one staged slab.
    pub bk: u32,
    /// Rows per invocation (a multiple of 4).
    pub tm: u32,
    /// Columns per invocation (a multiple of 4).
    pub tn: u32,
    pub a: OperandLoad,
    pub b: OperandLoad,
    /// vec4 stores of c (n a multiple of 4).
    pub c_vec: bool,
    /// A and B hold packed halves of this format (two per u32 word), unpacked by the scalar
    /// loads as they stage the slabs: half the bytes read, while the slabs, the FMAs and c stay
    /// f32 (the caller rounds c once). Scalar loads only.
    pub half: Option<HalfFormat>,
}

impl MatmulConfig {
    /// Invocations per workgroup.
    pub fn threads(&self) -> u32 {
        (self.bm / self.tm) * (self.bn / self.tn)
    }

    /// Workgroup memory in bytes.
    pub fn shared_bytes(&self) -> u32 {
        4 * self.bk * (self.bm + self.bn)
    }

    /// Whether the tile shape is one the template can build.
    pub fn is_valid(&self) -> bool {
        let p2 = |x: u32| x.is_power_of_two();
        p2(self.bm)
            && p2(self.bn)
            && p2(self.bk)
            && p2(self.tm)
            && p2(self.tn)
            && self.tm >= 4
            && self.tn >= 4
            && self.bk >= 4
            && self.bm >= self.tm
            && self.bn >= self.tn
            && (self.bm * self.bk / 4) >= 1
            && (self.half.is_none() || !(self.a.is_vec() || self.b.is_vec()))
    }

    /// The tile shapes the runtime picks from (see the tensor crate's matmul dispatch).
    pub const TILES: [(u32, u32, u32, u32, u32); 4] = [
        (64, 64, 16, 4, 4),
        (64, 64, 8, 8, 8),
        (32, 32, 16, 4, 4),
        (128, 128, 8, 8, 8),
    ];

    pub(crate) fn source(&self) -> String {
        assert!(self.is_valid(), "invalid matmul tile {self:?}");
        // The operands' element type; c is always f32.
        let ty = |v: bool| match (v, self.half) {
            (_, Some(_)) => "u32",
            (true, None) => "vec4<f32>",
            (false, None) => "f32",
        };
        let (tm, tn4) = (self.tm, self.tn / 4);
        let comp = ["x", "y", "z", "w"];
        let (mut acc, mut inner, mut store) = (String::new(), String::new(), String::new());
        let (mut slab_zero, mut slab_add) = (String::new(), String::new());
        // The invocation's rows are vec4 groups interleaved across ty, its vec4 columns are
        // interleaved across tx; one k step is TM x TN/4 vec4 FMAs.
        for r4 in 0..tm / 4 {
            inner += &format!("            let av{r4} = As[kk * BM4 + {r4}u * NTY + ty];\n");
        }
        for q in 0..tn4 {
            inner += &format!("            let bv{q} = Bs[kk * BN4 + {q}u * NTX + tx];\n");
        }
        for r in 0..tm {
            let (r4, lane) = (r / 4, r % 4);
            for q in 0..tn4 {
                acc += &format!("    var acc_{r}_{q} = vec4<f32>(0.0);\n");
                slab_zero += &format!("        var s_{r}_{q} = vec4<f32>(0.0);\n");
                slab_add += &format!("        acc_{r}_{q} = acc_{r}_{q} + s_{r}_{q};\n");
                inner += &format!(
                    "            s_{r}_{q} = fma(vec4<f32>(av{r4}.{}), bv{q}, s_{r}_{q});\n",
                    comp[lane as usize]
                );
                store += &format!(
                    "    store4(c_base, row0 + ({r4}u * NTY + ty) * 4u + {lane}u, \
                     col0 + ({q}u * NTX + tx) * 4u, acc_{r}_{q});\n"
                );
            }
        }
        let src = render(
            MATMUL,
            &[
                ("BM", &self.bm.to_string()),
                ("BN", &self.bn.to_string()),
                ("BK", &self.bk.to_string()),
                ("TM", &self.tm.to_string()),
                ("TN", &self.tn.to_string()),
                ("NT", &self.threads().to_string()),
                ("A_TYPE", ty(self.a.is_vec())),
                ("B_TYPE", ty(self.b.is_vec())),
                ("C_TYPE", if self.c_vec { "vec4<f32>" } else { "f32" }),
                ("LOAD_A", &self.a.load(Operand::A, self.half)),
                ("LOAD_B", &self.b.load(Operand::B, self.half)),
                ("STORE", store_fn(self.c_vec)),
                ("ACC", acc.trim_end()),
                ("SLAB_ZERO", slab_zero.trim_end()),
                ("SLAB_ADD", slab_add.trim_end()),
                ("INNER", inner.trim_end()),
                ("STORE_ALL", store.trim_end()),
            ],
        );
        match self.half {
            Some(_) => format!("{HALF}\n{src}"),
            None => src,
        }
    }
}

/// The operands of c = A B, as the load files see them: `o` is the axis that is not k.
#[derive(Clone, Copy, PartialEq)]
enum Operand {
    A,
    B,
}

impl OperandLoad {
    /// The `load_a` / `load_b` function of this staging for `x` (with `read_a` / `read_b`
    /// for the scalar loads: an f32 element, or one half of a packed word).
    fn load(self, x: Operand, half: Option<HalfFormat>) -> String {
        // (name, slab, extent, limit, stride along o, stride along k)
        let (name, slab, ext, limit, o_stride, k_stride) = match x {
            Operand::A => ("a", "As", "BM", "params.m", "params.a_rs", "params.a_cs"),
            Operand::B => ("b", "Bs", "BN", "params.n", "params.b_cs", "params.b_rs"),
        };
        let mut vars = vec![
            ("X", name),
            ("SLAB", slab),
            ("EXT", ext),
            ("LIMIT", limit),
            ("O_STRIDE", o_stride),
            ("K_STRIDE", k_stride),
        ];
        // The scalar loads' step order: k fastest, or o fastest.
        let (o_o, k_o) = (format!("l % {ext}"), format!("l / {ext}"));
        let read = match half {
            None => format!("fn read_{name}(i: u32) -> f32 {{\n    return {name}[i];\n}}\n"),
            Some(f) => format!(
                "fn read_{name}(i: u32) -> f32 {{\n    let word = {name}[i >> 1u];\n    \
                 return {}_to_f32((word >> ((i & 1u) * 16u)) & 0xFFFFu);\n}}\n",
                f.wgsl()
            ),
        };
        let template = match self {
            OperandLoad::ScalarK => {
                vars.extend([("O", "l / BK"), ("KK", "l % BK")]);
                LOAD_SCALAR
            }
            OperandLoad::ScalarMn => {
                vars.extend([("O", o_o.as_str()), ("KK", k_o.as_str())]);
                LOAD_SCALAR
            }
            OperandLoad::VecK => LOAD_VEC_K,
            OperandLoad::VecMn => LOAD_VEC_MN,
        };
        // Each file uses only some of the names.
        let used: Vec<(&str, &str)> = vars
            .into_iter()
            .filter(|(k, _)| template.contains(&format!("{{{{{k}}}}}")))
            .collect();
        let load = render(template, &used);
        if template == LOAD_SCALAR {
            format!("{read}{load}")
        } else {
            load
        }
    }
}

/// The `store4` of c's layout.
fn store_fn(c_vec: bool) -> &'static str {
    if c_vec {
        STORE_VEC
    } else {
        STORE_SCALAR
    }
}

/// The subgroup matmul of CPU-backed adapters (`matmul_subgroup.wgsl`): `sg` lanes per
/// workgroup, `s * sg` rows and `4 * sg * q` columns of c per workgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubgroupMatmulConfig {
    pub sg: u32,
    pub s: u32,
    pub q: u32,
    /// vec4 stores of c (n a multiple of 4).
    pub c_vec: bool,
    /// A read where it lies (row-major, see `matmul_subgroup.wgsl`), else packed.
    pub a_direct: bool,
    /// B read where it lies, else packed.
    pub b_direct: bool,
}

impl SubgroupMatmulConfig {
    /// The (s, q) shapes the runtime picks from.
    pub const SHAPES: [(u32, u32); 2] = [(4, 1), (2, 1)];
    /// The subgroup sizes the runtime uses it with (a CPU-backed adapter's fixed size; lavapipe
    /// has 8 or 16 by vector width).
    pub const SUBGROUP_SIZES: [u32; 5] = [4, 8, 16, 32, 64];

    /// Rows of c per workgroup.
    pub fn rows(&self) -> u32 {
        self.s * self.sg
    }
    /// Columns of c per workgroup.
    pub fn cols(&self) -> u32 {
        4 * self.sg * self.q
    }

    /// A's index set-up, one k4 step's loads (`av0..`) and the step: packed or in place.
    fn a_reads(&self) -> (String, String, String) {
        let (sg, tm) = (self.sg, self.rows());
        let (mut init, mut loads) = (String::new(), String::new());
        if self.a_direct {
            init += "    var ai = params.a_off + batch * params.a_bs + k4_begin;\n";
            for ss in 0..self.s {
                let r0 = ss * sg;
                init +=
                    &format!("    let ar{ss} = min(row0 + {r0}u + lane, M - 1u) * params.a_rs;\n");
                loads += &format!("        let av{ss} = a[ai + ar{ss}];\n");
            }
            (init, loads, "        ai = ai + 1u;".into())
        } else {
            init += &format!(
                "    var ai = batch * params.a_bs + (wid.y * K4 + k4_begin) * {tm}u + lane;\n"
            );
            for ss in 0..self.s {
                loads += &format!("        let av{ss} = a[ai + {}u];\n", ss * sg);
            }
            (init, loads, format!("        ai = ai + {tm}u;"))
        }
    }

    /// B's index set-up, one k4 step's loads (`b{e}_{q}`: row k + e, lane's vec4 of panel q)
    /// and the step: packed or in place.
    fn b_reads(&self) -> (String, String, String) {
        let (sg, w) = (self.sg, self.sg * self.q);
        let (mut init, mut loads) = (String::new(), String::new());
        if self.b_direct {
            init +=
                "    var bi = params.b_off + batch * params.b_bs + k4_begin * 4u * params.b_rs;\n";
            for qq in 0..self.q {
                let c0 = qq * sg;
                init += &format!(
                    "    let bc{qq} = min(wid.x * {w}u + {c0}u + lane, (N >> 2u) - 1u);\n"
                );
            }
            for e in 0..4 {
                for qq in 0..self.q {
                    loads +=
                        &format!("        let b{e}_{qq} = b[bi + {e}u * params.b_rs + bc{qq}];\n");
                }
            }
            (init, loads, "        bi = bi + 4u * params.b_rs;".into())
        } else {
            init += &format!(
                "    var bi = batch * params.b_bs + (wid.x * K4 * 4u + k4_begin * 4u) * {w}u + lane;\n"
            );
            for e in 0..4 {
                for qq in 0..self.q {
                    loads += &format!("        let b{e}_{qq} = b[bi + {}u];\n", e * w + qq * sg);
                }
            }
            (init, loads, format!("        bi = bi + {}u;", 4 * w))
        }
    }

    pub(crate) fn source(&self) -> String {
        let (sg, s, q) = (self.sg, self.s, self.q);
        assert!(sg.is_power_of_two() && s >= 1 && q >= 1, "invalid {self:?}");
        let tm = s * sg;
        let w = sg * q;
        let comp = ["x", "y", "z", "w"];
        let (mut acc, mut inner, mut store) = (String::new(), String::new(), String::new());
        let (mut slab_zero, mut slab_add) = (String::new(), String::new());
        let (a_init, a_loads, a_step) = self.a_reads();
        let (b_init, b_loads, b_step) = self.b_reads();
        let loads = a_loads + &b_loads;
        for r in 0..tm {
            inner += &format!(
                "        let a{r} = subgroupBroadcast(av{}, {}u);\n",
                r / sg,
                r % sg
            );
            for (e, cmp) in comp.iter().enumerate() {
                for qq in 0..q {
                    inner += &format!(
                        "            s_{r}_{qq} = fma(vec4<f32>(a{r}.{cmp}), b{e}_{qq}, s_{r}_{qq});\n"
                    );
                }
            }
            for qq in 0..q {
                acc += &format!("    var acc_{r}_{qq} = vec4<f32>(0.0);\n");
                slab_zero += &format!("        var s_{r}_{qq} = vec4<f32>(0.0);\n");
                slab_add += &format!("        acc_{r}_{qq} = acc_{r}_{qq} + s_{r}_{qq};\n");
                store += &format!(
                    "    store4(c_base, row0 + {r}u, (wid.x * {w}u + {}u + lane) * 4u, acc_{r}_{qq});\n",
                    qq * sg
                );
            }
        }
        render(
            MATMUL_SUBGROUP,
            &[
                ("SG", &sg.to_string()),
                ("TM", &tm.to_string()),
                ("W", &w.to_string()),
                ("C_TYPE", if self.c_vec { "vec4<f32>" } else { "f32" }),
                ("STORE", store_fn(self.c_vec)),
                ("ACC", acc.trim_end()),
                ("SLAB_ZERO", slab_zero.trim_end()),
                ("SLAB_ADD", slab_add.trim_end()),
                ("A_INIT", a_init.trim_end()),
                ("B_INIT", b_init.trim_end()),
                ("A_STEP", &a_step),
                ("B_STEP", &b_step),
                ("LOADS", loads.trim_end()),
                ("INNER", inner.trim_end()),
                ("STORE_ALL", store.trim_end()),
            ],
        )
    }
}
