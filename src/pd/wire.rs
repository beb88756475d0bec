//! The PD protocol's frames on a byte stream: a 16-byte header (kind, payload length, room)
//! then the payload. Control payloads are JSON; DATA carries raw state bytes after an 8-byte
//! offset. Every length is checked against a per-kind cap before anything is allocated, so a
//! corrupt or hostile peer cannot make the reader allocate more than one state header.

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::kv::state::{LayoutFingerprint, SequenceState};

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Opens a connection (both directions): [`Hello`].
    Hello = 1,
    /// The acceptor refuses the connection: [`Refusal`]; the connection then closes.
    Refuse = 2,
    /// Decode → prefill: [`Claim`] for one room.
    Claim = 3,
    /// Prefill → decode: [`StateHeader`], then DATA frames, then DONE.
    State = 4,
    /// Prefill → decode: an 8-byte little-endian offset, then state bytes.
    Data = 5,
    /// Prefill → decode: [`Done`].
    Done = 6,
    /// Decode → prefill: the state landed in the decode's pools; the room is done.
    Ack = 7,
    /// Either way: the room failed on the sender ([`Failure`]).
    Fail = 8,
    /// Either way, room 0: the sender is alive.
    Heartbeat = 9,
    /// Prefill → decode, over UCX, answering the decode's FAIL: nothing more will be written
    /// into the room's destination (every RMA write issued for it is complete), so the decode
    /// may free its pages.
    Flushed = 10,
    /// The first frame each way where the engines hold a `pd.auth_key_file`: [`Auth`], the
    /// sender's nonce (`auth`).
    Auth = 11,
    /// After the AUTHs, each way: [`Proof`] that the sender holds the secret.
    Proof = 12,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Self> {
        use Kind::*;
        Some(match v {
            1 => Hello,
            2 => Refuse,
            3 => Claim,
            4 => State,
            5 => Data,
            6 => Done,
            7 => Ack,
            8 => Fail,
            9 => Heartbeat,
            10 => Flushed,
            11 => Auth,
            12 => Proof,
            _ => return None,
        })
    }

    /// The largest payload a frame of this kind may have.
    pub fn max_payload(self) -> usize {
        match self {
            Kind::Data => DATA_CHUNK + 8,
            // A state header is a few scalars.
            Kind::State => 64 << 10,
            // A claim lists a long sequence's destination pages.
            Kind::Claim => 16 << 20,
            Kind::Heartbeat | Kind::Ack | Kind::Flushed => 0,
            // A nonce or an HMAC in hex, in a few bytes of JSON.
            Kind::Auth | Kind::Proof => 256,
            _ => 1 << 20,
        }
    }
}

/// The largest payload any frame kind may carry.
pub fn max_payload() -> usize {
    (1..=12)
        .filter_map(Kind::from_u8)
        .map(Kind::max_payload)
        .max()
        .unwrap_or(0)
}

/// Bytes of state per DATA frame: small enough that a heartbeat or a FAIL queued behind bulk
/// data waits for one frame at most (about 0.1 ms at 25 Gb/s).
pub const DATA_CHUNK: usize = 256 << 10;

pub const HEADER: usize = 16;

/// `dsv4-pd` protocol version; a peer speaking another is refused at HELLO.
/// 2: the STATE frame carries [`StateInfo`] (scalars), no longer the prefill's region list.
/// 3: the claim's request digest is XXH3-64 (was FNV-1a).
/// 4: over UCX the state's bytes may be written by RMA (HELLO's `rma_keys`, the claim's
/// `rma_spans`, FLUSHED).
/// 5: AUTH and PROOF before HELLO where the engines hold a `pd.auth_key_file`; claims carry
/// the request digest keyed by the secret.
pub const VERSION: u32 = 5;

/// One frame as read.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub kind: Kind,
    pub room: u64,
    pub payload: Vec<u8>,
}

/// A frame's 16-byte header: kind, three zero bytes, payload length, room.
pub fn header(kind: Kind, len: usize, room: u64) -> [u8; HEADER] {
    let mut out = [0u8; HEADER];
    out[0] = kind as u8;
    out[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    out[8..16].copy_from_slice(&room.to_le_bytes());
    out
}

/// The header and payload of one frame, ready to write.
pub fn encode(kind: Kind, room: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&header(kind, payload.len(), room));
    out.extend_from_slice(payload);
    out
}

/// A control frame with a JSON payload.
pub fn encode_json<T: Serialize>(kind: Kind, room: u64, value: &T) -> Vec<u8> {
    // Serializing our own plain structs cannot fail.
    encode(kind, room, &serde_json::to_vec(value).unwrap_or_default())
}

/// A DATA frame: `bytes` at byte `offset` of the room's state.
pub fn encode_data(room: u64, offset: u64, bytes: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(8 + bytes.len());
    payload.extend_from_slice(&offset.to_le_bytes());
    payload.extend_from_slice(bytes);
    encode(Kind::Data, room, &payload)
}

/// The header and offset of a DATA frame carrying `len` bytes at `offset`: written before the
/// bytes themselves (one vectored write, no copy of the bytes into a frame).
pub fn data_prefix(room: u64, offset: u64, len: usize) -> [u8; HEADER + 8] {
    let mut out = [0u8; HEADER + 8];
    out[0] = Kind::Data as u8;
    out[4..8].copy_from_slice(&((len + 8) as u32).to_le_bytes());
    out[8..16].copy_from_slice(&room.to_le_bytes());
    out[16..24].copy_from_slice(&offset.to_le_bytes());
    out
}

/// Splits a DATA payload into its offset and bytes.
pub fn split_data(payload: &[u8]) -> Option<(u64, &[u8])> {
    let (offset, bytes) = payload.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*offset), bytes))
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadError {
    /// The stream failed or ended (a clean end before a header is `UnexpectedEof`).
    Io(io::Error),
    /// The peer sent something that is not this protocol: the connection is unusable.
    Protocol(String),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Reads one frame with `read_exact`-like semantics over `r`; `fill` does the reading (the
/// link's reader retries timeouts there while the peer is not yet declared dead).
pub fn read_frame(fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> Result<Frame, ReadError> {
    let (kind, len, room) = read_header(fill)?;
    let mut payload = Vec::new();
    read_payload(fill, &mut payload, len)?;
    Ok(Frame {
        kind,
        room,
        payload,
    })
}

/// A payload buffer grows this far ahead of the bytes that arrived.
const GROW_STEP: usize = 64 << 10;

/// Reads `len` more bytes onto the end of `payload`, growing it as they arrive (at most
/// [`GROW_STEP`] ahead): a header announcing a 16 MiB claim costs nothing until its bytes
/// come, so connections that announce large frames and send nothing hold no memory.
pub fn read_payload(
    fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>,
    payload: &mut Vec<u8>,
    len: usize,
) -> io::Result<()> {
    let end = payload.len() + len;
    while payload.len() < end {
        let at = payload.len();
        payload.resize(at + (end - at).min(GROW_STEP), 0);
        fill(&mut payload[at..])?;
    }
    Ok(())
}

/// Reads and checks one frame's header: its kind, payload length (within the kind's cap) and
/// room. The payload is the caller's to read.
pub fn read_header(
    fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>,
) -> Result<(Kind, usize, u64), ReadError> {
    let mut header = [0u8; HEADER];
    fill(&mut header)?;
    let kind = Kind::from_u8(header[0])
        .ok_or_else(|| ReadError::Protocol(format!("unknown frame kind {}", header[0])))?;
    if header[1..4] != [0, 0, 0] {
        return Err(ReadError::Protocol(
            "reserved header bytes are not zero".into(),
        ));
    }
    let len = u32::from_le_bytes(header[4..8].try_into().unwrap_or_default()) as usize;
    let room = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
    if len > kind.max_payload() {
        return Err(ReadError::Protocol(format!(
            "a {kind:?} frame of {len} bytes exceeds its limit of {}",
            kind.max_payload()
        )));
    }
    Ok((kind, len, room))
}

/// Reads one frame from a blocking reader.
pub fn read_frame_from(r: &mut impl Read) -> Result<Frame, ReadError> {
    read_frame(&mut |buf| r.read_exact(buf))
}

/// Writes `bytes` (one or more encoded frames).
pub fn write_all(w: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    w.write_all(bytes)
}

/// Parses a JSON payload and checks its lengths ([`super::limits`]), naming the frame on
/// failure.
pub fn parse<'a, T: Deserialize<'a> + super::limits::Bounded>(
    frame: &'a Frame,
) -> Result<T, String> {
    let value: T = serde_json::from_slice(&frame.payload)
        .map_err(|e| format!("a {:?} frame's payload is not valid: {e}", frame.kind))?;
    value
        .check()
        .map_err(|e| format!("a {:?} frame's payload is out of bounds: {e}", frame.kind))?;
    Ok(value)
}

/// Which side of the pipeline an engine is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Prefill,
    Decode,
}

/// The first frame each way on a connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: String,
    pub version: u32,
    pub side: Side,
    /// The sender's advertised endpoint.
    pub endpoint: String,
    /// What the sender's KV bytes mean: model identity, page size, every pool's row format.
    pub layout: LayoutFingerprint,
    /// How often the sender sends a heartbeat when idle: the receiver declares it dead after
    /// its own `heartbeat_misses` of these.
    pub heartbeat_interval_ms: u64,
    /// A UCX decode's pool memory, registered for the prefill's RMA writes: one key per
    /// region. Empty over TCP, on a prefill, and where the pools are not host memory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rma_keys: Vec<RmaKey>,
}

/// One region of a decode's memory that a prefill may write by RMA: `len` bytes from `addr`,
/// and the packed remote key (hex) that unlocks them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RmaKey {
    pub addr: u64,
    pub len: u64,
    pub rkey: String,
}

pub const PROTOCOL: &str = "dsv4-pd";

/// A side's nonce for the challenge-response ([`super::auth`]), hex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Auth {
    pub nonce: String,
}

/// A side's proof that it holds the secret: HMAC-SHA256 over both nonces, hex.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proof {
    pub proof: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    pub reason: super::room::FailReason,
    pub message: String,
}

/// A decode engine's claim on a room: it has reserved the destination.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// The request's digest on the decode (prompt, sampling, seed, salt): the prefill's must
    /// be the same.
    pub request_hash: u64,
    pub prompt_tokens: usize,
    /// The destination: the slot and the pages reserved for the prompt's KV.
    pub slot: u32,
    pub pages: Vec<u32>,
    /// Over UCX, where the destination is in memory the decode registered (its HELLO's
    /// `rma_keys`): the destination's `(address, length)` spans in state byte order. The
    /// prefill then writes the state's bytes there by RMA instead of sending DATA frames, and
    /// flushes before its DONE or FAIL. Empty: DATA frames.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rma_spans: Vec<(u64, u64)>,
}

/// A sequence state's scalars, as a room sends them: the bytes' layout follows from the
/// layout both engines agreed on in HELLO and the position, so the prefill's own region list
/// (offsets into its pools, ~13 KB of JSON for an 8000-token prompt, ~35 µs to parse on the
/// decode's critical path) does not travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateInfo {
    /// Tokens processed: the position of the next token.
    pub position: usize,
    /// The first generated token (sampled by the prefill, not yet fed).
    pub last_token: Option<u32>,
    /// The sampler's RNG state after that sample.
    pub rng: Option<u64>,
    /// Pages the state fills.
    pub pages: usize,
    /// Bytes of the state, in the layout's region order.
    pub bytes: u64,
}

impl StateInfo {
    pub fn of(state: &SequenceState) -> Self {
        Self {
            position: state.position,
            last_token: state.last_token,
            rng: state.rng,
            pages: state.pages,
            bytes: state.byte_len() as u64,
        }
    }
}

/// What the prefill sends ahead of the bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateHeader {
    /// Position, first token, RNG state and byte length.
    pub state: StateInfo,
    /// The first token's log-probability (0 unless the request asked for logprobs).
    pub first_logprob: f32,
    /// Prompt tokens the prefill reused from its device / host cache (reported in events).
    pub cached_tokens_device: u32,
    pub cached_tokens_host: u32,
}

/// The end of a room's data: its length and a CRC-32C over the STATE payload and every state
/// byte, in the order sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    pub bytes: u64,
    pub crc32c: u32,
    /// On an authenticated link, for a room written by RMA: the MAC (hex) over the STATE
    /// payload and every byte, under the link's RMA key ([`super::seal`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

/// Why a room failed, as its sender saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    pub reason: super::room::FailReason,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_lengths_are_capped_before_allocation() {
        let mut bytes = encode(Kind::Ack, 7, &[]);
        bytes.extend(encode_data(9, 4096, b"abc"));
        let mut r = &bytes[..];
        let a = read_frame_from(&mut r).unwrap();
        assert_eq!((a.kind, a.room, a.payload.len()), (Kind::Ack, 7, 0));
        let d = read_frame_from(&mut r).unwrap();
        assert_eq!((d.kind, d.room), (Kind::Data, 9));
        assert_eq!(split_data(&d.payload), Some((4096, &b"abc"[..])));
        // A header claiming 4 GiB of DATA is refused without reading (or allocating) it.
        let mut huge = encode(Kind::Data, 1, &[]);
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        match read_frame_from(&mut &huge[..]) {
            Err(ReadError::Protocol(m)) => assert!(m.contains("exceeds its limit"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mut unknown = encode(Kind::Ack, 1, &[]);
        unknown[0] = 200;
        assert!(matches!(
            read_frame_from(&mut &unknown[..]),
            Err(ReadError::Protocol(_))
        ));
        // A truncated frame is an I/O error (the stream ended), not a short frame.
        let cut = encode_data(1, 0, b"abcdef");
        assert!(matches!(
            read_frame_from(&mut &cut[..cut.len() - 1]),
            Err(ReadError::Io(_))
        ));
    }

    #[test]
    fn a_data_prefix_and_its_bytes_are_the_encoded_frame() {
        let bytes = b"some state bytes";
        let mut framed = data_prefix(42, 4096, bytes.len()).to_vec();
        framed.extend_from_slice(bytes);
        assert_eq!(framed, encode_data(42, 4096, bytes));
    }
}
