//! Training-step throughput of two fixed workloads (an MLP and a decoder block) on every device
//! found, plain and through a 1-stage pipeline, with PyTorch and Burn reference columns.
//! Run in release: `cargo run --release --example bench_train`.

use wgpipe_apps::bench_train::{run, BenchArgs};
use wgpipe_apps::exit_on_error;
use wgpipe_apps::Parser;

fn main() {
    exit_on_error(run(BenchArgs::parse()));
}
