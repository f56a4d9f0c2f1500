//! What the processes of a step agree on.

#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(feature = "mpi")]
pub(crate) mod mpi_tied;
