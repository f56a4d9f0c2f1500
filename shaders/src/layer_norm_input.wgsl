// <INPUT> of layer_norm.wgsl for the plain layer norm: the row is x; mean and rstd go to two
// outputs.

@group(0) @binding(5) var<storage, read_write> mean_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> rstd_out: array<f32>;

fn input(base: u32, j: u32) -> f32 {
    return x[params.x_offset + base + j];
}

fn keep_input(i: u32, v: f32) {}

fn store_stats(row: u32, mean: f32, rstd: f32) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
}
