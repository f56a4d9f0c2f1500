// out[i] = value for i < numel. Params: [numel, value].

@group(0) @binding(1) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params[0]) {
        return;
    }
    out[i] = param_f32(1u);
}
