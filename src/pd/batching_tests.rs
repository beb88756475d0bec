//! Rooms that arrive together over TCP are handed over together: a decode's engine lands
//! them while more are on the wire and their ACKs go in one write; the prefill's reader hands
//! their TRANSFERRED notices to its engine in one batch. Nothing waits for other traffic: the
//! heartbeats here are 10 s apart, so a notice or an ACK held until the next frame would miss
//! every deadline below. The bytes are checked against the prefill's source, as memcmp would.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::limits::tests::fingerprint;
use super::node::{Config, Node, Notice, Sink};
use super::test_rooms::{header, open_and_claim};
use super::Side;
use crate::config::params::{Endpoint, PdTransport};

const ROOMS: u64 = 8;
const STATE: usize = 64 << 10;

/// The engine's inbox as the node sees it: every notice, and how many came in each hand-over.
#[derive(Default)]
struct Inbox(Mutex<(Vec<Notice>, Vec<usize>)>, Condvar);

impl Sink for Inbox {
    fn notice(&self, n: Notice) {
        self.notices(vec![n]);
    }

    fn notices(&self, ns: Vec<Notice>) {
        let mut q = self.0.lock().unwrap();
        q.1.push(ns.len());
        q.0.extend(ns);
        self.1.notify_all();
    }
}

impl Inbox {
    /// Waits until `count` of the notices satisfy `pick`; panics on a failed room.
    fn wait_for(&self, count: usize, pick: impl Fn(&Notice) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut q = self.0.lock().unwrap();
        loop {
            if let Some(Notice::Failed { error, .. }) =
                q.0.iter().find(|n| matches!(n, Notice::Failed { .. }))
            {
                panic!("a room failed: {error}");
            }
            let n = q.0.iter().filter(|n| pick(n)).count();
            if n >= count {
                assert_eq!(n, count, "a notice came twice");
                return;
            }
            let now = Instant::now();
            assert!(now < deadline, "{n} of {count} notices within 5 s");
            q = self.1.wait_timeout(q, deadline - now).unwrap().0;
        }
    }
}

fn config(side: Side) -> Config {
    Config {
        side,
        listen: Endpoint {
            transport: PdTransport::Tcp,
            host: "127.0.0.1".into(),
            port: 0,
        },
        ucx_library: None,
        advertise: None,
        bootstrap_timeout: Duration::from_secs(30),
        transfer_timeout: Duration::from_secs(30),
        heartbeat_interval: Duration::from_secs(10),
        heartbeat_misses: 3,
        max_rooms: 16,
        bounds: crate::pd::PeerBounds::default(),
        auth: None,
        tls: None,
        allowed_peers: Vec::new(),
        layout: fingerprint(),
        rma_regions: Vec::new(),
        rma_emulated: false,
    }
}

/// Room `room`'s state: a pattern of its own with no zero byte.
fn state(room: u64) -> Vec<u8> {
    (0..STATE as u64)
        .map(|i| ((i.wrapping_add(room << 20).wrapping_mul(2_654_435_761) >> 13) as u8) | 1)
        .collect()
}

#[test]
fn rooms_arriving_together_are_landed_acknowledged_and_reported_together() {
    let (from_p, from_d) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
    let prefill = Node::start(config(Side::Prefill), from_p.clone()).unwrap();
    let decode = Node::start(config(Side::Decode), from_d.clone()).unwrap();
    let mut pool = vec![0u8; STATE * ROOMS as usize];
    let base = pool.as_mut_ptr().expose_provenance() as u64;
    for room in 1..=ROOMS {
        let at = base + (room - 1) * STATE as u64;
        open_and_claim(&prefill, &decode, room, &[(at, STATE as u64)], STATE);
    }
    for room in 1..=ROOMS {
        prefill
            .send(room, header(STATE), state(room).into())
            .unwrap();
    }
    // Every room's notice, although no frame follows the last one for 10 s.
    from_d.wait_for(ROOMS as usize, |n| matches!(n, Notice::Received { .. }));
    for room in 1..=ROOMS {
        let at = (room - 1) as usize * STATE;
        assert!(
            pool[at..at + STATE] == state(room)[..],
            "room {room}'s bytes differ from what the prefill sent"
        );
    }
    // The engine lands them one by one: the ACKs of the first seven wait for company (the
    // others are still to land), the eighth takes them all along at once.
    for room in 1..=ROOMS {
        decode.landed(room);
    }
    from_p.wait_for(ROOMS as usize, |n| matches!(n, Notice::Transferred { .. }));
    let batches = from_p.0.lock().unwrap().1.clone();
    assert!(
        batches.len() < ROOMS as usize,
        "the prefill's engine was handed the {ROOMS} TRANSFERRED notices one by one: {batches:?}"
    );
    decode.shutdown();
    prefill.shutdown();
}
