// One fused Adam / AdamW step per element (see wgpipe_tensor::backend::AdamStep):
// g' = g + wd * p unless decoupled; m' = b1 m + (1 - b1) g'; v' = b2 v + (1 - b2) g'^2;
// p' = p - lr (m' / bc1) / (sqrt(v' / bc2) + eps) - (decoupled ? lr wd p : 0).
//
// Placeholders: <BINDINGS> declare param, grad, m_in and v_in (read) and the outputs <P_OUT>,
// <M_OUT>, <V_OUT>; the in-place variant binds param, m_in and v_in read-write and writes them.

struct AdamParams {
    numel: u32, lr: f32, beta1: f32, beta2: f32, eps: f32,
    weight_decay: f32,
    // Non-zero for AdamW.
    decoupled: u32,
    // 1 - beta1^t, 1 - beta2^t.
    bc1: f32, bc2: f32,
}

@group(0) @binding(0) var<storage, read> params: AdamParams;

{{BINDINGS}}

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params.numel) { return; }
    let lr = params.lr;
    let wd = params.weight_decay;
    let decoupled = params.decoupled != 0u;
    let p = param[i];
    var g = grad[i];
    if (!decoupled) {
        g = g + wd * p;
    }
    let m = params.beta1 * m_in[i] + (1.0 - params.beta1) * g;
    let v = params.beta2 * v_in[i] + (1.0 - params.beta2) * g * g;
    var np = p - lr * (m / params.bc1) / (sqrt(v / params.bc2) + params.eps);
    if (decoupled) {
        np = np - lr * wd * p;
    }
    {{P_OUT}}[i] = np;
    {{M_OUT}}[i] = m;
    {{V_OUT}}[i] = v;
}
