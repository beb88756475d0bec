//! PD rooms under random interleavings and injected faults (issues "PD 2" and "PD across
//! hosts"), on both transports. Over tcp a prefill and a decode engine talk through the fault
//! proxy (tests/common/fault_proxy.rs); over ucx, where UCX owns the wire, their UCX threads
//! inject the faults themselves (src/pd/ucx_faults.rs: a byte flipped in a room's RMA write,
//! a room's message lost, random delays that reorder messages, every connection closed at
//! once). Each case submits
//! a few rooms to both engines in either order (some to one side only, so they time out),
//! aborts some on either side at random times, injects one scripted fault into some rooms'
//! frames, adds benign noise (delays, lost heartbeats, duplicated ACKs) and sometimes kills
//! the connection. For every room: exactly one terminal event on each side it was submitted
//! to, nothing after it, a status that follows from what was done to the room (docs/pd.md),
//! the decode's tokens always a prefix of the unified engine's (all of them when the room
//! succeeded); and after every case both engines' pools hold no page, slot or snapshot.
//!
//! One engine pair (and proxy) serves every case: an engine starts in well under a second,
//! but reusing the pair also checks that nothing a case leaves behind (a room, a claim, a
//! held page, a stray event) disturbs the next.

mod common;

use common::fault_proxy::{
    At, Chance, Dir, Fault, FaultProxy, Plan, Rule, ACK, CLAIM, DATA, DONE, HEARTBEAT, STATE,
};
use common::requests::*;

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, FinishReason, RequestSpec};
use dsv4::error::ErrorKind;
use dsv4::pd::ucx_faults::{self, Applied};
use proptest::prelude::*;
use serde_json::json;

const MAX_NEW: u32 = 4;
/// Prompt lengths: one page, a few pages, and one whose state spans several DATA frames.
const PROMPTS: [usize; 3] = [40, 300, 700];
const BOOTSTRAP_MS: u64 = 1000;
/// Room for a loaded 2-core machine: four rooms' prefills and transfers take well under a second.
const TRANSFER_MS: u64 = 3000;
/// Heartbeats every 50 ms, dead after 20 missed (1 s): benign delays (at most 200 ms) and a
/// busy machine never make a peer look dead; peer deaths here are closed connections.
const HEARTBEAT_MS: u64 = 50;

/// What one room's frames suffer (one scripted fault, aimed at this room's frames).
#[derive(Debug, Clone, Copy)]
enum Injected {
    DropState,
    DropData(usize),
    DropDone,
    /// A state byte of the nth DATA frame (after its 8-byte offset).
    FlipStateByte(usize, usize),
    /// A byte of the nth DATA frame's offset.
    FlipOffset(usize, usize),
    FlipStateHeader(usize),
    FlipDone(usize),
    DupState,
    DupData(usize),
    DupDone,
    ReorderState,
    ReorderData(usize),
    /// The frame's room id points nowhere: lost, as far as its room can tell.
    WrongRoomData(usize),
    /// An unknown frame kind: the decode drops the connection (protocol error).
    BadKindData(usize),
    /// A non-zero reserved header byte: the same.
    BadReservedData(usize, usize),
    Truncate(u8, usize),
    CloseOnData(usize),
    DropClaim,
    /// The claim's JSON broken at its first byte: the prefill cannot read it.
    FlipClaim,
    DupClaim,
    DropAck,
    DupAck,
    CloseOnClaim,
    Delay(Dir, u8, u64),
    /// ucx: a byte of the room's first RMA write flipped.
    FlipPut,
    /// ucx: the room's first message lost on the way (on each side: both UCX threads of the
    /// process take the setting): everything after it on the connection waits behind the gap
    /// until the peer is declared dead.
    LoseRoom,
}

impl Injected {
    /// The fault's setting for the UCX threads (`DSV4_UCX_FAULTS` syntax).
    fn ucx_setting(self, room: u64) -> String {
        match self {
            Injected::FlipPut => format!("flip_room={room}"),
            Injected::LoseRoom => format!("lose_room={room}"),
            other => unreachable!("{other:?} is a tcp proxy fault"),
        }
    }

    fn rule(self, room: u64) -> Rule {
        use Injected::*;
        let (dir, kind, nth, fault) = match self {
            DropState => (Dir::ToDecode, STATE, 1, Fault::Drop),
            DropData(n) => (Dir::ToDecode, DATA, n, Fault::Drop),
            DropDone => (Dir::ToDecode, DONE, 1, Fault::Drop),
            FlipStateByte(n, k) => (Dir::ToDecode, DATA, n, corrupt(At::Payload(8 + k))),
            FlipOffset(n, k) => (Dir::ToDecode, DATA, n, corrupt(At::Payload(k % 8))),
            FlipStateHeader(k) => (Dir::ToDecode, STATE, 1, corrupt(At::Payload(k))),
            FlipDone(k) => (Dir::ToDecode, DONE, 1, corrupt(At::Payload(k))),
            DupState => (Dir::ToDecode, STATE, 1, Fault::Duplicate),
            DupData(n) => (Dir::ToDecode, DATA, n, Fault::Duplicate),
            DupDone => (Dir::ToDecode, DONE, 1, Fault::Duplicate),
            ReorderState => (Dir::ToDecode, STATE, 1, Fault::Reorder),
            ReorderData(n) => (Dir::ToDecode, DATA, n, Fault::Reorder),
            WrongRoomData(n) => (Dir::ToDecode, DATA, n, corrupt(At::Header(15))),
            BadKindData(n) => (
                Dir::ToDecode,
                DATA,
                n,
                Fault::Corrupt {
                    at: At::Header(0),
                    mask: 0x80,
                },
            ),
            BadReservedData(n, i) => (Dir::ToDecode, DATA, n, corrupt(At::Header(1 + i % 3))),
            Truncate(kind, k) => (Dir::ToDecode, kind, 1, Fault::Truncate(k)),
            CloseOnData(n) => (Dir::ToDecode, DATA, n, Fault::Close),
            DropClaim => (Dir::ToPrefill, CLAIM, 1, Fault::Drop),
            FlipClaim => (Dir::ToPrefill, CLAIM, 1, corrupt(At::Payload(0))),
            DupClaim => (Dir::ToPrefill, CLAIM, 1, Fault::Duplicate),
            DropAck => (Dir::ToPrefill, ACK, 1, Fault::Drop),
            DupAck => (Dir::ToPrefill, ACK, 1, Fault::Duplicate),
            CloseOnClaim => (Dir::ToPrefill, CLAIM, 1, Fault::Close),
            FlipPut | LoseRoom => unreachable!("{self:?} is a ucx fault"),
            Delay(dir, kind, ms) => (dir, kind, 1, Fault::Delay(Duration::from_millis(ms))),
        };
        Rule {
            dir,
            kind: Some(kind),
            room: Some(room),
            nth,
            fault,
        }
    }

    /// The (prefill, decode) ends the fault allows, once it was applied (docs/pd.md).
    fn allows(self) -> Vec<(Pat, Pat)> {
        use Injected::*;
        let same = |reasons: &[&'static str]| -> Vec<(Pat, Pat)> {
            reasons.iter().map(|r| (kvt(r), kvt(r))).collect()
        };
        match self {
            // The decode misses the STATE frame or bytes (DONE's length disagrees), gets a byte
            // twice or at another offset (an overlap, or past the end).
            DropState | DropData(_) | FlipOffset(..) | DupState | DupData(_) | WrongRoomData(_) => {
                same(&["mismatch"])
            }
            // DATA carries its offset and may come before STATE (complete pages are sent
            // early), so a STATE or DATA frame swapped with the room's next DATA frame is
            // harmless; one swapped with DONE leaves DONE short of bytes.
            ReorderState => vec![(Pat::Ok, Pat::Ok)],
            ReorderData(_) => [vec![(Pat::Ok, Pat::Ok)], same(&["mismatch"])].concat(),
            FlipStateByte(..) => same(&["checksum"]),
            // The CRC covers the STATE payload: whatever the flip did, the room fails.
            FlipStateHeader(_) => same(&["mismatch", "checksum", "capacity"]),
            FlipDone(_) => same(&["mismatch", "checksum"]),
            // The decode never hears the end: one side's transfer deadline passes and it
            // tells the other.
            DropDone | DropClaim => vec![(timeout(), timeout())],
            // A second DONE after the state was handed to the engine fails the delivered
            // room, unless the state already landed (the duplicate is then for an ended room).
            DupDone => [vec![(Pat::Ok, Pat::Ok)], same(&["mismatch"])].concat(),
            // The same claim again changes nothing (a taken claim repeated on its connection
            // is ignored; an early one replaces the first).
            DupClaim => vec![(Pat::Ok, Pat::Ok)],
            BadKindData(_) | BadReservedData(..) | Truncate(..) | CloseOnData(_) => {
                same(&["peer_dead"])
            }
            // The prefill answers an unreadable claim with FAIL and keeps waiting for one.
            FlipClaim => vec![(timeout(), kvt("mismatch"))],
            // The prefill never hears the claim; the decode's link is gone.
            CloseOnClaim => vec![(timeout(), kvt("peer_dead"))],
            // The prefill's transfer deadline passes; the decode has its state and usually
            // finished before the FAIL arrives.
            DropAck => vec![(timeout(), Pat::Ok), (timeout(), kvt("timeout"))],
            DupAck | Delay(..) => vec![(Pat::Ok, Pat::Ok)],
            // The decode's check at DONE covers every byte, however it was written.
            FlipPut => same(&["checksum"]),
            // The link stalls until a side declares the other dead; a prefill that lost the
            // claim has the room waiting for one until its deadline.
            LoseRoom => vec![
                (kvt("peer_dead"), kvt("peer_dead")),
                (timeout(), kvt("peer_dead")),
            ],
        }
    }

    fn kills_connection(self) -> bool {
        use Injected::*;
        matches!(
            self,
            BadKindData(_)
                | BadReservedData(..)
                | Truncate(..)
                | CloseOnData(_)
                | CloseOnClaim
                | LoseRoom
        )
    }
}

fn corrupt(at: At) -> Fault {
    Fault::Corrupt { at, mask: 0x40 }
}

/// How a room ended on one side.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// Prefill: FINISHED transferred; decode: FINISHED length with the unified engine's tokens.
    Ok,
    Aborted,
    /// ERROR with its kind and the failure reason the message ends with.
    Failed(ErrorKind, String),
    /// Not submitted on this side.
    Absent,
}

/// An end a room may have.
#[derive(Debug, Clone, PartialEq)]
enum Pat {
    Ok,
    Aborted,
    Err(ErrorKind, &'static str),
    Absent,
}

fn kvt(reason: &'static str) -> Pat {
    Pat::Err(ErrorKind::KvTransfer, reason)
}

fn timeout() -> Pat {
    Pat::Err(ErrorKind::Timeout, "timeout")
}

impl Pat {
    fn matches(&self, e: &End) -> bool {
        match (self, e) {
            (Pat::Ok, End::Ok) | (Pat::Aborted, End::Aborted) | (Pat::Absent, End::Absent) => true,
            (Pat::Err(k, r), End::Failed(kind, reason)) => k == kind && r == reason,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Sides {
    Both { decode_first: bool, gap_ms: u64 },
    PrefillOnly,
    DecodeOnly,
}

#[derive(Debug, Clone, Copy)]
enum Act {
    Plain,
    Abort { on_decode: bool, after_ms: u64 },
    Fault(Injected),
}

#[derive(Debug, Clone)]
struct RoomPlan {
    prompt: usize,
    start_ms: u64,
    sides: Sides,
    act: Act,
}

#[derive(Debug, Clone)]
struct Case {
    rooms: Vec<RoomPlan>,
    kill_ms: Option<u64>,
    noise: bool,
    seed: u64,
}

fn injected() -> impl Strategy<Value = Injected> {
    use Injected::*;
    let n = 1usize..3;
    prop_oneof![
        Just(DropState),
        n.clone().prop_map(DropData),
        Just(DropDone),
        (n.clone(), 0usize..4096).prop_map(|(n, k)| FlipStateByte(n, k)),
        (n.clone(), 0usize..8).prop_map(|(n, k)| FlipOffset(n, k)),
        any::<usize>().prop_map(FlipStateHeader),
        any::<usize>().prop_map(FlipDone),
        Just(DupState),
        n.clone().prop_map(DupData),
        Just(DupDone),
        Just(ReorderState),
        n.clone().prop_map(ReorderData),
        n.clone().prop_map(WrongRoomData),
        n.clone().prop_map(BadKindData),
        (n.clone(), 0usize..3).prop_map(|(n, i)| BadReservedData(n, i)),
        (prop::sample::select(vec![STATE, DATA, DONE]), 0usize..64)
            .prop_map(|(k, n)| Truncate(k, n)),
        n.prop_map(CloseOnData),
        Just(DropClaim),
        Just(FlipClaim),
        Just(DupClaim),
        Just(DropAck),
        Just(DupAck),
        Just(CloseOnClaim),
        (
            prop::sample::select(vec![
                (Dir::ToPrefill, CLAIM),
                (Dir::ToPrefill, ACK),
                (Dir::ToDecode, STATE),
                (Dir::ToDecode, DATA),
                (Dir::ToDecode, DONE),
            ]),
            10u64..200
        )
            .prop_map(|((d, k), ms)| Delay(d, k, ms)),
    ]
}

/// What the UCX threads can do to one room (UCX owns the wire: frames cannot be cut, doubled
/// or edited on it). A lost message costs a second (the dead interval), so it is rarer.
fn injected_ucx() -> impl Strategy<Value = Injected> {
    prop_oneof![3 => Just(Injected::FlipPut), 1 => Just(Injected::LoseRoom)]
}

fn room_plan(ucx: bool) -> impl Strategy<Value = RoomPlan> {
    let sides = prop_oneof![
        6 => (any::<bool>(), 0u64..300)
            .prop_map(|(decode_first, gap_ms)| Sides::Both { decode_first, gap_ms }),
        1 => Just(Sides::PrefillOnly),
        1 => Just(Sides::DecodeOnly),
    ];
    let act = prop_oneof![
        2 => Just(Act::Plain),
        1 => (any::<bool>(), 0u64..400)
            .prop_map(|(on_decode, after_ms)| Act::Abort { on_decode, after_ms }),
        4 => if ucx { injected_ucx().boxed() } else { injected().boxed() }.prop_map(Act::Fault),
    ];
    (0..PROMPTS.len(), 0u64..200, sides, act).prop_map(|(prompt, start_ms, sides, act)| {
        // A one-sided room has no frames to fault, and aborts only where it was submitted.
        let act = match (sides, act) {
            (Sides::Both { .. }, a) => a,
            (_, Act::Fault(_)) => Act::Plain,
            (s, Act::Abort { after_ms, .. }) => Act::Abort {
                on_decode: matches!(s, Sides::DecodeOnly),
                after_ms,
            },
            (_, a) => a,
        };
        RoomPlan {
            prompt,
            start_ms,
            sides,
            act,
        }
    })
}

fn case(ucx: bool) -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(room_plan(ucx), 1..5),
        prop::option::weighted(0.15, 0u64..600),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(rooms, kill_ms, noise, seed)| Case {
            rooms,
            kill_ms,
            noise,
            seed,
        })
}

/// The engines, the proxy between them (tcp) and the reference streams, shared by every case.
struct Rig {
    p: Engine,
    d: Engine,
    /// tcp: the fault proxy the decode reaches the prefill through; ucx: none (the UCX
    /// threads inject the faults).
    proxy: Option<FaultProxy>,
    /// Where the decode finds the prefill.
    peer: String,
    prompts: Vec<Vec<u32>>,
    /// (token, logprob bits) from a unified engine, per prompt.
    want: Vec<Vec<(u32, u32)>>,
    next_room: Cell<u64>,
    /// The engines authenticate (`pd.auth_key_file`): every frame carries a MAC, so any frame
    /// the proxy drops, duplicates or changes takes the whole connection down.
    sealed: bool,
    /// How rooms ended, for the summary line (what the cases exercised).
    tally: RefCell<BTreeMap<String, usize>>,
}

fn spec(prompt: &[u32]) -> RequestSpec {
    let mut s = exact(prompt, MAX_NEW);
    s.logprobs = true;
    s
}

impl Rig {
    /// `transport`: `tcp` or `ucx`, `-auth` after it between engines holding a key.
    fn new(transport: &str) -> Rig {
        let sealed = transport.ends_with("-auth");
        let transport = transport.trim_end_matches("-auth");
        let ids = common::ids("flash-like");
        let prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|&n| ids.iter().copied().cycle().take(n).collect())
            .collect();
        let unified = engine_with(json!({}));
        let want = prompts
            .iter()
            .map(|p| {
                let id = unified.submit(spec(p)).unwrap();
                stream(&collect(&unified, &[id])[&id])
            })
            .collect();
        let mut pd = json!({
            "transport": transport,
            "listen": format!("{transport}://127.0.0.1:0"),
            "bootstrap_timeout_ms": BOOTSTRAP_MS,
            "transfer_timeout_ms": TRANSFER_MS,
            "heartbeat_interval_ms": HEARTBEAT_MS,
            "heartbeat_misses": 20,
        });
        if sealed {
            let key = std::env::temp_dir().join(format!("dsv4-faults-{}.key", std::process::id()));
            std::fs::write(
                &key,
                "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b\n",
            )
            .unwrap();
            pd["auth_key_file"] = json!(key);
        }
        let p = engine_with(json!({"role": "prefill", "pd": pd.clone()}));
        let d = engine_with(json!({"role": "decode", "pd": pd}));
        let prefill = p.pd_endpoint().unwrap();
        let proxy = (transport == "tcp").then(|| match sealed {
            true => FaultProxy::start_sealed(&prefill, Plan::default(), 0),
            false => FaultProxy::start(&prefill, Plan::default(), 0),
        });
        Rig {
            p,
            d,
            peer: proxy.as_ref().map_or(prefill, |x| x.addr().to_string()),
            proxy,
            prompts,
            want,
            next_room: Cell::new(1),
            sealed,
            tally: RefCell::new(BTreeMap::new()),
        }
    }

    fn run(&self, case: &Case) {
        let first = self.next_room.get();
        self.next_room.set(first + case.rooms.len() as u64);
        let room_of = |i: usize| first + i as u64;
        // The rooms' scripted faults, then the noise: benign whatever frame it hits.
        let mut plan = Plan::default();
        let mut ucx_setting = Vec::new();
        for (i, r) in case.rooms.iter().enumerate() {
            if let Act::Fault(f) = r.act {
                match self.proxy {
                    Some(_) => plan.rules.push(f.rule(room_of(i))),
                    None => ucx_setting.push(f.ucx_setting(room_of(i))),
                }
            }
        }
        if case.noise && self.proxy.is_none() {
            // Messages handed on after a random delay, so they overtake each other.
            ucx_setting.push(format!("delay_ms={}", 5 + case.seed % 40));
            ucx_setting.push(format!("seed={}", case.seed));
        }
        let ucx_setting = ucx_setting.join(",");
        if case.noise && self.proxy.is_some() {
            let ms = 5 + case.seed % 40;
            for dir in [Dir::ToPrefill, Dir::ToDecode] {
                plan.chances.push(Chance {
                    dir,
                    kinds: vec![HEARTBEAT],
                    p: 0.2,
                    fault: Fault::Drop,
                });
                plan.chances.push(Chance {
                    dir,
                    kinds: vec![],
                    p: 0.05,
                    fault: Fault::Delay(Duration::from_millis(ms)),
                });
            }
            plan.chances.push(Chance {
                dir: Dir::ToPrefill,
                kinds: vec![ACK],
                p: 0.3,
                fault: Fault::Duplicate,
            });
        }
        match &self.proxy {
            Some(proxy) => proxy.set_plan(plan, case.seed),
            None => {
                // What an earlier case did is that case's.
                ucx_faults::applied();
                ucx_faults::set(&ucx_setting).unwrap();
            }
        }

        // The timeline: submissions, aborts and the kill, in time order.
        #[derive(Debug)]
        enum Step {
            Submit(usize, bool),
            Abort(usize, bool),
            Kill,
        }
        let mut steps: Vec<(u64, Step)> = Vec::new();
        for (i, r) in case.rooms.iter().enumerate() {
            let (p_at, d_at) = match r.sides {
                Sides::Both {
                    decode_first,
                    gap_ms,
                } if decode_first => (Some(r.start_ms + gap_ms), Some(r.start_ms)),
                Sides::Both { gap_ms, .. } => (Some(r.start_ms), Some(r.start_ms + gap_ms)),
                Sides::PrefillOnly => (Some(r.start_ms), None),
                Sides::DecodeOnly => (None, Some(r.start_ms)),
            };
            for (at, on_decode) in [(p_at, false), (d_at, true)] {
                if let Some(at) = at {
                    steps.push((at, Step::Submit(i, on_decode)));
                    if let Act::Abort {
                        on_decode: side,
                        after_ms,
                    } = r.act
                    {
                        if side == on_decode {
                            steps.push((at + after_ms, Step::Abort(i, on_decode)));
                        }
                    }
                }
            }
        }
        if let Some(ms) = case.kill_ms {
            steps.push((ms, Step::Kill));
        }
        steps.sort_by_key(|s| s.0);
        let start = Instant::now();
        // Request ids by room index, per side.
        let mut ids: Vec<[Option<u64>; 2]> = vec![[None, None]; case.rooms.len()];
        for (at, step) in &steps {
            // The case's random interleaving: sleeping is the input here, not a wait.
            let due = start + Duration::from_millis(*at);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            match *step {
                Step::Submit(i, on_decode) => {
                    let r = &case.rooms[i];
                    let mut s = spec(&self.prompts[r.prompt]);
                    s.pd_room = room_of(i);
                    let engine = if on_decode {
                        s.pd_peer = Some(self.peer.clone());
                        &self.d
                    } else {
                        &self.p
                    };
                    ids[i][on_decode as usize] = Some(engine.submit(s).unwrap());
                }
                Step::Abort(i, on_decode) => {
                    let engine = if on_decode { &self.d } else { &self.p };
                    // An error only says the request already ended.
                    let _ = engine.abort(ids[i][on_decode as usize].unwrap());
                }
                Step::Kill => match &self.proxy {
                    Some(proxy) => proxy.kill(),
                    // Every connection closed by force. The case's faults are set again (those
                    // already used re-armed: they can only hit rooms the kill fails anyway).
                    None => ucx_faults::set(&format!("{ucx_setting},close=1")).unwrap(),
                },
            }
        }

        let report = || match &self.proxy {
            Some(proxy) => proxy.report(),
            None => format!("ucx faults: {ucx_setting:?}"),
        };
        let context =
            |what: String| format!("{what}\ncase (rooms {first}..): {case:#?}\n{}", report());
        let side_ids = |side: usize| -> Vec<u64> { ids.iter().filter_map(|x| x[side]).collect() };
        let from_p = self.events(&self.p, &side_ids(0), "prefill", &context);
        let from_d = self.events(&self.d, &side_ids(1), "decode", &context);

        // Which rooms' faults fired, and whether the connection went down under the case.
        let (fired, killed, applied): (HashSet<u64>, bool, Vec<Applied>) = match &self.proxy {
            Some(proxy) => {
                let log = proxy.log();
                let fired = log
                    .iter()
                    .filter(|a| a.rule.is_some())
                    .map(|a| a.room)
                    .collect();
                // On an authenticated link any frame dropped, duplicated or changed (a delay
                // changes nothing) fails the next MAC check: the connection goes down.
                let broken = self.sealed && log.iter().any(|a| !matches!(a.fault, Fault::Delay(_)));
                (fired, broken || log.iter().any(|a| a.kind == 0), Vec::new())
            }
            None => {
                let applied = ucx_faults::applied();
                let fired = applied
                    .iter()
                    .filter_map(|a| match a {
                        Applied::Flipped { room } | Applied::FlippedMessage { room } => Some(*room),
                        Applied::Lost { room, .. } => *room,
                        Applied::Closed(_) => None,
                    })
                    .collect();
                let closed = applied.iter().any(|a| matches!(a, Applied::Closed(_)));
                (fired, closed, applied)
            }
        };
        let conn_died = (killed && (self.sealed || case.kill_ms.is_some()))
            || case.rooms.iter().enumerate().any(|(i, r)| {
                matches!(r.act, Act::Fault(f) if f.kills_connection() && fired.contains(&room_of(i)))
            });

        for (i, r) in case.rooms.iter().enumerate() {
            let room = room_of(i);
            let want = &self.want[r.prompt];
            let p_events = ids[i][0].map(|id| &from_p[&id]);
            let d_events = ids[i][1].map(|id| &from_d[&id]);
            let ctx = |what: &str| {
                context(format!(
                    "room {room}: {what}\nprefill events: {p_events:?}\ndecode events: \
                     {d_events:?}\nucx faults applied: {applied:?}"
                ))
            };
            // The prefill never streams; the decode's tokens are the unified engine's, as far
            // as they go, whatever happened to the room.
            if let Some(ev) = p_events {
                assert!(stream(ev).is_empty(), "{}", ctx("a prefill TOKEN event"));
            }
            if let Some(ev) = d_events {
                let got = stream(ev);
                assert!(
                    got.len() <= want.len() && same_stream(&got, &want[..got.len()]),
                    "{}",
                    ctx(&format!("decode tokens {got:?}, unified {want:?}"))
                );
            }
            let ends = (
                p_events.map_or(End::Absent, |e| end_of(e, false, want)),
                d_events.map_or(End::Absent, |e| end_of(e, true, want)),
            );
            // A prefill that handed over means the state landed: the decode emitted its first
            // token.
            if ends.0 == End::Ok {
                assert!(
                    d_events.is_some_and(|e| !stream(e).is_empty()),
                    "{}",
                    ctx("transferred, but the decode never landed the state")
                );
            }
            *self
                .tally
                .borrow_mut()
                .entry(format!("{:?}", ends))
                .or_default() += 1;
            let allowed = allowed(r, fired.contains(&room));
            let ok = if conn_died {
                // Rooms on the connection when it went down fail with peer_dead; their
                // claims are lost (the prefill times out, or refuses a later claim for a room
                // that ended). Anything the room itself allows stays allowed.
                let loose = [
                    Pat::Ok,
                    timeout(),
                    kvt("peer_dead"),
                    kvt("mismatch"),
                    Pat::Absent,
                ];
                let side_ok = |e: &End, side: usize| {
                    loose.iter().any(|p| p.matches(e))
                        || allowed.iter().any(|a| {
                            let p = if side == 0 { &a.0 } else { &a.1 };
                            p.matches(e)
                        })
                        || (matches!(r.act, Act::Abort { .. })
                            && [Pat::Aborted, kvt("aborted")].iter().any(|p| p.matches(e)))
                };
                side_ok(&ends.0, 0) && side_ok(&ends.1, 1)
            } else {
                allowed
                    .iter()
                    .any(|(p, d)| p.matches(&ends.0) && d.matches(&ends.1))
            };
            assert!(
                ok,
                "{}",
                ctx(&format!(
                    "ended {ends:?}; allowed {allowed:?} (connection died: {conn_died})"
                ))
            );
        }
        self.settle(&context);
    }

    /// Every event of `ids` until each has its terminal one; fails on an event for another
    /// request (a stray from an earlier case) or after a terminal one.
    fn events(
        &self,
        engine: &Engine,
        ids: &[u64],
        side: &str,
        context: &dyn Fn(String) -> String,
    ) -> HashMap<u64, Vec<Event>> {
        let mut out: HashMap<u64, Vec<Event>> = HashMap::new();
        let mut ended = HashSet::new();
        // Longer than any deadline a room can wait out, with room for a loaded machine.
        let deadline = Instant::now() + Duration::from_millis(4 * (BOOTSTRAP_MS + TRANSFER_MS));
        let mut quiet_until = None;
        loop {
            let now = Instant::now();
            if ended.len() == ids.len() {
                // A short look for anything after the terminal events.
                let q = *quiet_until.get_or_insert(now + Duration::from_millis(50));
                if now >= q {
                    break;
                }
            }
            assert!(
                now < deadline,
                "{}",
                context(format!(
                    "{side}: rooms never ended: {:?}",
                    ids.iter()
                        .filter(|i| !ended.contains(*i))
                        .collect::<Vec<_>>()
                ))
            );
            for e in engine.poll(64, Some(Duration::from_millis(20))).unwrap() {
                let id = e.request_id();
                assert!(
                    ids.contains(&id),
                    "{}",
                    context(format!(
                        "{side}: an event for request {id}, not this case's: {e:?}"
                    ))
                );
                assert!(
                    !ended.contains(&id),
                    "{}",
                    context(format!(
                        "{side}: request {id}: an event after its terminal one: {e:?} (before: {:?})",
                        out[&id]
                    ))
                );
                if e.is_terminal() {
                    ended.insert(id);
                }
                out.entry(id).or_default().push(e);
            }
        }
        out
    }

    /// Both engines back to empty: no room, early claim or reservation left, and once cached
    /// prefixes are flushed, no page, slot or snapshot in use.
    fn settle(&self, context: &dyn Fn(String) -> String) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for (side, e) in [("prefill", &self.p), ("decode", &self.d)] {
            // Early claims and tombstones are cleared by the peer's FAIL, which may still be
            // on its way when the request's own terminal event was polled.
            loop {
                let m = e.metrics();
                let g = &m.pd;
                let busy = (
                    g.prefill_bootstrap + g.prefill_inflight,
                    g.decode_prealloc + g.decode_transfer,
                    g.pages_held,
                    g.early_claims,
                    m.queued,
                    m.running,
                );
                if busy == (0, 0, 0, 0, 0, 0) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{}",
                    context(format!(
                        "{side}: still busy after every room ended (rooms p/d, pages held, early \
                         claims, queued, running): {busy:?}"
                    ))
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            let u = e.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
            assert_eq!(
                (u.pages, u.slots, u.snapshots),
                (0, 0, 0),
                "{}",
                context(format!("{side}: units in use after every room ended"))
            );
        }
    }
}

/// How a side's events ended.
fn end_of(events: &[Event], decode: bool, want: &[(u32, u32)]) -> End {
    let t = terminal(events);
    match t.kind() {
        EventKind::Error => {
            let m = t.message().unwrap_or("");
            let reason = m
                .strip_suffix(')')
                .and_then(|m| m.rsplit_once('('))
                .map_or("?", |(_, r)| r);
            End::Failed(t.error_kind().unwrap(), reason.to_string())
        }
        _ => match t.finish_reason() {
            Some(FinishReason::Aborted) => End::Aborted,
            Some(FinishReason::Transferred) if !decode => End::Ok,
            Some(FinishReason::Length) if decode && same_stream(&stream(events), want) => End::Ok,
            other => End::Failed(ErrorKind::Internal, format!("finished {other:?}")),
        },
    }
}

/// The (prefill, decode) ends a room may have, when the connection stayed up.
fn allowed(r: &RoomPlan, fired: bool) -> Vec<(Pat, Pat)> {
    match (r.sides, r.act) {
        (Sides::PrefillOnly, act) => {
            let mut v = vec![(timeout(), Pat::Absent)];
            if matches!(act, Act::Abort { .. }) {
                v.push((Pat::Aborted, Pat::Absent));
            }
            v
        }
        (Sides::DecodeOnly, act) => {
            // The prefill's early claim expires and it says so; or the decode's own
            // deadline passes first.
            let mut v = vec![(Pat::Absent, timeout())];
            if matches!(act, Act::Abort { .. }) {
                v.push((Pat::Absent, Pat::Aborted));
            }
            v
        }
        (_, Act::Plain) => vec![(Pat::Ok, Pat::Ok)],
        (_, Act::Fault(f)) if fired => f.allows(),
        (_, Act::Fault(_)) => vec![(Pat::Ok, Pat::Ok)],
        // Aborted on the prefill: the decode hears it, or has its claim refused for a room
        // that ended (`mismatch`); an abort after the hand-over changes nothing.
        (
            _,
            Act::Abort {
                on_decode: false, ..
            },
        ) => vec![
            (Pat::Aborted, kvt("aborted")),
            (Pat::Aborted, kvt("mismatch")),
            (Pat::Aborted, Pat::Ok),
            (Pat::Ok, Pat::Ok),
        ],
        // Aborted on the decode: the prefill hears it, or (aborted before the claim went
        // out) waits for a claim that never comes; after the state landed the prefill is done.
        (
            _,
            Act::Abort {
                on_decode: true, ..
            },
        ) => vec![
            (kvt("aborted"), Pat::Aborted),
            (timeout(), Pat::Aborted),
            (Pat::Ok, Pat::Aborted),
            (Pat::Ok, Pat::Ok),
        ],
    }
}

const CASES: u32 = 48;
/// UCX cases (fewer: a lost message costs its case a dead interval).
const UCX_CASES: u32 = 32;

/// 48 cases (about a second each) of up to four rooms each, on one engine pair. Cases are
/// timing-dependent, so shrinking would not replay them: a failure prints the case, the
/// proxy's seed and every fault applied instead.
#[test]
fn every_room_ends_once_on_each_side_with_its_status_and_nothing_leaks() {
    property("tcp", CASES);
}

/// The same property between engines that authenticate: every frame carries a MAC, so each
/// fault the proxy applies (but a delay) takes the connection down, and the rooms on it fail
/// as they do when it is killed; the others stay exact.
#[test]
fn every_room_ends_once_on_each_side_with_its_status_and_nothing_leaks_when_authenticated() {
    property("tcp-auth", CASES / 2);
}

/// The same property over UCX (RMA writes, active messages), with the faults UCX's own wire
/// can suffer.
#[test]
fn every_room_ends_once_on_each_side_with_its_status_and_nothing_leaks_over_ucx() {
    property("ucx", UCX_CASES);
}

/// Over UCX between engines that authenticate: every message carries a MAC and each RMA
/// write's room a MAC in its DONE; the faults UCX's wire can suffer end rooms as they do
/// without a key (a byte flipped in an RMA write fails its room on the MAC, as `checksum`).
#[test]
fn every_room_ends_once_on_each_side_with_its_status_and_nothing_leaks_over_authenticated_ucx() {
    property("ucx-auth", UCX_CASES / 2);
}

/// The UCX runs take turns: the faults their UCX threads inject are the process's
/// (`ucx_faults::set`), as is the record of what was applied.
static UCX_TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn property(transport: &str, default_cases: u32) {
    let _turn = transport
        .starts_with("ucx")
        .then(|| UCX_TURN.lock().unwrap_or_else(|e| e.into_inner()));
    let rig = Rig::new(transport);
    // PROPTEST_CASES runs more (or fewer) cases, e.g. to soak the property locally.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 0,
        ..ProptestConfig::default()
    };
    let start = Instant::now();
    proptest!(config, |(c in case(transport.starts_with("ucx")))| {
        rig.run(&c);
    });
    eprintln!(
        "{transport}: {} rooms in {:?}; ends (prefill, decode): {:?}",
        rig.next_room.get() - 1,
        start.elapsed(),
        rig.tally.borrow()
    );
}
