//! Params documents as a C caller passes them (raw bytes) to `Params::from_json_bytes`.
//! A crash is a panic; the checks below turn a wrong answer into one too.

use dsv4::config::Params;
use dsv4::ErrorKind;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        match Params::from_json_bytes(data) {
            // Accepted params survive their resolved document, the form dsv4_params_validate
            // returns to the caller.
            Ok(params) => {
                let resolved = params.to_json_value();
                assert_eq!(Params::from_value(&resolved).as_ref(), Ok(&params));
            }
            // A refusal is a config error with a message that says something, and never one
            // that echoes a megabyte document back.
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Config, "{e}");
                assert!(!e.message().trim().is_empty());
                assert!(e.message().len() <= 64 << 10, "{} bytes", e.message().len());
            }
        }
    });
}
