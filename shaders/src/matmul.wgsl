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
// <LOAD_B> stage one slab; <ACC> declares the accumulators; <INNER> one k step of the
// register tile; <STORE> writes the block (bounds-checked).
//
// Params: [m, k_end, n, tiles_n, a_off, a_bs, a_rs, a_cs, b_off, b_bs, b_rs, b_cs, batch_base,
// k_begin, accumulate] (element (b, i, j) of an operand is at off + b * bs + i * rs + j * cs).
// One dispatch covers k in [k_begin, k_end); with `accumulate` it adds to c instead of storing,
// so the host can split a long k into several dispatches (lavapipe stops any invocation after
// 65535 loop iterations in all).

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

@compute @workgroup_size({{NT}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let M = params[0];
    let K = params[1];
    let k_begin = params[13];
    let accumulate = params[14] != 0u;
    let N = params[2];
    let tiles_n = params[3];
    let batch = params[12] + wid.z;
    let tile = linear_group(wid, nwg);
    let row0 = (tile / tiles_n) * BM;
    let col0 = (tile % tiles_n) * BN;
    if (row0 >= M) {
        return;
    }
    let a_base = params[4] + batch * params[5];
    let a_rs = params[6];
    let a_cs = params[7];
    let b_base = params[8] + batch * params[9];
    let b_rs = params[10];
    let b_cs = params[11];
    let c_base = batch * M * N;
    let tx = lid % NTX;
    let ty = lid / NTX;

{{ACC}}
    for (var k0 = k_begin; k0 < K; k0 = k0 + BK) {
{{LOAD_A}}
{{LOAD_B}}
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk = kk + 1u) {
{{INNER}}
        }
        workgroupBarrier();
    }
{{STORE}}
}
