//! Running a step: the stages, the worker that walks one device's action list, its threads,
//! the transports that carry tensors between devices, the step communicator through which
//! replicas and ranks agree, tied weights' gradient sums and the stages a rank does not hold.

pub(crate) mod absent;
pub mod comm;
pub(crate) mod described;
pub(crate) mod runner;
pub mod stage;
pub mod threads;
pub(crate) mod tied;
pub mod transport;
pub(crate) mod worker;

pub use stage::Stage;
pub use worker::NonFiniteAt;
