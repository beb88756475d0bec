//! Where a room's bytes stand on the decode: complete pages may arrive before the STATE frame
//! (the prefill sends them while the prompt is still computing), at any offset the reserved
//! destination can hold; no byte may arrive twice. The bytes go straight into the destination
//! pages when the engine's pools are host memory ([`Landing`]), else into a buffer the engine
//! copies from when the room is done.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::wire::StateHeader;
use crate::kv::Landing;

/// Where a DATA frame's bytes are read to, lent to the link's reader for one frame.
pub enum Lent {
    /// The room's buffer (handed back with the bytes at their offset).
    Buffer(Vec<u8>),
    /// The destination itself.
    Direct(Arc<Landing>),
    /// Nowhere: the engine is ending the room's request (the room closes next).
    Discard,
}

enum Store {
    Buffer(Vec<u8>),
    Direct(Arc<Landing>),
    /// The engine released the destination: bytes still arriving are dropped.
    Released,
}

pub(super) struct Incoming {
    pub(super) header: Option<StateHeader>,
    /// CRC-32C of the STATE payload.
    header_crc: u32,
    /// The STATE payload (a few hundred bytes): the MAC of an RMA-written room covers it.
    state_payload: Vec<u8>,
    /// CRC-32C of bytes `..crc_upto`, taken as bytes arrive in offset order (a DATA frame
    /// extends it when it starts where it stops): the reader does it while the next frame is
    /// on its way instead of ~25 µs after the last. Seeded with `header_crc` when the STATE
    /// frame came before any byte was folded in (the usual case); else DONE combines the two
    /// (`crc::combine`).
    bytes_crc: u32,
    pub(super) crc_upto: usize,
    seeded: bool,
    store: Store,
    /// Bytes the state may hold: the destination's capacity, then the STATE frame's length.
    len: usize,
    /// Byte ranges received: start → end, disjoint.
    pub(super) ranges: BTreeMap<usize, usize>,
    pub(super) received: usize,
}

impl Incoming {
    /// Room for `capacity` bytes: straight into `landing` when given, else a buffer.
    pub(super) fn new(capacity: usize, landing: Option<Arc<Landing>>) -> Self {
        let (store, len) = match landing {
            Some(l) => {
                let len = capacity.min(l.len());
                (Store::Direct(l), len)
            }
            None => (Store::Buffer(vec![0; capacity]), capacity),
        };
        Self {
            header: None,
            header_crc: 0,
            state_payload: Vec::new(),
            bytes_crc: 0,
            crc_upto: 0,
            seeded: false,
            store,
            len,
            ranges: Default::default(),
            received: 0,
        }
    }

    /// Bytes the state holds (or, before the STATE frame, may hold).
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The state is `len` bytes (from its STATE frame; at most what it could hold).
    pub(super) fn set_len(&mut self, len: usize) {
        self.len = self.len.min(len);
        if let Store::Buffer(b) = &mut self.store {
            b.truncate(self.len);
        }
    }

    /// The engine released the destination: what still arrives is dropped.
    pub(super) fn release(&mut self) {
        self.store = Store::Released;
    }

    pub(super) fn is_released(&self) -> bool {
        matches!(self.store, Store::Released)
    }

    /// Where `len` bytes at `offset` go, or why they may not (past the end, or over bytes
    /// already in).
    pub(super) fn check(&self, offset: u64, len: usize) -> Result<(usize, usize), String> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(len);
        if end > self.len {
            return Err(format!(
                "DATA for bytes {offset}..{} runs past the {} bytes the state can hold",
                offset.saturating_add(len as u64),
                self.len
            ));
        }
        let before = self.ranges.range(..end).next_back();
        if before.is_some_and(|(_, &e)| e > start) {
            return Err(format!(
                "DATA for bytes {start}..{end} overlaps bytes already received"
            ));
        }
        Ok((start, end))
    }

    /// Takes `data` at `offset`, or says why not ([`Self::check`]).
    pub(super) fn put(&mut self, offset: u64, data: &[u8]) -> Result<(), String> {
        if self.is_released() {
            return Ok(());
        }
        let (start, end) = self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(()); // as a range it would replace the one starting at the same byte
        }
        match &mut self.store {
            Store::Buffer(b) => b[start..end].copy_from_slice(data),
            // SAFETY: the destination stays reserved while the room holds its landing (the
            // engine releases it through the node, which drops it here first), and the range
            // was checked not to overlap bytes already in; the table's lock is held, so no
            // reader writes this room meanwhile.
            Store::Direct(l) => unsafe { l.write(start, data) },
            Store::Released => {}
        }
        self.record(start, end);
        Ok(())
    }

    /// Lends where `len` bytes at `offset` go, for the link's reader to read them there
    /// outside the node's lock ([`Self::put_back`] after); `None` when they may not go
    /// anywhere ([`Self::check`]: the frame then goes through [`Self::put`] and is refused).
    pub(super) fn lend(&mut self, offset: u64, len: usize) -> Option<Lent> {
        if self.is_released() {
            return Some(Lent::Discard);
        }
        self.check(offset, len).ok()?;
        Some(match &mut self.store {
            Store::Buffer(b) => Lent::Buffer(std::mem::take(b)),
            Store::Direct(l) => Lent::Direct(l.clone()),
            Store::Released => Lent::Discard,
        })
    }

    /// The running CRC when bytes at `offset` would extend it (they start where it stops):
    /// the reader extends it over them before taking them back ([`ahead_crc`]), outside the
    /// node's lock.
    pub(super) fn crc_base(&self, offset: u64) -> Option<u32> {
        (offset == self.crc_upto as u64 && !self.is_released()).then_some(self.bytes_crc)
    }

    /// A lent buffer or destination back, with `len` more bytes at `offset` when `filled`;
    /// `ahead`: the running CRC the bytes extend ([`Self::crc_base`]) and the CRC extended
    /// over them, taken meanwhile.
    pub(super) fn put_back(
        &mut self,
        offset: u64,
        len: usize,
        lent: Lent,
        filled: bool,
        ahead: Option<(u32, u32)>,
    ) {
        if let (Lent::Buffer(b), Store::Buffer(mine)) = (lent, &mut self.store) {
            *mine = b;
        }
        if filled && len > 0 && !self.is_released() {
            let start = offset as usize; // checked by lend
            if let Some((base, crc)) = ahead {
                // Unless the CRC moved meanwhile (it cannot: this room's bytes come through
                // one reader, which is here), it now runs to the end of these bytes.
                if self.crc_upto == start && self.bytes_crc == base {
                    self.bytes_crc = crc;
                    self.crc_upto = start + len;
                }
            }
            self.record(start, start + len);
        }
    }

    /// Every byte of the state is in the destination (written there by RMA): counted as
    /// received, and the CRC runs over them.
    pub(super) fn landed_whole(&mut self) {
        if self.received == 0 && self.len > 0 && !self.is_released() {
            self.record(0, self.len);
        }
    }

    /// Counts bytes `start..end` (checked, non-empty) as received, and extends the running
    /// CRC over what it can.
    fn record(&mut self, start: usize, end: usize) {
        self.ranges.insert(start, end);
        self.received += end - start;
        // Pages sent early may have left a gap: once it is filled, the CRC runs on over them.
        while let Some(&to) = self.ranges.get(&self.crc_upto) {
            let from = self.crc_upto;
            self.bytes_crc = match &self.store {
                Store::Buffer(b) => crate::crc::append(self.bytes_crc, &b[from..to]),
                // SAFETY: the destination is reserved (as in `put`) and these bytes are in:
                // only ranges not yet received are written.
                Store::Direct(l) => unsafe { l.crc_append(self.bytes_crc, from, to) },
                Store::Released => self.bytes_crc,
            };
            self.crc_upto = to;
        }
    }

    /// Takes the STATE payload's CRC (before any byte was folded in: as the running CRC's seed).
    pub(super) fn set_header_crc(&mut self, payload: &[u8]) {
        self.header_crc = crate::crc::crc32c(payload);
        self.state_payload = payload.to_vec();
        if self.crc_upto == 0 {
            self.bytes_crc = self.header_crc;
            self.seeded = true;
        }
    }

    /// Whether `tag` is the MAC of room `room` under `key` over the STATE payload and every
    /// byte (an authenticated link's room written by RMA); `None` until all are in.
    pub(super) fn mac_matches(
        &self,
        key: &super::seal::Keyed,
        room: u64,
        tag: &[u8; super::seal::TAG],
    ) -> Option<bool> {
        if self.received != self.len {
            return None;
        }
        let mut m = key.begin(room);
        m.update(&self.state_payload);
        match &self.store {
            Store::Buffer(b) => m.update(&b[..self.len]),
            // SAFETY: the destination is reserved (as in `put`) and every byte is in: nothing
            // writes it while it is read.
            Store::Direct(l) => unsafe { l.read(0, self.len, |b| m.update(b)) },
            Store::Released => return None,
        }
        Some(super::seal::verify(m, tag))
    }

    /// CRC-32C of the STATE payload followed by every byte, once all are in.
    pub(super) fn crc(&self) -> Option<u32> {
        (self.crc_upto == self.len).then(|| {
            if self.seeded {
                self.bytes_crc
            } else {
                crate::crc::combine(self.header_crc, self.bytes_crc, self.len)
            }
        })
    }

    /// The bytes, for the engine to write into the destination: `None` when they are in it
    /// already.
    pub(super) fn take_bytes(&mut self) -> Option<Vec<u8>> {
        match &mut self.store {
            Store::Buffer(b) => Some(std::mem::take(b)),
            _ => None,
        }
    }
}

/// `base` (a room's running CRC, [`Incoming::crc_base`]) extended over bytes `start..end`
/// that were just read into `lent`, for [`Incoming::put_back`]; `None` when nothing was
/// stored.
///
/// # Safety
/// `lent` is still lent (a destination stays reserved until it is handed back) and
/// `start..end` was just filled through it, by this thread.
pub(super) unsafe fn ahead_crc(lent: &Lent, base: u32, start: usize, end: usize) -> Option<u32> {
    match lent {
        Lent::Buffer(b) => b
            .get(start..end)
            .map(|bytes| crate::crc::append(base, bytes)),
        // SAFETY: the caller's contract: the pages are reserved while lent, and only this
        // thread writes the room's bytes, which it has finished writing.
        Lent::Direct(l) => Some(unsafe { l.crc_append(base, start, end) }),
        Lent::Discard => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{Incoming, Lent};

    /// The running CRC equals one taken over the STATE payload and all bytes in offset order,
    /// whatever order the ranges came in (pages sent early leave gaps filled later).
    #[test]
    fn the_running_crc_is_the_crc_of_the_bytes_in_offset_order() {
        let header = b"{\"state\": 1}";
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let want = crate::crc::append(crate::crc::crc32c(header), &bytes);
        for order in [
            vec![0..4000, 4000..10_000],
            vec![4000..8000, 0..4000, 8000..10_000],
            vec![8000..10_000, 4000..8000, 0..10, 10..4000],
        ] {
            // The STATE frame first (the running CRC seeded with it), or after the first
            // range (combined at the end).
            for state_after in [0, 1] {
                let mut inc = Incoming::new(bytes.len(), None);
                for (i, r) in order.iter().enumerate() {
                    if i == state_after {
                        inc.set_header_crc(header);
                    }
                    assert_eq!(inc.crc(), None, "{order:?}: not all bytes are in after {i}");
                    inc.put(r.start as u64, &bytes[r.clone()]).unwrap();
                    inc.put(r.start as u64, &[]).unwrap(); // an empty frame changes nothing
                }
                assert_eq!(
                    inc.crc(),
                    Some(want),
                    "{order:?}, STATE after {state_after}"
                );
                assert_eq!(inc.take_bytes(), Some(bytes.clone()));
            }
        }
        // Lent and handed back: the CRC extended by the reader (`ahead_crc`) is taken when it
        // extends the running one; one taken from a stale base is ignored (the bytes are
        // folded in from the store instead).
        for stale in [false, true] {
            let mut inc = Incoming::new(bytes.len(), None);
            inc.set_header_crc(header);
            for r in [0..4000, 4000..10_000] {
                let Some(Lent::Buffer(mut buf)) = inc.lend(r.start as u64, r.len()) else {
                    panic!("a buffer is lent");
                };
                buf[r.clone()].copy_from_slice(&bytes[r.clone()]);
                let lent = Lent::Buffer(buf);
                let base = inc.crc_base(r.start as u64).unwrap() ^ u32::from(stale);
                // SAFETY: a buffer is owned by the lent value.
                let crc = unsafe { super::ahead_crc(&lent, base, r.start, r.end) }.unwrap();
                inc.put_back(r.start as u64, r.len(), lent, true, Some((base, crc)));
            }
            assert_eq!(inc.crc(), Some(want), "stale base {stale}");
        }
        let mut inc = Incoming::new(10, None);
        inc.put(2, &[1, 2, 3]).unwrap();
        assert!(inc.put(4, &[9]).unwrap_err().contains("overlaps"));
        assert!(inc.put(8, &[0; 3]).unwrap_err().contains("runs past"));
    }
}
