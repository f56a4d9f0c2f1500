//! Training-step throughput of three fixed workloads (an MLP, a decoder block and the main job's
//! model) on every device found, plain and through a 1-stage pipeline, with a PyTorch column
//! measured in the same run (given a Python with torch) and Burn's lavapipe figures quoted.
//! Run in release: `cargo run --release --example bench_train`.

use wgpipe_apps::bench_train::{run, BenchArgs};
use wgpipe_apps::exit_on_error;
use wgpipe_apps::Parser;

fn main() {
    exit_on_error(run(BenchArgs::parse()));
}
