// reduce.wgsl, final mode: the (value, index) partials of each row into out.

@group(0) @binding(1) var<storage, read> part_v: array<f32>;
@group(0) @binding(2) var<storage, read> part_i: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn load(base: u32, j: u32) -> Acc {
    return Acc(part_v[base + j], part_i[base + j]);
}

fn store(g: u32, best: Acc) {
    out[g] = result(best);
}
