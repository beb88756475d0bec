//! Faults injected into the UCX thread for tests (`DSV4_UCX_FAULTS`). UCX owns its wire, so
//! where the TCP tests put a proxy on the byte stream (`tests/common/fault_proxy.rs`) the UCX
//! thread itself delays and reorders the messages it receives, loses one, or flips a byte of
//! an RMA write. Read when the thread starts, and again whenever a test calls [`set`]; unset
//! (production), nothing changes.
//!
//! `DSV4_UCX_FAULTS` is a comma-separated list of:
//! - `delay_ms=N`: every received message is handed on after a random 0..=N ms (so messages
//!   overtake each other: the receiver must put them back in order);
//! - `lose=N`: the N-th message this thread receives (counting from 1) vanishes: everything
//!   after it waits behind the gap, as after a lost packet on a connection that never
//!   retransmits, until the peer is declared dead;
//! - `flip_put=N`: the N-th RMA write this thread issues carries its first byte inverted;
//! - `lose_room=R` (may repeat): the first message of room R this thread receives vanishes,
//!   as with `lose` (each side's thread loses its own first one of the room);
//! - `flip_room=R` (may repeat): the first RMA write of room R carries its first byte inverted;
//! - `flip_message_room=R` (may repeat): the first message of room R this thread receives
//!   with data has its last byte inverted (a message changed on the way);
//! - `close=1` (through [`set`] only): every connection the thread holds is closed by force,
//!   once, when it takes the setting (a peer that died: UCX reports nothing more from it);
//! - `seed=N`: the random delays' seed (default 1).
//!
//! In-process tests change the faults of every UCX thread in the process while it runs with
//! [`set`] (each thread takes them at its next pass; messages it holds stay held) and read
//! what was done with [`applied`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::ucx::Message;

pub const ENV: &str = "DSV4_UCX_FAULTS";

/// What a thread did on purpose, for a test's report and its expectations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The n-th message the thread received since its faults were last set vanished (a
    /// message of `room`, when it named one).
    Lost { nth: u64, room: Option<u64> },
    /// An RMA write of this room carried a flipped byte.
    Flipped { room: u64 },
    /// A message of this room was received with a flipped byte.
    FlippedMessage { room: u64 },
    /// This many connections were closed by force.
    Closed(usize),
}

/// The faults last [`set`]; their generation counts the calls (0: never set, the threads keep
/// their own), bumped under the lock, so a reader holding it sees the text's generation.
static SET: Mutex<String> = Mutex::new(String::new());
static GENERATION: AtomicU64 = AtomicU64::new(0);
static APPLIED: Mutex<Vec<Applied>> = Mutex::new(Vec::new());

/// Tests only: every UCX thread of this process replaces its faults with `text` (the
/// `DSV4_UCX_FAULTS` syntax; empty: none) at its next pass. Refused, changing nothing, when
/// `text` does not parse.
#[doc(hidden)]
pub fn set(text: &str) -> Result<(), String> {
    Faults::parse(text)?;
    let mut g = SET.lock().unwrap_or_else(|e| e.into_inner());
    *g = text.to_string();
    GENERATION.fetch_add(1, Ordering::Release);
    Ok(())
}

/// Tests only: what the threads did on purpose since the last call (in the order done).
#[doc(hidden)]
pub fn applied() -> Vec<Applied> {
    std::mem::take(&mut *APPLIED.lock().unwrap_or_else(|e| e.into_inner()))
}

fn record(a: Applied) {
    APPLIED.lock().unwrap_or_else(|e| e.into_inner()).push(a);
}

/// The faults [`set`] since generation `seen`, with their generation; `None` when unchanged
/// (one atomic load: the UCX thread asks at every pass).
pub(crate) fn changed(seen: u64) -> Option<(u64, Faults)> {
    if GENERATION.load(Ordering::Acquire) == seen {
        return None;
    }
    let g = SET.lock().unwrap_or_else(|e| e.into_inner());
    // `set` parsed it already.
    let f = Faults::parse(&g).unwrap_or_else(|_| Faults::parse("").expect("empty parses"));
    Some((GENERATION.load(Ordering::Acquire), f))
}

#[derive(Debug)]
pub struct Faults {
    rng: fastrand::Rng,
    delay: Duration,
    lose: Option<u64>,
    flip_put: Option<u64>,
    flip_rooms: HashSet<u64>,
    lose_rooms: HashSet<u64>,
    flip_message_rooms: HashSet<u64>,
    close: bool,
    received: u64,
    puts: u64,
    /// Messages waiting for their time: (due, connection, message).
    held: Vec<(Instant, u64, Message)>,
}

impl Faults {
    /// From `DSV4_UCX_FAULTS`; `None` when unset. A value that does not parse is refused with
    /// the reason (the thread then runs without faults, and says so).
    pub fn from_env() -> Option<Faults> {
        let text = std::env::var(ENV).ok()?;
        match Self::parse(&text) {
            Ok(f) => {
                log::warn!("PD: {ENV}={text}: the UCX thread injects faults (a test setting)");
                Some(f)
            }
            Err(e) => {
                log::error!("PD: {ENV}={text} ignored: {e}");
                None
            }
        }
    }

    pub fn parse(text: &str) -> Result<Faults, String> {
        let mut f = Faults {
            rng: fastrand::Rng::with_seed(1),
            delay: Duration::ZERO,
            lose: None,
            flip_put: None,
            flip_rooms: HashSet::new(),
            lose_rooms: HashSet::new(),
            flip_message_rooms: HashSet::new(),
            close: false,
            received: 0,
            puts: 0,
            held: Vec::new(),
        };
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not key=value"))?;
            let n: u64 = value
                .parse()
                .map_err(|_| format!("`{item}`: {value} is not a whole number"))?;
            match key {
                "delay_ms" => f.delay = Duration::from_millis(n),
                "lose" => f.lose = Some(n),
                "flip_put" => f.flip_put = Some(n),
                "flip_room" => {
                    f.flip_rooms.insert(n);
                }
                "lose_room" => {
                    f.lose_rooms.insert(n);
                }
                "flip_message_room" => {
                    f.flip_message_rooms.insert(n);
                }
                "close" => f.close = n != 0,
                "seed" => f.rng = fastrand::Rng::with_seed(n),
                _ => {
                    return Err(format!(
                        "unknown fault `{key}` (known: delay_ms, lose, lose_room, flip_put, \
                         flip_room, flip_message_room, close, seed)"
                    ))
                }
            }
        }
        Ok(f)
    }

    /// A message received on connection `conn`: passed on now, or held (delayed), or lost.
    pub fn receive(&mut self, conn: u64, mut m: Message) -> Option<(u64, Message)> {
        self.received += 1;
        // The message header: a sequence number, then the frame's header (room at 8..16).
        let room = m
            .header
            .get(16..24)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .filter(|&r| r != 0);
        if self.lose == Some(self.received) || room.is_some_and(|r| self.lose_rooms.remove(&r)) {
            log::warn!("PD: {ENV}: lost message {} on purpose", self.received);
            record(Applied::Lost {
                nth: self.received,
                room,
            });
            return None;
        }
        if let Some(r) = room.filter(|r| !m.data.is_empty() && self.flip_message_rooms.remove(r)) {
            log::warn!("PD: {ENV}: flipped a byte of a message of room {r} on purpose");
            if let Some(b) = m.data.last_mut() {
                *b ^= 0xff;
            }
            record(Applied::FlippedMessage { room: r });
        }
        if self.delay.is_zero() {
            return Some((conn, m));
        }
        let wait = self.delay.mul_f64(self.rng.f64());
        self.held.push((Instant::now() + wait, conn, m));
        None
    }

    /// Held messages whose time came, in the order they fall due.
    pub fn due(&mut self, now: Instant) -> Vec<(u64, Message)> {
        self.held.sort_by_key(|(at, _, _)| *at);
        let n = self.held.partition_point(|(at, _, _)| *at <= now);
        self.held.drain(..n).map(|(_, c, m)| (c, m)).collect()
    }

    /// When the next held message falls due.
    pub fn next_due(&self) -> Option<Instant> {
        self.held.iter().map(|(at, _, _)| *at).min()
    }

    /// Whether the next RMA write (of `room`) is to carry a flipped byte.
    pub fn flip_this_put(&mut self, room: u64) -> bool {
        self.puts += 1;
        let flip = self.flip_put == Some(self.puts) || self.flip_rooms.remove(&room);
        if flip {
            record(Applied::Flipped { room });
        }
        flip
    }

    /// Takes over the messages `old` still holds (new faults do not lose them).
    pub fn adopt(&mut self, old: Faults) {
        self.held.extend(old.held);
    }

    /// Whether every connection is to be closed now (once).
    pub fn take_close(&mut self) -> bool {
        std::mem::take(&mut self.close)
    }

    /// Records that `n` connections were closed on purpose.
    pub fn closed(&self, n: usize) {
        log::warn!("PD: {ENV}: closed {n} connection(s) on purpose");
        record(Applied::Closed(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(n: u8) -> Message {
        Message {
            id: 0,
            header: vec![n],
            data: Vec::new(),
            from: None,
        }
    }

    #[test]
    fn faults_parse_and_act_as_named() {
        assert!(Faults::parse("delay_ms=x")
            .unwrap_err()
            .contains("not a whole number"));
        assert!(Faults::parse("jitter=3")
            .unwrap_err()
            .contains("unknown fault `jitter`"));
        assert!(Faults::parse("lose").unwrap_err().contains("not key=value"));
        // The second message is lost, the others pass at once.
        let mut f = Faults::parse("lose=2, flip_put=3, flip_room=9, close=1, lose_room=5").unwrap();
        assert!(f.take_close() && !f.take_close(), "close acts once");
        let passed: Vec<u8> = (1..=4)
            .filter_map(|n| f.receive(7, msg(n)))
            .map(|(c, m)| {
                assert_eq!(c, 7);
                m.header[0]
            })
            .collect();
        assert_eq!(passed, vec![1, 3, 4]);
        // Room 5's first message only (the room at bytes 16..24 of the header).
        let of_room = |room: u64| Message {
            id: 0,
            header: [[0u8; 16].as_slice(), &room.to_le_bytes()].concat(),
            data: Vec::new(),
            from: None,
        };
        let kept = [4, 5, 5].map(|room| f.receive(1, of_room(room)).is_some());
        assert_eq!(kept, [true, false, true]);
        assert_eq!(
            (0..4).map(|_| f.flip_this_put(1)).collect::<Vec<_>>(),
            vec![false, false, true, false]
        );
        // Room 9's first write only.
        assert_eq!(
            [2, 9, 9].map(|room| f.flip_this_put(room)),
            [false, true, false]
        );
        // Delayed: nothing passes at once; all are due within the delay, in due order.
        let mut f = Faults::parse("delay_ms=20,seed=5").unwrap();
        for n in 0..50 {
            assert!(f.receive(1, msg(n)).is_none());
        }
        assert!(f.next_due().is_some());
        let later = Instant::now() + Duration::from_millis(25);
        let out: Vec<u8> = f.due(later).into_iter().map(|(_, m)| m.header[0]).collect();
        assert_eq!(out.len(), 50);
        assert_ne!(out, (0..50).collect::<Vec<_>>(), "random delays reorder");
        assert!(f.next_due().is_none());
    }
}
