//! wgpipe-shaders: the WGSL compute shaders of wgpipe and a tiny API that hands out the final
//! source of each kernel variant.
//!
//! The `.wgsl` files in `src/` are included verbatim; a few are templates whose `{{NAME}}`
//! placeholders are filled here (one elementwise template for every unary/binary/select op, one
//! reduce template for every reduction, one matmul template for every tile shape and operand
//! layout). [`Kernel`] names one variant; [`Kernel::source`] gives its WGSL, with `common.wgsl`
//! (the parameter-block binding and helpers) prepended. Every kernel reads its shapes and scalars
//! from binding 0, a `array<u32>` parameter block (f32 values as bits).
//!
//! `tests/validate.rs` parses and validates every variant ([`Kernel::all`]) with naga, so a typo
//! fails `cargo test` without a GPU.

const COMMON: &str = include_str!("common.wgsl");
const ELEMENTWISE: &str = include_str!("elementwise.wgsl");
const COPY_STRIDED: &str = include_str!("copy_strided.wgsl");
const FILL: &str = include_str!("fill.wgsl");
const REDUCE: &str = include_str!("reduce.wgsl");
const SOFTMAX: &str = include_str!("softmax.wgsl");
const LAYER_NORM: &str = include_str!("layer_norm.wgsl");
const MATMUL: &str = include_str!("matmul.wgsl");
const MATMUL_SUBGROUP: &str = include_str!("matmul_subgroup.wgsl");
const PACK: &str = include_str!("pack.wgsl");
const INDEX: &str = include_str!("index.wgsl");
const SPATIAL: &str = include_str!("spatial.wgsl");
const PHILOX: &str = include_str!("philox.wgsl");
const DROPOUT: &str = include_str!("dropout.wgsl");
const ADAM: &str = include_str!("adam.wgsl");

/// Invocations per workgroup of the one-invocation-per-element kernels.
pub const ELEMENTWISE_WG: u32 = 256;
/// Invocations per workgroup of the one-workgroup-per-row kernels (reduce, softmax, layer norm)
/// on GPUs. CPU-backed adapters take one subgroup per row instead (see `ROW_WG_CHOICES`).
pub const ROW_WG: u32 = 256;

/// The row-kernel workgroup sizes the runtime may ask for (powers of two).
pub const ROW_WG_CHOICES: [u32; 5] = [8, 16, 32, 64, 256];

/// Fills the `{{KEY}}` placeholders of `template`; panics if one is left (a bug caught by the
/// validation test).
pub fn render(template: &str, vars: &[(&str, &str)]) -> String {
    let mut s = template.to_string();
    for (k, v) in vars {
        s = s.replace(&format!("{{{{{k}}}}}"), v);
    }
    if let Some(p) = s.find("{{") {
        let end = s[p..].find("}}").map(|e| p + e + 2).unwrap_or(s.len());
        panic!("unfilled shader placeholder {}", &s[p..end]);
    }
    s
}

/// How a binding is used: the parameter block and inputs are read-only, outputs read-write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    ReadWrite,
}

/// How the elementwise kernels read their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EwLayout {
    /// Each input at its offset + i.
    Contiguous,
    /// Each input through its shape, strides and offset.
    Strided,
    /// Contiguous inputs at offsets that are multiples of 4, four elements per invocation.
    Vec4,
}

impl EwLayout {
    pub const ALL: [EwLayout; 3] = [EwLayout::Contiguous, EwLayout::Strided, EwLayout::Vec4];
}

/// Elementwise unary ops; `s0`, `s1` are the scalars of the parameter block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unary {
    /// `a` (the strided-to-contiguous copy).
    Identity,
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Abs,
    Sign,
    Tanh,
    Sigmoid,
    Relu,
    Gelu,
    GeluGrad,
    Sin,
    Cos,
    Square,
    Recip,
    /// `a * s0 + s1`.
    Affine,
    /// `a ^ s0`.
    Powf,
    /// `s0 / a`.
    RDiv,
    /// `s0 - a`.
    RSub,
    MaxScalar,
    MinScalar,
    GtScalar,
    EqScalar,
}

impl Unary {
    pub const ALL: [Unary; 25] = [
        Unary::Identity,
        Unary::Neg,
        Unary::Exp,
        Unary::Log,
        Unary::Sqrt,
        Unary::Rsqrt,
        Unary::Abs,
        Unary::Sign,
        Unary::Tanh,
        Unary::Sigmoid,
        Unary::Relu,
        Unary::Gelu,
        Unary::GeluGrad,
        Unary::Sin,
        Unary::Cos,
        Unary::Square,
        Unary::Recip,
        Unary::Affine,
        Unary::Powf,
        Unary::RDiv,
        Unary::RSub,
        Unary::MaxScalar,
        Unary::MinScalar,
        Unary::GtScalar,
        Unary::EqScalar,
    ];

    /// The WGSL expression over `a`, `s0`, `s1`.
    pub fn expr(self) -> &'static str {
        match self {
            Unary::Identity => "a",
            Unary::Neg => "-a",
            Unary::Exp => "exp(a)",
            Unary::Log => "log(a)",
            Unary::Sqrt => "sqrt(a)",
            Unary::Rsqrt => "inverseSqrt(a)",
            Unary::Abs => "abs(a)",
            Unary::Sign => "sign(a)",
            Unary::Tanh => "tanh_c(a)",
            Unary::Sigmoid => "sigmoid(a)",
            Unary::Relu => "max(a, 0.0)",
            Unary::Gelu => "gelu(a)",
            Unary::GeluGrad => "gelu_grad(a)",
            Unary::Sin => "sin(a)",
            Unary::Cos => "cos(a)",
            Unary::Square => "a * a",
            Unary::Recip => "1.0 / a",
            Unary::Affine => "a * s0 + s1",
            Unary::Powf => "spow(a, s0)",
            Unary::RDiv => "s0 / a",
            Unary::RSub => "s0 - a",
            Unary::MaxScalar => "max(a, s0)",
            Unary::MinScalar => "min(a, s0)",
            Unary::GtScalar => "flag(a > s0)",
            Unary::EqScalar => "flag(a == s0)",
        }
    }
}

/// Elementwise binary ops (comparisons give 1.0 / 0.0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Pow,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Binary {
    pub const ALL: [Binary; 13] = [
        Binary::Add,
        Binary::Sub,
        Binary::Mul,
        Binary::Div,
        Binary::Maximum,
        Binary::Minimum,
        Binary::Pow,
        Binary::Eq,
        Binary::Ne,
        Binary::Lt,
        Binary::Le,
        Binary::Gt,
        Binary::Ge,
    ];

    /// The WGSL expression over `a`, `b`.
    pub fn expr(self) -> &'static str {
        match self {
            Binary::Add => "a + b",
            Binary::Sub => "a - b",
            Binary::Mul => "a * b",
            Binary::Div => "a / b",
            Binary::Maximum => "max(a, b)",
            Binary::Minimum => "min(a, b)",
            Binary::Pow => "spow(a, b)",
            Binary::Eq => "flag(a == b)",
            Binary::Ne => "flag(a != b)",
            Binary::Lt => "flag(a < b)",
            Binary::Le => "flag(a <= b)",
            Binary::Gt => "flag(a > b)",
            Binary::Ge => "flag(a >= b)",
        }
    }
}

/// Row reductions; the arg variants store the first index of the extreme as f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduce {
    Sum,
    Max,
    Min,
    ArgMax,
    ArgMin,
}

impl Reduce {
    pub const ALL: [Reduce; 5] = [
        Reduce::Sum,
        Reduce::Max,
        Reduce::Min,
        Reduce::ArgMax,
        Reduce::ArgMin,
    ];

    fn parts(self) -> (&'static str, &'static str, &'static str) {
        // (identity, combine body, result)
        const INF: &str = "bitcast<f32>(0x7f800000u)";
        const NEG_INF: &str = "bitcast<f32>(0xff800000u)";
        match self {
            Reduce::Sum => ("0.0", "return Acc(a.v + b.v, 0u);", "best.v"),
            Reduce::Max => (
                NEG_INF,
                "if (b.v > a.v) { return b; }\n    return a;",
                "best.v",
            ),
            Reduce::Min => (INF, "if (b.v < a.v) { return b; }\n    return a;", "best.v"),
            Reduce::ArgMax => (
                NEG_INF,
                "if (b.v > a.v || (b.v == a.v && b.i < a.i)) { return b; }\n    return a;",
                "f32(best.i)",
            ),
            Reduce::ArgMin => (
                INF,
                "if (b.v < a.v || (b.v == a.v && b.i < a.i)) { return b; }\n    return a;",
                "f32(best.i)",
            ),
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
}

impl ReduceMode {
    pub const ALL: [ReduceMode; 3] = [ReduceMode::Direct, ReduceMode::Partial, ReduceMode::Final];
}

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
    }

    /// The tile shapes the runtime picks from (see the tensor crate's matmul dispatch).
    pub const TILES: [(u32, u32, u32, u32, u32); 4] = [
        (64, 64, 16, 4, 4),
        (64, 64, 8, 8, 8),
        (32, 32, 16, 4, 4),
        (128, 128, 8, 8, 8),
    ];

    fn source(&self) -> String {
        assert!(self.is_valid(), "invalid matmul tile {self:?}");
        let ty = |v: bool| if v { "vec4<f32>" } else { "f32" };
        let tm = self.tm;
        let tn4 = self.tn / 4;
        let i2 = "        "; // indentation inside the k0 loop
        let i3 = "            ";

        let mut acc = String::new();
        for r in 0..tm {
            for q in 0..tn4 {
                acc += &format!("    var acc_{r}_{q} = vec4<f32>(0.0);\n");
            }
        }

        // One k step: the invocation's rows (vec4 groups interleaved across ty) and vec4 columns
        // (interleaved across tx), then TM x TN/4 vec4 FMAs.
        let mut inner = String::new();
        for r4 in 0..tm / 4 {
            inner += &format!("{i3}let av{r4} = As[kk * BM4 + {r4}u * NTY + ty];\n");
        }
        for q in 0..tn4 {
            inner += &format!("{i3}let bv{q} = Bs[kk * BN4 + {q}u * NTX + tx];\n");
        }
        let comp = ["x", "y", "z", "w"];
        for r in 0..tm {
            for q in 0..tn4 {
                inner += &format!(
                    "{i3}acc_{r}_{q} = fma(vec4<f32>(av{}.{}), bv{q}, acc_{r}_{q});\n",
                    r / 4,
                    comp[(r % 4) as usize]
                );
            }
        }

        let load_a = match self.a {
            OperandLoad::ScalarK | OperandLoad::ScalarMn => {
                let (i, kk) = if self.a == OperandLoad::ScalarK {
                    ("l / BK", "l % BK")
                } else {
                    ("l % BM", "l / BM")
                };
                format!(
                    "{i2}for (var l = lid; l < BM * BK; l = l + NT) {{
{i3}let i = {i};
{i3}let kk = {kk};
{i3}let gi = row0 + i;
{i3}let gk = k0 + kk;
{i3}var v = 0.0;
{i3}if (gi < M && gk < K) {{ v = a[a_base + gi * a_rs + gk * a_cs]; }}
{i3}As[kk * BM4 + i / 4u][i % 4u] = v;
{i2}}}"
                )
            }
            OperandLoad::VecK => format!(
                "{i2}for (var l = lid; l < BM * BK / 4u; l = l + NT) {{
{i3}let i = l / (BK / 4u);
{i3}let kq = (l % (BK / 4u)) * 4u;
{i3}let gi = row0 + i;
{i3}let gk = k0 + kq;
{i3}var v = vec4<f32>(0.0);
{i3}if (gi < M && gk < K) {{ v = a[(a_base + gi * a_rs + gk) / 4u]; }}
{i3}As[kq * BM4 + i / 4u][i % 4u] = v.x;
{i3}As[(kq + 1u) * BM4 + i / 4u][i % 4u] = v.y;
{i3}As[(kq + 2u) * BM4 + i / 4u][i % 4u] = v.z;
{i3}As[(kq + 3u) * BM4 + i / 4u][i % 4u] = v.w;
{i2}}}"
            ),
            OperandLoad::VecMn => format!(
                "{i2}for (var l = lid; l < BM * BK / 4u; l = l + NT) {{
{i3}let iq = l % BM4;
{i3}let kk = l / BM4;
{i3}let gi = row0 + iq * 4u;
{i3}let gk = k0 + kk;
{i3}var v = vec4<f32>(0.0);
{i3}if (gi < M && gk < K) {{ v = a[(a_base + gi + gk * a_cs) / 4u]; }}
{i3}As[kk * BM4 + iq] = v;
{i2}}}"
            ),
        };

        let load_b = match self.b {
            OperandLoad::ScalarK | OperandLoad::ScalarMn => {
                let (j, kk) = if self.b == OperandLoad::ScalarK {
                    ("l / BK", "l % BK")
                } else {
                    ("l % BN", "l / BN")
                };
                format!(
                    "{i2}for (var l = lid; l < BN * BK; l = l + NT) {{
{i3}let j = {j};
{i3}let kk = {kk};
{i3}let gj = col0 + j;
{i3}let gk = k0 + kk;
{i3}var v = 0.0;
{i3}if (gj < N && gk < K) {{ v = b[b_base + gk * b_rs + gj * b_cs]; }}
{i3}Bs[kk * BN4 + j / 4u][j % 4u] = v;
{i2}}}"
                )
            }
            OperandLoad::VecK => format!(
                "{i2}for (var l = lid; l < BN * BK / 4u; l = l + NT) {{
{i3}let j = l / (BK / 4u);
{i3}let kq = (l % (BK / 4u)) * 4u;
{i3}let gj = col0 + j;
{i3}let gk = k0 + kq;
{i3}var v = vec4<f32>(0.0);
{i3}if (gj < N && gk < K) {{ v = b[(b_base + gk + gj * b_cs) / 4u]; }}
{i3}Bs[kq * BN4 + j / 4u][j % 4u] = v.x;
{i3}Bs[(kq + 1u) * BN4 + j / 4u][j % 4u] = v.y;
{i3}Bs[(kq + 2u) * BN4 + j / 4u][j % 4u] = v.z;
{i3}Bs[(kq + 3u) * BN4 + j / 4u][j % 4u] = v.w;
{i2}}}"
            ),
            OperandLoad::VecMn => format!(
                "{i2}for (var l = lid; l < BN * BK / 4u; l = l + NT) {{
{i3}let jq = l % BN4;
{i3}let kk = l / BN4;
{i3}let gj = col0 + jq * 4u;
{i3}let gk = k0 + kk;
{i3}var v = vec4<f32>(0.0);
{i3}if (gj < N && gk < K) {{ v = b[(b_base + gk * b_rs + gj) / 4u]; }}
{i3}Bs[kk * BN4 + jq] = v;
{i2}}}"
            ),
        };

        let mut store = String::new();
        for r in 0..tm {
            store += &format!(
                "    let row_{r} = row0 + ({}u * NTY + ty) * 4u + {}u;\n",
                r / 4,
                r % 4
            );
            store += &format!("    if (row_{r} < M) {{\n");
            for q in 0..tn4 {
                store += &format!("        let col_{r}_{q} = col0 + ({q}u * NTX + tx) * 4u;\n");
                if self.c_vec {
                    store += &format!(
                        "        if (col_{r}_{q} < N) {{\n            let ci = (c_base + row_{r} * N + col_{r}_{q}) / 4u;\n            if (accumulate) {{ c[ci] = c[ci] + acc_{r}_{q}; }} else {{ c[ci] = acc_{r}_{q}; }}\n        }}\n"
                    );
                } else {
                    store += &format!(
                        "        for (var e = 0u; e < 4u; e = e + 1u) {{\n            let ci = c_base + row_{r} * N + col_{r}_{q} + e;\n            if (col_{r}_{q} + e < N) {{\n                if (accumulate) {{ c[ci] = c[ci] + acc_{r}_{q}[e]; }} else {{ c[ci] = acc_{r}_{q}[e]; }}\n            }}\n        }}\n"
                    );
                }
            }
            store += "    }\n";
        }

        render(
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
                ("C_TYPE", ty(self.c_vec)),
                ("ACC", &acc),
                ("INNER", &inner),
                ("LOAD_A", &load_a),
                ("LOAD_B", &load_b),
                ("STORE", &store),
            ],
        )
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
}

impl SubgroupMatmulConfig {
    /// The (s, q) shapes the runtime picks from.
    pub const SHAPES: [(u32, u32); 2] = [(4, 1), (2, 1)];

    /// Rows of c per workgroup.
    pub fn rows(&self) -> u32 {
        self.s * self.sg
    }
    /// Columns of c per workgroup.
    pub fn cols(&self) -> u32 {
        4 * self.sg * self.q
    }

    fn source(&self) -> String {
        let (sg, s, q) = (self.sg, self.s, self.q);
        assert!(sg.is_power_of_two() && s >= 1 && q >= 1, "invalid {self:?}");
        let tm = s * sg;
        let w = sg * q;
        let i2 = "        ";
        let mut acc = String::new();
        for r in 0..tm {
            for qq in 0..q {
                acc += &format!("    var acc_{r}_{qq} = vec4<f32>(0.0);\n");
            }
        }
        let mut loads = String::new();
        for e in 0..4 {
            for qq in 0..q {
                loads += &format!("{i2}let b{e}_{qq} = b[bi + {}u];\n", e * w + qq * sg);
            }
        }
        for ss in 0..s {
            loads += &format!("{i2}let av{ss} = a[ai + {}u];\n", ss * sg);
        }
        let comp = ["x", "y", "z", "w"];
        let mut inner = String::new();
        for r in 0..tm {
            inner += &format!(
                "{i2}let a{r} = subgroupBroadcast(av{}, {}u);\n",
                r / sg,
                r % sg
            );
            for (e, cmp) in comp.iter().enumerate() {
                for qq in 0..q {
                    inner += &format!(
                        "{i2}acc_{r}_{qq} = fma(vec4<f32>(a{r}.{cmp}), b{e}_{qq}, acc_{r}_{qq});\n"
                    );
                }
            }
        }
        let mut store = String::new();
        for r in 0..tm {
            store += &format!("    if (row0 + {r}u < M) {{\n");
            for qq in 0..q {
                store += &format!(
                    "        let col4_{r}_{qq} = wid.x * {w}u + {}u + lane;\n",
                    qq * sg
                );
                if self.c_vec {
                    store += &format!(
                        "        if (col4_{r}_{qq} * 4u < N) {{\n            let ci = (c_base + (row0 + {r}u) * N) / 4u + col4_{r}_{qq};\n            if (accumulate) {{ c[ci] = c[ci] + acc_{r}_{qq}; }} else {{ c[ci] = acc_{r}_{qq}; }}\n        }}\n"
                    );
                } else {
                    store += &format!(
                        "        for (var e = 0u; e < 4u; e = e + 1u) {{\n            let col = col4_{r}_{qq} * 4u + e;\n            if (col < N) {{\n                let ci = c_base + (row0 + {r}u) * N + col;\n                if (accumulate) {{ c[ci] = c[ci] + acc_{r}_{qq}[e]; }} else {{ c[ci] = acc_{r}_{qq}[e]; }}\n            }}\n        }}\n"
                    );
                }
            }
            store += "    }\n";
        }
        render(
            MATMUL_SUBGROUP,
            &[
                ("SG", &sg.to_string()),
                ("TM", &tm.to_string()),
                ("W", &w.to_string()),
                ("C_TYPE", if self.c_vec { "vec4<f32>" } else { "f32" }),
                ("ACC", &acc),
                ("LOADS", &loads),
                ("INNER", &inner),
                ("STORE", &store),
            ],
        )
    }
}

/// Entry points of `index.wgsl`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexKernel {
    IndexSelect,
    Gather,
    IndexAdd,
    ScatterAdd,
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

/// One compute kernel variant: what the runtime compiles and caches a pipeline for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `out = op(a)`.
    Unary {
        op: Unary,
        layout: EwLayout,
    },
    /// `out = op(a, b)` over inputs of one shape.
    Binary {
        op: Binary,
        layout: EwLayout,
    },
    /// `out = a != 0 ? b : c`.
    Where {
        layout: EwLayout,
    },
    /// Strided-to-strided copy (concat).
    CopyStrided,
    /// `out = value`.
    Fill,
    /// Row reductions, `wg` invocations per row (a power of two).
    Reduce {
        op: Reduce,
        mode: ReduceMode,
        wg: u32,
    },
    Softmax {
        log: bool,
        wg: u32,
    },
    LayerNorm {
        wg: u32,
    },
    Matmul(MatmulConfig),
    /// Needs the `SUBGROUP` feature and a fixed subgroup size of `sg`.
    MatmulSubgroup(SubgroupMatmulConfig),
    /// Strided matrices to the tiled, padded operand layout of `MatmulSubgroup`.
    Pack,
    Index(IndexKernel),
    Spatial(SpatialKernel),
    Dropout,
    Adam,
}

impl Kernel {
    /// The complete WGSL of this variant.
    pub fn source(&self) -> String {
        let wg = ELEMENTWISE_WG.to_string();
        let body = match *self {
            Kernel::Unary { op, layout } => elementwise(1, layout, op.expr()),
            Kernel::Binary { op, layout } => elementwise(2, layout, op.expr()),
            Kernel::Where { layout } => elementwise(3, layout, "select(c, b, a != 0.0)"),
            Kernel::CopyStrided => render(COPY_STRIDED, &[("WG", &wg)]),
            Kernel::Fill => render(FILL, &[("WG", &wg)]),
            Kernel::Reduce { op, mode, wg } => {
                let (identity, combine, result) = op.parts();
                let (bindings, load, store) = match mode {
                    ReduceMode::Direct => (
                        "@group(0) @binding(1) var<storage, read> x: array<f32>;\n\
                         @group(0) @binding(2) var<storage, read_write> out: array<f32>;",
                        "Acc(x[base + j], j)".to_string(),
                        format!("out[g] = {result};"),
                    ),
                    ReduceMode::Partial => (
                        "@group(0) @binding(1) var<storage, read> x: array<f32>;\n\
                         @group(0) @binding(2) var<storage, read_write> part_v: array<f32>;\n\
                         @group(0) @binding(3) var<storage, read_write> part_i: array<u32>;",
                        "Acc(x[base + j], j)".to_string(),
                        "part_v[g] = best.v;\n        part_i[g] = best.i;".to_string(),
                    ),
                    ReduceMode::Final => (
                        "@group(0) @binding(1) var<storage, read> part_v: array<f32>;\n\
                         @group(0) @binding(2) var<storage, read> part_i: array<u32>;\n\
                         @group(0) @binding(3) var<storage, read_write> out: array<f32>;",
                        "Acc(part_v[base + j], part_i[base + j])".to_string(),
                        format!("out[g] = {result};"),
                    ),
                };
                render(
                    REDUCE,
                    &[
                        ("WG", &wg.to_string()),
                        ("IDENTITY", identity),
                        ("COMBINE", combine),
                        ("BINDINGS", bindings),
                        ("LOAD", &load),
                        ("STORE", &store),
                    ],
                )
            }
            Kernel::Softmax { log, wg } => render(
                SOFTMAX,
                &[
                    ("WG", &wg.to_string()),
                    ("LOG", if log { "true" } else { "false" }),
                ],
            ),
            Kernel::LayerNorm { wg } => render(LAYER_NORM, &[("WG", &wg.to_string())]),
            Kernel::Matmul(cfg) => cfg.source(),
            Kernel::MatmulSubgroup(cfg) => cfg.source(),
            Kernel::Pack => render(PACK, &[("WG", &wg)]),
            Kernel::Index(_) => render(INDEX, &[("WG", &wg)]),
            Kernel::Spatial(_) => render(SPATIAL, &[("WG", &wg)]),
            Kernel::Dropout => format!("{PHILOX}\n{}", render(DROPOUT, &[("WG", &wg)])),
            Kernel::Adam => render(ADAM, &[("WG", &wg)]),
        };
        format!("{COMMON}\n{body}")
    }

    /// Whether the variant needs the `SUBGROUP` device feature (and naga capability).
    pub fn needs_subgroups(&self) -> bool {
        matches!(self, Kernel::MatmulSubgroup(_))
    }

    /// The entry point to compile.
    pub fn entry_point(&self) -> &'static str {
        match self {
            Kernel::Index(k) => match k {
                IndexKernel::IndexSelect => "index_select",
                IndexKernel::Gather => "gather",
                IndexKernel::IndexAdd => "index_add",
                IndexKernel::ScatterAdd => "scatter_add",
            },
            Kernel::Spatial(k) => match k {
                SpatialKernel::Im2col => "im2col",
                SpatialKernel::Col2im => "col2im",
                SpatialKernel::MaxPool2d => "max_pool2d",
                SpatialKernel::MaxPool2dBackward => "max_pool2d_backward",
                SpatialKernel::AvgPool2d => "avg_pool2d",
                SpatialKernel::AvgPool2dBackward => "avg_pool2d_backward",
            },
            _ => "main",
        }
    }

    /// The bindings after the parameter block (binding 0), as `(binding, access)` in the order
    /// the runtime passes buffers: inputs first, then outputs.
    pub fn bindings(&self) -> Vec<(u32, Access)> {
        use Access::{Read as R, ReadWrite as W};
        let seq = |reads: u32, writes: u32| -> Vec<(u32, Access)> {
            (1..=reads)
                .map(|b| (b, R))
                .chain((reads + 1..=reads + writes).map(|b| (b, W)))
                .collect()
        };
        match self {
            Kernel::Unary { .. } => seq(1, 1),
            Kernel::Binary { .. } => seq(2, 1),
            Kernel::Where { .. } => seq(3, 1),
            Kernel::CopyStrided => seq(1, 1),
            Kernel::Fill | Kernel::Dropout => seq(0, 1),
            Kernel::Reduce { mode, .. } => match mode {
                ReduceMode::Direct => seq(1, 1),
                ReduceMode::Partial => seq(1, 2),
                ReduceMode::Final => seq(2, 1),
            },
            Kernel::Softmax { .. } => seq(1, 1),
            Kernel::LayerNorm { .. } => seq(3, 3),
            Kernel::Matmul(_) | Kernel::MatmulSubgroup(_) => seq(2, 1),
            Kernel::Pack => seq(1, 1),
            Kernel::Index(_) => seq(2, 1),
            Kernel::Spatial(k) => match k {
                SpatialKernel::MaxPool2d => vec![(1, R), (3, W), (4, W)],
                SpatialKernel::MaxPool2dBackward => vec![(1, R), (2, R), (3, W)],
                _ => vec![(1, R), (3, W)],
            },
            Kernel::Adam => seq(4, 3),
        }
    }

    /// Invocations per workgroup (the host sizes dispatches with it).
    pub fn workgroup_size(&self) -> u32 {
        match self {
            Kernel::Reduce { wg, .. } | Kernel::Softmax { wg, .. } | Kernel::LayerNorm { wg } => {
                *wg
            }
            Kernel::Matmul(cfg) => cfg.threads(),
            Kernel::MatmulSubgroup(cfg) => cfg.sg,
            _ => ELEMENTWISE_WG,
        }
    }

    /// Every variant the runtime can ask for (what the validation test compiles).
    pub fn all() -> Vec<Kernel> {
        let mut v = Vec::new();
        for layout in EwLayout::ALL {
            v.extend(Unary::ALL.iter().map(|&op| Kernel::Unary { op, layout }));
            v.extend(Binary::ALL.iter().map(|&op| Kernel::Binary { op, layout }));
            v.push(Kernel::Where { layout });
        }
        v.extend([Kernel::CopyStrided, Kernel::Fill]);
        for wg in ROW_WG_CHOICES {
            for op in Reduce::ALL {
                v.extend(
                    ReduceMode::ALL
                        .iter()
                        .map(|&mode| Kernel::Reduce { op, mode, wg }),
                );
            }
            v.extend([
                Kernel::Softmax { log: false, wg },
                Kernel::Softmax { log: true, wg },
                Kernel::LayerNorm { wg },
            ]);
        }
        for (bm, bn, bk, tm, tn) in MatmulConfig::TILES {
            for a in OperandLoad::ALL {
                for b in OperandLoad::ALL {
                    for c_vec in [false, true] {
                        v.push(Kernel::Matmul(MatmulConfig {
                            bm,
                            bn,
                            bk,
                            tm,
                            tn,
                            a,
                            b,
                            c_vec,
                        }));
                    }
                }
            }
        }
        for sg in [8, 16] {
            for (s, q) in SubgroupMatmulConfig::SHAPES {
                for c_vec in [false, true] {
                    v.push(Kernel::MatmulSubgroup(SubgroupMatmulConfig {
                        sg,
                        s,
                        q,
                        c_vec,
                    }));
                }
            }
        }
        v.push(Kernel::Pack);
        v.extend(
            [
                IndexKernel::IndexSelect,
                IndexKernel::Gather,
                IndexKernel::IndexAdd,
                IndexKernel::ScatterAdd,
            ]
            .map(Kernel::Index),
        );
        v.extend(
            [
                SpatialKernel::Im2col,
                SpatialKernel::Col2im,
                SpatialKernel::MaxPool2d,
                SpatialKernel::MaxPool2dBackward,
                SpatialKernel::AvgPool2d,
                SpatialKernel::AvgPool2dBackward,
            ]
            .map(Kernel::Spatial),
        );
        v.extend([Kernel::Dropout, Kernel::Adam]);
        v
    }
}

/// The elementwise template for `arity` inputs (named a, b, c in `expr`).
fn elementwise(arity: usize, layout: EwLayout, expr: &str) -> String {
    const NAMES: [&str; 3] = ["a", "b", "c"];
    let vec = layout == EwLayout::Vec4;
    let ty = if vec { "vec4<f32>" } else { "f32" };
    let mut inputs = String::new();
    let mut body = String::new();
    for (k, name) in NAMES.iter().enumerate().take(arity) {
        inputs += &format!(
            "@group(0) @binding({}) var<storage, read> in_{name}: array<{ty}>;\n",
            k + 1
        );
    }
    let out = format!(
        "@group(0) @binding({}) var<storage, read_write> out: array<{ty}>;",
        arity + 1
    );
    // Input k's offset is at params[4 + rank + k * (rank + 1)], its strides follow.
    let offset = |k: usize| format!("params[4u + rank + {k}u * (rank + 1u)]");
    match layout {
        EwLayout::Contiguous => {
            for (k, name) in NAMES.iter().enumerate().take(arity) {
                body += &format!("    let {name} = in_{name}[{} + i];\n", offset(k));
            }
        }
        EwLayout::Strided => {
            for (k, name) in NAMES.iter().enumerate().take(arity) {
                body += &format!("    var i{name} = {};\n", offset(k));
            }
            body += "    var rem = i;\n    for (var d = rank; d > 0u; d = d - 1u) {\n";
            body += "        let k = d - 1u;\n        let size = params[4u + k];\n";
            body += "        let coord = rem % size;\n        rem = rem / size;\n";
            for (k, name) in NAMES.iter().enumerate().take(arity) {
                body += &format!(
                    "        i{name} = i{name} + coord * params[4u + rank + {k}u * (rank + 1u) + 1u + k];\n"
                );
            }
            body += "    }\n";
            for name in NAMES.iter().take(arity) {
                body += &format!("    let {name} = in_{name}[i{name}];\n");
            }
        }
        EwLayout::Vec4 => {
            for (k, name) in NAMES.iter().enumerate().take(arity) {
                body += &format!("    let v{name} = in_{name}[{} / 4u + i];\n", offset(k));
            }
        }
    }
    if vec {
        let lane = |c: &str| -> String {
            let args: Vec<String> = NAMES
                .iter()
                .enumerate()
                .map(|(k, n)| {
                    if k < arity {
                        format!("v{n}.{c}")
                    } else {
                        "0.0".to_string()
                    }
                })
                .collect();
            format!("op({}, s0, s1)", args.join(", "))
        };
        body += &format!(
            "    out[i] = vec4<f32>({}, {}, {}, {});\n",
            lane("x"),
            lane("y"),
            lane("z"),
            lane("w")
        );
    } else {
        let args: Vec<&str> = (0..3)
            .map(|k| if k < arity { NAMES[k] } else { "0.0" })
            .collect();
        body += &format!("    out[i] = op({}, s0, s1);\n", args.join(", "));
    }
    render(
        ELEMENTWISE,
        &[
            ("WG", &ELEMENTWISE_WG.to_string()),
            ("INPUTS", &inputs),
            ("OUT", &out),
            ("EXPR", expr),
            ("BODY", &body),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_fills_and_complains() {
        assert_eq!(render("x{{A}}y", &[("A", "1")]), "x1y");
        let r = std::panic::catch_unwind(|| render("{{B}}", &[]));
        assert!(r.is_err());
    }

    #[test]
    fn bindings_are_distinct() {
        for k in Kernel::all() {
            let b = k.bindings();
            let mut ids: Vec<u32> = b.iter().map(|x| x.0).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), b.len(), "{k:?}");
        }
    }
}
