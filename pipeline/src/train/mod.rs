//! Training: the public [`Pipeline`] (a group of replicas, its optimizers, loss scaler and step
//! counter), one replica's step, the optimizer step with its rollback, the training loop
//! (`train_steps`, one step at a time or back to back), evaluation, reports, persistence and
//! the builder.

mod back_to_back;
pub mod builder;
mod eval;
mod export;
mod optim_step;
pub mod persist;
pub mod pipeline;
mod planned;
pub mod replica;
pub mod replicas;
pub mod report;
pub mod scaler;
pub mod shards;
pub mod steps;
mod workers;

pub use pipeline::Pipeline;
pub use replica::Replica;
