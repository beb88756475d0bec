//! Weights kept in their checkpoint's FP8 / FP4 format (`model.weight_dtype = native`) and
//! decoded to f32 where they are used: a few rows at a time into an L1-sized buffer for the
//! matrix-vector kernels, blocks of rows for the GEMMs, one row for an embedding. Resident
//! bytes are the checkpoint's (plus per-row FP8 scales), and a decode step reads a quarter
//! (FP8) or an eighth (FP4) of the f32 bytes. Decoding is exact: every FP8/FP4 value times
//! its power-of-two scale is an f32.

use std::borrow::Cow;

use super::arena::Bytes;
use super::paired::{by_inputs, Interleaved};
use crate::backend::weights::{WeightData, WeightFormat};
use crate::formats::{e4m3_decode, E2M1};

/// A matrix in a native low-precision format, `[rows, cols]` row-major.
#[derive(Debug, Clone)]
pub(crate) enum Native {
    /// FP8 e4m3fn values, one power-of-two scale per row per `block` columns, kept as its
    /// exponent byte (the checkpoint's `128 × 128` e8m0 tiles repeated on each of their rows,
    /// so a row needs no tile lookup: one byte per 128 values, 0.8 %).
    Fp8 {
        values: Bytes,
        exponents: Bytes,
        block: usize,
        /// No value is a NaN code (0x7F / 0xFF), so the fused kernel skips the NaN blend.
        nan_free: bool,
        /// Bit `r · nb + b` (of byte `/ 8`, bit `% 8`) set where row `r`'s column block `b`
        /// holds an e4m3 subnormal (exponent bits 0, mantissa not): the one-input kernel's
        /// integer decoder would make an f32 subnormal of it, and an FMA given one costs a
        /// microcode assist on Intel cores (a product over random codes ran 0.6 against
        /// 24 GB/s), so those blocks take the f16 route. Rounded weights have ~2 such codes
        /// per 128 × 128 tile: ~5 % of four rows' blocks.
        subnormal_blocks: Bytes,
    },
    /// FP4 e2m1 values two per byte (element 2j in the low nibble), one power-of-two scale per
    /// row per `block` columns, kept as its f32 exponent byte (e8m0, as in the checkpoint).
    Fp4 {
        packed: Bytes,
        exponents: Bytes,
        block: usize,
    },
}

impl Native {
    /// `weight` kept as stored, when every part has the same FP8 column block (or the same
    /// FP4 block with power-of-two scales); `None` otherwise (the caller widens it).
    pub(crate) fn of(weight: &WeightData<'_>) -> Option<Self> {
        let cols = weight.cols;
        let first = weight.parts.first()?.format;
        match first {
            WeightFormat::Fp8E4m3 { block } if block[1] > 0 && block[0] > 0 => {
                let nb = cols.div_ceil(block[1]);
                let mut values = super::huge_pages::reserve(weight.rows() * cols);
                let mut exponents = Vec::with_capacity(weight.rows() * nb);
                for p in &weight.parts {
                    let WeightFormat::Fp8E4m3 { block: b } = p.format else {
                        return None;
                    };
                    if b[1] != block[1] || b[0] == 0 {
                        return None;
                    }
                    for r in p.rows.clone() {
                        values.extend_from_slice(&p.bytes[r * cols..(r + 1) * cols]);
                        let tile = (r / b[0]) * nb;
                        for &s in &p.scales[tile..tile + nb] {
                            exponents.push(power_of_two_exponent(s)?);
                        }
                    }
                }
                let nan_free = values.iter().all(|&b| b & 0x7f != 0x7f);
                let subnormal_blocks = subnormal_blocks(&values, cols, block[1]);
                // Under 2 MiB, into a shared huge-page chunk (`arena`).
                Some(Native::Fp8 {
                    values: Bytes::pack(values),
                    exponents: Bytes::pack(exponents),
                    block: block[1],
                    nan_free,
                    subnormal_blocks: Bytes::pack(subnormal_blocks),
                })
            }
            WeightFormat::Fp4E2m1 { block } if block > 0 && block % 2 == 0 => {
                let nb = cols.div_ceil(block);
                let mut packed = super::huge_pages::reserve(weight.rows() * cols / 2);
                let mut exponents = Vec::with_capacity(weight.rows() * nb);
                for p in &weight.parts {
                    if p.format != first {
                        return None;
                    }
                    for r in p.rows.clone() {
                        packed.extend_from_slice(&p.bytes[r * cols / 2..(r + 1) * cols / 2]);
                        for &s in &p.scales[r * nb..(r + 1) * nb] {
                            exponents.push(power_of_two_exponent(s)?);
                        }
                    }
                }
                Some(Native::Fp4 {
                    packed: Bytes::pack(packed),
                    exponents: Bytes::pack(exponents),
                    block,
                })
            }
            _ => None,
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Native::Fp8 {
                values,
                exponents,
                subnormal_blocks,
                ..
            } => values.len() + exponents.len() + subnormal_blocks.len(),
            Native::Fp4 {
                packed, exponents, ..
            } => packed.len() + exponents.len(),
        }
    }

    /// Calls `f` on each buffer this matrix holds (values, then scales).
    pub(crate) fn for_each_buffer(&self, mut f: impl FnMut(&[u8])) {
        match self {
            Native::Fp8 {
                values,
                exponents,
                subnormal_blocks,
                ..
            } => {
                f(values);
                f(exponents);
                f(subnormal_blocks);
            }
            Native::Fp4 {
                packed, exponents, ..
            } => {
                f(packed);
                f(exponents);
            }
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            Native::Fp8 { .. } => "fp8_e4m3",
            Native::Fp4 { .. } => "fp4_e2m1",
        }
    }

    /// Row `r` (of `cols` values) decoded into `out[..cols]`.
    pub(crate) fn decode_row(&self, cols: usize, r: usize, out: &mut [f32]) {
        self.decode_row_with(Level::best(), cols, r, out);
    }

    /// [`Self::decode_row`] with the kernels of `level` at most.
    fn decode_row_with(&self, level: Level, cols: usize, r: usize, out: &mut [f32]) {
        let out = &mut out[..cols];
        match self {
            Native::Fp8 {
                values,
                exponents,
                block,
                ..
            } => {
                let nb = cols.div_ceil(*block);
                let row = &values[r * cols..(r + 1) * cols];
                let s = &exponents[r * nb..(r + 1) * nb];
                #[cfg(target_arch = "x86_64")]
                if level == Level::Avx512 && block.is_multiple_of(16) && cols.is_multiple_of(16) {
                    // SAFETY: AVX-512F (and F16C with it) detected; the row, scales and output
                    // have the lengths the kernel reads and writes.
                    unsafe { x86::fp8_row_avx512(row, s, *block, out) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if level >= Level::Avx2 && block.is_multiple_of(8) && cols.is_multiple_of(8) {
                    // SAFETY: AVX2 and F16C detected; lengths as above.
                    unsafe { x86::fp8_row_avx2(row, s, *block, out) };
                    return;
                }
                for (c, (o, &q)) in out.iter_mut().zip(row).enumerate() {
                    *o = e4m3_decode(q) * scale_of(s[c / block]);
                }
            }
            Native::Fp4 {
                packed,
                exponents,
                block,
            } => {
                let nb = cols.div_ceil(*block);
                let row = &packed[r * cols / 2..(r + 1) * cols / 2];
                let e = &exponents[r * nb..(r + 1) * nb];
                #[cfg(target_arch = "x86_64")]
                if level == Level::Avx512 && block.is_multiple_of(32) && cols.is_multiple_of(32) {
                    // SAFETY: AVX-512F detected; lengths as the kernel needs them.
                    unsafe { x86::fp4_row_avx512(row, e, *block, out) };
                    return;
                }
                #[cfg(target_arch = "x86_64")]
                if level >= Level::Avx2 && block.is_multiple_of(16) && cols.is_multiple_of(16) {
                    // SAFETY: AVX2 detected; lengths as the kernel needs them.
                    unsafe { x86::fp4_row_avx2(row, e, *block, out) };
                    return;
                }
                for (j, &byte) in row.iter().enumerate() {
                    let c = 2 * j;
                    out[c] = E2M1[(byte & 0x0f) as usize] * scale_of(e[c / block]);
                    out[c + 1] = E2M1[(byte >> 4) as usize] * scale_of(e[(c + 1) / block]);
                }
            }
        }
    }
}

impl Native {
    /// Whether [`Self::dot4`] has a fused kernel for rows `cols` wide on this CPU.
    pub(crate) fn fuses(&self, cols: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx512() {
            return match self {
                Native::Fp8 { block, .. } => block.is_multiple_of(16) && cols.is_multiple_of(16),
                Native::Fp4 { block, .. } => block.is_multiple_of(32) && cols.is_multiple_of(32),
            };
        }
        let _ = cols;
        false
    }

    /// An input (`cols` wide) as [`Self::dot4`] takes it: FP4's kernel takes each 32 values
    /// split into their even and odd elements; FP8's (without NaN codes) the values times
    /// 2¹²⁰ where that stays finite, since it decodes its weights 2¹²⁰ times small (made once
    /// per input, for every row it meets).
    pub(crate) fn fused_input<'x>(&self, cols: usize, x: &'x [f32]) -> FusedInput<'x> {
        #[cfg(target_arch = "x86_64")]
        if self.fuses(cols) && x.len() == cols {
            match self {
                Native::Fp4 { .. } => {
                    // SAFETY: AVX-512F detected (`fuses`); `cols` is a multiple of 32 (`fuses`).
                    let split = unsafe { x86::split_even_odd(x) };
                    return FusedInput::plain(Cow::Owned(split));
                }
                // |x| < 2⁷: x · 2¹²⁰ < 2¹²⁷ is finite, and each product w · x (|w| ≤ 448)
                // comes out of the kernel as the same f32 it would unscaled. A larger, infinite
                // or NaN value keeps the f16 decoder, which takes inputs as they are; so does a
                // thread whose host set denormals-are-zero (e4m3 subnormals decode to f32
                // subnormals on the integer route).
                Native::Fp8 { nan_free, .. }
                    if *nan_free
                        && x.iter().all(|v| v.abs() < 128.0)
                        && !x86::denormals_are_zero() =>
                {
                    let up = f32::from_bits((127 + x86::FP8_SMALL_EXP) << 23);
                    return FusedInput {
                        values: Cow::Owned(x.iter().map(|v| v * up).collect()),
                        unscaled: Some(x),
                    };
                }
                _ => {}
            }
        }
        let _ = cols;
        FusedInput::plain(Cow::Borrowed(x))
    }

    /// Dot products of an input (`cols` wide, as [`Self::fused_input`] made it) with rows
    /// `j..j + 4`, decoding in registers (no buffer): `None` where no fused kernel applies
    /// (no AVX-512, a block or width not a multiple of the vector), and the caller decodes
    /// rows instead.
    pub(crate) fn dot4(&self, cols: usize, j: usize, input: &FusedInput<'_>) -> Option<[f32; 4]> {
        let x = &input.values[..];
        #[cfg(target_arch = "x86_64")]
        if x86::has_avx512() && x.len() == cols {
            match self {
                Native::Fp8 {
                    values,
                    exponents,
                    block,
                    nan_free,
                    subnormal_blocks,
                } if block.is_multiple_of(16) && cols.is_multiple_of(16) => {
                    let nb = cols.div_ceil(*block);
                    let rows = values.get(j * cols..(j + 4) * cols)?;
                    let exps = exponents.get(j * nb..(j + 4) * nb)?;
                    // SAFETY: AVX-512F/AVX2/F16C detected; four rows of `cols` values and their
                    // `nb` exponents each, `x` of `cols`.
                    // `unscaled`: `x` is the input times 2¹²⁰ and `nan_free` holds
                    // (`fused_input`); the bitmap covers every row's blocks (`of`).
                    return Some(unsafe {
                        if let Some(plain) = input.unscaled {
                            let small = x86::SmallRoute {
                                plain,
                                subnormal_blocks,
                                first_bit: j * nb,
                            };
                            x86::dot4_fp8_avx512::<{ x86::FP8_SMALL }>(
                                x,
                                rows,
                                exps,
                                *block,
                                Some(&small),
                            )
                        } else if *nan_free {
                            x86::dot4_fp8_avx512::<{ x86::FP8_F16 }>(x, rows, exps, *block, None)
                        } else {
                            x86::dot4_fp8_avx512::<{ x86::FP8_F16_NAN }>(
                                x, rows, exps, *block, None,
                            )
                        }
                    });
                }
                Native::Fp4 {
                    packed,
                    exponents,
                    block,
                } if block.is_multiple_of(32) && cols.is_multiple_of(32) => {
                    let nb = cols.div_ceil(*block);
                    let rows = packed.get(j * cols / 2..(j + 4) * cols / 2)?;
                    let exps = exponents.get(j * nb..(j + 4) * nb)?;
                    // SAFETY: as above, with packed rows of `cols / 2` bytes; `x` split by
                    // `fused_input`.
                    return Some(unsafe { x86::dot4_fp4_avx512(x, rows, exps, *block) });
                }
                _ => {}
            }
        }
        let _ = (cols, j, x);
        None
    }
}

/// An input as the fused one-input kernels take it ([`Native::fused_input`]).
pub(crate) struct FusedInput<'x> {
    values: Cow<'x, [f32]>,
    /// The input as given, where `values` is it times 2¹²⁰ (FP8's integer decoder; the
    /// blocks with subnormal codes take the f16 route, which reads it).
    unscaled: Option<&'x [f32]>,
}

impl<'x> FusedInput<'x> {
    fn plain(values: Cow<'x, [f32]>) -> Self {
        Self {
            values,
            unscaled: None,
        }
    }
}

/// [`Native::Fp8`]'s `subnormal_blocks` for `values` (`cols` a row, column blocks of `block`).
fn subnormal_blocks(values: &[u8], cols: usize, block: usize) -> Vec<u8> {
    let nb = cols.div_ceil(block);
    let rows = values.len().checked_div(cols).unwrap_or(0);
    let mut bits = vec![0u8; (rows * nb).div_ceil(8)];
    for (r, row) in values.chunks_exact(cols.max(1)).enumerate() {
        for (b, codes) in row.chunks(block).enumerate() {
            // A fold, not `any`: no early exit, so it vectorises (every byte of a checkpoint
            // passes here at load).
            let subnormal = codes
                .iter()
                .fold(false, |seen, &c| seen | (c & 0x78 == 0 && c & 0x07 != 0));
            if subnormal {
                let i = r * nb + b;
                bits[i / 8] |= 1 << (i % 8);
            }
        }
    }
    bits
}

impl Native {
    /// Whether [`Self::dot_rows`] has a kernel for rows `cols` wide on this CPU.
    pub(crate) fn pairs(&self, cols: usize) -> bool {
        // The kernels need what the fused one-input kernels do; FP4's takes 1 × 32 blocks
        // (the official format's) only.
        match self {
            Native::Fp8 { .. } => self.fuses(cols),
            Native::Fp4 { block, .. } => *block == 32 && self.fuses(cols),
        }
    }

    /// The inputs as [`Self::dot_rows`] takes them: interleaved once for the product (FP4's
    /// each split into even and odd elements first, as its kernels pair them with a byte's
    /// two nibbles).
    pub(crate) fn paired_inputs(&self, cols: usize, inputs: &[&[f32]]) -> Interleaved {
        if matches!(self, Native::Fp4 { .. }) {
            let split: Vec<FusedInput<'_>> = inputs
                .iter()
                .map(|x| self.fused_input(cols, &x[..cols]))
                .collect();
            let split: Vec<&[f32]> = split.iter().map(|x| &x.values[..]).collect();
            return Interleaved::new(&split, cols);
        }
        Interleaved::new(inputs, cols)
    }

    /// Dot products of every input (`cols` wide, interleaved once for the product) with rows
    /// `j0..j1` (an even count): `out[(j - j0) · inputs + input]`. Each row is decoded in
    /// registers once for up to eight inputs, two rows at a time. `None` where
    /// [`Self::pairs`] is false (the caller decodes rows instead).
    pub(crate) fn dot_rows(
        &self,
        cols: usize,
        (j0, j1): (usize, usize),
        inputs: &Interleaved,
        out: &mut [f32],
    ) -> Option<()> {
        #[cfg(target_arch = "x86_64")]
        if let Native::Fp8 {
            values,
            exponents,
            block,
            nan_free,
            ..
        } = self
        {
            if !self.pairs(cols) || !(j1 - j0).is_multiple_of(2) {
                return None;
            }
            let nb = cols.div_ceil(*block);
            values.get(j0 * cols..j1 * cols)?;
            exponents.get(j0 * nb..j1 * nb)?;
            inputs.for_pairs((j0, j1), out, |j, n, xi| {
                let rows = &values[j * cols..(j + 2) * cols];
                let exps = &exponents[j * nb..(j + 2) * nb];
                // SAFETY (both arms): AVX-512F/VL, AVX2 and F16C detected (`pairs`); `xi`
                // holds `n` inputs of `cols` floats interleaved by 16, `rows` two rows of
                // `cols` bytes and `exps` their `nb` exponents each; `cols` and `block` are
                // multiples of 16 (`pairs`).
                unsafe {
                    if *nan_free {
                        by_inputs!(
                            n,
                            x86::dot2xn_fp8_avx512,
                            [false],
                            (xi, cols, rows, exps, *block)
                        )
                    } else {
                        by_inputs!(
                            n,
                            x86::dot2xn_fp8_avx512,
                            [true],
                            (xi, cols, rows, exps, *block)
                        )
                    }
                }
            });
            return Some(());
        }
        #[cfg(target_arch = "x86_64")]
        if let Native::Fp4 {
            packed, exponents, ..
        } = self
        {
            if !self.pairs(cols) || !(j1 - j0).is_multiple_of(2) {
                return None;
            }
            let (half, nb) = (cols / 2, cols / 32);
            packed.get(j0 * half..j1 * half)?;
            exponents.get(j0 * nb..j1 * nb)?;
            inputs.for_pairs((j0, j1), out, |j, n, xi| {
                let rows = &packed[j * half..(j + 2) * half];
                let exps = &exponents[j * nb..(j + 2) * nb];
                // SAFETY: AVX-512F/VL detected (`pairs`); `xi` holds `n` inputs of `cols`
                // floats split into even and odd elements per 32 and interleaved by 16
                // (`paired_inputs`), `rows` two packed rows of `cols / 2` bytes and `exps`
                // their `cols / 32` exponents each; `cols` is a multiple of 32 (`pairs`).
                unsafe { by_inputs!(n, x86::dot2xn_fp4_avx512, [], (xi, cols, rows, exps)) }
            });
            return Some(());
        }
        let _ = (cols, j0, j1, inputs, out);
        None
    }
}

/// The decoders this CPU has, best last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Portable,
    Avx2,
    Avx512,
}

impl Level {
    fn best() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            if x86::has_avx512() {
                return Level::Avx512;
            }
            if x86::has_avx2() {
                return Level::Avx2;
            }
        }
        Level::Portable
    }
}

/// The f32 exponent byte of a positive normal power of two (an e8m0 scale), else `None`.
fn power_of_two_exponent(s: f32) -> Option<u8> {
    let bits = s.to_bits();
    let e = (bits >> 23) as u8;
    (bits & 0x807f_ffff == 0 && e != 0 && e != 255).then_some(e)
}

/// The scale an exponent byte stands for: 2^(e − 127).
pub(super) fn scale_of(e: u8) -> f32 {
    f32::from_bits(u32::from(e) << 23)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    pub use super::super::gemv::x86::split_even_odd;
    use super::super::gemv::x86::{prefetch_base, prefetch_lines};
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// AVX2 with F16C (the f16 conversions the FP8 decoder uses).
    pub fn has_avx2() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    /// FP8 e4m3fn → f32 eight at a time, as [`fp8_row_avx512`] does with 256-bit vectors.
    ///
    /// # Safety
    /// AVX2 and F16C available; `row.len() == out.len()`, a multiple of 8, and `block` a
    /// multiple of 8 with `exponents` holding one per block.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn fp8_row_avx2(row: &[u8], exponents: &[u8], block: usize, out: &mut [f32]) {
        assert!(row.len() == out.len() && row.len().is_multiple_of(8));
        assert!(exponents.len() >= row.len().div_ceil(block));
        let low7 = _mm_set1_epi16(0x7f);
        let sign = _mm_set1_epi16(0x80);
        let nan_in = _mm_set1_epi16(0x7f << 7);
        let nan_out = _mm_set1_epi16(0x7e00);
        let mut c = 0;
        while c < row.len() {
            let s = _mm256_set1_ps(super::scale_of(exponents[c / block]) * 256.0);
            // SAFETY: c + 8 <= len for both slices (lengths asserted, c steps by 8).
            unsafe {
                let b = _mm_loadl_epi64(row.as_ptr().add(c).cast());
                let h = _mm_cvtepu8_epi16(b);
                let mag = _mm_slli_epi16(_mm_and_si128(h, low7), 7);
                let sgn = _mm_slli_epi16(_mm_and_si128(h, sign), 8);
                let nan = _mm_cmpeq_epi16(mag, nan_in);
                let f16 = _mm_blendv_epi8(_mm_or_si128(mag, sgn), nan_out, nan);
                let v = _mm256_mul_ps(_mm256_cvtph_ps(f16), s);
                _mm256_storeu_ps(out.as_mut_ptr().add(c), v);
            }
            c += 8;
        }
    }

    /// FP4 e2m1 → f32 sixteen at a time: the magnitude from an 8-entry table (`vpermps`), the
    /// nibble's bit 3 as the sign, low and high nibbles interleaved back into order.
    ///
    /// # Safety
    /// AVX2 available; `out.len() == 2 * row.len()`, a multiple of 16, `block` a multiple of
    /// 16 with `exponents` holding one per block.
    #[target_feature(enable = "avx2")]
    pub unsafe fn fp4_row_avx2(row: &[u8], exponents: &[u8], block: usize, out: &mut [f32]) {
        assert!(out.len() == 2 * row.len() && out.len().is_multiple_of(16));
        assert!(exponents.len() >= out.len().div_ceil(block));
        // SAFETY: E2M1's first 8 entries are the magnitudes.
        let table = unsafe { _mm256_loadu_ps(super::E2M1.as_ptr()) };
        let seven = _mm256_set1_epi32(7);
        let eight = _mm256_set1_epi32(8);
        let value = |nib: __m256i| {
            let mag = _mm256_permutevar8x32_ps(table, _mm256_and_si256(nib, seven));
            let sign = _mm256_slli_epi32(_mm256_and_si256(nib, eight), 28);
            _mm256_xor_ps(mag, _mm256_castsi256_ps(sign))
        };
        let mut c = 0;
        while c < out.len() {
            let s = _mm256_set1_ps(super::scale_of(exponents[c / block]));
            // SAFETY: the 8 bytes at c / 2 and the 16 floats at c are in bounds (lengths
            // asserted, c steps by 16).
            unsafe {
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.as_ptr().add(c / 2).cast()));
                let lo = value(b);
                let hi = value(_mm256_srli_epi32(b, 4));
                let (a, z) = (_mm256_unpacklo_ps(lo, hi), _mm256_unpackhi_ps(lo, hi));
                let first = _mm256_permute2f128_ps(a, z, 0x20);
                let second = _mm256_permute2f128_ps(a, z, 0x31);
                _mm256_storeu_ps(out.as_mut_ptr().add(c), _mm256_mul_ps(first, s));
                _mm256_storeu_ps(out.as_mut_ptr().add(c + 8), _mm256_mul_ps(second, s));
            }
            c += 16;
        }
    }

    /// AVX-512F and VL with AVX2 and F16C (every AVX-512 CPU since Skylake-X has them).
    pub fn has_avx512() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    /// FP8 e4m3fn → f32 sixteen at a time, through f16: the e4m3 bits moved into an f16's
    /// (sign to bit 15, exponent and mantissa shifted up 7) are that value times 2⁻⁸ — f16
    /// subnormals included, which `vcvtph2ps` converts exactly — so one multiply by the
    /// block's scale × 2⁸ finishes it. 0x7F / 0xFF (NaN) become an f16 NaN.
    ///
    /// # Safety
    /// AVX-512F and VL, AVX2 and F16C available; `row.len() == out.len()`, a multiple of 16, and
    /// `block` a multiple of 16 with `exponents` holding one per block.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub unsafe fn fp8_row_avx512(row: &[u8], exponents: &[u8], block: usize, out: &mut [f32]) {
        assert!(row.len() == out.len() && row.len().is_multiple_of(16));
        assert!(exponents.len() >= row.len().div_ceil(block));
        // Callers decode consecutive rows (gemv four at a time, gemm a block): the row four
        // further on, `PREFETCH_LEAD` past it, a line per 64 bytes (wasted for an embedding row).
        let ahead = prefetch_base(row.as_ptr(), 4 * row.len());
        let mut c = 0;
        while c < row.len() {
            if c % 64 == 0 {
                prefetch_lines::<1>(ahead, c);
            }
            let s = _mm512_set1_ps(super::scale_of(exponents[c / block]) * 256.0);
            // SAFETY: c + 16 <= len for both slices (lengths asserted, c steps by 16).
            unsafe {
                let v = _mm512_mul_ps(fp8x16::<true>(row.as_ptr().add(c)), s);
                _mm512_storeu_ps(out.as_mut_ptr().add(c), v);
            }
            c += 16;
        }
    }

    /// Sixteen FP8 bytes at `p` as f32 times 2⁻⁸ (see [`fp8_row_avx512`]); `NAN`: NaN codes
    /// become NaN (else they read as 480: callers know there are none).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    unsafe fn fp8x16<const NAN: bool>(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let b = unsafe { _mm_loadu_si128(p.cast()) };
        if !NAN {
            // Sign-extended, shifted up 7: the sign lands in bit 15 and the byte's bit 7 in
            // bit 14, which the mask clears (an e4m3 magnitude never reaches f16's top
            // exponent bit).
            let h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
            let f16 = _mm256_and_si256(h, _mm256_set1_epi16(0xbfffu16 as i16));
            return _mm512_cvtph_ps(f16);
        }
        let h = _mm256_cvtepu8_epi16(b);
        let mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
        let sgn = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
        let nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f << 7));
        let f16 = _mm256_blendv_epi8(_mm256_or_si256(mag, sgn), _mm256_set1_epi16(0x7e00), nan);
        _mm512_cvtph_ps(f16)
    }

    /// Whether this thread's MXCSR has denormals-are-zero set (a host may set it on the
    /// threads it creates ours from).
    pub fn denormals_are_zero() -> bool {
        let mut csr = 0u32;
        // SAFETY: `stmxcsr` stores the 4-byte control/status register at the given address,
        // a live local; it changes no state.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
        }
        csr & (1 << 6) != 0
    }

    /// How small [`fp8x16_small`] decodes: 2^-`FP8_SMALL_EXP`.
    pub const FP8_SMALL_EXP: u32 = 120;

    /// Sixteen FP8 bytes at `p` as f32 times 2⁻¹²⁰, in integer operations only: the byte
    /// sign-extended to 32 bits and shifted up 20 puts its sign in bit 31 and its exponent and
    /// mantissa in the f32's low exponent and high mantissa bits (the mask clears the sign's
    /// copies between); an e4m3 subnormal becomes the f32 subnormal of the same scaled value.
    /// Three integer operations where the f16 route takes a conversion as well (~20 % faster
    /// a product on Zen 4); NaN codes read as 480 · 2⁻¹²⁰ (callers know there are none).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn fp8x16_small(p: *const u8) -> __m512 {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let b = unsafe { _mm_loadu_si128(p.cast()) };
        let s = _mm512_slli_epi32(_mm512_cvtepi8_epi32(b), 20);
        _mm512_castsi512_ps(_mm512_and_si512(
            s,
            _mm512_set1_epi32(0x87f0_0000u32 as i32),
        ))
    }

    /// [`dot4_fp8_avx512`]'s decoders: the f16 route, the f16 route with NaN codes, and
    /// [`fp8x16_small`] (the input times 2¹²⁰).
    pub const FP8_F16: u8 = 0;
    pub const FP8_F16_NAN: u8 = 1;
    pub const FP8_SMALL: u8 = 2;

    /// What [`dot4_fp8_avx512`]'s integer route ([`FP8_SMALL`]) needs besides the scaled
    /// input: the input as given and which blocks hold e4m3 subnormals, which it decodes
    /// through f16 instead (an f32 subnormal into an FMA costs a microcode assist on Intel).
    pub struct SmallRoute<'a> {
        pub plain: &'a [f32],
        /// [`super::Native::Fp8`]'s bitmap: bit `r · nb + b` for row `r`, block `b`.
        pub subnormal_blocks: &'a [u8],
        /// The first of the four rows' bit for block 0 (`j · nb`).
        pub first_bit: usize,
    }

    impl SmallRoute<'_> {
        /// Whether any of the four rows has a subnormal code in block `b` (of `nb`).
        pub fn has_subnormal(&self, nb: usize, b: usize) -> bool {
            (0..4).any(|r| {
                let i = self.first_bit + r * nb + b;
                self.subnormal_blocks[i / 8] >> (i % 8) & 1 != 0
            })
        }
    }

    /// Dot products of `x` with four FP8 rows decoded in registers: per column block, four
    /// partial sums, then each times its row's scale. `DECODE`: [`FP8_F16`],
    /// [`FP8_F16_NAN`] or [`FP8_SMALL`] — the last with `x` the input times 2¹²⁰, rows
    /// without NaN codes and `small` given: each product then the same f32 as the f16
    /// routes' times 2⁸ (save products under 2⁻¹¹⁸, f32 subnormals on the f16 routes), and
    /// a block with a subnormal code taken by the f16 route on `small.plain`, so the results
    /// are the f16 route's bit for bit.
    ///
    /// # Safety
    /// AVX-512F and VL, AVX2 and F16C available; `rows` holds 4 rows of `x.len()` bytes (a multiple
    /// of 16), `exps` 4 rows of `x.len().div_ceil(block)`, `block` a multiple of 16; for
    /// [`FP8_SMALL`], `small` with `plain` as long as `x`.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub unsafe fn dot4_fp8_avx512<const DECODE: u8>(
        x: &[f32],
        rows: &[u8],
        exps: &[u8],
        block: usize,
        small: Option<&SmallRoute<'_>>,
    ) -> [f32; 4] {
        let k = x.len();
        let nb = k.div_ceil(block);
        assert!(rows.len() >= 4 * k && exps.len() >= 4 * nb && k.is_multiple_of(16));
        let small = (DECODE == FP8_SMALL).then(|| small.expect("the small route's blocks"));
        if let Some(s) = small {
            assert!(s.plain.len() == k && s.subnormal_blocks.len() * 8 >= s.first_bit + 4 * nb);
        }
        let mut acc = [_mm512_setzero_ps(); 4];
        // A step reads 4 rows × 16 bytes: one line of the next rows.
        let ahead = prefetch_base(rows.as_ptr(), 4 * k);
        for b in 0..nb {
            let span = (b * block, ((b + 1) * block).min(k));
            // The f16 routes' values are 2⁻⁸ small; the small route's products are the input's.
            // SAFETY: `span` lies in 0..k, a multiple of 16; `rows` holds 4 rows of k.
            let (part, unit) = unsafe {
                match small {
                    None if DECODE == FP8_F16_NAN => {
                        (block_sums::<FP8_F16_NAN>(x, rows, span, ahead), 256.0)
                    }
                    None => (block_sums::<FP8_F16>(x, rows, span, ahead), 256.0),
                    Some(s) if s.has_subnormal(nb, b) => {
                        (block_sums::<FP8_F16>(s.plain, rows, span, ahead), 256.0)
                    }
                    Some(_) => (block_sums::<FP8_SMALL>(x, rows, span, ahead), 1.0),
                }
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let s = _mm512_set1_ps(super::scale_of(exps[r * nb + b]) * unit);
                *a = _mm512_fmadd_ps(part[r], s, *a);
            }
        }
        super::super::gemv::x86::reduce4_512(acc)
    }

    /// [`dot4_fp8_avx512`]'s sums over columns `span.0..span.1` of its four rows, decoded by
    /// `DECODE`.
    ///
    /// # Safety
    /// As [`dot4_fp8_avx512`]'s, with `span` within `0..x.len()` in steps of 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    unsafe fn block_sums<const DECODE: u8>(
        x: &[f32],
        rows: &[u8],
        (from, to): (usize, usize),
        ahead: Option<*const u8>,
    ) -> [__m512; 4] {
        let k = x.len();
        let mut part = [_mm512_setzero_ps(); 4];
        let mut c = from;
        while c < to {
            prefetch_lines::<1>(ahead, 4 * c);
            // SAFETY: c + 16 <= k; row r spans rows[r·k .. (r+1)·k].
            unsafe {
                let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                for (r, p) in part.iter_mut().enumerate() {
                    let at = rows.as_ptr().add(r * k + c);
                    let w = match DECODE {
                        FP8_SMALL => fp8x16_small(at),
                        FP8_F16_NAN => fp8x16::<true>(at),
                        _ => fp8x16::<false>(at),
                    };
                    *p = _mm512_fmadd_ps(w, xv, *p);
                }
            }
            c += 16;
        }
        part
    }

    /// Dot products of `N` inputs with two FP8 rows (`k` columns each, back to back in
    /// `rows`): `out[input][row]`. Each 16 columns of a row are decoded in registers and scaled
    /// once for all `N` inputs (a batch's decode step) instead of being written to a buffer and
    /// read back. Scaling by a power of two is exact and the sums are formed in the order the
    /// decoded-row kernel (`dot4x4_avx512`) forms them, so the results are bit for bit its.
    /// The inputs come interleaved (`paired::Interleaved`): one pointer walks all of them, so the
    /// loop's 2·`N` sums stay in registers (with a pointer per input the compiler ran out of
    /// general registers and kept three sums on the stack: 38 cycles per 16 columns instead
    /// of ~20).
    ///
    /// # Safety
    /// AVX-512F and VL, AVX2 and F16C available; `xi` holds `N` inputs of `k` floats (a multiple of
    /// 16) interleaved by 16, `rows` 2 rows of `k` bytes, `exps` 2 rows of
    /// `k.div_ceil(block)`, `block` a multiple of 16.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    pub unsafe fn dot2xn_fp8_avx512<const N: usize, const NAN: bool>(
        xi: &[f32],
        k: usize,
        rows: &[u8],
        exps: &[u8],
        block: usize,
    ) -> [[f32; 2]; N] {
        let nb = k.div_ceil(block);
        assert!(xi.len() >= N * k);
        assert!(rows.len() >= 2 * k && exps.len() >= 2 * nb);
        assert!(k.is_multiple_of(16) && block.is_multiple_of(16));
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        // Two steps read 2 rows × 32 bytes: one line of the next pair of rows.
        let ahead = prefetch_base(rows.as_ptr(), 2 * k);
        let (r0, r1) = (rows.as_ptr(), rows.as_ptr().wrapping_add(k));
        let xp = xi.as_ptr();
        let scale =
            |r: usize, c: usize| _mm512_set1_ps(super::scale_of(exps[r * nb + c / block]) * 256.0);
        let (mut s0, mut s1) = (scale(0, 0), scale(1, 0));
        let mut next_block = block;
        for c in (0..k).step_by(16) {
            if c == next_block {
                (s0, s1) = (scale(0, c), scale(1, c));
                next_block += block;
            }
            if c.is_multiple_of(32) {
                prefetch_lines::<1>(ahead, 2 * c);
            }
            // SAFETY: c + 16 <= k; row r spans rows[r·k .. (r+1)·k]; the 16-column chunk
            // c / 16 of `xi` is N × 16 floats at N · c.
            unsafe {
                let w0 = _mm512_mul_ps(fp8x16::<NAN>(r0.add(c)), s0);
                let w1 = _mm512_mul_ps(fp8x16::<NAN>(r1.add(c)), s1);
                let x = xp.add(N * c);
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(x.add(16 * i));
                    a[0] = _mm512_fmadd_ps(xv, w0, a[0]);
                    a[1] = _mm512_fmadd_ps(xv, w1, a[1]);
                }
            }
        }
        acc.map(|a| [_mm512_reduce_add_ps(a[0]), _mm512_reduce_add_ps(a[1])])
    }

    /// Dot products of `N` inputs with two FP4 rows of 1 × 32 blocks (`k` columns each, back
    /// to back in `rows`, two per byte): `out[input][row]`. Each 32 columns of a row are
    /// decoded in registers once for all `N` inputs, and the sums are formed as the
    /// one-input kernel (`dot4_fp4_block32`) forms them, so the results are bit for bit its.
    ///
    /// # Safety
    /// AVX-512F and VL available; `xi` holds `N` inputs of `k` floats (a multiple of 32), each
    /// split into even and odd elements per 32 and interleaved by 16 (`paired_inputs`),
    /// `rows` 2 rows of `k / 2` bytes, `exps` 2 rows of `k / 32`.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot2xn_fp4_avx512<const N: usize>(
        xi: &[f32],
        k: usize,
        rows: &[u8],
        exps: &[u8],
    ) -> [[f32; 2]; N] {
        let (half, nb) = (k / 2, k / 32);
        assert!(xi.len() >= N * k && k.is_multiple_of(32));
        assert!(rows.len() >= 2 * half && exps.len() >= 2 * nb);
        // SAFETY: E2M1 has 16 f32s.
        let table = unsafe { _mm512_loadu_ps(super::E2M1.as_ptr()) };
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        // Two steps read 2 rows × 32 bytes: one line of the next pair of rows.
        let ahead = prefetch_base(rows.as_ptr(), k);
        let (r0, r1) = (rows.as_ptr(), rows.as_ptr().wrapping_add(half));
        let xp = xi.as_ptr();
        for t in 0..nb {
            let c = 32 * t;
            if t.is_multiple_of(2) {
                prefetch_lines::<1>(ahead, c);
            }
            let s0 = _mm512_set1_ps(super::scale_of(exps[t]));
            let s1 = _mm512_set1_ps(super::scale_of(exps[nb + t]));
            // SAFETY: c + 32 <= k; packed row r spans rows[r·k/2 .. (r+1)·k/2]; the columns
            // c..c + 32 of `xi` are N × 16 even elements, then N × 16 odd ones, at N · c.
            unsafe {
                let (lo0, hi0) = fp4x32(r0.add(c / 2), table);
                let (lo1, hi1) = fp4x32(r1.add(c / 2), table);
                let x = xp.add(N * c);
                for (i, a) in acc.iter_mut().enumerate() {
                    let xe = _mm512_loadu_ps(x.add(16 * i));
                    let xo = _mm512_loadu_ps(x.add(16 * (N + i)));
                    let t0 = _mm512_fmadd_ps(lo0, xe, _mm512_mul_ps(hi0, xo));
                    a[0] = _mm512_fmadd_ps(t0, s0, a[0]);
                    let t1 = _mm512_fmadd_ps(lo1, xe, _mm512_mul_ps(hi1, xo));
                    a[1] = _mm512_fmadd_ps(t1, s1, a[1]);
                }
            }
        }
        acc.map(|a| [_mm512_reduce_add_ps(a[0]), _mm512_reduce_add_ps(a[1])])
    }

    /// Sixteen packed FP4 bytes at `p` as f32 through `table` (E2M1): the low nibbles (16
    /// even elements) and the high ones (16 odd elements).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn fp4x32(p: *const u8, table: __m512) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 16 readable bytes at `p`.
        let v = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.cast()) });
        // `vpermps` reads only an index's low 4 bits: the low nibble needs no mask.
        let lo = _mm512_permutexvar_ps(v, table);
        let hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        (lo, hi)
    }

    /// The even and odd elements of 32 values of an input split by [`split_even_odd`].
    ///
    /// # Safety
    /// AVX-512F and VL available; 32 readable f32s at `p`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn even_odd(p: *const f32) -> (__m512, __m512) {
        // SAFETY: the caller guarantees 32 readable f32s at `p`.
        unsafe { (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))) }
    }

    /// Dot products of `x` with four FP4 rows decoded in registers. The low nibbles of 16
    /// bytes are 16 even elements, the high ones the odd: `x` comes split the same way
    /// ([`split_even_odd`]), so no decoded value needs reordering.
    ///
    /// # Safety
    /// AVX-512F and VL available; `x` split by [`split_even_odd`]; `rows` holds 4 packed rows of
    /// `x.len() / 2` bytes (`x.len()` a multiple of 32), `exps` 4 rows of
    /// `x.len().div_ceil(block)`, `block` a multiple of 32.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot4_fp4_avx512(x: &[f32], rows: &[u8], exps: &[u8], block: usize) -> [f32; 4] {
        let k = x.len();
        let nb = k.div_ceil(block);
        assert!(rows.len() >= 2 * k && exps.len() >= 4 * nb && k.is_multiple_of(32));
        if block == 32 {
            // SAFETY: as this function's (asserted above).
            return unsafe { dot4_fp4_block32(x, rows, exps) };
        }
        // SAFETY: E2M1 has 16 f32s.
        let table = unsafe { _mm512_loadu_ps(super::E2M1.as_ptr()) };
        let half = k / 2;
        let mut acc = [_mm512_setzero_ps(); 4];
        // A step reads 4 rows × 16 bytes: one line of the next rows.
        let ahead = prefetch_base(rows.as_ptr(), 2 * k);
        for b in 0..nb {
            let mut part = [_mm512_setzero_ps(); 4];
            let mut c = b * block;
            while c < ((b + 1) * block).min(k) {
                prefetch_lines::<1>(ahead, 2 * c);
                // SAFETY: c + 32 <= k; packed row r spans rows[r·k/2 .. (r+1)·k/2].
                unsafe {
                    let (xe, xo) = even_odd(x.as_ptr().add(c));
                    for (r, p) in part.iter_mut().enumerate() {
                        let (lo, hi) = fp4x32(rows.as_ptr().add(r * half + c / 2), table);
                        *p = _mm512_fmadd_ps(lo, xe, *p);
                        *p = _mm512_fmadd_ps(hi, xo, *p);
                    }
                }
                c += 32;
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let s = _mm512_set1_ps(super::scale_of(exps[r * nb + b]));
                *a = _mm512_fmadd_ps(part[r], s, *a);
            }
        }
        super::super::gemv::x86::reduce4_512(acc)
    }

    /// [`dot4_fp4_avx512`] for the official format's 32-wide scale blocks, where a block is
    /// one step of 32 columns: the scales of 16 blocks at a time are made in one vector (the
    /// e8m0 byte shifted into an f32's exponent field is 2^(e − 127)) and stored, and each
    /// step broadcasts its own from memory (a load, where picking a vector's lane took a
    /// shuffle: the kernel is bound by shuffles, 4 a row a step with the decode); each step's
    /// even and odd products are summed and scaled into the row's accumulator at once.
    ///
    /// # Safety
    /// AVX-512F and VL available; `x` split by [`split_even_odd`], its length a multiple of 32;
    /// `rows` 4 packed rows of `x.len() / 2` bytes, `exps` 4 rows of `x.len() / 32`.
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn dot4_fp4_block32(x: &[f32], rows: &[u8], exps: &[u8]) -> [f32; 4] {
        let k = x.len();
        let nb = k / 32;
        let half = k / 2;
        assert!(rows.len() >= 2 * k && exps.len() >= 4 * nb && k.is_multiple_of(32));
        // SAFETY: E2M1 has 16 f32s.
        let table = unsafe { _mm512_loadu_ps(super::E2M1.as_ptr()) };
        let mut acc = [_mm512_setzero_ps(); 4];
        // A step reads 4 rows × 16 bytes: one line of the next rows.
        let ahead = prefetch_base(rows.as_ptr(), 2 * k);
        let mut b = 0;
        while b < nb {
            let n = (nb - b).min(16);
            let mut scales = [[0f32; 16]; 4];
            for (r, s) in scales.iter_mut().enumerate() {
                // The row's next `n` exponents, read 16 (or 8) bytes at a time where `exps`
                // has them (lanes past `n` are never used): a copy of a variable length is a
                // `memcpy` call, which had cost short rows a third of their time (a 1024 ×
                // 256 product 21 → 14.5 µs).
                let at = r * nb + b;
                // SAFETY: the loads read `exps[at..at + 16]` or `exps[at..at + 8]`, inside
                // `exps` (checked); `e` is 16 bytes, `s` 16 f32s.
                unsafe {
                    let raw = if at + 16 <= exps.len() {
                        _mm_loadu_si128(exps.as_ptr().add(at).cast())
                    } else if n <= 8 && at + 8 <= exps.len() {
                        _mm_loadl_epi64(exps.as_ptr().add(at).cast())
                    } else {
                        let mut e = [0u8; 16];
                        e[..n].copy_from_slice(&exps[at..at + n]);
                        _mm_loadu_si128(e.as_ptr().cast())
                    };
                    let v = _mm512_cvtepu8_epi32(raw);
                    let v = _mm512_castsi512_ps(_mm512_slli_epi32(v, 23));
                    _mm512_storeu_ps(s.as_mut_ptr(), v);
                }
            }
            // `j` is the step's column block and its scale's index in every row's 16.
            #[allow(clippy::needless_range_loop)]
            for j in 0..n {
                let c = (b + j) * 32;
                prefetch_lines::<1>(ahead, 2 * c);
                // SAFETY: c + 32 <= k; packed row r spans rows[r·k/2 .. (r+1)·k/2].
                unsafe {
                    let (xe, xo) = even_odd(x.as_ptr().add(c));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let (lo, hi) = fp4x32(rows.as_ptr().add(r * half + c / 2), table);
                        let t = _mm512_fmadd_ps(lo, xe, _mm512_mul_ps(hi, xo));
                        *a = _mm512_fmadd_ps(t, _mm512_set1_ps(scales[r][j]), *a);
                    }
                }
            }
            b += n;
        }
        super::super::gemv::x86::reduce4_512(acc)
    }

    /// FP4 e2m1 → f32 thirty-two at a time: a 16-entry table in one register
    /// (`vpermps`), low nibbles are the even elements, high nibbles the odd ones.
    ///
    /// # Safety
    /// AVX-512F and VL available; `out.len() == 2 * row.len()`, a multiple of 32, `block` a
    /// multiple of 32 with `exponents` holding one per block.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn fp4_row_avx512(row: &[u8], exponents: &[u8], block: usize, out: &mut [f32]) {
        assert!(out.len() == 2 * row.len() && out.len().is_multiple_of(32));
        assert!(exponents.len() >= out.len().div_ceil(block));
        // SAFETY: E2M1 has 16 f32s.
        let table = unsafe { _mm512_loadu_ps(super::E2M1.as_ptr()) };
        let even = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        let odd = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        // Callers decode consecutive rows (gemv four at a time, gemm a block): the row four
        // further on, `PREFETCH_LEAD` past it, a line per 64 bytes (wasted for an embedding row).
        let ahead = prefetch_base(row.as_ptr(), 4 * row.len());
        let mut c = 0;
        while c < out.len() {
            if c % 128 == 0 {
                prefetch_lines::<1>(ahead, c / 2);
            }
            let s = _mm512_set1_ps(super::scale_of(exponents[c / block]));
            // SAFETY: the 16 bytes at c / 2 and the 32 floats at c are in bounds (lengths
            // asserted, c steps by 32).
            unsafe {
                let (lo, hi) = fp4x32(row.as_ptr().add(c / 2), table);
                let first = _mm512_permutex2var_ps(lo, even, hi);
                let second = _mm512_permutex2var_ps(lo, odd, hi);
                _mm512_storeu_ps(out.as_mut_ptr().add(c), _mm512_mul_ps(first, s));
                _mm512_storeu_ps(out.as_mut_ptr().add(c + 16), _mm512_mul_ps(second, s));
            }
            c += 32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::weights::WeightData;

    /// Every FP8 byte and FP4 nibble, with ragged scales, decodes to what the checkpoint
    /// decoder (`WeightData::to_f32`) gives, on the SIMD path and the portable one.
    #[test]
    fn native_rows_decode_to_the_checkpoint_values() {
        let (rows, cols) = (6, 512);
        let fp8: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 256) as u8).collect();
        // 2 × 128 tiles: 3 × 4 power-of-two scales (e8m0).
        let scales: Vec<f32> = (0..12).map(|i| 2f32.powi(i - 6)).collect();
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [2, 128] },
            &fp8,
            scales,
            rows,
            cols,
        );
        let fp4: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 91 % 256) as u8).collect();
        let exps: Vec<f32> = (0..rows * cols / 32)
            .map(|i| 2f32.powi(i as i32 % 9 - 4))
            .collect();
        let w4 = WeightData::whole(WeightFormat::Fp4E2m1 { block: 32 }, &fp4, exps, rows, cols);
        for weight in [w, w4] {
            let want = weight.to_f32();
            let native = Native::of(&weight).expect("kept native");
            let mut got = vec![0.0f32; cols];
            for level in [
                Level::best(),
                Level::Avx2.min(Level::best()),
                Level::Portable,
            ] {
                for r in 0..rows {
                    native.decode_row_with(level, cols, r, &mut got);
                    for c in 0..cols {
                        let (a, b) = (got[c], want[r * cols + c]);
                        assert!(
                            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                            "{} {level:?} row {r} col {c}: {a} vs {b}",
                            native.name()
                        );
                    }
                }
            }
        }
    }

    /// The matrix-vector kernels (a few input rows, four weight rows decoded at a time, a
    /// ragged last quad) and the blocked GEMM on native matrices give the products of the
    /// checkpoint's decoded values.
    #[test]
    fn products_with_native_matrices_match_the_decoded_values() {
        // 640 columns: 20 FP4 blocks of 32, so the 32-wide kernel makes its scales 16 blocks
        // at a time and then 4; 256 (an expert's down projection) and 96: rows whose scales
        // the kernel reads 8 bytes at a time, or copies, at the end of its four rows.
        for k in [640, 256, 96] {
            native_products_match_the_decoded_values(k);
        }
    }

    fn native_products_match_the_decoded_values(k: usize) {
        use super::super::gemm::{gemm_into, Strided};
        use super::super::gemv::gemv_into;
        use super::super::{CpuMatrix, MatrixData};
        let out = 37;
        let fp8: Vec<u8> = (0..out * k)
            .map(|i| (i * 53 % 256) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0x38 } else { b })
            .collect();
        let s8: Vec<f32> = (0..out.div_ceil(16) * k.div_ceil(128))
            .map(|i| 2f32.powi(i as i32 % 5 - 2))
            .collect();
        let fp4: Vec<u8> = (0..out * k / 2).map(|i| (i * 29 % 256) as u8).collect();
        let s4: Vec<f32> = (0..out * k / 32)
            .map(|i| 2f32.powi(i as i32 % 7 - 3))
            .collect();
        // A fused projection stored in two formats: FP8 rows 0..20, then bf16 rows.
        let bf16: Vec<u8> = (0..out * k)
            .flat_map(|i| half::bf16::from_f32((i as f32 * 0.013).sin()).to_le_bytes())
            .collect();
        let mut stacked = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [16, 128] },
            &fp8,
            s8.clone(),
            out,
            k,
        );
        stacked.parts[0].rows = 0..20;
        stacked.parts.push(crate::backend::weights::WeightPart {
            format: WeightFormat::Bf16,
            bytes: &bf16,
            scales: Vec::new(),
            stored_rows: out,
            rows: 20..out,
        });
        let weights = [
            WeightData::whole(WeightFormat::Fp8E4m3 { block: [16, 128] }, &fp8, s8, out, k),
            WeightData::whole(WeightFormat::Fp4E2m1 { block: 32 }, &fp4, s4, out, k),
            stacked,
        ];
        let cpu = super::super::CpuBackend::new(2).unwrap();
        let at = |stride| Strided {
            offset: 0,
            row_stride: stride,
        };
        for weight in weights {
            let w = weight.to_f32();
            let m =
                crate::backend::Backend::matrix(&cpu, &weight, crate::backend::Precision::Native)
                    .unwrap();
            assert!(matches!(
                (&m.data, weight.parts.len()),
                (MatrixData::Native(_), 1) | (MatrixData::Stacked(_), 2)
            ));
            let m: CpuMatrix = m;
            // 2-16 inputs: the paired kernels (9 and 16 in two passes); 40: the GEMM.
            for rows in [1, 2, 3, 4, 5, 9, 16, 40] {
                let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let mut y = vec![0.0f32; rows * out];
                if rows <= super::super::gemv::MAX_ROWS {
                    gemv_into(&x, at(k), rows, &m, 0..out, &mut y, at(out));
                } else {
                    gemm_into(&x, at(k), rows, &m, 0..out, &mut y, at(out));
                }
                for r in 0..rows {
                    for j in 0..out {
                        let terms =
                            (0..k).map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i]));
                        let exact: f64 = terms.clone().sum();
                        // f32 accumulation: error bounded by the terms' magnitude (FP8 values
                        // reach 448 × the scale, and the sums cancel).
                        let size: f64 = terms.map(f64::abs).sum();
                        let got = f64::from(y[r * out + j]);
                        assert!(
                            (got - exact).abs() <= 1e-5 * size + 1e-6,
                            "k {k}, rows {rows}: [{r}, {j}] {got} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    /// The one-input FP8 kernel decodes in integer operations when every input value is under
    /// 2⁷ (the input scaled by 2¹²⁰ instead), and through f16 otherwise, and on the integer
    /// route the blocks holding subnormal codes through f16 too: every code but NaN under
    /// scales from 2⁻⁶ to 2⁴ gives the exact products either way, the integer route the f16
    /// route's results bit for bit, and the bitmap marks exactly the subnormal blocks.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn one_input_fp8_products_are_exact_on_both_decoders() {
        if !x86::has_avx512() {
            eprintln!("skipped: this CPU has no AVX-512 (the fused kernels need it)");
            return;
        }
        let (out, k) = (4, 512);
        // Every code but 0x7F / 0xFF, each row in a different order; subnormal codes (0x01 ..
        // 0x07, 0x81 .. 0x87) only in row 1's block 1 and row 3's block 3, so blocks 0 and
        // 2 take the integer route and 1 and 3 the f16 route.
        let codes: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
        let normal: Vec<u8> = codes
            .iter()
            .copied()
            .filter(|b| b & 0x78 != 0 || b & 0x07 == 0)
            .collect();
        let fp8: Vec<u8> = (0..out * k)
            .map(|i| {
                let (r, b) = (i / k, i % k / 128);
                let set = if (r, b) == (1, 1) || (r, b) == (3, 3) {
                    &codes
                } else {
                    &normal
                };
                set[(i * 37 + r * 11) % set.len()]
            })
            .collect();
        let scales: Vec<f32> = (0..out * k / 128)
            .map(|i| 2f32.powi(i as i32 % 11 - 6))
            .collect();
        let weight = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [1, 128] },
            &fp8,
            scales,
            out,
            k,
        );
        let w = weight.to_f32();
        let native = Native::of(&weight).unwrap();
        let Native::Fp8 {
            subnormal_blocks, ..
        } = &native
        else {
            unreachable!()
        };
        // Bits r · 4 + b: (1, 1) is bit 5, (3, 3) bit 15.
        assert_eq!(&subnormal_blocks[..], &[1 << 5, 1 << 7]);
        let route = x86::SmallRoute {
            plain: &[],
            subnormal_blocks,
            first_bit: 0,
        };
        let f16_blocks: Vec<bool> = (0..4).map(|b| route.has_subnormal(4, b)).collect();
        assert_eq!(f16_blocks, [false, true, false, true]);
        let small: Vec<f32> = (0..k).map(|i| (i as f32 * 0.61).sin() * 127.0).collect();
        let mut large = small.clone();
        large[300] = 128.0;
        for (x, scaled) in [(&small, true), (&large, false)] {
            let input = native.fused_input(k, x);
            assert_eq!(input.unscaled.is_some(), scaled, "max |x| {}", x[300]);
            let got = native.dot4(k, 0, &input).unwrap();
            for (r, &got) in got.iter().enumerate() {
                let terms = (0..k).map(|i| f64::from(x[i]) * f64::from(w[r * k + i]));
                let exact: f64 = terms.clone().sum();
                let size: f64 = terms.map(f64::abs).sum();
                assert!(
                    (f64::from(got) - exact).abs() <= 1e-6 * size,
                    "row {r}, scaled {scaled}: {got} vs {exact}"
                );
            }
            if scaled {
                let Native::Fp8 {
                    values, exponents, ..
                } = &native
                else {
                    unreachable!()
                };
                // SAFETY: AVX-512 detected; 4 rows of k bytes and k / 128 exponents each.
                let f16 = unsafe {
                    x86::dot4_fp8_avx512::<{ x86::FP8_F16 }>(x, values, exponents, 128, None)
                };
                assert_eq!(got.map(f32::to_bits), f16.map(f32::to_bits));
            }
        }
    }

    /// The paired FP8 kernel gives bit for bit what the kernel over decoded rows gives, for
    /// every number of inputs it takes at once.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn paired_fp8_products_equal_the_decoded_row_kernel() {
        let (out, k) = (4, 384);
        let fp8: Vec<u8> = (0..out * k)
            .map(|i| (i * 97 % 256) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0x41 } else { b })
            .collect();
        let scales: Vec<f32> = (0..3).map(|i| 2f32.powi(i - 1)).collect();
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &fp8,
            scales,
            out,
            k,
        );
        let native = Native::of(&w).unwrap();
        if !native.pairs(k) {
            println!("skipped: no AVX-512 on this CPU, so there is no paired kernel to compare");
            return;
        }
        let mut decoded = vec![0.0f32; out * k];
        for (r, row) in decoded.chunks_exact_mut(k).enumerate() {
            native.decode_row(k, r, row);
        }
        let xs: Vec<Vec<f32>> = (0..12)
            .map(|n| {
                (0..k)
                    .map(|i| ((i * 3 + n * 11) as f32 * 0.21).cos())
                    .collect()
            })
            .collect();
        for n in 1..=xs.len() {
            let inputs: Vec<&[f32]> = xs[..n].iter().map(Vec::as_slice).collect();
            let mut got = vec![0.0f32; 2 * n];
            let il = Interleaved::new(&inputs, k);
            native.dot_rows(k, (2, 4), &il, &mut got).unwrap();
            for i in 0..n {
                let g = [got[i], got[n + i]];
                let four = [inputs[i], inputs[i], inputs[i], inputs[i]];
                let quad = super::super::gemv::Rows4::F32(&decoded);
                // SAFETY: `pairs` found AVX-512F; each input and decoded row has k floats.
                let want = unsafe { super::super::gemv::x86::dot4x4_avx512(four, quad, k, false) };
                assert_eq!(
                    g[0].to_bits(),
                    want[0][2].to_bits(),
                    "{n} inputs, input {i}"
                );
                assert_eq!(
                    g[1].to_bits(),
                    want[0][3].to_bits(),
                    "{n} inputs, input {i}"
                );
            }
        }
    }

    /// The paired FP4 kernel gives bit for bit what the fused one-input kernel gives, for
    /// every number of inputs it takes at once (two chunks past eight).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn paired_fp4_products_equal_the_one_input_kernel() {
        let (out, k) = (6, 640);
        let fp4: Vec<u8> = (0..out * k / 2).map(|i| (i * 29 % 256) as u8).collect();
        let s4: Vec<f32> = (0..out * k / 32)
            .map(|i| 2f32.powi(i as i32 % 7 - 3))
            .collect();
        let w = WeightData::whole(WeightFormat::Fp4E2m1 { block: 32 }, &fp4, s4, out, k);
        let native = Native::of(&w).unwrap();
        if !native.pairs(k) {
            println!("skipped: no AVX-512 on this CPU, so there is no paired kernel to compare");
            return;
        }
        let xs: Vec<Vec<f32>> = (0..11)
            .map(|n| {
                (0..k)
                    .map(|i| ((i * 5 + n * 13) as f32 * 0.17).sin())
                    .collect()
            })
            .collect();
        for n in 1..=xs.len() {
            let inputs: Vec<&[f32]> = xs[..n].iter().map(Vec::as_slice).collect();
            let mut got = vec![f32::NAN; 4 * n];
            let il = native.paired_inputs(k, &inputs);
            native.dot_rows(k, (2, 6), &il, &mut got).unwrap();
            for (i, x) in inputs.iter().enumerate() {
                let want = native.dot4(k, 2, &native.fused_input(k, x)).unwrap();
                for (r, want) in want.iter().enumerate() {
                    assert_eq!(
                        got[r * n + i].to_bits(),
                        want.to_bits(),
                        "{n} inputs, input {i}, row {}",
                        2 + r
                    );
                }
            }
        }
    }

    /// A NaN code in an FP8 matrix (the loader would flag it, but the kernels must not turn
    /// it into a number) makes exactly its row's products NaN, fused or decoded.
    #[test]
    fn a_nan_weight_makes_its_row_nan_on_every_path() {
        use super::super::gemm::Strided;
        use super::super::gemv::gemv_into;
        use super::super::{CpuMatrix, MatrixData};
        let (out, k) = (4, 128);
        let mut fp8 = vec![0x38u8; out * k]; // 1.0
        fp8[2 * k + 5] = 0xff;
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &fp8,
            vec![1.0],
            out,
            k,
        );
        let native = Native::of(&w).unwrap();
        assert!(matches!(
            native,
            Native::Fp8 {
                nan_free: false,
                ..
            }
        ));
        let m = CpuMatrix {
            rows: out,
            cols: k,
            data: MatrixData::Native(native),
        };
        let at = |stride| Strided {
            offset: 0,
            row_stride: stride,
        };
        for rows in [1, 5] {
            let x = vec![1.0f32; rows * k];
            let mut y = vec![0.0f32; rows * out];
            gemv_into(&x, at(k), rows, &m, 0..out, &mut y, at(out));
            for r in 0..rows {
                for j in 0..out {
                    let v = y[r * out + j];
                    assert!(
                        if j == 2 { v.is_nan() } else { v == 128.0 },
                        "rows {rows}: {v}"
                    );
                }
            }
        }
    }

    #[test]
    fn scales_that_are_not_powers_of_two_are_widened_instead() {
        let fp8 = vec![0x38u8; 16];
        let w = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &fp8,
            vec![0.3],
            1,
            16,
        );
        assert!(Native::of(&w).is_none());
        let fp4 = vec![0x21u8; 16];
        let w = WeightData::whole(WeightFormat::Fp4E2m1 { block: 32 }, &fp4, vec![0.3], 1, 32);
        assert!(Native::of(&w).is_none());
        assert_eq!(power_of_two_exponent(0.25), Some(125));
        assert_eq!(power_of_two_exponent(-0.25), None);
        assert_eq!(scale_of(125), 0.25);
    }
}
