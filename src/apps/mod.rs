//! The examples as library code: each `run(args)` is a whole program whose `main` in
//! `examples/` only parses the flags, so tests run the examples in-process.

pub mod bench_train;
pub mod train_cnn;
pub mod train_transformer;
