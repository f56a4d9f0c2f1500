//! The elementwise family (`elementwise.wgsl`): unary, binary, unary-gradient and select
//! kernels over up to three inputs in one of three layouts.

use crate::{render, ELEMENTWISE_WG};

use crate::wgsl::ELEMENTWISE;

/// How the elementwise kernels read their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EwLayout {
    /// Each input at its offset + i.
    Contiguous,
    /// Each input through its shape, strides and offset.
    Strided,
    /// As `Strided`, over a rank-4 shape by rows, four elements of the last dim per invocation
    /// (vec4 loads where an input is contiguous along it), a workgroup row per index of the
    /// others: no division per invocation.
    StridedRows,
    /// Contiguous inputs at offsets that are multiples of 4, four elements per invocation.
    Vec4,
}

impl EwLayout {
    pub const ALL: [EwLayout; 4] = [
        EwLayout::Contiguous,
        EwLayout::Strided,
        EwLayout::StridedRows,
        EwLayout::Vec4,
    ];

    /// Invocations per workgroup of the rows layout (a row shorter than four times this leaves
    /// some idle).
    pub const ROWS_WG: u32 = 16;
}

/// The output element of an invocation on the linear grid.
const LINEAR_INDEX: &str = "    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params.count) { return; }";

/// The output elements (c0, c1, c2, x .. x + 3) of the rows layout (see `rows_index`); `i` is
/// their vec4.
const ROWS_INDEX: &str = "    let x = gid.x * 4u;
    if (x >= params.dims[3]) { return; }
    let c2 = wid.y;
    let c1 = wid.z % params.dims[1];
    let c0 = wid.z / params.dims[1];
    let i = ((wid.z * params.dims[2] + c2) * params.dims[3] + x) / 4u;";

/// The rows layout's read of four elements of input NAME from element j on, `s` apart: one vec4
/// where they are contiguous and aligned, one element for all four where s is 0.
const ROWS_LOAD: &str = "fn rows_load_{{NAME}}(j: u32, s: u32) -> vec4<f32> {
    if (s == 1u && (j & 3u) == 0u) {
        return in_{{NAME}}[j >> 2u];
    }
    if (s == 0u) {
        return vec4<f32>(in_{{NAME}}[j >> 2u][j & 3u]);
    }
    var v: vec4<f32>;
    for (var e = 0u; e < 4u; e = e + 1u) {
        let je = j + e * s;
        v[e] = in_{{NAME}}[je >> 2u][je & 3u];
    }
    return v;
}
";

/// The inputs' names in the template (`op(a, b, c, s0, s1)`).
const NAMES: [&str; 3] = ["a", "b", "c"];

/// The elementwise kernel over `arity` inputs (named a, b, c in `expr`).
pub(crate) fn source(arity: usize, layout: EwLayout, expr: &str) -> String {
    source_with(arity, layout, expr, false)
}

/// The binary kernel `out = op(out, b)`: input `a` is the output itself, read before it is
/// written (the runtime passes input `a`'s layout as contiguous from 0, so `out[i]` is element i).
pub(crate) fn source_assign(layout: EwLayout, expr: &str) -> String {
    source_with(2, layout, expr, true)
}

/// [`source`], with input `a` read from `out` when `a_is_out`.
fn source_with(arity: usize, layout: EwLayout, expr: &str, a_is_out: bool) -> String {
    let vec = matches!(layout, EwLayout::Vec4 | EwLayout::StridedRows);
    let ty = if vec { "vec4<f32>" } else { "f32" };
    let mut inputs = String::new();
    let mut loads = String::new();
    for (k, name) in NAMES.iter().enumerate().take(arity) {
        if a_is_out && k == 0 {
            loads += if vec {
                "    let va = out[i];\n"
            } else {
                "    let a = out[i];\n"
            };
            continue;
        }
        inputs += &format!(
            "@group(0) @binding({}) var<storage, read> in_{name}: array<{ty}>;\n",
            k + 1
        );
        if layout == EwLayout::StridedRows {
            inputs += &render(ROWS_LOAD, &[("NAME", name)]);
        }
        loads += &match layout {
            EwLayout::Contiguous => {
                format!("    let {name} = in_{name}[input_offset({k}u) + i];\n")
            }
            EwLayout::Strided => format!("    let {name} = in_{name}[strided_index(i, {k}u)];\n"),
            // dims: shape[4], then per input its offset and strides[4]; the last is along d3
            EwLayout::StridedRows => format!(
                "    let v{name} = rows_load_{name}(rows_index({k}u, c0, c1, c2, x), \
                 params.dims[{}u]);\n",
                4 + 5 * k + 4
            ),
            EwLayout::Vec4 => {
                format!("    let v{name} = in_{name}[input_offset({k}u) / 4u + i];\n")
            }
        };
    }
    // The op's arguments: the loaded inputs, 0.0 for the missing ones.
    let args = |lane: &str| -> String {
        let a: Vec<String> = NAMES
            .iter()
            .enumerate()
            .map(|(k, n)| match (k < arity, vec) {
                (false, _) => "0.0".to_string(),
                (true, false) => n.to_string(),
                (true, true) => format!("v{n}.{lane}"),
            })
            .collect();
        format!("op({}, s0, s1)", a.join(", "))
    };
    let store = if vec {
        let lanes: Vec<String> = ["x", "y", "z", "w"].iter().map(|l| args(l)).collect();
        format!("    out[i] = vec4<f32>({});", lanes.join(", "))
    } else {
        format!("    out[i] = {};", args(""))
    };
    let (wg, index) = match layout {
        EwLayout::StridedRows => (EwLayout::ROWS_WG, ROWS_INDEX),
        _ => (ELEMENTWISE_WG, LINEAR_INDEX),
    };
    render(
        ELEMENTWISE,
        &[
            ("INDEX", index),
            ("WG", &wg.to_string()),
            ("TY", ty),
            ("INPUTS", inputs.trim_end()),
            ("OUT", &(arity + 1).to_string()),
            ("EXPR", expr),
            ("LOADS", loads.trim_end()),
            ("STORE", &store),
        ],
    )
}
