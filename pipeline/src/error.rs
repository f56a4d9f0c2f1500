//! Pipeline errors: every failure names where it happened (stage, micro-batch, action) and why.

use crate::partition::PartitionError;
use crate::schedule::ScheduleError;
use crate::sim::timeline::TimelineError;

/// Why a stage failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StageCause {
    /// An op returned an error (shape, out of memory, wgpu...).
    #[error("{0}")]
    Tensor(wgpipe_tensor::Error),
    /// A layer panicked; the payload's message.
    #[error("panic: {0}")]
    Panic(String),
    /// A neighbouring stage disappeared (it failed first, or its channel closed).
    #[error("{0}")]
    Disconnected(String),
    /// A loss, activation or gradient holds NaN or infinity, first here (its inputs were
    /// finite); see [`NonFinite`].
    #[error("non-finite values: {0}")]
    NonFinite(String),
    /// An action ran past the pipeline's action time limit.
    #[error("timed out: {0}")]
    TimedOut(String),
}

/// What a training step does when a loss, an activation or a gradient is NaN or infinite.
/// Each stage checks what it makes (its output or loss in forward, the input gradient it sends
/// back, its parameter gradients at the end of the step) on its own device, and the messages it
/// sends carry the verdict, so the stage where the values first turned non-finite is known
/// without a second pass or an extra message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFinite {
    /// `train_step` returns an error naming the stage and micro-batch where non-finite values
    /// first appeared; nothing changes (the default).
    #[default]
    Error,
    /// The step runs to its end, then its gradients are dropped (the parameters' gradients are
    /// put back as before the step) and the report's `skipped` names where non-finite values
    /// first appeared: what dynamic loss scaling needs. Call `optimizer_step` only when
    /// `skipped` is `None`.
    SkipStep,
    /// No checks (no cost).
    Ignore,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineError {
    /// The pipeline was configured wrongly (devices, micro-batches, inputs...).
    #[error("pipeline configuration: {0}")]
    Config(String),
    #[error("partition: {0}")]
    Partition(#[from] PartitionError),
    #[error("schedule: {0}")]
    Schedule(#[from] ScheduleError),
    #[error("simulated timeline: {0}")]
    Timeline(#[from] TimelineError),
    /// A stage failed while running its schedule; every stage was stopped.
    #[error("stage {stage} (device {device}), micro-batch {micro_batch}, {action}: {cause}")]
    Stage {
        stage: usize,
        device: String,
        micro_batch: usize,
        action: String,
        /// Boxed: it holds a tensor error, and `Result<_, PipelineError>` stays small.
        cause: Box<StageCause>,
    },
    /// A step that timed out still has threads running, which hold some of the stages.
    #[error("a step that timed out is still running ({0}); its stages come back when it ends")]
    Stuck(String),
    /// An op outside any stage (splitting the batch, moving data, the optimizer) failed.
    #[error("{0}")]
    Tensor(#[from] wgpipe_tensor::Error),
}

impl PipelineError {
    /// A stage error whose device is said more precisely (`where_` follows the device name,
    /// e.g. "on rank 1"); other errors as they are.
    pub(crate) fn at(self, where_: &str) -> PipelineError {
        match self {
            PipelineError::Stage {
                stage,
                device,
                micro_batch,
                action,
                cause,
            } => PipelineError::Stage {
                stage,
                device: format!("{device}{where_}"),
                micro_batch,
                action,
                cause,
            },
            other => other,
        }
    }

    /// The failing stage, for stage errors.
    pub fn stage(&self) -> Option<usize> {
        match self {
            PipelineError::Stage { stage, .. } => Some(*stage),
            _ => None,
        }
    }
    /// Why the stage failed, for stage errors.
    pub fn cause(&self) -> Option<&StageCause> {
        match self {
            PipelineError::Stage { cause, .. } => Some(cause),
            _ => None,
        }
    }
    /// The failing micro-batch, for stage errors.
    pub fn micro_batch(&self) -> Option<usize> {
        match self {
            PipelineError::Stage { micro_batch, .. } => Some(*micro_batch),
            _ => None,
        }
    }
}

pub type Result<T, E = PipelineError> = std::result::Result<T, E>;
