//! Limits on every length inside a PD control payload. The frame reader caps each payload's
//! size before allocating it (`wire::read_frame`); these cap what a payload may say once parsed
//! — texts a peer's message ends up in our events and logs with, page and region counts a
//! claim or state header makes us iterate — so a corrupt or hostile peer is refused with a
//! message, never trusted with a length.

use super::wire::{Auth, Claim, Done, Failure, Hello, Proof, Refusal, StateHeader};
use crate::kv::state::LayoutFingerprint;

/// Longest text field: endpoints, model names, row-format names, messages.
pub const MAX_TEXT: usize = 4096;
/// Most pools a layout may name.
pub const MAX_POOLS: usize = 64;
/// Most pages one sequence may span (a 2²⁰-page table is 64 M tokens at 64 tokens a page).
pub const MAX_PAGES: usize = 1 << 20;
/// Longest packed UCX remote key (hex): a few hundred bytes with every transport UCX has.
pub const MAX_RKEY_HEX: usize = 16 << 10;
/// Largest state a room may carry (also bounded by the destination the decode reserved).
pub const MAX_STATE_BYTES: u64 = 1 << 40;

/// A payload whose lengths are within the limits above.
pub trait Bounded {
    /// Why a length is out of bounds, naming the field and the limit.
    fn check(&self) -> Result<(), String>;
}

fn text(field: &str, s: &str) -> Result<(), String> {
    if s.len() > MAX_TEXT {
        return Err(format!(
            "{field} is {} bytes long; the limit is {MAX_TEXT}",
            s.len()
        ));
    }
    Ok(())
}

fn count(field: &str, n: usize, max: usize) -> Result<(), String> {
    if n > max {
        return Err(format!("{field} lists {n} entries; the limit is {max}"));
    }
    Ok(())
}

fn layout(l: &LayoutFingerprint) -> Result<(), String> {
    text("layout.model", &l.model)?;
    text("layout.layers", &l.layers)?;
    text("layout.kv_rows", &l.kv_rows)?;
    text("layout.index_rows", &l.index_rows)?;
    count("layout.unit_bytes", l.unit_bytes.len(), MAX_POOLS)?;
    for (name, _) in &l.unit_bytes {
        text("a layout pool name", name)?;
    }
    Ok(())
}

impl Bounded for Hello {
    fn check(&self) -> Result<(), String> {
        text("protocol", &self.protocol)?;
        text("endpoint", &self.endpoint)?;
        count("rma_keys", self.rma_keys.len(), MAX_POOLS)?;
        for k in &self.rma_keys {
            if k.rkey.len() > MAX_RKEY_HEX {
                return Err(format!(
                    "an rma_keys rkey is {} bytes long; the limit is {MAX_RKEY_HEX}",
                    k.rkey.len()
                ));
            }
        }
        layout(&self.layout)
    }
}

impl Bounded for Auth {
    fn check(&self) -> Result<(), String> {
        text("nonce", &self.nonce)
    }
}

impl Bounded for Proof {
    fn check(&self) -> Result<(), String> {
        text("proof", &self.proof)
    }
}

impl Bounded for Refusal {
    fn check(&self) -> Result<(), String> {
        text("message", &self.message)
    }
}

impl Bounded for Failure {
    fn check(&self) -> Result<(), String> {
        text("message", &self.message)
    }
}

impl Bounded for Claim {
    fn check(&self) -> Result<(), String> {
        count("pages", self.pages.len(), MAX_PAGES)?;
        count("rma_spans", self.rma_spans.len(), MAX_PAGES)
    }
}

impl Bounded for StateHeader {
    fn check(&self) -> Result<(), String> {
        if !self.first_logprob.is_finite() || self.first_logprob > 0.0 {
            return Err(format!(
                "first_logprob = {} is not a finite log-probability (≤ 0)",
                self.first_logprob
            ));
        }
        let s = &self.state;
        // The prefill reused these from its caches; they are reported in the request's events
        // and metrics, so they must be prompt tokens.
        let cached = u64::from(self.cached_tokens_device) + u64::from(self.cached_tokens_host);
        if cached > s.position as u64 {
            return Err(format!(
                "cached_tokens_device + cached_tokens_host = {cached} exceeds the state's {} \
                 tokens",
                s.position
            ));
        }

        if s.pages > MAX_PAGES {
            return Err(format!(
                "state.pages = {}; the limit is {MAX_PAGES}",
                s.pages
            ));
        }
        if s.bytes > MAX_STATE_BYTES {
            return Err(format!(
                "the state holds {} bytes; the limit is {MAX_STATE_BYTES}",
                s.bytes
            ));
        }
        Ok(())
    }
}

impl Bounded for Done {
    fn check(&self) -> Result<(), String> {
        if self.bytes > MAX_STATE_BYTES {
            return Err(format!(
                "DONE reports {} bytes; the limit is {MAX_STATE_BYTES}",
                self.bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::wire::{self, encode_json, Kind, RmaKey, Side};
    use super::*;

    pub(crate) fn fingerprint() -> LayoutFingerprint {
        LayoutFingerprint {
            model: "tiny".into(),
            layers: "SCH".into(),
            mtp_layers: 1,
            head_dim: 64,
            index_dim: 32,
            window: 128,
            csa_ratio: 4,
            hca_ratio: 128,
            page_size: 64,
            kv_rows: "fp8 (80 B)".into(),
            index_rows: "fp4 (18 B)".into(),
            unit_bytes: vec![("kv".into(), 4096)],
        }
    }

    /// Encodes `value` as a frame, reads it back and parses it the way a node does.
    fn through_the_wire<T>(kind: Kind, value: &T) -> Result<T, String>
    where
        T: serde::Serialize + for<'a> serde::Deserialize<'a> + Bounded,
    {
        let bytes = encode_json(kind, 5, value);
        let frame = wire::read_frame_from(&mut &bytes[..]).expect("a whole frame");
        wire::parse(&frame)
    }

    #[test]
    fn every_length_a_peer_states_is_bounded_when_parsed() {
        let hello = Hello {
            protocol: wire::PROTOCOL.into(),
            version: wire::VERSION,
            side: Side::Decode,
            endpoint: "tcp://10.0.0.1:7000".into(),
            layout: fingerprint(),
            heartbeat_interval_ms: 1000,
            rma_keys: vec![RmaKey {
                addr: 1 << 20,
                len: 4096,
                rkey: "00ff".into(),
            }],
        };
        assert_eq!(through_the_wire(Kind::Hello, &hello).unwrap(), hello);
        let mut long_key = hello.clone();
        long_key.rma_keys[0].rkey = "0".repeat(MAX_RKEY_HEX + 1);
        let e = through_the_wire(Kind::Hello, &long_key).unwrap_err();
        assert!(e.contains("rkey is 16385 bytes long"), "{e}");
        let long = Hello {
            endpoint: "x".repeat(MAX_TEXT + 1),
            ..hello.clone()
        };
        let e = through_the_wire(Kind::Hello, &long).unwrap_err();
        assert!(
            e.contains("endpoint is 4097 bytes long; the limit is 4096"),
            "{e}"
        );
        let mut many_pools = hello.clone();
        many_pools.layout.unit_bytes = vec![("p".into(), 1); MAX_POOLS + 1];
        let e = through_the_wire(Kind::Hello, &many_pools).unwrap_err();
        assert!(e.contains("layout.unit_bytes lists 65 entries"), "{e}");

        let claim = Claim {
            request_hash: 1,
            prompt_tokens: 10,
            slot: 0,
            pages: vec![3; MAX_PAGES + 1],
            rma_spans: Vec::new(),
        };
        let e = through_the_wire(Kind::Claim, &claim).unwrap_err();
        assert!(e.contains("pages lists 1048577 entries"), "{e}");
        let spans = Claim {
            pages: vec![3],
            rma_spans: vec![(1 << 20, 64); MAX_PAGES + 1],
            ..claim
        };
        let e = through_the_wire(Kind::Claim, &spans).unwrap_err();
        assert!(e.contains("rma_spans lists 1048577 entries"), "{e}");

        let failure = Failure {
            reason: crate::pd::FailReason::Aborted,
            message: "m".repeat(MAX_TEXT + 1),
        };
        assert!(through_the_wire(Kind::Fail, &failure).is_err());

        let done = Done {
            bytes: MAX_STATE_BYTES + 1,
            crc32c: 0,
            mac: None,
        };
        let e = through_the_wire(Kind::Done, &done).unwrap_err();
        assert!(e.contains("out of bounds"), "{e}");

        // A prefill's counts are checked against the state they describe: a 41-token prompt
        // cannot have reused 4294967295 tokens.
        let header = |device: u32, host: u32, logprob: f32| StateHeader {
            state: crate::pd::StateInfo {
                position: 41,
                last_token: Some(7),
                rng: None,
                pages: 1,
                bytes: 4096,
            },
            first_logprob: logprob,
            cached_tokens_device: device,
            cached_tokens_host: host,
        };
        assert!(through_the_wire(Kind::State, &header(32, 9, -0.5)).is_ok());
        let e = through_the_wire(Kind::State, &header(u32::MAX, 0, 0.0)).unwrap_err();
        assert!(
            e.contains("= 4294967295 exceeds the state's 41 tokens"),
            "{e}"
        );
        let e = through_the_wire(Kind::State, &header(40, 2, 0.0)).unwrap_err();
        assert!(e.contains("= 42 exceeds"), "{e}");
        let e = through_the_wire(Kind::State, &header(0, 0, 0.25)).unwrap_err();
        assert!(e.contains("log-probability"), "{e}");
    }
}

#[cfg(test)]
mod seeds {
    use super::super::wire::{self, Claim, Done, Failure, Hello, Kind, Refusal, StateHeader};

    /// The fuzz target's seeds (fuzz/corpus/pd_frames) are frames a node accepts, so the fuzzer
    /// starts from valid protocol and mutates from there; they fail here when the protocol
    /// changes under them.
    #[test]
    fn the_fuzz_seeds_are_valid_frames() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/pd_frames");
        let mut frames = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed corpus") {
            let path = entry.expect("an entry").path();
            let bytes = std::fs::read(&path).expect("a seed");
            let mut input = &bytes[..];
            while !input.is_empty() {
                let f = wire::read_frame_from(&mut input)
                    .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
                let parsed = match f.kind {
                    Kind::Hello => wire::parse::<Hello>(&f).map(drop),
                    Kind::Refuse => wire::parse::<Refusal>(&f).map(drop),
                    Kind::Claim => wire::parse::<Claim>(&f).map(drop),
                    Kind::State => wire::parse::<StateHeader>(&f).map(drop),
                    Kind::Done => wire::parse::<Done>(&f).map(drop),
                    Kind::Fail => wire::parse::<Failure>(&f).map(drop),
                    Kind::Data => wire::split_data(&f.payload)
                        .map(drop)
                        .ok_or_else(|| "no offset".to_string()),
                    Kind::Auth => wire::parse::<super::super::wire::Auth>(&f).map(drop),
                    Kind::Proof => wire::parse::<super::super::wire::Proof>(&f).map(drop),
                    Kind::Ack | Kind::Heartbeat | Kind::Flushed => Ok(()),
                };
                parsed.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                frames += 1;
            }
        }
        assert!(frames >= 9, "{frames} frames in the seeds");
    }
}
