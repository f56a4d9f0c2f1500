//! Cross-crate tests of the pipeline, all on simulated CPU-backed devices unless named wgpu.
//! One test binary (one link) with a module per theme.

mod atomic;
mod back_to_back;
mod cpu_threads;
mod equivalence;
mod faults;
mod hf_models;
mod layering;
mod locality;
mod memory;
mod persist;
mod planner;
mod precision;
mod remat_layers;
mod replicas;
mod reports;
mod schedules;
mod shards;
mod sim_time;
mod skips;
mod tied;
mod transport;
mod user_layer;
mod wgpu;
