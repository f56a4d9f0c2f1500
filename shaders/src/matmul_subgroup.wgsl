// Matmul for CPU-backed adapters (lavapipe): one subgroup of SG invocations per workgroup, the
// operands pre-packed (pack.wgsl) so that every load streams through contiguous memory.
//
// On llvmpipe a subgroup is one SIMD vector and every load whose address differs between lanes
// costs a scalar loop over the lanes, while arithmetic and subgroup broadcasts are vector
// instructions. So each lane loads distinct data only: its own vec4 of B columns, and one row of
// each SG-row group of A, which subgroupBroadcast then hands to every lane. A workgroup computes
// TM = S * SG rows x 4 * SG * Q columns of c.
//
// Packed A: [batch, Mb, K4, TM] vec4 (k in groups of four); packed B: [batch, Nb, 4 * K4, SG * Q]
// vec4 (a panel of 4 * SG * Q columns, row by row). Both zero-padded.
//
// A direct operand is read where it lies instead (row-major, k and its row stride multiples of
// four, offsets in vec4s): a lane-varying load costs the same wherever it points, so packing
// only pays where the layout forbids vec4 loads. Rows and columns past the edge read the last
// one (clamped, never out of bounds); their results are never stored.
//
// Placeholders: <SG> <TM> <W> (= SG * Q), <C_TYPE>; <STORE> the file that defines `store4`
// (matmul_store_{scalar,vec}.wgsl); <ACC> declares the TM x Q vec4 accumulators acc_r_q;
// <SLAB_ZERO> / <SLAB_ADD> declare a slab's accumulators s_r_q and add them to acc_r_q;
// <A_INIT>, <B_INIT> set up each operand's index (packed or direct), <A_STEP>, <B_STEP> advance
// it by one k4; <LOADS> one k4 step's loads; <INNER> its broadcasts and FMAs; <STORE_ALL> calls
// `store4` for each accumulator.

// Batch strides in vec4s of the packed arrays or direct operands (0 for an operand shared by the
// batch); a direct operand's offset and row stride in vec4s.
struct SubgroupMatmulParams {
    m: u32, n: u32, k4_begin: u32, k4_end: u32, accumulate: u32,
    a_bs: u32, b_bs: u32, batch_base: u32, k4: u32,
    a_off: u32, a_rs: u32, b_off: u32, b_rs: u32,
}

@group(0) @binding(0) var<storage, read> params: SubgroupMatmulParams;

// k is summed in slabs of 4 * SLAB4 into fresh accumulators, each slab then added to the total:
// the rounding error of a long k grows with K / 32 + 32 additions instead of K.
const SLAB4: u32 = 8u;

@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> c: array<{{C_TYPE}}>;

{{STORE}}

@compute @workgroup_size({{SG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let M = params.m;
    let N = params.n;
    let k4_begin = params.k4_begin;
    let k4_end = params.k4_end;
    let batch = params.batch_base + wid.z;
    let K4 = params.k4;
    let row0 = wid.y * {{TM}}u;
{{A_INIT}}
{{B_INIT}}
{{ACC}}
    for (var k4_slab = k4_begin; k4_slab < k4_end; k4_slab = k4_slab + SLAB4) {
{{SLAB_ZERO}}
        for (var k4 = k4_slab; k4 < min(k4_slab + SLAB4, k4_end); k4 = k4 + 1u) {
{{LOADS}}
{{A_STEP}}
{{B_STEP}}
{{INNER}}
        }
{{SLAB_ADD}}
    }
    let c_base = batch * M * N;
{{STORE_ALL}}
}
