//! More than one engine on a side (issue "PD across hosts", on loopback, over both transports (tcp, ucx)): one decode engine
//! takes rooms from two prefill engines and one prefill engine serves two decode engines at
//! once, every room's tokens those of a unified engine (log-probabilities within 1e-4: rooms in
//! flight together share forward passes, and the CPU kernels' last bits depend on how many
//! sequences a pass holds; tests/pd_loopback.rs checks bit-equality one room at a time); and
//! rooms are independent: a
//! prefill engine that goes away fails its own rooms on the decode, not the other prefill's.

mod common;

use common::requests::*;

use dsv4::engine::{Engine, EventKind, FinishReason, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;
use serde_json::{json, Value};

on_both_transports! {

fn engine(role: &str, extra: Value) -> Engine {
    let mut doc = common::pd_doc(role, TRANSPORT);
    merge(&mut doc, extra);
    engine_with(doc)
}

fn spec(prompt: &[u32], max_new: u32) -> RequestSpec {
    RequestSpec {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        logprobs: true,
        seed: 7,
        sampling: SamplingParams {
            temperature: 2.0,
            logit_bias: vec![(1, -1000.0)], // no EOS: every run generates max_new tokens
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

fn in_room(s: &RequestSpec, room: u64, peer: Option<String>) -> RequestSpec {
    RequestSpec {
        pd_room: room,
        pd_peer: peer,
        ..s.clone()
    }
}

#[test]
fn two_prefills_feed_one_decode_and_one_prefill_feeds_two_decodes_at_once() {
    let ids = common::ids("flash-like");
    let unified = engine_with(json!({}));
    let prefills = [engine("prefill", json!({})), engine("prefill", json!({}))];
    let decodes = [engine("decode", json!({})), engine("decode", json!({}))];
    // Eight rooms, every (prefill, decode) pairing twice, all in flight together.
    let rooms: Vec<(u64, usize, usize, RequestSpec)> = (0..8)
        .map(|i| {
            let len = 20 + 37 * i;
            (
                100 + i as u64,
                i % 2,
                (i / 2) % 2,
                spec(&ids[i..i + len], 6),
            )
        })
        .collect();
    let mut submitted = Vec::new();
    for (room, p, d, s) in &rooms {
        let pid = prefills[*p].submit(in_room(s, *room, None)).unwrap();
        let peer = prefills[*p].pd_endpoint().unwrap();
        let did = decodes[*d].submit(in_room(s, *room, Some(peer))).unwrap();
        submitted.push((pid, did));
    }
    let mut from_p = [
        collect(&prefills[0], &ids_of(&submitted, &rooms, 0, true)),
        collect(&prefills[1], &ids_of(&submitted, &rooms, 1, true)),
    ];
    let mut from_d = [
        collect(&decodes[0], &ids_of(&submitted, &rooms, 0, false)),
        collect(&decodes[1], &ids_of(&submitted, &rooms, 1, false)),
    ];
    for ((room, p, d, s), (pid, did)) in rooms.iter().zip(&submitted) {
        let uid = unified.submit(s.clone()).unwrap();
        let want = collect(&unified, &[uid]).remove(&uid).unwrap();
        let sent = from_p[*p].remove(pid).unwrap();
        assert_eq!(
            terminal(&sent).finish_reason(),
            Some(FinishReason::Transferred),
            "room {room}: {sent:?}"
        );
        let got = from_d[*d].remove(did).unwrap();
        assert_eq!(
            terminal(&got).finish_reason(),
            Some(FinishReason::Length),
            "room {room}: {got:?}"
        );
        assert!(
            same_stream(&stream(&got), &stream(&want)),
            "room {room}: {:?} vs {:?}",
            stream(&got),
            stream(&want)
        );
    }
    // Each side counted its four rooms; each engine saw both peers of the other side.
    for e in prefills.iter().chain(&decodes) {
        let m = e.metrics();
        assert_eq!(m.kv_transfer.requests, 4);
        assert_eq!(m.kv_transfer.failures, 0);
        assert_eq!(m.pd.peers, 2);
        assert_eq!(m.pd.pages_held, 0);
    }
}

/// The request ids on engine `which` of one side (`prefill`: the prefill's, else the decode's).
fn ids_of(
    submitted: &[(u64, u64)],
    rooms: &[(u64, usize, usize, RequestSpec)],
    which: usize,
    prefill: bool,
) -> Vec<u64> {
    rooms
        .iter()
        .zip(submitted)
        .filter(|((_, p, d, _), _)| (if prefill { *p } else { *d }) == which)
        .map(|(_, (pid, did))| if prefill { *pid } else { *did })
        .collect()
}

#[test]
fn a_prefill_that_goes_away_fails_only_its_own_rooms() {
    let ids = common::ids("flash-like");
    let unified = engine_with(json!({}));
    let (staying, leaving) = (engine("prefill", json!({})), engine("prefill", json!({})));
    let decode = engine("decode", json!({}));
    let (to_stay, to_leave) = (
        staying.pd_endpoint().unwrap(),
        leaving.pd_endpoint().unwrap(),
    );
    // Rooms on the leaving prefill are claimed but never computed there (their prefill requests
    // are not sent): they wait on its side when it goes. Rooms on the staying one run whole.
    let mut waiting = Vec::new();
    for room in 1..=3u64 {
        let s = spec(&ids[..40 + room as usize], 4);
        waiting.push(
            decode
                .submit(in_room(&s, room, Some(to_leave.clone())))
                .unwrap(),
        );
    }
    // The claims reach the leaving prefill (its early claims) before it goes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while leaving.metrics().pd.early_claims < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the claims did not arrive"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = spec(&ids[..90], 5);
    let pid = staying.submit(in_room(&s, 10, None)).unwrap();
    let did = decode.submit(in_room(&s, 10, Some(to_stay))).unwrap();
    drop(leaving);
    let mut ended = collect(&decode, &[did, waiting[0], waiting[1], waiting[2]]);
    for id in &waiting {
        let events = ended.remove(id).unwrap();
        let t = terminal(&events);
        assert_eq!(t.kind(), EventKind::Error, "{events:?}");
        assert_eq!(t.error_kind(), Some(ErrorKind::KvTransfer));
        assert!(
            t.message().unwrap().contains("peer_dead"),
            "{:?}",
            t.message()
        );
    }
    let uid = unified.submit(s.clone()).unwrap();
    let want = collect(&unified, &[uid]).remove(&uid).unwrap();
    let got = ended.remove(&did).unwrap();
    assert!(same_stream(&stream(&got), &stream(&want)));
    assert_eq!(
        terminal(&collect(&staying, &[pid]).remove(&pid).unwrap()).finish_reason(),
        Some(FinishReason::Transferred)
    );
    let m = decode.metrics();
    assert_eq!((m.kv_transfer.requests, m.kv_transfer.failures), (1, 3));
    assert_eq!(m.pd.pages_held, 0);
    assert_eq!(m.pd.peers, 1);
}

}
