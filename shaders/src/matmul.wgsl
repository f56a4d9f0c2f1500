// Tiled batched matmul: c[b] = A[b] (m x k) @ B[b] (k x n), A and B strided, c contiguous.
//
// Each workgroup computes a BM x BN tile of c. It walks k in slabs of BK: the invocations stage
// the BM x BK slab of A and the BK x BN slab of B in workgroup memory (k-major, so a row of the
// slab is read as vec4s), then each invocation accumulates a TM x TN block of outputs in
// registers (TM rows x TN/4 vec4 columns, interleaved across invocations so that neighbouring
// invocations read neighbouring workgroup memory and write neighbouring outputs).
//
// Placeholders: <BM> <BN> <BK> <TM> <TN> tile sizes; <A_TYPE> / <B_TYPE> / <C_TYPE>
// f32 or vec4<f32> (vec4 where the layout allows aligned vector loads or stores); <LOAD_A> /
// <LOAD_B> the file that defines `load_a` / `load_b`, which stage one slab
// (matmul_load_{a,b}_{scalar,vec_k,vec_mn}.wgsl); <STORE> the file that defines `store4`
// (matmul_store_{scalar,vec}.wgsl); <ACC> declares the TM x TN/4 vec4 accumulators acc_r_q;
// <SLAB_ZERO> / <SLAB_ADD> declare a slab's accumulators s_r_q and add them to acc_r_q;
// <INNER> one k step of the register tile; <STORE_ALL> calls `store4` for each accumulator.
//
// Each slab of BK is summed into fresh accumulators, then added to the totals: the rounding
// error of a long k grows with K / BK + BK additions instead of K (the float64 model check).
// It costs TM x TN/4 more vec4 registers, not yet measured on a GPU (the autotune picks the
// faster tile where it runs).
//
// Element (b, i, j) of an operand is at off + b * bs + i * rs + j * cs. One dispatch covers k
// in [k_begin, k_end); with `accumulate` it adds to c instead of storing, so the host can split
// a long k into several dispatches (lavapipe stops any invocation after 65535 loop iterations
// in all).

struct MatmulParams {
    m: u32, k_end: u32, n: u32, tiles_n: u32,
    a_off: u32, a_bs: u32, a_rs: u32, a_cs: u32,
    b_off: u32, b_bs: u32, b_rs: u32, b_cs: u32,
    batch_base: u32, k_begin: u32, accumulate: u32,
}

@group(0) @binding(0) var<storage, read> params: MatmulParams;

const BM: u32 = {{BM}}u;
const BN: u32 = {{BN}}u;
const BK: u32 = {{BK}}u;
const TM: u32 = {{TM}}u;
const TN: u32 = {{TN}}u;
const BM4: u32 = BM / 4u;
const BN4: u32 = BN / 4u;
const NTX: u32 = BN / TN;
const NTY: u32 = BM / TM;
const NT: u32 = NTX * NTY;

@group(0) @binding(1) var<storage, read> a: array<{{A_TYPE}}>;
@group(0) @binding(2) var<storage, read> b: array<{{B_TYPE}}>;
@group(0) @binding(3) var<storage, read_write> c: array<{{C_TYPE}}>;

var<workgroup> As: array<vec4<f32>, BK * BM4>;
var<workgroup> Bs: array<vec4<f32>, BK * BN4>;

{{LOAD_A}}
{{LOAD_B}}
{{STORE}}

@compute @workgroup_size({{NT}})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let M = params.m;
    let K = params.k_end;
    let N = params.n;
    let batch = params.batch_base + wid.z;
    let tile = linear_group(wid, nwg);
    let row0 = (tile / params.tiles_n) * BM;
    let col0 = (tile % params.tiles_n) * BN;
    if (row0 >= M) { return; }
    let a_base = params.a_off + batch * params.a_bs;
    let b_base = params.b_off + batch * params.b_bs;
    let c_base = batch * M * N;
    let tx = lid % NTX;
    let ty = lid / NTX;

{{ACC}}
    for (var k0 = params.k_begin; k0 < K; k0 = k0 + BK) {
        load_a(lid, k0, row0, a_base);
        load_b(lid, k0, col0, b_base);
        workgroupBarrier();
{{SLAB_ZERO}}
        for (var kk = 0u; kk < BK; kk = kk + 1u) {
{{INNER}}
        }
{{SLAB_ADD}}
        workgroupBarrier();
    }
{{STORE_ALL}}
}
