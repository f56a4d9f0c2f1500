// Elementwise template: out[i] = op(a, b, c) over up to three inputs.
//
// Three layouts share it: strided inputs (each read through its shape, strides and offset, so
// views need no copy), contiguous inputs (offset + i), and aligned contiguous inputs read and
// written as vec4 (four elements per invocation).
//
// Placeholders: <WG> workgroup size; <INPUTS> the input bindings (at 1..) and <OUT> the
// output binding; <EXPR> the op over a, b, c and the scalars s0, s1; <BODY> the layout's
// indexing, loads and store.
//
// Params: [count, rank, s0, s1, shape[rank], then per input: offset, strides[rank]] (count is
// elements, or vec4s for the vec4 layout; rank 0 for the contiguous layouts).

{{INPUTS}}
{{OUT}}

fn op(a: f32, b: f32, c: f32, s0: f32, s1: f32) -> f32 {
    return {{EXPR}};
}

// tanh that stays finite for large |x| on every backend (tanh(15) rounds to 1 in f32).
fn tanh_c(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

// x^y with the CPU's conventions: integral exponents of negative bases keep their sign, and
// x^0 = 1 (WGSL's pow is undefined for x < 0 and gives NaN for 0^0).
fn spow(x: f32, y: f32) -> f32 {
    if (y == 0.0) {
        return 1.0;
    }
    if (x < 0.0) {
        if (floor(y) != y) {
            return bitcast<f32>(0x7fc00000u);
        }
        let m = pow(-x, y);
        let odd = (floor(y * 0.5) * 2.0) != y;
        return select(m, -m, odd);
    }
    if (x == 0.0) {
        return select(bitcast<f32>(0x7f800000u), 0.0, y > 0.0);
    }
    return pow(x, y);
}

const GELU_K: f32 = 0.7978845608028654; // sqrt(2 / pi)
const GELU_C: f32 = 0.044715;

fn gelu(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_c(GELU_K * (x + GELU_C * x * x * x)));
}

fn gelu_grad(x: f32) -> f32 {
    let t = tanh_c(GELU_K * (x + GELU_C * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * x * x);
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn flag(b: bool) -> f32 {
    return select(0.0, 1.0, b);
}

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    let n = params[0];
    if (i >= n) {
        return;
    }
    let rank = params[1];
    let s0 = param_f32(2u);
    let s1 = param_f32(3u);
{{BODY}}
}
