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
    outer: u32, dim: u32, inner: u32, n: u32,
    // The j range of this dispatch (index_add, scatter_add).
    j_begin: u32, j_end: u32,
}

@group(0) @binding(0) var<storage, read> params: IndexParams;

@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const WG: u32 = {{WG}}u;

// src[o, idx[k], i] for element e = (o, j, i) of the [outer, n, inner] output, where k is the
// slot of idx that element reads.
fn pick(e: u32, k: u32) -> f32 {
    let p = params;
    let i = e % p.inner;
    let o = e / (p.inner * p.n);
    return src[(o * p.dim + u32(idx[k])) * p.inner + i];
}

// out [outer, n, inner] = x[:, idx[j], :]
@compute @workgroup_size(WG)
fn index_select(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let p = params;
    if (e >= p.outer * p.n * p.inner) { return; }
    out[e] = pick(e, (e / p.inner) % p.n);
}

// out [outer, n, inner] = x[o, idx[o, j, i], i]
@compute @workgroup_size(WG)
fn gather(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let e = linear_index(gid, nwg, WG);
    let p = params;
    if (e >= p.outer * p.n * p.inner) { return; }
    out[e] = pick(e, e);
}

// For column col = (o, i): out[o, d, i] += src[o, j, i] for j in this dispatch's range, with
// d = idx[j] (index_add) or idx[o, j, i] (scatter_add, `per_element`).
fn add_column(col: u32, per_element: bool) {
    let p = params;
    if (col >= p.outer * p.inner) { return; }
    let i = col % p.inner;
    let o = col / p.inner;
    for (var j = p.j_begin; j < p.j_end; j = j + 1u) {
        let s = (o * p.n + j) * p.inner + i;
        let d = u32(idx[select(j, s, per_element)]);
        let t = (o * p.dim + d) * p.inner + i;
        out[t] = out[t] + src[s];
    }
}

// out[o, idx[j], i] += src[o, j, i]
@compute @workgroup_size(WG)
fn index_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    add_column(linear_index(gid, nwg, WG), false);
}

// out[o, idx[o, j, i], i] += src[o, j, i]
@compute @workgroup_size(WG)
fn scatter_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    add_column(linear_index(gid, nwg, WG), true);
}
