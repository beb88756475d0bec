//! `exp` of many f32 values at once: attention's softmax terms and the compressor's pooling
//! weights (a weight per slot and channel, on the step's one thread), millions a prefill, were
//! glibc's scalar `expf`, one call each.
//!
//! Every value goes through the same vector formula, a slice's last partial vector included
//! (masked loads and stores), so a value's result does not depend on where it sits in the
//! slice: a decode step's attention parts and compressed rows and a prefill's give the same
//! bits.

/// `v[i] = exp(v[i])`: with AVX-512 within 1 ulp of the exact value (tested against f64),
/// else `f32::exp`. `-inf` gives 0, `+inf` infinity, NaN NaN.
pub(super) fn exp_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::gemv::has_avx512() {
        // SAFETY: AVX-512F was detected.
        unsafe { x86::exp_in_place(v) };
        return;
    }
    v.iter_mut().for_each(|x| *x = x.exp());
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// ln 2 in two parts (Cody–Waite): the first has 9 significant bits, so `n · LN2_HI` is
    /// exact for every `n` the clamp allows.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    /// `e^r` for `|r| ≤ ln2 / 2`: Taylor to `r^7` (its truncation error is below 1e-8).
    const TAYLOR: [f32; 7] = [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];

    /// # Safety
    /// AVX-512F and VL available.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn exp_in_place(v: &mut [f32]) {
        let mut i = 0;
        while i < v.len() {
            let n = (v.len() - i).min(16);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // SAFETY: the mask covers only v[i .. i + n], inside the slice.
            unsafe {
                let p = v.as_mut_ptr().add(i);
                let x = _mm512_maskz_loadu_ps(mask, p);
                _mm512_mask_storeu_ps(p, mask, exp16(x));
            }
            i += 16;
        }
    }

    /// `x = n ln2 + r`, `e^x = 2^n e^r`; `vscalefps` applies `2^n` with IEEE overflow to
    /// infinity and gradual underflow to 0.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn exp16(x: __m512) -> __m512 {
        // Below −104 the result rounds to 0 and above 89 to infinity; the clamp keeps `n`
        // small (and turns ±inf into those). `max`/`min` return their second operand when
        // either is NaN, so a NaN passes through.
        let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
        let x = _mm512_min_ps(_mm512_set1_ps(89.0), x);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(1.0 / 5040.0);
        for c in TAYLOR {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between `got` and the f64 `want` rounded to f32.
    fn ulps(got: f32, want: f64) -> u32 {
        let want = want as f32;
        if got == want {
            return 0;
        }
        (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn within_one_ulp_of_exp_over_the_whole_range() {
        // Every 997th f32 of either sign up to 110 in magnitude (about 2.3 million values,
        // dense near 0 as floats are), plus the edges of the range.
        let mut xs: Vec<f32> = (0..=110f32.to_bits())
            .step_by(997)
            .map(f32::from_bits)
            .flat_map(|x| [x, -x])
            .filter(|&x| x <= 90.0)
            .collect();
        xs.extend([
            0.0, -0.0, 1e-30, -1e-30, 88.72, 88.73, -87.33, -103.9, -103.0,
        ]);
        let mut got = xs.clone();
        exp_in_place(&mut got);
        let mut worst = (0, 0.0f32);
        for (&x, &g) in xs.iter().zip(&got) {
            // Subnormal results are held to the subnormal grid's ulp as well.
            let u = ulps(g, f64::from(x).exp());
            if u > worst.0 {
                worst = (u, x);
            }
        }
        assert!(worst.0 <= 1, "{} ulp at exp({})", worst.0, worst.1);
        assert_eq!(got[xs.len() - 9], 1.0, "exp(0) is exactly 1");
    }

    #[test]
    fn special_values_and_positions() {
        let mut v = [
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -200.0,
            200.0,
            -1e38,
            1e38,
        ];
        exp_in_place(&mut v);
        assert_eq!(v[0], 0.0);
        assert_eq!(v[1], f32::INFINITY);
        assert!(v[2].is_nan());
        assert_eq!(v[3], 0.0);
        assert_eq!(v[4], f32::INFINITY);
        assert_eq!(v[5], 0.0);
        assert_eq!(v[6], f32::INFINITY);
        // A value's result is the same wherever it sits (full vectors and partial tails).
        let base: Vec<f32> = (0..40).map(|i| (i as f32 * 0.731).sin() * 20.0).collect();
        let mut whole = base.clone();
        exp_in_place(&mut whole);
        for start in 0..base.len() {
            for len in [1, 3, 16, 17] {
                let end = (start + len).min(base.len());
                let mut part = base[start..end].to_vec();
                exp_in_place(&mut part);
                for (k, &p) in part.iter().enumerate() {
                    assert_eq!(p.to_bits(), whole[start + k].to_bits(), "at {}", start + k);
                }
            }
        }
    }
}
