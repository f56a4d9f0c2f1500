// One fused Adam / AdamW step per element (see wgpipe_tensor::backend::AdamStep):
// g' = g + wd * p unless decoupled; m' = b1 m + (1 - b1) g'; v' = b2 v + (1 - b2) g'^2;
// p' = p - lr (m' / bc1) / (sqrt(v' / bc2) + eps) - (decoupled ? lr wd p : 0).
//
// Params: [numel, lr, beta1, beta2, eps, weight_decay, decoupled, bc1, bc2].

@group(0) @binding(1) var<storage, read> param: array<f32>;
@group(0) @binding(2) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read> m_in: array<f32>;
@group(0) @binding(4) var<storage, read> v_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> param_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> m_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> v_out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params[0]) {
        return;
    }
    let lr = param_f32(1u);
    let beta1 = param_f32(2u);
    let beta2 = param_f32(3u);
    let eps = param_f32(4u);
    let wd = param_f32(5u);
    let decoupled = params[6] != 0u;
    let bc1 = param_f32(7u);
    let bc2 = param_f32(8u);
    let p = param[i];
    var g = grad[i];
    if (!decoupled) {
        g = g + wd * p;
    }
    let m = beta1 * m_in[i] + (1.0 - beta1) * g;
    let v = beta2 * v_in[i] + (1.0 - beta2) * g * g;
    var np = p - lr * (m / bc1) / (sqrt(v / bc2) + eps);
    if (decoupled) {
        np = np - lr * wd * p;
    }
    param_out[i] = np;
    m_out[i] = m;
    v_out[i] = v;
}
