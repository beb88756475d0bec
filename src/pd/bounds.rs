//! What one peer, and all peers together, may hold of an engine: connections, handshakes in
//! progress, time to finish a handshake, bytes queued for a peer that does not read, and how
//! far a peer's own heartbeat interval is believed. Every resource a connection costs (two
//! threads, a socket, queued frames) is bounded by these, so a flood of connections or a peer
//! that stops reading costs a bounded amount and is dropped (docs/security.md).

use std::time::Duration;

/// Limits on peers (`pd.max_links`, `pd.max_handshakes`, `pd.handshake_timeout_ms`,
/// `pd.max_outbox_bytes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerBounds {
    /// Links at once; a peer past it is refused.
    pub max_links: usize,
    /// Connections in their handshake at once; more are closed at accept, unanswered.
    pub max_handshakes: usize,
    /// A connection that has not finished its handshake by then is closed.
    pub handshake_timeout: Duration,
    /// Control frames queued for one link: past it the link is dropped.
    pub max_outbox_bytes: usize,
}

impl Default for PeerBounds {
    fn default() -> Self {
        Self {
            max_links: 256,
            max_handshakes: 32,
            handshake_timeout: Duration::from_millis(5000),
            max_outbox_bytes: 64 << 20,
        }
    }
}

/// The shortest heartbeat interval a peer may announce.
pub const MIN_PEER_INTERVAL: Duration = Duration::from_millis(10);
/// The longest: a peer announcing more is still declared dead after this many of ours.
pub const MAX_PEER_INTERVAL: Duration = Duration::from_secs(60);

/// A peer's announced heartbeat interval, as this engine believes it: within
/// [`MIN_PEER_INTERVAL`, `MAX_PEER_INTERVAL`]. A peer announcing 10¹² ms would otherwise set
/// the writer's socket timeout (the interval × misses) to decades.
pub fn peer_interval(announced_ms: u64) -> Duration {
    Duration::from_millis(announced_ms).clamp(MIN_PEER_INTERVAL, MAX_PEER_INTERVAL)
}

/// Whether `pd.allowed_peers` (`allowed`, non-empty) lists `peer`: an entry `host` allows any
/// port of it, `host:port` (`[v6]:port`) that port; hosts compare without case.
pub fn peer_allowed(allowed: &[String], peer: &crate::config::params::Endpoint) -> bool {
    let host_port = if peer.host.contains(':') {
        format!("[{}]:{}", peer.host, peer.port)
    } else {
        format!("{}:{}", peer.host, peer.port)
    };
    allowed.iter().any(|a| {
        let bare = a.trim_start_matches('[').trim_end_matches(']');
        bare.eq_ignore_ascii_case(&peer.host) || a.eq_ignore_ascii_case(&host_port)
    })
}

/// How long a shutdown waits for a peer to take the last frames (FAILs of rooms still open)
/// before closing its socket regardless.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_peers_name_hosts_or_host_ports() {
        use crate::config::params::Endpoint;
        let list = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ep = |t: &str| Endpoint::parse(t).unwrap();
        let allowed = list(&["10.0.0.5", "prefill-2:7000", "[fd00::1]:7001", "::2"]);
        assert!(peer_allowed(&allowed, &ep("tcp://10.0.0.5:1234")));
        assert!(peer_allowed(&allowed, &ep("tcp://PREFILL-2:7000")));
        assert!(!peer_allowed(&allowed, &ep("tcp://prefill-2:7001")));
        assert!(peer_allowed(&allowed, &ep("tcp://[fd00::1]:7001")));
        assert!(!peer_allowed(&allowed, &ep("tcp://[fd00::1]:7000")));
        assert!(peer_allowed(&allowed, &ep("tcp://[::2]:9")));
        assert!(!peer_allowed(&allowed, &ep("tcp://10.0.0.6:1234")));
        assert!(!peer_allowed(&allowed, &ep("tcp://10.0.0.55:1234")));
    }

    #[test]
    fn a_peers_heartbeat_is_believed_within_ten_ms_and_a_minute() {
        assert_eq!(peer_interval(0), MIN_PEER_INTERVAL);
        assert_eq!(peer_interval(3), MIN_PEER_INTERVAL);
        assert_eq!(peer_interval(1000), Duration::from_secs(1));
        assert_eq!(peer_interval(1_000_000_000_000), MAX_PEER_INTERVAL);
        assert_eq!(peer_interval(u64::MAX), MAX_PEER_INTERVAL);
    }
}
