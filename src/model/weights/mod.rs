//! Checkpoint reading: safetensors files ([`checkpoint`]), the official and Hugging Face naming
//! schemes ([`names`]), FP8/FP4 decoding ([`dequant`]) and validated loading ([`load`]).

pub mod checkpoint;
pub mod dequant;
pub mod load;
pub mod names;

pub use checkpoint::Checkpoint;
pub use load::Loader;
pub use names::Naming;
