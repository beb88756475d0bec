//! Quantised checkpoint matrices decoded exactly to f32 (formats in [`crate::formats`]):
//! FP8 e4m3fn values with e8m0 (power-of-two) block scales, FP4 e2m1 values packed two per
//! byte (element 2j in the low nibble) with one e8m0 scale per 32 inputs.

use crate::formats::{e4m3_decode, E2M1};

/// `[rows, cols]` FP8 values with block scales `[ceil(rows/b0), ceil(cols/b1)]`. The last block
/// of a row or column may be narrower (ragged edges): element (r, c) uses scale
/// `[r / b0, c / b1]`.
pub fn fp8_block(
    values: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
) -> Vec<f32> {
    let lut: Vec<f32> = (0..=255u8).map(e4m3_decode).collect();
    let scale_cols = cols.div_ceil(block[1]);
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let scale_row = &scales[(r / block[0]) * scale_cols..(r / block[0] + 1) * scale_cols];
        let row = &values[r * cols..(r + 1) * cols];
        out.extend(
            row.iter()
                .enumerate()
                .map(|(c, &q)| lut[q as usize] * scale_row[c / block[1]]),
        );
    }
    out
}

/// `[rows, cols]` FP4 values packed `[rows, cols/2]` with scales `[rows, cols/block]`.
pub fn fp4_packed(
    packed: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    block: usize,
) -> Vec<f32> {
    let scale_cols = cols.div_ceil(block);
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let bytes = &packed[r * cols / 2..(r + 1) * cols / 2];
        let s = &scales[r * scale_cols..(r + 1) * scale_cols];
        for (j, &byte) in bytes.iter().enumerate() {
            out.push(E2M1[(byte & 0x0f) as usize] * s[(2 * j) / block]);
            out.push(E2M1[(byte >> 4) as usize] * s[(2 * j + 1) / block]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ragged_fp8_blocks_use_their_own_scales() {
        // [3, 5] with 2×2 blocks: a 2×3 scale grid whose last row and column are ragged.
        let one = 0x38; // 1.0
        let values = vec![one; 15];
        let scales = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        let w = fp8_block(&values, &scales, 3, 5, [2, 2]);
        assert_eq!(&w[0..5], &[1.0, 1.0, 2.0, 2.0, 4.0]);
        assert_eq!(&w[5..10], &[1.0, 1.0, 2.0, 2.0, 4.0]);
        assert_eq!(&w[10..15], &[8.0, 8.0, 16.0, 16.0, 32.0]);
    }

    #[test]
    fn fp4_low_nibble_is_the_even_element() {
        // byte 0x72: low nibble 2 (1.0) is element 0, high nibble 7 (6.0) is element 1.
        let w = fp4_packed(&[0x72, 0x9f], &[2.0], 1, 4, 32);
        assert_eq!(w, vec![2.0, 12.0, -12.0, -1.0]);
    }
}
