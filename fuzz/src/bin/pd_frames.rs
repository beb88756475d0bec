//! Bytes a PD peer sends, as a node reads them: a stream of frames through
//! `wire::read_frame_from`, each payload parsed and bounds-checked as its kind's message
//! (`wire::parse`), DATA split into offset and bytes. What must hold for any input: no panic,
//! no allocation beyond a frame kind's cap, every error a message, and every accepted message
//! within the limits of `pd::limits` and re-encodable to the same value.

use dsv4::pd::limits::{Bounded, MAX_STATE_BYTES};
use dsv4::pd::wire::{
    self, encode_json, Claim, Done, Failure, Frame, Hello, Kind, ReadError, Refusal, StateHeader,
};
use serde::{Deserialize, Serialize};

/// Parses `frame` as `T`; an accepted value is within its limits and survives a round trip.
fn check<T>(frame: &Frame) -> Option<T>
where
    T: Serialize + for<'a> Deserialize<'a> + Bounded + PartialEq + std::fmt::Debug,
{
    match wire::parse::<T>(frame) {
        Ok(v) => {
            assert!(v.check().is_ok());
            let again = encode_json(frame.kind, frame.room, &v);
            let back = wire::read_frame_from(&mut &again[..]).expect("our own frame reads back");
            assert_eq!(wire::parse::<T>(&back).as_ref(), Ok(&v));
            Some(v)
        }
        Err(m) => {
            assert!(!m.is_empty() && m.len() <= 16 << 10, "{} bytes", m.len());
            None
        }
    }
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let mut input = data;
        loop {
            let frame = match wire::read_frame_from(&mut input) {
                Ok(f) => f,
                Err(ReadError::Io(_)) => break,
                Err(ReadError::Protocol(m)) => {
                    assert!(!m.is_empty());
                    break;
                }
            };
            assert!(frame.payload.len() <= frame.kind.max_payload());
            match frame.kind {
                Kind::Hello => {
                    check::<Hello>(&frame);
                }
                Kind::Refuse => {
                    check::<Refusal>(&frame);
                }
                Kind::Claim => {
                    check::<Claim>(&frame);
                }
                Kind::State => {
                    if let Some(h) = check::<StateHeader>(&frame) {
                        assert!(h.state.bytes <= MAX_STATE_BYTES);
                    }
                }
                Kind::Data => {
                    if let Some((_, bytes)) = wire::split_data(&frame.payload) {
                        assert!(bytes.len() <= wire::DATA_CHUNK);
                    }
                }
                Kind::Done => {
                    check::<Done>(&frame);
                }
                Kind::Fail => {
                    check::<Failure>(&frame);
                }
                Kind::Auth => {
                    check::<wire::Auth>(&frame);
                }
                Kind::Proof => {
                    check::<wire::Proof>(&frame);
                }
                Kind::Ack | Kind::Heartbeat | Kind::Flushed => {}
            }
        }
    });
}
