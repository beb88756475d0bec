//! Good news that can wait for the rest of the stream. When rooms arrive back to back, a TCP
//! reader that woke the engine thread for each one (a decode's landed room, a prefill's ACK)
//! would have it preempt the reader, land one room and send one ACK, once per room: on a
//! machine with few cores that CPU comes out of the transfer. So a reader holds such notices
//! while more of the stream is already in its socket, and hands them over together once it
//! has caught up, after [`MAX_ROOMS`] of them, or once the oldest has waited [`MAX_WAIT`].
//! Nothing that ends a room badly is held, and whatever is emitted goes after what was held,
//! so the engine sees every room's notices in their order.

use std::time::{Duration, Instant};

use super::node::Notice;

/// At most this many notices are held...
pub const MAX_ROOMS: usize = 8;
/// ...and none longer than this (checked between frames): a room of a few hundred KiB takes
/// a fraction of it on the wire here.
pub const MAX_WAIT: Duration = Duration::from_millis(1);

/// The notices a reader may hold: a room landed whole (decode) or acknowledged (prefill).
pub fn may_wait(n: &Notice) -> bool {
    matches!(n, Notice::Received { .. } | Notice::Transferred { .. })
}

/// Notices held back, oldest first.
#[derive(Default)]
pub struct Deferred {
    notices: Vec<Notice>,
    since: Option<Instant>,
}

impl Deferred {
    pub fn is_empty(&self) -> bool {
        self.notices.is_empty()
    }

    /// Holds `notices`; true when they are due now (too many held).
    pub fn hold(&mut self, notices: Vec<Notice>, now: Instant) -> bool {
        if !notices.is_empty() {
            self.since.get_or_insert(now);
            self.notices.extend(notices);
        }
        self.notices.len() >= MAX_ROOMS
    }

    /// True when the oldest held notice has waited long enough (or too many are held).
    pub fn due(&self, now: Instant) -> bool {
        self.notices.len() >= MAX_ROOMS
            || self
                .since
                .is_some_and(|s| now.saturating_duration_since(s) >= MAX_WAIT)
    }

    /// What was held, followed by `then`.
    pub fn take_then(&mut self, then: Vec<Notice>) -> Vec<Notice> {
        self.since = None;
        let mut all = std::mem::take(&mut self.notices);
        all.extend(then);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn transferred(room: u64) -> Notice {
        Notice::Transferred {
            room,
            request: room,
        }
    }

    fn rooms(ns: &[Notice]) -> Vec<u64> {
        ns.iter()
            .map(|n| match n {
                Notice::Transferred { room, .. } | Notice::Released { room } => *room,
                _ => unreachable!(),
            })
            .collect()
    }

    #[test]
    fn held_notices_come_out_first_in_order_and_are_due_by_count_or_age() {
        let t0 = Instant::now();
        let mut d = Deferred::default();
        assert!(
            !d.due(t0 + Duration::from_secs(9)),
            "nothing held is never due"
        );
        for room in 1..MAX_ROOMS as u64 {
            assert!(!d.hold(vec![transferred(room)], t0 + Duration::from_micros(room)));
        }
        // The oldest came at t0 + 1 µs: age counts from it, not from the newest.
        assert!(!d.due(t0 + MAX_WAIT));
        assert!(d.due(t0 + Duration::from_micros(1) + MAX_WAIT));
        assert!(
            d.hold(vec![transferred(MAX_ROOMS as u64)], t0),
            "the count bound"
        );
        let all = d.take_then(vec![Notice::Released { room: 99 }]);
        let mut want: Vec<u64> = (1..=MAX_ROOMS as u64).collect();
        want.push(99);
        assert_eq!(rooms(&all), want);
        assert!(d.is_empty());
        assert!(
            !d.due(t0 + Duration::from_secs(9)),
            "the age restarts when emptied"
        );
        assert!(may_wait(&transferred(1)));
        assert!(!may_wait(&Notice::Released { room: 1 }));
    }
}
