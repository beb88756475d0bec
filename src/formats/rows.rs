//! Row codecs: how one row of KV state is stored in a pool (docs/kv-cache.md "Row formats").
//!
//! - `F32`, `Bf16`: plain little-endian values.
//! - `Fp8Kv`: SGLang's packed K=V row — the non-rope channels as e4m3 in 64-channel blocks with
//!   ue8m0 scales, the rope channels as bf16; layout `[nope e4m3][rope bf16][scales][pad to 8]`
//!   (448 + 128 + 7 + 1 = 584 bytes for DeepSeek V4). The scales follow the official FP8 round
//!   trip, so rows that went through it (official numerics) are stored exactly.
//! - `Fp8Index`: indexer keys as e4m3 with one f32 scale (`amax / 448`) per 128 channels;
//!   layout `[values][scales f32]` (132 bytes at width 128).
//! - `Fp4Index`: indexer keys as e2m1 pairs (element 2j in the low nibble) with one ue8m0 scale
//!   per 32 channels, as in the official FP4 round trip; layout `[packed][scales]` (68 bytes).

use std::sync::LazyLock;

use half::bf16;

use super::{ceil_log2, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, E2M1};

/// The format of one stored row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowCodec {
    F32,
    Bf16,
    Fp8Kv { nope: usize, rope: usize },
    Fp8Index,
    Fp4Index,
}

/// Every e4m3 code's value: decoding is on the attention hot path (keys are decoded while they
/// are gathered).
static E4M3_VALUES: LazyLock<[f32; 256]> =
    LazyLock::new(|| std::array::from_fn(|b| e4m3_decode(b as u8)));

const KV_BLOCK: usize = 64;
const INDEX_FP8_BLOCK: usize = 128;
const INDEX_FP4_BLOCK: usize = 32;

impl RowCodec {
    /// Bytes of one row of `width` values.
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            Self::F32 => width * 4,
            Self::Bf16 => width * 2,
            Self::Fp8Kv { nope, rope } => {
                debug_assert_eq!(nope + rope, width);
                (nope + 2 * rope + nope.div_ceil(KV_BLOCK)).next_multiple_of(8)
            }
            Self::Fp8Index => width + 4 * width.div_ceil(INDEX_FP8_BLOCK),
            Self::Fp4Index => width.div_ceil(2) + width.div_ceil(INDEX_FP4_BLOCK),
        }
    }

    /// Encodes `x` into `out` (`row_bytes(x.len())` bytes).
    pub fn encode(self, x: &[f32], out: &mut [u8]) {
        let width = x.len();
        debug_assert_eq!(out.len(), self.row_bytes(width));
        match self {
            Self::F32 => {
                for (o, v) in out.chunks_exact_mut(4).zip(x) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            Self::Bf16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(x) {
                    o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
            Self::Fp8Kv { nope, rope } => {
                let (values, rest) = out.split_at_mut(nope);
                let (rope_bytes, rest) = rest.split_at_mut(2 * rope);
                let (scales, pad) = rest.split_at_mut(nope.div_ceil(KV_BLOCK));
                for (b, block) in x[..nope].chunks(KV_BLOCK).enumerate() {
                    let amax = block.iter().fold(1e-4f32, |m, v| m.max(v.abs()));
                    let e = ceil_log2(amax / 448.0);
                    let scale = 2f32.powi(e);
                    scales[b] = (e + 127) as u8;
                    for (i, v) in block.iter().enumerate() {
                        values[b * KV_BLOCK + i] = e4m3_encode((v / scale).clamp(-448.0, 448.0));
                    }
                }
                for (o, v) in rope_bytes.chunks_exact_mut(2).zip(&x[nope..]) {
                    o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
                pad.fill(0);
            }
            Self::Fp8Index => {
                let (values, scales) = out.split_at_mut(width);
                for (b, block) in x.chunks(INDEX_FP8_BLOCK).enumerate() {
                    let amax = block.iter().fold(1e-4f32, |m, v| m.max(v.abs()));
                    let scale = amax / 448.0;
                    scales[4 * b..4 * b + 4].copy_from_slice(&scale.to_le_bytes());
                    for (i, v) in block.iter().enumerate() {
                        values[b * INDEX_FP8_BLOCK + i] =
                            e4m3_encode((v / scale).clamp(-448.0, 448.0));
                    }
                }
            }
            Self::Fp4Index => {
                let (packed, scales) = out.split_at_mut(width.div_ceil(2));
                packed.fill(0);
                for (b, block) in x.chunks(INDEX_FP4_BLOCK).enumerate() {
                    let amax = block
                        .iter()
                        .fold(6.0 * 2f32.powi(-126), |m, v| m.max(v.abs()));
                    let e = ceil_log2(amax / 6.0);
                    let scale = 2f32.powi(e);
                    scales[b] = (e + 127) as u8;
                    for (i, v) in block.iter().enumerate() {
                        let j = b * INDEX_FP4_BLOCK + i;
                        let code = e2m1_encode((v / scale).clamp(-6.0, 6.0));
                        packed[j / 2] |= if j.is_multiple_of(2) { code } else { code << 4 };
                    }
                }
            }
        }
    }

    /// Appends a stored row's `width` values to `out`: f32 rows as they are read (a gather of
    /// cold window rows would otherwise write each row twice: zeroes, then the values), other
    /// formats decoded into the appended space.
    #[inline]
    pub fn decode_append(self, bytes: &[u8], width: usize, out: &mut Vec<f32>) {
        if self == Self::F32 {
            out.extend(
                bytes[..4 * width]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
            return;
        }
        let start = out.len();
        out.resize(start + width, 0.0);
        self.decode(bytes, &mut out[start..]);
    }

    /// Decodes a stored row into `out` (its width).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        let width = out.len();
        match self {
            Self::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Self::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Self::Fp8Kv { nope, rope } => {
                let scales = &bytes[nope + 2 * rope..];
                let table = &*E4M3_VALUES;
                for (b, (o, v)) in out[..nope]
                    .chunks_mut(KV_BLOCK)
                    .zip(bytes[..nope].chunks(KV_BLOCK))
                    .enumerate()
                {
                    let scale = e8m0_decode(scales[b]);
                    for (o, &v) in o.iter_mut().zip(v) {
                        *o = table[v as usize] * scale;
                    }
                }
                for (o, b) in out[nope..]
                    .iter_mut()
                    .zip(bytes[nope..nope + 2 * rope].chunks_exact(2))
                {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Self::Fp8Index => {
                let scales = &bytes[width..];
                let table = &*E4M3_VALUES;
                for (b, (o, v)) in out
                    .chunks_mut(INDEX_FP8_BLOCK)
                    .zip(bytes[..width].chunks(INDEX_FP8_BLOCK))
                    .enumerate()
                {
                    let s = &scales[4 * b..4 * b + 4];
                    let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    for (o, &v) in o.iter_mut().zip(v) {
                        *o = table[v as usize] * scale;
                    }
                }
            }
            Self::Fp4Index => {
                let scales = &bytes[width.div_ceil(2)..];
                for (i, o) in out.iter_mut().enumerate() {
                    let byte = bytes[i / 2];
                    let code = if i.is_multiple_of(2) {
                        byte & 0x0f
                    } else {
                        byte >> 4
                    };
                    *o = E2M1[code as usize] * e8m0_decode(scales[i / INDEX_FP4_BLOCK]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_sizes_match_the_deepseek_v4_formats() {
        assert_eq!(
            RowCodec::Fp8Kv {
                nope: 448,
                rope: 64
            }
            .row_bytes(512),
            584
        );
        assert_eq!(RowCodec::Fp8Index.row_bytes(128), 132);
        assert_eq!(RowCodec::Fp4Index.row_bytes(128), 68);
        assert_eq!(RowCodec::Bf16.row_bytes(512), 1024);
        assert_eq!(RowCodec::F32.row_bytes(512), 2048);
    }

    #[test]
    fn lossless_codecs_round_trip_and_lossy_ones_stay_close() {
        let x: Vec<f32> = (0..128).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        for (codec, tol) in [
            (RowCodec::F32, 0.0),
            (RowCodec::Bf16, 0.02),
            (RowCodec::Fp8Kv { nope: 96, rope: 32 }, 0.2),
            (RowCodec::Fp8Index, 0.2),
            (RowCodec::Fp4Index, 1.0),
        ] {
            let mut bytes = vec![0u8; codec.row_bytes(128)];
            codec.encode(&x, &mut bytes);
            let mut back = vec![0.0; 128];
            codec.decode(&bytes, &mut back);
            let err = x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= tol, "{codec:?}: {err}");
        }
    }

    #[test]
    fn rows_after_the_official_round_trips_are_stored_exactly() {
        use crate::formats::{fp4_round_trip, fp8_round_trip};
        let x: Vec<f32> = (0..512)
            .map(|i| ((i as f32) * 0.73).sin() * (1.0 + (i % 97) as f32))
            .collect();
        // fp8 KV: the nope channels after the official FP8 round trip come back bit for bit;
        // the rope channels as bf16.
        let mut kv = x.clone();
        kv[..448].chunks_mut(64).for_each(fp8_round_trip);
        let codec = RowCodec::Fp8Kv {
            nope: 448,
            rope: 64,
        };
        let mut bytes = vec![0u8; codec.row_bytes(512)];
        codec.encode(&kv, &mut bytes);
        let mut back = vec![0.0; 512];
        codec.decode(&bytes, &mut back);
        assert_eq!(back[..448], kv[..448]);
        for (b, v) in back[448..].iter().zip(&kv[448..]) {
            assert_eq!(*b, bf16::from_f32(*v).to_f32());
        }
        // fp4 indexer keys after the official FP4 round trip, likewise.
        let mut ix = x[..128].to_vec();
        ix.chunks_mut(32).for_each(fp4_round_trip);
        let mut bytes = vec![0u8; RowCodec::Fp4Index.row_bytes(128)];
        RowCodec::Fp4Index.encode(&ix, &mut bytes);
        let mut back = vec![0.0; 128];
        RowCodec::Fp4Index.decode(&bytes, &mut back);
        assert_eq!(back, ix);
    }
}
