//! `dsv4`: the DeepSeek V4 prefill/decode serving pipeline behind a stable C ABI.
//!
//! Layout (see docs/architecture.md): [`config`] parses and validates, [`plan`] sizes every memory
//! pool from config + params alone, and [`ffi`] is the only module that speaks C.

pub mod backend;
pub mod config;
pub mod crc;
pub mod engine;
pub mod error;
pub mod formats;
pub mod kv;
pub mod model;
pub mod pd;
pub mod plan;
pub mod threads;
pub mod tokenizer;

pub mod ffi;

pub use error::{Error, ErrorKind, Result};
