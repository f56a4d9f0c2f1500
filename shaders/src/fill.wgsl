// out[i] = value for i < numel.

struct FillParams {
    numel: u32, value: f32,
}

@group(0) @binding(0) var<storage, read> params: FillParams;

@group(0) @binding(1) var<storage, read_write> out: array<f32>;

@compute @workgroup_size({{WG}})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, {{WG}}u);
    if (i >= params.numel) { return; }
    out[i] = params.value;
}
