//! Configuration: the model's `config.json` ([`model`]), the tensors it implies ([`tensors`]),
//! and the engine parameters ([`params`]). Validation returns every problem at once and never
//! panics or exits.

pub mod model;
pub mod params;
pub mod size;
pub mod tensors;

pub use model::{AttentionKind, ModelConfig};
pub use params::Params;
