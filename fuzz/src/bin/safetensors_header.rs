//! A `model.safetensors` file (8-byte header length, JSON header, data) through
//! `Checkpoint::open`, the loader's entry point, and every tensor it then offers through `get`.

use std::path::PathBuf;

use dsv4::model::weights::Checkpoint;
use dsv4::ErrorKind;

fn main() {
    // run.sh passes a scratch directory (in memory where it can) and removes it afterwards:
    // afl-fuzz ends its targets with SIGKILL, so they cannot clean up after themselves.
    let dir = std::env::var_os("DSV4_FUZZ_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("dsv4-fuzz-safetensors-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let file = dir.join("model.safetensors");
    afl::fuzz!(|data: &[u8]| {
        std::fs::write(&file, data).expect("the scratch file is writable");
        match Checkpoint::open(&dir) {
            Ok(ckpt) => {
                for name in ckpt.names() {
                    let t = ckpt.get(name).expect("a listed tensor is there");
                    let elements: usize = t.shape.iter().product();
                    assert_eq!(t.bytes.len() * 8, elements * t.dtype.bitsize(), "{name}");
                }
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
                assert!(!e.message().trim().is_empty());
            }
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
