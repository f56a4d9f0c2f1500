// <INPUT> of layer_norm.wgsl for the fused residual add: the row is x + r, written to s as
// well; mean and rstd share one output (`[2, rows]`: means, then rstds) so the kernel stays
// within 8 storage bindings.

@group(0) @binding(5) var<storage, read_write> stats: array<f32>;
@group(0) @binding(6) var<storage, read> r: array<f32>;
@group(0) @binding(7) var<storage, read_write> sum_out: array<f32>;

fn input(base: u32, j: u32) -> f32 {
    return x[params.x_offset + base + j] + r[params.r_offset + base + j];
}

fn keep_input(i: u32, v: f32) {
    sum_out[i] = v;
}

fn store_stats(row: u32, mean: f32, rstd: f32) {
    stats[row] = mean;
    stats[params.rows + row] = rstd;
}
