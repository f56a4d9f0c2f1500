// reduce.wgsl, direct mode: whole rows of x into out.

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

fn load(base: u32, j: u32) -> Acc {
    return Acc(x[base + j], j);
}

fn store(g: u32, best: Acc) {
    out[g] = result(best);
}
