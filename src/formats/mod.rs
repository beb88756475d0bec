//! The low-precision number formats of DeepSeek V4, exactly: FP8 `e4m3fn`, FP4 `e2m1`, the
//! power-of-two `ue8m0` scales, and the official release's round trips built from them
//! (docs/model.md §2.11, §4.2). Encoders round to nearest, ties to even.

pub mod rows;

/// `float8_e4m3fn` → f32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
/// S.1111.111 is NaN.
pub fn e4m3_decode(byte: u8) -> f32 {
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

/// f32 → `float8_e4m3fn`, round to nearest even, saturating at ±448 (NaN stays NaN).
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(448.0);
    if a < 2f32.powi(-6) {
        // Subnormal: multiples of 2^-9 (a code of 8 is the smallest normal, 0x08).
        let q = (a * 512.0).round_ties_even() as u8;
        return sign | q;
    }
    let e = floor_log2(a);
    let m = ((a / 2f32.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
    let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
    sign | (((e + 7) as u8) << 3) | m as u8
}

/// `float8_e8m0fnu` → f32: `2^(byte − 127)`; 0xFF is NaN.
pub fn e8m0_decode(byte: u8) -> f32 {
    if byte == 0xff {
        f32::NAN
    } else {
        2f32.powi(i32::from(byte) - 127)
    }
}

/// e2m1 code → value (bit 3 is the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// f32 (already within ±6) → e2m1 code, nearest value, ties to the even code.
pub fn e2m1_encode(x: f32) -> u8 {
    const MIDPOINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let a = x.abs();
    let mut code = 0u8;
    for (i, &mid) in MIDPOINTS.iter().enumerate() {
        let upper = i as u8 + 1;
        if a > mid || (a == mid && upper.is_multiple_of(2)) {
            code = upper;
        }
    }
    if x.is_sign_negative() {
        code | 8
    } else {
        code
    }
}

/// ⌊log2 a⌋ for a finite positive normal f32, exactly (from the exponent bits).
fn floor_log2(a: f32) -> i32 {
    ((a.to_bits() >> 23) & 0xff) as i32 - 127
}

/// ⌈log2 v⌉ exactly, for finite positive v (normal or not; zero gives the smallest subnormal's
/// exponent, −149).
pub fn ceil_log2(v: f32) -> i32 {
    if v <= 0.0 {
        -149
    } else if v >= f32::MIN_POSITIVE {
        let bits = v.to_bits();
        let e = ((bits >> 23) & 0xff) as i32 - 127;
        if bits & 0x7f_ffff == 0 {
            e
        } else {
            e + 1
        }
    } else {
        // Subnormals: scale up exactly first (2^64 is exact).
        ceil_log2(v * 18_446_744_073_709_551_616.0) - 64
    }
}

/// The ue8m0 scale for a block: `2^ceil(log2(amax / top))`.
pub fn pow2_scale(amax: f32, top: f32) -> f32 {
    2f32.powi(ceil_log2(amax / top))
}

/// The official FP8 round trip of one block (the kv channels, 64 per block):
/// `e4m3(clamp(x / s, ±448)) · s` with `s = 2^ceil(log2(max(amax, 1e-4) / 448))`.
pub fn fp8_round_trip(block: &mut [f32]) {
    let amax = block.iter().fold(1e-4f32, |m, v| m.max(v.abs()));
    let scale = pow2_scale(amax, 448.0);
    for v in block {
        *v = e4m3_decode(e4m3_encode((*v / scale).clamp(-448.0, 448.0))) * scale;
    }
}

/// The official FP4 round trip of one block of 32:
/// `e2m1(clamp(x / s, ±6)) · s` with `s = 2^ceil(log2(max(amax, 6·2^-126) / 6))`.
pub fn fp4_round_trip(block: &mut [f32]) {
    let amax = block
        .iter()
        .fold(6.0 * 2f32.powi(-126), |m, v| m.max(v.abs()));
    let scale = pow2_scale(amax, 6.0);
    for v in block {
        *v = E2M1[e2m1_encode((*v / scale).clamp(-6.0, 6.0)) as usize] * scale;
    }
}

/// In-place normalised Walsh–Hadamard transform (Sylvester order, scaled by `n^-½`); `x.len()`
/// must be a power of two.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for start in (0..n).step_by(2 * h) {
            for i in start..start + h {
                let (a, b) = (x[i], x[i + h]);
                x[i] = a + b;
                x[i + h] = a - b;
            }
        }
        h *= 2;
    }
    let scale = (n as f32).powf(-0.5);
    x.iter_mut().for_each(|v| *v *= scale);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_every_code_by_its_definition() {
        let mut finite = 0;
        for byte in 0..=255u8 {
            let v = e4m3_decode(byte);
            let (s, e, m) = (byte >> 7, (byte >> 3) & 15, byte & 7);
            if e == 15 && m == 7 {
                assert!(v.is_nan(), "{byte:#x}");
                continue;
            }
            finite += 1;
            let magnitude = if e == 0 {
                f64::from(m) * 2f64.powi(-9)
            } else {
                (8.0 + f64::from(m)) * 2f64.powi(i32::from(e) - 10)
            };
            let expected = if s == 1 { -magnitude } else { magnitude };
            assert_eq!(f64::from(v), expected, "{byte:#x}");
        }
        assert_eq!(finite, 254);
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
    }

    #[test]
    fn e4m3_encodes_every_value_back_to_its_code_and_rounds_ties_to_even() {
        for byte in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let v = e4m3_decode(byte);
            assert_eq!(e4m3_encode(v), byte, "{byte:#x} = {v}");
        }
        // Midpoints between neighbours go to the even mantissa.
        assert_eq!(e4m3_decode(e4m3_encode(1.0625)), 1.0); // between 1.0 (m0) and 1.125 (m1)
        assert_eq!(e4m3_decode(e4m3_encode(1.1875)), 1.25); // between m1 and m2
        assert_eq!(e4m3_decode(e4m3_encode(-0.5 * 2f32.powi(-9))), -0.0); // below the smallest subnormal
        assert_eq!(
            e4m3_decode(e4m3_encode(1.5 * 2f32.powi(-9))),
            2.0 * 2f32.powi(-9)
        );
        assert_eq!(e4m3_decode(e4m3_encode(1e6)), 448.0); // saturates
        assert_eq!(
            e4m3_decode(e4m3_encode(15.5 / 8.0 * 2f32.powi(-6) * 0.5)),
            e4m3_decode(0x08)
        );
    }

    #[test]
    fn ue8m0_is_every_power_of_two() {
        for byte in 0..=254u8 {
            assert_eq!(
                f64::from(e8m0_decode(byte)),
                2f64.powi(i32::from(byte) - 127)
            );
        }
        assert!(e8m0_decode(255).is_nan());
    }

    #[test]
    fn e2m1_table_round_trips_and_ties_go_to_even_codes() {
        for code in 0..16u8 {
            let v = E2M1[code as usize];
            assert_eq!(e2m1_encode(v), code, "{code} = {v}");
        }
        for (x, expected) in [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (0.26, 0.5),
            (5.01, 6.0),
            (-2.9, -3.0),
        ] {
            assert_eq!(E2M1[e2m1_encode(x) as usize], expected, "{x}");
        }
    }

    #[test]
    fn ceil_log2_is_exact_at_and_around_powers_of_two() {
        assert_eq!(ceil_log2(1.0), 0);
        assert_eq!(ceil_log2(f32::from_bits(1.0f32.to_bits() + 1)), 1);
        assert_eq!(ceil_log2(0.75), 0);
        assert_eq!(ceil_log2(f32::from_bits(1 << 19)), -130); // the subnormal 2^-130
        assert_eq!(ceil_log2(f32::from_bits(3 << 19)), -128);
        assert_eq!(pow2_scale(448.0, 448.0), 1.0);
        assert_eq!(pow2_scale(449.0, 448.0), 2.0);
    }

    #[test]
    fn round_trips_keep_block_maxima_representable() {
        let mut block: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.37).collect();
        fp8_round_trip(&mut block);
        // Scale 2^ceil(log2(11.655/448)) = 2^-5: 11.655 · 32 = 372.96 → the e4m3 grid at 384.
        assert_eq!(block[63], 384.0 / 32.0);
        let mut small = vec![3.0f32, -0.1, 1.0, 0.4];
        fp4_round_trip(&mut small);
        // Scale 2^ceil(log2(3/6)) = 0.5: 3 → 6·0.5, −0.1 → 0, 1 → 2·0.5, 0.4 → 1·0.5 (0.8 rounds to 1).
        assert_eq!(small, vec![3.0, -0.0, 1.0, 0.5]);
    }

    #[test]
    fn hadamard_is_orthonormal_and_self_inverse() {
        let original: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut x = original.clone();
        hadamard(&mut x);
        let norm = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((norm(&x) - norm(&original)).abs() < 1e-5);
        // First output is the scaled sum.
        assert!((x[0] - original.iter().sum::<f32>() / 8f32.sqrt()).abs() < 1e-6);
        hadamard(&mut x);
        for (a, b) in x.iter().zip(&original) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
