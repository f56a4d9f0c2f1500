// reduce.wgsl, partial mode: segments of rows of x into (value, index) partials.

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> part_v: array<f32>;
@group(0) @binding(3) var<storage, read_write> part_i: array<u32>;

fn load(base: u32, j: u32) -> Acc {
    return Acc(x[base + j], j);
}

fn store(g: u32, best: Acc) {
    part_v[g] = best.v;
    part_i[g] = best.i;
}
