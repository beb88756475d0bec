//! A man-in-the-middle proxy between a decode and a prefill engine, speaking raw sockets and
//! parsing only the 16-byte frame header (kind, 3 zero bytes, payload length u32 LE, room u64
//! LE), corrupts one thing on the way: a flipped state byte, a dropped DATA frame, a DONE frame
//! that claims a different length. Each must fail the room on both engines with the named
//! reason and leave both pools empty: nothing truncated, nothing imported (issue "PD 1").

mod common;

use common::requests::*;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;
use serde_json::json;

const DATA: u8 = 5;
const DONE: u8 = 6;

/// What the proxy does to the prefill → decode direction.
#[derive(Clone, Copy)]
enum Fault {
    FlipByteInSecondData,
    DropSecondData,
    DoneSaysOneByteMore,
}

fn read_frame(s: &mut TcpStream) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut header = vec![0u8; 16];
    s.read_exact(&mut header).ok()?;
    let len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

/// Accepts one connection (the decode's) and relays it to `prefill`, applying `fault`.
fn proxy(fault: Fault, prefill: String) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("tcp://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let (mut from_decode, _) = listener.accept().unwrap();
        let mut to_prefill = TcpStream::connect(prefill.trim_start_matches("tcp://")).unwrap();
        let (mut d2, mut p2) = (
            from_decode.try_clone().unwrap(),
            to_prefill.try_clone().unwrap(),
        );
        // Decode → prefill: untouched.
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut d2, &mut p2);
            let _ = p2.shutdown(Shutdown::Both);
        });
        let mut data_frames = 0;
        while let Some((mut header, mut payload)) = read_frame(&mut to_prefill) {
            if header[0] == DATA {
                data_frames += 1;
                if data_frames == 2 {
                    match fault {
                        Fault::FlipByteInSecondData => payload[8 + 1000] ^= 0x40,
                        Fault::DropSecondData => continue,
                        Fault::DoneSaysOneByteMore => {}
                    }
                }
            }
            if header[0] == DONE {
                if let Fault::DoneSaysOneByteMore = fault {
                    let mut done: serde_json::Value = serde_json::from_slice(&payload).unwrap();
                    done["bytes"] = (done["bytes"].as_u64().unwrap() + 1).into();
                    payload = serde_json::to_vec(&done).unwrap();
                    header[4..8].copy_from_slice(&(payload.len() as u32).to_le_bytes());
                }
            }
            if from_decode.write_all(&header).is_err() || from_decode.write_all(&payload).is_err() {
                break;
            }
        }
        let _ = from_decode.shutdown(Shutdown::Both);
    });
    addr
}

fn pd_engine(role: &str) -> Engine {
    engine_with(json!({"role": role, "pd": {"listen": "tcp://127.0.0.1:0"}}))
}

fn error_of(events: &[Event]) -> (ErrorKind, String) {
    let t = terminal(events);
    assert_eq!(t.kind(), EventKind::Error, "{events:?}");
    (t.error_kind().unwrap(), t.message().unwrap().to_string())
}

#[test]
fn corrupted_dropped_or_misstated_state_bytes_fail_the_room_on_both_sides() {
    let ids = common::ids("flash-like");
    // Long enough for several 256 KiB DATA frames.
    let prompt: Vec<u32> = ids.iter().copied().cycle().take(700).collect();
    let spec = RequestSpec {
        prompt,
        max_new_tokens: 4,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    };
    for (room, fault, reason) in [
        (1, Fault::FlipByteInSecondData, "checksum"),
        (2, Fault::DropSecondData, "mismatch"),
        (3, Fault::DoneSaysOneByteMore, "mismatch"),
    ] {
        let p = pd_engine("prefill");
        let d = pd_engine("decode");
        let via = proxy(fault, p.pd_endpoint().unwrap());
        let pid = p
            .submit(RequestSpec {
                pd_room: room,
                ..spec.clone()
            })
            .unwrap();
        let did = d
            .submit(RequestSpec {
                pd_room: room,
                pd_peer: Some(via),
                ..spec.clone()
            })
            .unwrap();
        let start = Instant::now();
        let from_d = collect(&d, &[did]);
        let from_p = collect(&p, &[pid]);
        assert!(start.elapsed() < Duration::from_secs(10));
        for (side, events) in [("decode", &from_d[&did]), ("prefill", &from_p[&pid])] {
            let (kind, message) = error_of(events);
            assert_eq!(kind, ErrorKind::KvTransfer, "{side}: {message}");
            assert!(
                message.contains(&format!("({reason})")),
                "{side}: {message}"
            );
            assert!(
                message.contains(&format!("room {room}")),
                "{side}: {message}"
            );
        }
        // No TOKEN reached the host: nothing was imported.
        assert!(from_d[&did].iter().all(|e| e.kind() != EventKind::Token));
        for e in [&p, &d] {
            let u = e.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
            assert_eq!((u.pages, u.slots), (0, 0));
        }
        let m = d.metrics();
        let i = [
            "timeout",
            "peer_dead",
            "aborted",
            "layout",
            "mismatch",
            "checksum",
            "capacity",
        ]
        .iter()
        .position(|r| *r == reason)
        .unwrap();
        assert_eq!(m.pd.failures[i], 1, "{reason}");
    }
}
