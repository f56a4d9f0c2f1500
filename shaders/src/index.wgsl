// Index kernels over [outer, dim, inner] tensors with f32 indices (already range-checked).
// Bindings: 1 = src, 2 = idx, 3 = out.
//
// index_select / gather: one invocation per output element.
// index_add / scatter_add: one invocation per (outer, inner) column, which adds src[j] for
// j = j_begin, j_begin + 1, ... < j_end in order into the (zero-filled) output: no atomics, no
// races (a column is owned by one invocation) and a fixed summation order, so results are
// deterministic. The host splits long j ranges over several dispatches (lavapipe stops an
// invocation after 65535 loop iterations).
//

struct IndexParams {
    outer: u32,
    dim: u32,
    inner: u32,
    n: u32,
    // The j range of this dispatch (index_add, scatter_add).
    j_begin: u32,
    j_end: u32,
}

@group(0) @binding(0) var<storage, read> params: IndexParams;

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = {{WG}}u;

// out [outer, n, inner] = x[:, idx[j], :]
@compute @workgroup_size(WG)
fn index_select(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let outer = params.outer;
    let dim = params.dim;
    let inner = params.inner;
    let n = params.n;
    if (e >= outer * n * inner) {
        return;
    }
    let i = e % inner;
    let j = (e / inner) % n;
    let o = e / (inner * n);
    let d = u32(idx[j]);
    out[e] = src[(o * dim + d) * inner + i];
}

// out [outer, n, inner] = x[o, idx[o, j, i], i]
@compute @workgroup_size(WG)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let outer = params.outer;
    let dim = params.dim;
    let inner = params.inner;
    let n = params.n;
    if (e >= outer * n * inner) {
        return;
    }
    let i = e % inner;
    let o = e / (inner * n);
    let d = u32(idx[e]);
    out[e] = src[(o * dim + d) * inner + i];
}

// out[o, idx[j], i] += src[o, j, i]
@compute @workgroup_size(WG)
fn index_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let col = linear_index(gid, nwg, WG);
    let outer = params.outer;
    let dim = params.dim;
    let inner = params.inner;
    let n = params.n;
    if (col >= outer * inner) {
        return;
    }
    let i = col % inner;
    let o = col / inner;
    for (var j = params.j_begin; j < params.j_end; j = j + 1u) {
        let d = u32(idx[j]);
        let t = (o * dim + d) * inner + i;
        out[t] = out[t] + src[(o * n + j) * inner + i];
    }
}

// out[o, idx[o, j, i], i] += src[o, j, i]
@compute @workgroup_size(WG)
fn scatter_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let col = linear_index(gid, nwg, WG);
    let outer = params.outer;
    let dim = params.dim;
    let inner = params.inner;
    let n = params.n;
    if (col >= outer * inner) {
        return;
    }
    let i = col % inner;
    let o = col / inner;
    for (var j = params.j_begin; j < params.j_end; j = j + 1u) {
        let s = (o * n + j) * inner + i;
        let d = u32(idx[s]);
        let t = (o * dim + d) * inner + i;
        out[t] = out[t] + src[s];
    }
}
