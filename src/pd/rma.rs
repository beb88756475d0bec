//! A room's state written by RMA into the decode's memory (UCX). The decode registers its
//! pool memory once and names it in its HELLO (`rma_keys`); each claim names the destination's
//! spans (`rma_spans`). The prefill's UCX thread turns each DATA frame it would have sent into
//! puts of the same bytes at the matching remote addresses, and flushes its endpoint before
//! the room's DONE, FAIL or FLUSHED goes out. So the decode reads the bytes only once all are
//! in (DONE), and frees the pages only once nothing more can land in them: after DONE, FAIL or
//! FLUSHED from the prefill, or once its endpoint to the prefill is closed.

use crate::kv::spans::Spans;

/// The decode's destination of one room, as the claim named it.
#[derive(Debug)]
pub struct Target {
    spans: Spans,
}

impl Target {
    /// The claim's `rma_spans`; refused when they overflow.
    pub fn from_claim(spans: &[(u64, u64)]) -> Result<Self, String> {
        Spans::new(spans.iter().copied())
            .map(|spans| Self { spans })
            .ok_or_else(|| "the claim's rma_spans overflow the address space".into())
    }

    /// Bytes the destination takes.
    pub fn len(&self) -> u64 {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Where state bytes `start..end` go: `(remote address, length)` pieces in order; `None`
    /// when the destination ends before `end`.
    pub fn pieces(&self, start: u64, end: u64) -> Option<Vec<(u64, u64)>> {
        (end <= self.spans.len()).then(|| self.spans.pieces(start, end).collect())
    }
}

/// The index of the region (`(address, length)`) that holds `len` bytes at `addr` whole.
pub fn region_of(
    regions: impl IntoIterator<Item = (u64, u64)>,
    addr: u64,
    len: u64,
) -> Option<usize> {
    regions
        .into_iter()
        .position(|(a, n)| addr >= a && (addr - a).checked_add(len).is_some_and(|end| end <= n))
}

/// A packed remote key as it travels in a HELLO.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of [`to_hex`]'s text.
pub fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "a remote key of {} characters is not hex bytes",
            text.len()
        ));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_keys_round_trip_through_hex_and_bad_text_is_refused() {
        let key: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&key)).unwrap(), key);
        assert_eq!(to_hex(&[0x0a, 0xff]), "0aff");
        for bad in ["abc", "zz", "0g", "é0"] {
            assert!(from_hex(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pieces_and_regions_map_state_bytes_to_registered_memory() {
        let t = Target::from_claim(&[(0x1000, 16), (0x9000, 8)]).unwrap();
        assert_eq!(t.len(), 24);
        assert_eq!(t.pieces(10, 20), Some(vec![(0x100a, 6), (0x9000, 4)]));
        assert_eq!(t.pieces(20, 25), None, "past the destination");
        assert!(Target::from_claim(&[(u64::MAX, 2)]).is_err());
        let regions = [(0x1000, 0x100), (0x9000, 0x10)];
        assert_eq!(region_of(regions, 0x100a, 6), Some(0));
        assert_eq!(region_of(regions, 0x9008, 8), Some(1));
        assert_eq!(region_of(regions, 0x9008, 9), None, "runs past its region");
        assert_eq!(region_of(regions, 0x0fff, 1), None);
        assert_eq!(region_of(regions, u64::MAX, 2), None);
    }
}
