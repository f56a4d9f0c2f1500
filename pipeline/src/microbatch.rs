//! Splitting a mini-batch into micro-batches.
//!
//! Like `torch.chunk`'s even variant in torchgpipe: N samples into M micro-batches whose sizes
//! differ by at most one (the first N mod M get one more). M > N is an error: a micro-batch would
//! be empty. The loss of each micro-batch is scaled by its size / N, so uneven splits still give
//! the mean loss over the mini-batch.

use wgpipe_tensor::Tensor;

use crate::error::{PipelineError, Result};

/// Why a mini-batch cannot be split: typed, so that a front-end can name its own flag
/// (`--micro-batches`, `--batch`) instead of checking the rule again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MicroBatchError {
    #[error("the number of micro-batches must be at least 1")]
    NoMicroBatches,
    #[error("a mini-batch of {samples} samples cannot be split into {micro_batches} micro-batches (each needs at least one sample)")]
    TooFewSamples {
        samples: usize,
        micro_batches: usize,
    },
}

/// Sizes of the M micro-batches of N samples (the one place the rules M >= 1 and N >= M are
/// checked).
pub fn micro_batch_sizes(n: usize, m: usize) -> std::result::Result<Vec<usize>, MicroBatchError> {
    if m == 0 {
        return Err(MicroBatchError::NoMicroBatches);
    }
    if n < m {
        return Err(MicroBatchError::TooFewSamples {
            samples: n,
            micro_batches: m,
        });
    }
    Ok((0..m).map(|i| n / m + usize::from(i < n % m)).collect())
}

/// Views of `t` split along axis 0 into `m` micro-batches (no copy).
pub fn split_batch(what: &str, t: &Tensor, m: usize) -> Result<Vec<Tensor>> {
    if t.rank() == 0 {
        return Err(PipelineError::Config(format!(
            "{what} must have a batch axis (axis 0); got a scalar"
        )));
    }
    // One prefix: the typed cause has none of its own.
    let sizes = micro_batch_sizes(t.shape()[0], m)
        .map_err(|e| PipelineError::Config(format!("{what} of shape {:?}: {e}", t.shape())))?;
    Ok(t.split_sizes(&sizes, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_even_or_differ_by_one() {
        assert_eq!(micro_batch_sizes(8, 4).unwrap(), vec![2, 2, 2, 2]);
        assert_eq!(micro_batch_sizes(10, 4).unwrap(), vec![3, 3, 2, 2]);
        assert_eq!(micro_batch_sizes(3, 3).unwrap(), vec![1, 1, 1]);
        let e = micro_batch_sizes(2, 3).unwrap_err().to_string();
        assert!(
            e.contains("2 samples") && e.contains("3 micro-batches"),
            "{e}"
        );
        assert!(micro_batch_sizes(4, 0).is_err());
    }
}
