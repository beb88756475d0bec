//! Where one request stands. Every accepted request is in exactly one [`Phase`] from submit to
//! its terminal event, and moves only along [`Phase::may_become`]:
//!
//! ```text
//!  submit ──► Waiting ───┐                      (host hit)
//!                        ├───────────────────► LoadingBack ───┐
//!            Retracted ──┤                         │          │ (landed)
//!                ▲       └─────────────────────────┼────────► Prefilling ──► Decoding
//!                │                     (no pages:  │               │   │         │
//!                │                      requeued)  ▼               │   │         │
//!                │                     Waiting / Retracted         │   │         │
//!                └───────── retraction (the pools ran out) ────────┴───┼─────────┘
//!  prefill role:              Prefilling ──(first token sampled)──► Transferring
//!  decode role:   Waiting ──(destination reserved, claimed)──► Receiving ──► Decoding
//!  import ──► Imported ──────────────────────────────────────────────────────► Decoding
//!  every phase ──► Finished  (its one terminal event: length, stop, aborted, timeout,
//!                             transferred, error)
//! ```
//!
//! A request in `Waiting`, `Imported` or `Retracted` sits in the scheduler's queue and holds no
//! pool units; `LoadingBack`, `Prefilling` and `Decoding` hold a slot (and pages, once past
//! `LoadingBack`). PD disaggregation adds two phases that hold units but take no part in
//! steps: on a prefill engine, `Transferring` (prefilled, its first token sampled; its pages
//! stay locked while its room waits for the decode's claim and the bytes go out, until the
//! decode acknowledges), and on a decode engine, `Receiving` (its destination pages reserved
//! and claimed; the state arrives), which ends like `Imported`, in `Decoding`. Neither is ever
//! retracted: their pages belong to a room in flight.

/// One request's phase (see the module docs for the transitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Accepted and queued; has computed nothing here (a request started and requeued before
    /// it computed anything waits here again, as submitted).
    Waiting,
    /// Queued with a sequence exported from another engine: its KV comes with it, so it
    /// decodes as soon as its pages are allocated.
    Imported,
    /// Ran, then gave its pages back when the pools ran out: queued at the front to recompute
    /// its tokens (its sampler and emitted tokens are kept, so its output does not change).
    Retracted,
    /// Holds a slot while its cached prefix is copied back from the host tier; its prefill's
    /// pages are reserved once that lands.
    LoadingBack,
    /// Holds its prefill's pages and computes its tokens in chunks; samples after the last.
    Prefilling,
    /// Samples one token per step.
    Decoding,
    /// Prefill role: prefilled and its first token sampled; holds its pages while its room's
    /// state goes to the decode engine.
    Transferring,
    /// Decode role: holds the destination reserved for its prompt's state while it arrives.
    Receiving,
    /// Its terminal event went out.
    Finished,
}

impl Phase {
    /// Every phase, in the order a request meets them.
    pub const ALL: [Phase; 9] = [
        Self::Waiting,
        Self::Imported,
        Self::Retracted,
        Self::LoadingBack,
        Self::Prefilling,
        Self::Decoding,
        Self::Transferring,
        Self::Receiving,
        Self::Finished,
    ];

    /// In the queue (holds no pool units).
    pub fn is_queued(self) -> bool {
        matches!(self, Self::Waiting | Self::Imported | Self::Retracted)
    }

    /// Holds its prefill's pages: takes part in forward steps.
    pub fn is_reserved(self) -> bool {
        matches!(self, Self::Prefilling | Self::Decoding)
    }

    /// Whether a request in `self` may move to `next`.
    pub fn may_become(self, next: Phase) -> bool {
        use Phase::*;
        match (self, next) {
            (Finished, _) => false,
            (_, Finished) => true,
            (Waiting | Retracted, LoadingBack | Prefilling) => true,
            (Imported, Decoding) => true,
            // No pages once the load-back landed: queued again (as it was).
            (LoadingBack, Prefilling | Waiting | Retracted) => true,
            (Prefilling, Decoding | Retracted) => true,
            (Decoding, Retracted) => true,
            (Prefilling, Transferring) => true,
            (Waiting, Receiving) => true,
            (Receiving, Decoding) => true,
            _ => false,
        }
    }

    /// `next`, after checking (in debug builds) that the move is allowed.
    pub fn become_(self, next: Phase) -> Phase {
        debug_assert!(
            self.may_become(next),
            "a request may not move from {self:?} to {next:?}"
        );
        next
    }
}

#[cfg(test)]
mod tests {
    use super::Phase::{self, *};

    const ALL: [Phase; 9] = Phase::ALL;

    #[test]
    fn transitions_are_exactly_the_diagram() {
        // Every allowed move, written out from the diagram; every other pair is refused.
        let allowed = [
            (Waiting, LoadingBack),
            (Waiting, Prefilling),
            (Retracted, LoadingBack),
            (Retracted, Prefilling),
            (Imported, Decoding),
            (LoadingBack, Prefilling),
            (LoadingBack, Waiting),
            (LoadingBack, Retracted),
            (Prefilling, Decoding),
            (Prefilling, Retracted),
            (Decoding, Retracted),
            (Prefilling, Transferring),
            (Waiting, Receiving),
            (Receiving, Decoding),
        ];
        for from in ALL {
            for to in ALL {
                let want = from != Finished && (to == Finished || allowed.contains(&(from, to)));
                assert_eq!(from.may_become(to), want, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn queued_and_reserved_phases_are_disjoint() {
        for p in ALL {
            assert!(!(p.is_queued() && p.is_reserved()), "{p:?}");
        }
        assert_eq!(ALL.iter().filter(|p| p.is_queued()).count(), 3);
        assert_eq!(ALL.iter().filter(|p| p.is_reserved()).count(), 2);
    }
}
