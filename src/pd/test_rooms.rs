//! Test helpers: a room opened on a prefill node and a decode node and claimed into given
//! memory, and the header of the state a test sends (a 5-token prompt, first token 3).

use super::node::Node;
use super::wire::{Claim, StateHeader, StateInfo};
use crate::kv::Landing;

/// Opens `room` on both (requests 10 + room and 20 + room) and has the decode claim it into
/// `spans` (address, length) for a state of `bytes` bytes.
pub fn open_and_claim(
    prefill: &Node,
    decode: &Node,
    room: u64,
    spans: &[(u64, u64)],
    bytes: usize,
) {
    let endpoint = prefill.endpoint().to_string();
    prefill.register(room, 10 + room, 77, None).unwrap();
    prefill.activate(room);
    decode
        .register(room, 20 + room, 77, Some(endpoint))
        .unwrap();
    decode.activate(room);
    let claim = Claim {
        request_hash: 77,
        prompt_tokens: 5,
        slot: 0,
        pages: vec![0],
        rma_spans: Vec::new(),
    };
    decode
        .claim(room, claim, bytes, Some(Landing::over(spans)))
        .unwrap();
}

/// The header of a `bytes`-byte state that continues the claimed 5-token prompt.
pub fn header(bytes: usize) -> StateHeader {
    StateHeader {
        state: StateInfo {
            position: 5,
            last_token: Some(3),
            rng: None,
            pages: 1,
            bytes: bytes as u64,
        },
        first_logprob: 0.0,
        cached_tokens_device: 0,
        cached_tokens_host: 0,
    }
}
