//! Low-precision number formats of DeepSeek V4 checkpoints, decoded exactly to f32:
//! FP8 e4m3fn values with e8m0 (power-of-two) block scales, FP4 e2m1 values packed two per
//! byte (element 2j in the low nibble) with one e8m0 scale per 32 inputs.

/// `float8_e4m3fn`: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111
/// is NaN.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((byte >> 3) & 0x0f);
    let mant = f32::from(byte & 0x07);
    if exp == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * magnitude
}

/// `float8_e8m0fnu`: an unsigned power of two, `2^(byte − 127)`; 0xFF is NaN.
pub fn e8m0_to_f32(byte: u8) -> f32 {
    if byte == 0xff {
        f32::NAN
    } else {
        2f32.powi(i32::from(byte) - 127)
    }
}

/// e2m1 code → value: bit 3 is the sign.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

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
    let lut: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
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
    fn e4m3_matches_its_definition_on_every_code() {
        // Independent construction: enumerate every (sign, exponent, mantissa) and compare.
        let mut finite = 0;
        for byte in 0..=255u8 {
            let v = e4m3_to_f32(byte);
            let (s, e, m) = (byte >> 7, (byte >> 3) & 15, byte & 7);
            if e == 15 && m == 7 {
                assert!(v.is_nan(), "{byte:#x}");
                continue;
            }
            finite += 1;
            let expected = if e == 0 {
                f64::from(m) * 2f64.powi(-9)
            } else {
                (8.0 + f64::from(m)) * 2f64.powi(i32::from(e) - 10)
            } * if s == 1 { -1.0 } else { 1.0 };
            assert_eq!(f64::from(v), expected, "{byte:#x}");
        }
        assert_eq!(finite, 254);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3_to_f32(0x38), 1.0);
    }

    #[test]
    fn e8m0_is_a_power_of_two() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert!(e8m0_to_f32(255).is_nan());
    }

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
