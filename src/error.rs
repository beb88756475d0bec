//! The crate's error type. Every failure carries a kind (which becomes a `dsv4_status` at the C
//! boundary) and a message written for the operator: what is wrong, with which value, and the fix.

use std::fmt;

/// What went wrong, at the granularity a caller can act on. `ffi` maps each kind to one fixed
/// status code; nothing below `ffi` knows the numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A caller passed something unusable: a NULL pointer, an out-of-range id, a bad struct size.
    InvalidArgument,
    /// Engine parameters are invalid or contradict the model.
    Config,
    /// A file is missing or unreadable.
    Io,
    /// A checkpoint or `config.json` does not have the expected structure.
    ModelFormat,
    /// Not enough pages, slots or memory for what was asked.
    Capacity,
    /// Admission control refused the request.
    QueueFull,
    /// A deadline passed.
    Timeout,
    /// The request was aborted.
    Aborted,
    /// Moving KV state between engines failed.
    KvTransfer,
    /// An output buffer is too small; the caller should retry with the size reported.
    BufferTooSmall,
    /// Valid, but not built yet (or not on this backend).
    Unsupported,
    /// The engine is shutting down.
    Shutdown,
    /// The thing named does not exist.
    NotFound,
    /// A bug in dsv4.
    Internal,
}

/// An error with its kind and an actionable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub fn config(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, message)
    }

    pub fn io(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Io, message)
    }

    pub fn model_format(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::ModelFormat, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }

    /// Several independent problems reported at once, so an operator fixes them in one pass.
    pub fn from_problems(kind: ErrorKind, what: &str, problems: &[String]) -> Self {
        let message = match problems {
            [one] => format!("{what}: {one}"),
            many => {
                let mut message = format!("{} problems in {what}:", many.len());
                for problem in many {
                    message.push_str("\n  - ");
                    message.push_str(problem);
                }
                message
            }
        };
        Self::new(kind, message)
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_problem_reads_as_a_sentence_and_many_as_a_list() {
        let one = Error::from_problems(ErrorKind::Config, "params", &["a is wrong".into()]);
        assert_eq!(one.message(), "params: a is wrong");
        let two = Error::from_problems(
            ErrorKind::Config,
            "params",
            &["a is wrong".into(), "b is wrong".into()],
        );
        assert_eq!(
            two.message(),
            "2 problems in params:\n  - a is wrong\n  - b is wrong"
        );
        assert_eq!(two.kind(), ErrorKind::Config);
    }
}
