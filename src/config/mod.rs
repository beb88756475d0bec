//! Configuration: the model's `config.json` ([`model`]), the tensors it implies ([`tensors`]),
//! and the engine parameters ([`params`]). Validation returns every problem at once and never
//! panics or exits.

pub mod json;
pub mod model;
pub mod params;
pub mod size;
pub mod tensors;

pub use model::{AttentionKind, ModelConfig};
pub use params::Params;

use crate::error::{Error, ErrorKind};

/// The most problems one error lists; the rest are counted. A document with a million bad
/// entries would otherwise become an error message of a hundred megabytes.
pub const MAX_PROBLEMS: usize = 50;

/// One error for every problem found, as [`Error::from_problems`] words it, but listing only the
/// first [`MAX_PROBLEMS`] (the count still says how many there are).
pub fn problems_error(kind: ErrorKind, what: &str, problems: &[String]) -> Error {
    if problems.len() <= MAX_PROBLEMS {
        return Error::from_problems(kind, what, problems);
    }
    let mut message = format!(
        "{} problems in {what}, the first {MAX_PROBLEMS} listed:",
        problems.len()
    );
    for problem in &problems[..MAX_PROBLEMS] {
        message.push_str("\n  - ");
        message.push_str(problem);
    }
    message.push_str(&format!(
        "\n  … and {} more: fix these and validate again",
        problems.len() - MAX_PROBLEMS
    ));
    Error::new(kind, message)
}
