//! Checkpoint reading: safetensors files ([`checkpoint`]), the official and Hugging Face naming
//! schemes ([`names`]) and validated loading ([`load`]) into [`crate::backend::WeightData`]
//! (raw bytes in their checkpoint format; FP8/FP4 decoding lives with it in `backend::weights`).

pub mod checkpoint;
pub mod load;
pub mod names;

pub use checkpoint::Checkpoint;
pub use load::Loader;
pub use names::Naming;
