pub mod nvrtc;
pub mod sources;
