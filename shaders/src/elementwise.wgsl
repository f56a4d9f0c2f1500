// Elementwise template: out[i] = op(a, b, c) over up to three inputs.
//
// Four layouts share it: strided inputs (each read through its shape, strides and offset, so
// views need no copy), the same over rank-4 shapes by rows (below), contiguous inputs
// (offset + i), and aligned contiguous inputs read and written as vec4 (four elements per
// invocation).
//
// Placeholders: <WG> workgroup size; <INDEX> sets the output element `i` (and returns past the
// end); <TY> f32 or vec4<f32> (the vec4 and rows layouts); <INPUTS> the input bindings in_a,
// in_b, in_c (at 1..) and <OUT> the output binding's number; <EXPR> the op over a, b, c and the
// scalars s0, s1; <LOADS> the layout's loads of a, b, c (through `input_offset`,
// `strided_index` or `rows_index`); <STORE> the write of out[i].

struct EwParams {
    // Elements, or vec4s for the vec4 layout.
    count: u32,
    // 0 for the contiguous layouts.
    rank: u32, s0: f32, s1: f32,
    // shape[rank], then per input: offset, strides[rank].
    dims: array<u32>,
}

@group(0) @binding(0) var<storage, read> params: EwParams;
{{INPUTS}}
@group(0) @binding({{OUT}}) var<storage, read_write> out: array<{{TY}}>;

// Where input k starts.
fn input_offset(k: u32) -> u32 {
    return params.dims[params.rank + k * (params.rank + 1u)];
}

// Where element i (row-major over the shape) of strided input k is.
fn strided_index(i: u32, k: u32) -> u32 {
    let rank = params.rank;
    let base = rank + k * (rank + 1u);
    var idx = params.dims[base];
    var rem = i;
    for (var d = rank; d > 0u; d = d - 1u) {
        let j = d - 1u;
        let size = params.dims[j];
        let coord = rem % size;
        rem = rem / size;
        idx = idx + coord * params.dims[base + 1u + j];
    }
    return idx;
}

// The rows layout: the shape is [d0, d1, d2, d3] (shorter shapes padded with leading 1s, d3 a
// multiple of 4), x (four elements per invocation) runs along d3, the workgroup's y along d2 and
// its z over d0 x d1. Only x differs between an invocation's lanes, so the index needs no
// division per lane (llvmpipe has no vector integer division and divides lane by lane), and an
// input contiguous along d3 is read a vec4 at a time (on llvmpipe each load whose address
// differs between lanes is a loop over the lanes: four elements per load, not one).
fn rows_index(k: u32, c0: u32, c1: u32, c2: u32, x: u32) -> u32 {
    let base = 4u + k * 5u;
    return params.dims[base] + c0 * params.dims[base + 1u] + c1 * params.dims[base + 2u]
        + c2 * params.dims[base + 3u] + x * params.dims[base + 4u];
}

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

// The tanh-form GELU through s = (1 + tanh u) / 2 = sigmoid(2u), u = k (x + c x^3), with
// e = exp(-2|u|) and r = 1 / (1 + e): s = r or e r, and q = s (1 - s) = (1 - tanh^2 u) / 4 = e r^2.
// Both without the cancellation of 1 +- tanh u near tanh u = -+1, and nothing can overflow.
fn gelu_tanh_sq(x: f32) -> vec2<f32> {
    let u = GELU_K * (x + GELU_C * x * x * x);
    let e = exp(-2.0 * abs(u));
    let r = 1.0 / (1.0 + e);
    return vec2<f32>(select(e * r, r, u >= 0.0), e * r * r);
}

fn gelu_tanh(x: f32) -> f32 {
    return x * gelu_tanh_sq(x).x;
}

// d/dx x s(2u) = s + 2 x q u', u' = k (1 + 3 c x^2).
fn gelu_tanh_grad(x: f32) -> f32 {
    let sq = gelu_tanh_sq(x);
    return sq.x + 2.0 * x * sq.y * GELU_K * (1.0 + 3.0 * GELU_C * x * x);
}

// d/dx of gelu_tanh_grad: with 1 - 2 s = -t, t = tanh u:
// q (4 u' - 4 x u'^2 t + 12 k c x^2).
fn gelu_tanh_grad2(x: f32) -> f32 {
    let sq = gelu_tanh_sq(x);
    let t = 2.0 * sq.x - 1.0;
    let u1 = GELU_K * (1.0 + 3.0 * GELU_C * x * x);
    return sq.y * (4.0 * u1 - 4.0 * x * u1 * u1 * t + 12.0 * GELU_K * GELU_C * x * x);
}

// erfc(z) for z >= 0, relative error below 1.2e-7: the formula of `erfc_pos` in
// shaders/src/ops/math.rs (the CPU reference).
fn erfc_pos(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    var p = 0.17087277;
    p = p * t - 0.82215223;
    p = p * t + 1.48851587;
    p = p * t - 1.13520398;
    p = p * t + 0.27886807;
    p = p * t - 0.18628806;
    p = p * t + 0.09678418;
    p = p * t + 0.37409196;
    p = p * t + 1.00002368;
    p = p * t - 1.26551223;
    return t * exp(p - z * z);
}

fn normal_cdf(x: f32) -> f32 {
    let half = 0.5 * erfc_pos(abs(x) * 0.70710678118654752);
    return select(1.0 - half, half, x < 0.0);
}

fn normal_pdf(x: f32) -> f32 {
    return 0.3989422804014327 * exp(-0.5 * x * x);
}

// Exact GELU x Phi(x) and its first two derivatives.
fn gelu(x: f32) -> f32 {
    return x * normal_cdf(x);
}

fn gelu_grad(x: f32) -> f32 {
    return normal_cdf(x) + x * normal_pdf(x);
}

fn gelu_grad2(x: f32) -> f32 {
    return normal_pdf(x) * (2.0 - x * x);
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

fn flag(b: bool) -> f32 {
    return select(0.0, 1.0, b);
}

@compute @workgroup_size({{WG}})
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
{{INDEX}}
    let s0 = params.s0;
    let s1 = params.s1;
{{LOADS}}
{{STORE}}
}
