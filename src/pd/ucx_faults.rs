//! Faults injected into the UCX thread for tests (`DSV4_UCX_FAULTS`). UCX owns its wire, so
//! where the TCP tests put a proxy on the byte stream (`tests/common/fault_proxy.rs`) the UCX
//! thread itself delays and reorders the messages it receives, loses one, or flips a byte of
//! an RMA write. Read once when the thread starts; unset (production), nothing changes.
//!
//! `DSV4_UCX_FAULTS` is a comma-separated list of:
//! - `delay_ms=N`: every received message is handed on after a random 0..=N ms (so messages
//!   overtake each other: the receiver must put them back in order);
//! - `lose=N`: the N-th message this thread receives (counting from 1) vanishes: everything
//!   after it waits behind the gap, as after a lost packet on a connection that never
//!   retransmits, until the peer is declared dead;
//! - `flip_put=N`: the N-th RMA write this thread issues carries its first byte inverted;
//! - `seed=N`: the random delays' seed (default 1).

use std::time::{Duration, Instant};

use super::ucx::Message;

pub const ENV: &str = "DSV4_UCX_FAULTS";

#[derive(Debug)]
pub struct Faults {
    rng: fastrand::Rng,
    delay: Duration,
    lose: Option<u64>,
    flip_put: Option<u64>,
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
                "seed" => f.rng = fastrand::Rng::with_seed(n),
                _ => {
                    return Err(format!(
                        "unknown fault `{key}` (known: delay_ms, lose, flip_put, seed)"
                    ))
                }
            }
        }
        Ok(f)
    }

    /// A message received on connection `conn`: passed on now, or held (delayed), or lost.
    pub fn receive(&mut self, conn: u64, m: Message) -> Option<(u64, Message)> {
        self.received += 1;
        if self.lose == Some(self.received) {
            log::warn!("PD: {ENV}: lost message {} on purpose", self.received);
            return None;
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

    /// Whether the next RMA write is to carry a flipped byte.
    pub fn flip_this_put(&mut self) -> bool {
        self.puts += 1;
        self.flip_put == Some(self.puts)
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
        let mut f = Faults::parse("lose=2, flip_put=3").unwrap();
        let passed: Vec<u8> = (1..=4)
            .filter_map(|n| f.receive(7, msg(n)))
            .map(|(c, m)| {
                assert_eq!(c, 7);
                m.header[0]
            })
            .collect();
        assert_eq!(passed, vec![1, 3, 4]);
        assert_eq!(
            (0..4).map(|_| f.flip_this_put()).collect::<Vec<_>>(),
            vec![false, false, true, false]
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
