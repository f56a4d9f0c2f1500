//! One error type for the examples: one line (or a few) that says what went wrong and which
//! flag to change. Library errors come in typed and are mapped to flags where they are made
//! (in the `args` and `files` modules); the rest keep the library's message as is, so a
//! message carries one prefix.

use std::fmt;

/// An error of an example.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AppError(pub String);

pub type AppResult<T> = Result<T, AppError>;

impl AppError {
    pub fn new(msg: impl Into<String>) -> AppError {
        AppError(msg.into())
    }
}

macro_rules! from_error {
    ($($t:ty),*) => {$(
        impl From<$t> for AppError {
            fn from(e: $t) -> AppError {
                AppError(e.to_string())
            }
        }
    )*};
}
from_error!(
    wgpipe_tensor::Error,
    wgpipe_pipeline::PipelineError,
    wgpipe_pipeline::PersistError,
    wgpipe_models::data::DataError,
    std::io::Error
);

/// `Err(AppError)` with a formatted message.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::AppError(format!($($arg)*)))
    };
}

/// Adds context in front of an error's message.
pub trait Context<T> {
    fn context(self, what: impl fmt::Display) -> AppResult<T>;
}

impl<T, E: fmt::Display> Context<T> for Result<T, E> {
    fn context(self, what: impl fmt::Display) -> AppResult<T> {
        self.map_err(|e| AppError(format!("{what}: {e}")))
    }
}

/// Prints the error and exits with status 2 (the examples' `main`).
pub fn exit_on_error(r: AppResult<impl Sized>) {
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}
