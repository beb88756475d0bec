//! Per-frame MACs on an authenticated TCP link. After the handshake ([`super::handshake`])
//! each direction has its own 128-bit key, derived with HKDF-SHA256 from the secret and both
//! nonces; every frame then ends with a 32-byte tag: AEGIS-128X2 used as a MAC over the
//! frame's sequence number in its direction, its 16-byte header and its payload. A frame
//! altered, dropped, repeated, reordered or injected on the way does not verify, and the link
//! goes down (its rooms fail with `peer_dead`) before the frame is acted on. The sequence
//! number is implicit (both sides count), so it costs no bytes.
//!
//! AEGIS because the MAC runs over every state byte on both sides: ~45 GB/s a core with
//! AES-NI here, against ~6.5 for keyed BLAKE3 and ~1.8 for HMAC-SHA256 (`make bench-transfer`
//! compares the authenticated path with the unauthenticated one).

use aegis::aegis128x2::Aegis128X2Mac;

/// Bytes of a frame's tag.
pub const TAG: usize = 32;

/// A frame's MAC while its bytes go in.
pub type Mac = Aegis128X2Mac<TAG>;

/// One direction's key.
#[derive(Clone)]
pub struct FrameKey([u8; 16]);

impl FrameKey {
    pub fn new(bytes: [u8; 16]) -> Self {
        FrameKey(bytes)
    }
}

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKey(redacted)")
    }
}

/// A link's two keys: what this side sends with and what it receives with.
#[derive(Clone, Debug)]
pub struct FrameKeys {
    pub send: FrameKey,
    pub recv: FrameKey,
}

/// One direction's running MAC state: the keyed state and the next frame's sequence number.
pub struct Sequence {
    keyed: Mac,
    next: u64,
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequence(next {})", self.next)
    }
}

impl Sequence {
    pub fn new(key: FrameKey) -> Self {
        Self {
            keyed: Mac::new(&key.0),
            next: 0,
        }
    }

    /// The MAC of the next frame, its sequence number already in (the number then moves on).
    pub fn begin(&mut self) -> Mac {
        let mut m = self.keyed.clone();
        m.update(&self.next.to_le_bytes());
        self.next += 1;
        m
    }

    /// The tag of the next frame, whose bytes are `parts` in order.
    pub fn tag(&mut self, parts: &[&[u8]]) -> [u8; TAG] {
        let mut m = self.begin();
        for p in parts {
            m.update(p);
        }
        m.finalize()
    }

    /// Appends the next frame's tag to `frame` (one whole encoded frame).
    pub fn seal(&mut self, frame: &mut Vec<u8>) {
        let tag = self.tag(&[frame]);
        frame.extend_from_slice(&tag);
    }

    /// Whether `tag` is the next frame's, whose bytes are `parts` in order.
    pub fn check(&mut self, parts: &[&[u8]], tag: &[u8; TAG]) -> bool {
        let mut m = self.begin();
        for p in parts {
            m.update(p);
        }
        verify(m, tag)
    }
}

/// `frame` (one whole encoded frame), sealed where the connection has a sending sequence.
pub fn sealed(sequence: Option<&mut Sequence>, mut frame: Vec<u8>) -> Vec<u8> {
    if let Some(s) = sequence {
        s.seal(&mut frame);
    }
    frame
}

/// Whether `tag` is the one `m` (a frame's bytes, from [`Sequence::begin`]) makes, compared in
/// constant time.
pub fn verify(m: Mac, tag: &[u8; TAG]) -> bool {
    m.verify(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_the_aegis_mac_of_the_sequence_number_and_the_frame() {
        let key = [9u8; 16];
        let mut s = Sequence::new(FrameKey::new(key));
        let mut frame = b"0123456789abcdef payload".to_vec();
        s.seal(&mut frame);
        // The same MAC over the whole message at once.
        let mut msg = 0u64.to_le_bytes().to_vec();
        msg.extend_from_slice(b"0123456789abcdef payload");
        let mut m = Mac::new(&key);
        m.update(&msg);
        assert_eq!(&frame[24..], &m.finalize()[..]);
        // The next frame is number 1: the same bytes get another tag.
        let again = s.tag(&[b"0123456789abcdef payload"]);
        assert_ne!(&again[..], &frame[24..]);
    }

    #[test]
    fn the_receiver_verifies_in_order_and_refuses_anything_else() {
        let key = FrameKey::new([3u8; 16]);
        let (mut tx, mut rx) = (Sequence::new(key.clone()), Sequence::new(key));
        let frames: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 40]).collect();
        let tags: Vec<[u8; TAG]> = frames.iter().map(|f| tx.tag(&[f])).collect();
        // In order, split anywhere: verified.
        let mut m = rx.begin();
        m.update(&frames[0][..7]);
        m.update(&frames[0][7..]);
        assert!(verify(m, &tags[0]));
        // Frame 2 where frame 1 is due (frame 1 dropped): refused.
        let mut m = rx.begin();
        m.update(&frames[2]);
        assert!(!verify(m, &tags[2]));
        // A flipped bit: refused.
        let mut rx2 = Sequence::new(FrameKey::new([3u8; 16]));
        let mut bad = frames[0].clone();
        bad[5] ^= 1;
        let mut m = rx2.begin();
        m.update(&bad);
        assert!(!verify(m, &tags[0]));
        // Another key: refused.
        let mut other = Sequence::new(FrameKey::new([4u8; 16]));
        let mut m = other.begin();
        m.update(&frames[0]);
        assert!(!verify(m, &tags[0]));
    }
}
