//! The one error type of the tensor library. Every message names the op and what was wrong.

/// Errors from tensor creation and ops. Cloneable so a pipeline stage can report it and keep it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Shapes that do not fit the op (`op` names it, `msg` gives the shapes).
    #[error("{op}: shape error: {msg}")]
    Shape { op: &'static str, msg: String },
    /// An axis out of range for the tensor's rank.
    #[error("{op}: axis {axis} is out of range for a tensor of rank {rank}")]
    Axis {
        op: &'static str,
        axis: isize,
        rank: usize,
    },
    /// An index value out of range (gather, index_select, one_hot...).
    #[error("{op}: index error: {msg}")]
    Index { op: &'static str, msg: String },
    /// Operands on different devices.
    #[error("{op}: operands are on different devices ({a} and {b}); move one with to_device()")]
    DeviceMismatch {
        op: &'static str,
        a: String,
        b: String,
    },
    /// Operands of different dtypes (cast one with `to_dtype`).
    #[error("{op}: operands have different dtypes ({a} and {b}); cast one with to_dtype()")]
    DTypeMismatch {
        op: &'static str,
        a: crate::dtype::DType,
        b: crate::dtype::DType,
    },
    /// An op with no kernel for this dtype on this backend (yet).
    #[error("{op}: no {dtype} kernel on the {backend} backend; cast to f32 with to_dtype() first")]
    UnsupportedDType {
        op: &'static str,
        dtype: crate::dtype::DType,
        backend: &'static str,
    },
    /// An allocation past the device's capacity.
    #[error("out of memory on device {device}: asked for {requested} bytes with {live} bytes live and a capacity of {capacity} bytes")]
    OutOfMemory {
        device: String,
        requested: usize,
        live: usize,
        capacity: usize,
    },
    /// A failure reported by wgpu (validation, device lost, mapping).
    #[error("wgpu error on device {device}: {msg}")]
    Wgpu { device: String, msg: String },
    /// No device of the asked kind could be found or opened.
    #[error("device error: {0}")]
    Device(String),
    /// Any other invalid argument.
    #[error("{op}: invalid argument: {msg}")]
    Invalid { op: &'static str, msg: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }
    pub(crate) fn invalid(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Invalid {
            op,
            msg: msg.into(),
        }
    }
    pub(crate) fn index(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Index {
            op,
            msg: msg.into(),
        }
    }
}

/// A dtype by its name (`f32`, `f16`, `bf16`), here rather than in `dtype`, which errors build
/// on.
impl std::str::FromStr for crate::dtype::DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<crate::dtype::DType> {
        crate::dtype::DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                Error::invalid("dtype", format!("unknown dtype {s:?} (f32, f16 or bf16)"))
            })
    }
}
