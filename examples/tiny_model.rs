//! Writes the built-in tiny DeepSeek V4 checkpoint (the one `make demo` serves) and prints its
//! directory, for tools outside Rust that need it on disk (`make demo-pd` starts dsv4-server on it).
//!
//!   cargo run --release --example tiny_model
//!
//! The directory is the demo's: $DSV4_DEMO_MODEL_DIR, else $XDG_CACHE_HOME/dsv4/tiny-model, else
//! ~/.cache/dsv4/tiny-model; an up-to-date checkpoint there is reused.

#[allow(dead_code)]
#[path = "common/agentic.rs"]
mod agentic;

fn main() {
    match agentic::tiny_model() {
        Ok((dir, _)) => println!("{}", dir.display()),
        Err(e) => {
            eprintln!("tiny_model: {e}");
            std::process::exit(1);
        }
    }
}
