//! Active messages a UCX peer sends, as the UCX thread takes them: each message's header and
//! data through `ucx_port::parse` (sequence number, frame header, a DATA frame's offset, the
//! data's length against the header's), then back in order by sequence number (`InOrder`,
//! with the thread's limit on frames held ahead of a missing one). The input is a series of
//! messages, each `[header length: u8][data length: u16 LE][header][data]`.
//!
//! What must hold for any input: no panic; a parsed message carries exactly the bytes its
//! header announces, an offset iff it is DATA, within its kind's cap; every error a message;
//! frames come out of `InOrder` once each, in sequence order, never more held than the limit.

use dsv4::pd::in_order::InOrder;
use dsv4::pd::ucx::Message;
use dsv4::pd::ucx_port::{parse, MAX_AM_HEADER, MAX_EARLY};
use dsv4::pd::wire::Kind;

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let mut input = data;
        let mut order = InOrder::new(MAX_EARLY);
        let mut delivered: u64 = 0;
        while input.len() >= 3 {
            let hlen = (input[0] as usize).min(MAX_AM_HEADER + 8);
            let dlen = u16::from_le_bytes([input[1], input[2]]) as usize;
            input = &input[3..];
            let hlen = hlen.min(input.len());
            let (header, rest) = input.split_at(hlen);
            let dlen = dlen.min(rest.len());
            let (body, rest) = rest.split_at(dlen);
            input = rest;
            let m = Message {
                id: 0,
                header: header.to_vec(),
                data: body.to_vec(),
                from: None,
            };
            match parse(m, None) {
                Ok((seq, (kind, _room, offset, bytes))) => {
                    assert_eq!(offset.is_some(), kind == Kind::Data);
                    assert_eq!(bytes.len(), dlen);
                    let announced = bytes.len() + offset.map_or(0, |_| 8);
                    assert!(announced <= kind.max_payload());
                    match order.accept(seq, seq) {
                        Ok(ready) => {
                            for s in ready {
                                assert_eq!(s, delivered, "out of order");
                                delivered += 1;
                            }
                        }
                        Err(e) => assert!(!e.is_empty()),
                    }
                }
                Err(e) => assert!(!e.is_empty() && e.len() <= 4096, "{e}"),
            }
        }
    });
}
