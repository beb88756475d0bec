//! One room's state: it only moves forward, `Failed` and `Done` are final, and a failure
//! carries the reason the metrics count it under.

use serde::{Deserialize, Serialize};

use crate::error::ErrorKind;

/// Why a room failed (the `reason` label of `dsv4_kv_transfer_failures_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailReason {
    /// The bootstrap or transfer deadline passed.
    Timeout,
    /// The peer stopped answering (heartbeats missed, connection lost or refused).
    PeerDead,
    /// Aborted on either side (`dsv4_abort`, an abort shutdown, the request's deadline).
    Aborted,
    /// The two engines' KV layouts differ (model, page size, row formats).
    Layout,
    /// The two sides disagree on the request or on what was sent (hash, lengths, units).
    Mismatch,
    /// The bytes arrived with a CRC-32C other than the one sent.
    Checksum,
    /// The receiving side cannot hold the state.
    Capacity,
}

impl FailReason {
    pub const ALL: [FailReason; 7] = [
        Self::Timeout,
        Self::PeerDead,
        Self::Aborted,
        Self::Layout,
        Self::Mismatch,
        Self::Checksum,
        Self::Capacity,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::PeerDead => "peer_dead",
            Self::Aborted => "aborted",
            Self::Layout => "layout",
            Self::Mismatch => "mismatch",
            Self::Checksum => "checksum",
            Self::Capacity => "capacity",
        }
    }

    /// The status a request failed for this reason ends with.
    pub fn error_kind(self) -> ErrorKind {
        match self {
            Self::Timeout => ErrorKind::Timeout,
            _ => ErrorKind::KvTransfer,
        }
    }
}

/// Where a room stands. On a prefill engine: `Bootstrapping` (registered, waiting for the
/// decode's claim) → `Claimed` → `Transferring` (bytes going out) → `Done` (the decode
/// acknowledged). On a decode engine: `Bootstrapping` (waiting for its destination pages) →
/// `Claimed` (claim sent) → `Transferring` (bytes arriving) → `Delivered` (whole and verified,
/// with the engine) → `Done` (in the pools, acknowledged). Any state but the final two may
/// become `Failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomState {
    Bootstrapping,
    Claimed,
    Transferring,
    Delivered,
    Done,
    Failed(FailReason),
}

impl RoomState {
    fn rank(self) -> u8 {
        match self {
            Self::Bootstrapping => 0,
            Self::Claimed => 1,
            Self::Transferring => 2,
            Self::Delivered => 3,
            Self::Done | Self::Failed(_) => 4,
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Done | Self::Failed(_))
    }

    /// Whether the room may move from `self` to `next`: forward only, never out of a final
    /// state.
    pub fn may_become(self, next: RoomState) -> bool {
        !self.is_final() && next.rank() > self.rank()
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Bootstrapping => "bootstrapping",
            Self::Claimed => "claimed",
            Self::Transferring => "transferring",
            Self::Delivered => "delivered",
            Self::Done => "done",
            Self::Failed(_) => "failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RoomState::*;
    use super::*;

    #[test]
    fn rooms_only_move_forward_and_final_states_stay() {
        let f = Failed(FailReason::Timeout);
        let order = [Bootstrapping, Claimed, Transferring, Delivered];
        for (i, a) in order.iter().enumerate() {
            for (j, b) in order.iter().enumerate() {
                assert_eq!(a.may_become(*b), j > i, "{a:?} -> {b:?}");
            }
            assert!(a.may_become(f) && a.may_become(Done));
        }
        for end in [Done, f] {
            for next in [Bootstrapping, Claimed, Transferring, Delivered, Done, f] {
                assert!(!end.may_become(next), "{end:?} -> {next:?}");
            }
        }
    }
}
