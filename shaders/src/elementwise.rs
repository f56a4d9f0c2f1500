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
    /// Contiguous inputs at offsets that are multiples of 4, four elements per invocation.
    Vec4,
}

impl EwLayout {
    pub const ALL: [EwLayout; 3] = [EwLayout::Contiguous, EwLayout::Strided, EwLayout::Vec4];
}

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
    let vec = layout == EwLayout::Vec4;
    let ty = if vec { "vec4<f32>" } else { "f32" };
    let mut inputs = String::new();
    let mut loads = String::new();
    for (k, name) in NAMES.iter().enumerate().take(arity) {
        if a_is_out && k == 0 {
            loads += &match layout {
                EwLayout::Vec4 => "    let va = out[i];\n".to_string(),
                _ => "    let a = out[i];\n".to_string(),
            };
            continue;
        }
        inputs += &format!(
            "@group(0) @binding({}) var<storage, read> in_{name}: array<{ty}>;\n",
            k + 1
        );
        loads += &match layout {
            EwLayout::Contiguous => {
                format!("    let {name} = in_{name}[input_offset({k}u) + i];\n")
            }
            EwLayout::Strided => format!("    let {name} = in_{name}[strided_index(i, {k}u)];\n"),
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
    render(
        ELEMENTWISE,
        &[
            ("WG", &ELEMENTWISE_WG.to_string()),
            ("TY", ty),
            ("INPUTS", inputs.trim_end()),
            ("OUT", &(arity + 1).to_string()),
            ("EXPR", expr),
            ("LOADS", loads.trim_end()),
            ("STORE", &store),
        ],
    )
}
