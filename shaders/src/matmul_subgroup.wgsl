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
// Placeholders: <SG> <S> <Q> <TM> <W> (= SG * Q), <C_TYPE>, <ACC>, <LOADS>, <INNER>, <STORE>.
// Params: [M, N, k4_begin, k4_end, accumulate, a_bs, b_bs, batch_base, K4] (batch strides in
// vec4s of the packed arrays; 0 for an operand shared by the batch).

@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> c: array<{{C_TYPE}}>;

@compute @workgroup_size({{SG}})
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let M = params[0];
    let N = params[1];
    let k4_begin = params[2];
    let k4_end = params[3];
    let accumulate = params[4] != 0u;
    let batch = params[7] + wid.z;
    let K4 = params[8];
    let row0 = wid.y * {{TM}}u;
    var ai = batch * params[5] + (wid.y * K4 + k4_begin) * {{TM}}u + lane;
    var bi = batch * params[6] + (wid.x * K4 * 4u + k4_begin * 4u) * {{W}}u + lane;
{{ACC}}
    for (var k4 = k4_begin; k4 < k4_end; k4 = k4 + 1u) {
{{LOADS}}
        ai = ai + {{TM}}u;
        bi = bi + 4u * {{W}}u;
{{INNER}}
    }
    let c_base = batch * M * N;
{{STORE}}
}
