//! How a weight matrix reaches the backend: in its checkpoint format with the raw bytes, so a
//! backend may keep FP8/FP4 native (a GPU's FP8 GEMM) or widen them (the CPU backend today).
//! The decoders here are exact: every FP8/FP4 value times its power-of-two scale is
//! representable in f32.

use std::ops::Range;

use half::{bf16, f16};

use crate::formats::{e4m3_decode, E2M1};

/// The storage format of one stored matrix: the formats of the official release and of
/// Hugging Face checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    F32,
    Bf16,
    F16,
    /// FP8 e4m3fn values, one scale per `block[0] × block[1]` block (official: 128 × 128 with
    /// e8m0 scales). Edge blocks may be narrower.
    Fp8E4m3 {
        block: [usize; 2],
    },
    /// FP4 e2m1 values packed two per byte (element 2j in the low nibble), one scale per
    /// `1 × block` inputs (official: 32 with e8m0 scales).
    Fp4E2m1 {
        block: usize,
    },
}

impl WeightFormat {
    /// The name used in reports ("bytes_by_dtype").
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Fp8E4m3 { .. } => "fp8_e4m3",
            Self::Fp4E2m1 { .. } => "fp4_e2m1",
        }
    }

    /// Bytes of one stored row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Self::F32 => 4 * cols,
            Self::Bf16 | Self::F16 => 2 * cols,
            Self::Fp8E4m3 { .. } => cols,
            Self::Fp4E2m1 { .. } => cols / 2,
        }
    }
}

/// Rows `rows` of one stored `[stored_rows, cols]` matrix.
#[derive(Debug, Clone)]
pub struct WeightPart<'a> {
    pub format: WeightFormat,
    /// The stored matrix's raw little-endian bytes, row-major (`format.row_bytes(cols)` per row).
    pub bytes: &'a [u8],
    /// Its block scales as f32 multipliers (e8m0 scales decode exactly), row-major over the
    /// block grid; empty for the float formats.
    pub scales: Vec<f32>,
    pub stored_rows: usize,
    /// The rows this part takes.
    pub rows: Range<usize>,
}

/// A weight matrix `[rows, cols]` (`[out, in]`): parts stacked by rows, e.g. an expert's
/// `w13 = [w1; w3]`, each in its own format.
#[derive(Debug, Clone)]
pub struct WeightData<'a> {
    pub cols: usize,
    pub parts: Vec<WeightPart<'a>>,
}

impl<'a> WeightData<'a> {
    /// One stored matrix, all of it.
    pub fn whole(
        format: WeightFormat,
        bytes: &'a [u8],
        scales: Vec<f32>,
        rows: usize,
        cols: usize,
    ) -> Self {
        Self {
            cols,
            parts: vec![WeightPart {
                format,
                bytes,
                scales,
                stored_rows: rows,
                rows: 0..rows,
            }],
        }
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows.len()).sum()
    }

    /// Every value as f32, `[rows, cols]` row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows() * self.cols);
        for p in &self.parts {
            p.decode_into(self.cols, &mut out);
        }
        out
    }

    /// Whether the parts' byte and scale lengths match their formats and shapes: what a
    /// backend checks before reading them.
    pub fn check(&self) -> Result<(), String> {
        for (i, p) in self.parts.iter().enumerate() {
            p.check(self.cols)
                .map_err(|problem| format!("weight part {i} {problem}"))?;
        }
        Ok(())
    }
}

impl WeightPart<'_> {
    /// Whether this part's byte and scale lengths match its format and shape, `cols` wide.
    pub fn check(&self, cols: usize) -> Result<(), String> {
        let want = self.format.row_bytes(cols) * self.stored_rows;
        let scales = match self.format {
            WeightFormat::Fp8E4m3 { block } => {
                self.stored_rows.div_ceil(block[0].max(1)) * cols.div_ceil(block[1].max(1))
            }
            WeightFormat::Fp4E2m1 { block } => self.stored_rows * cols.div_ceil(block.max(1)),
            _ => 0,
        };
        let problem = if self.bytes.len() != want {
            format!("{} bytes where {want} are needed", self.bytes.len())
        } else if self.scales.len() != scales {
            format!("{} scales where {scales} are needed", self.scales.len())
        } else if self.rows.end > self.stored_rows || self.rows.start > self.rows.end {
            format!("rows {:?} of {}", self.rows, self.stored_rows)
        } else if matches!(self.format, WeightFormat::Fp4E2m1 { .. }) && !cols.is_multiple_of(2) {
            format!("an odd width {cols} for packed FP4")
        } else {
            return Ok(());
        };
        Err(format!(
            "({} [{}, {cols}]): {problem}",
            self.format.name(),
            self.stored_rows
        ))
    }

    /// Appends rows `self.rows` decoded to f32.
    fn decode_into(&self, cols: usize, out: &mut Vec<f32>) {
        let row_bytes = self.format.row_bytes(cols);
        for r in self.rows.clone() {
            let row = &self.bytes[r * row_bytes..(r + 1) * row_bytes];
            match self.format {
                WeightFormat::F32 => out.extend(
                    row.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
                WeightFormat::Bf16 => out.extend(
                    row.chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                WeightFormat::F16 => out.extend(
                    row.chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                WeightFormat::Fp8E4m3 { block } => {
                    // Element (r, c) uses scale [r / b0, c / b1] (ragged edge blocks included).
                    let scale_cols = cols.div_ceil(block[1]);
                    let s =
                        &self.scales[(r / block[0]) * scale_cols..(r / block[0] + 1) * scale_cols];
                    out.extend(
                        row.iter()
                            .enumerate()
                            .map(|(c, &q)| e4m3_decode(q) * s[c / block[1]]),
                    );
                }
                WeightFormat::Fp4E2m1 { block } => {
                    let scale_cols = cols.div_ceil(block);
                    let s = &self.scales[r * scale_cols..(r + 1) * scale_cols];
                    for (j, &byte) in row.iter().enumerate() {
                        out.push(E2M1[(byte & 0x0f) as usize] * s[(2 * j) / block]);
                        out.push(E2M1[(byte >> 4) as usize] * s[(2 * j + 1) / block]);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_fp8_blocks_use_their_own_scales() {
        // [3, 5] with 2×2 blocks: a 2×3 scale grid whose last row and column are ragged.
        let one = 0x38; // 1.0
        let values = vec![one; 15];
        let scales = vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [2, 2] },
            &values,
            scales,
            3,
            5,
        );
        assert_eq!(w.check(), Ok(()));
        let w = w.to_f32();
        assert_eq!(&w[0..5], &[1.0, 1.0, 2.0, 2.0, 4.0]);
        assert_eq!(&w[5..10], &[1.0, 1.0, 2.0, 2.0, 4.0]);
        assert_eq!(&w[10..15], &[8.0, 8.0, 16.0, 16.0, 32.0]);
    }

    #[test]
    fn fp4_low_nibble_is_the_even_element() {
        // byte 0x72: low nibble 2 (1.0) is element 0, high nibble 7 (6.0) is element 1.
        let packed = [0x72, 0x9f];
        let w = WeightData::whole(
            WeightFormat::Fp4E2m1 { block: 32 },
            &packed,
            vec![2.0],
            1,
            4,
        );
        assert_eq!(w.check(), Ok(()));
        assert_eq!(w.to_f32(), vec![2.0, 12.0, -12.0, -1.0]);
    }

    #[test]
    fn parts_stack_by_rows_and_take_their_rows_only() {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [5.0f32, 6.0]
            .iter()
            .map(|&v| bf16::from_f32(v))
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let w = WeightData {
            cols: 2,
            parts: vec![
                WeightPart {
                    format: WeightFormat::F32,
                    bytes: &a,
                    scales: Vec::new(),
                    stored_rows: 2,
                    rows: 1..2,
                },
                WeightPart {
                    format: WeightFormat::Bf16,
                    bytes: &b,
                    scales: Vec::new(),
                    stored_rows: 1,
                    rows: 0..1,
                },
            ],
        };
        assert_eq!(w.check(), Ok(()));
        assert_eq!((w.rows(), w.to_f32()), (2, vec![3.0, 4.0, 5.0, 6.0]));
    }

    #[test]
    fn mismatched_lengths_are_named() {
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &[0u8; 10],
            vec![1.0],
            2,
            4,
        );
        let e = w.check().unwrap_err();
        assert!(e.contains("10 bytes where 8 are needed"), "{e}");
    }
}
