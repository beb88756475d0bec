//! Matrix products for a few rows (decode steps): weight rows are streamed once (four or two at
//! a time, or for one input one after another) and dotted with every input row while they sit
//! in L1, so these bandwidth-bound products run at memory speed. The kernels use AVX-512 or
//! AVX2+FMA when the CPU has them (detected at run time); bf16 weights are widened in
//! registers.

use std::ops::Range;
use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use super::gemm::Strided;
use super::paired::{by_inputs, Interleaved};
use super::{CpuMatrix, MatrixData};

/// Products with at most this many input rows take this path.
pub(super) const MAX_ROWS: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Simd {
    Avx512,
    Avx2,
    Portable,
}

fn simd() -> Simd {
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // AVX-512VL too: with it the compiler may use all 32 vector registers in a
            // kernel that also has 256-bit operations (without it, it kept accumulators on
            // the stack rather than use zmm16-31 there). Every AVX-512 CPU since Skylake-X
            // has it.
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Simd::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Simd::Avx2;
            }
        }
        Simd::Portable
    })
}

/// Whether the AVX-512 kernels run on this CPU (AVX-512F and VL, detected once).
pub(super) fn has_avx512() -> bool {
    simd() == Simd::Avx512
}

/// Four weight rows of one matrix, as stored.
#[derive(Clone, Copy)]
pub(super) enum Rows4<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// The dot products of `x` with four consecutive weight rows of length `x.len()`;
/// `prefetch`: `w` lies in a matrix whose next rows follow it (not a padded or decoded buffer).
fn dot4(level: Simd, x: &[f32], w: Rows4, prefetch: bool) -> [f32; 4] {
    match (level, w) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected at run time; the slices hold 4 rows of x.len().
        (Simd::Avx512, Rows4::F32(w)) => unsafe { x86::dot4_f32_avx512(x, w, prefetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Simd::Avx512, Rows4::Bf16(w)) => unsafe { x86::dot4_bf16_avx512(x, w, prefetch) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA were detected at run time; the slice holds 4 rows of x.len().
        (Simd::Avx2, Rows4::F32(w)) => unsafe { x86::dot4_f32_avx2(x, w) },
        (_, w) => dot4_portable(x, w),
    }
}

fn dot4_portable(x: &[f32], w: Rows4) -> [f32; 4] {
    let k = x.len();
    let mut out = [0.0f32; 4];
    for (r, o) in out.iter_mut().enumerate() {
        // Eight partial sums per row let the compiler vectorise without reassociating.
        let mut acc = [0.0f32; 8];
        for i in 0..k {
            let wv = match w {
                Rows4::F32(v) => v[r * k + i],
                Rows4::Bf16(v) => v[r * k + i].to_f32(),
            };
            acc[i % 8] += x[i] * wv;
        }
        *o = acc.iter().sum();
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// How far past the next four rows the kernels that stream weight rows (and the FP8/FP4
    /// row decoders) prefetch, in bytes.
    const PREFETCH_LEAD: usize = 4096;

    /// Four rows up to this many bytes are prefetched: the hardware prefetcher, which starts
    /// again at every 4 KiB page, keeps too few lines in flight for rows that short (the
    /// model's matrices of 256–1024 columns streamed at half the rate of an 8192 × 4096 one),
    /// while longer rows are four pages streamed at once, which it handles, and prefetching
    /// their next rows would only evict the current ones from L1.
    const PREFETCH_CHUNK: usize = 8 << 10;

    /// Where a kernel over the four rows at `rows` (`chunk` bytes) prefetches from, if it
    /// does: the next four rows' bytes, [`PREFETCH_LEAD`] further on. Past a matrix's end it
    /// points at whatever follows, which a prefetch may name (it never faults).
    #[inline(always)]
    pub(in crate::backend::cpu) fn prefetch_base(
        rows: *const u8,
        chunk: usize,
    ) -> Option<*const u8> {
        (chunk <= PREFETCH_CHUNK).then(|| rows.wrapping_add(chunk + PREFETCH_LEAD))
    }

    /// Prefetches `N` consecutive cache lines `at` bytes past `p` (if any) into L1: the
    /// kernels call this once per step with that step's share of the next four rows'
    /// bytes [`PREFETCH_LEAD`] further on, so in a stream of calls every call's rows were
    /// requested by the calls before it.
    #[inline(always)]
    pub(in crate::backend::cpu) fn prefetch_lines<const N: usize>(p: Option<*const u8>, at: usize) {
        let Some(p) = p else { return };
        let p = p.wrapping_add(at);
        for i in 0..N {
            // SAFETY: a prefetch is a hint that never faults and reads nothing the program
            // sees, so any address will do.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * i).cast()) };
        }
    }

    /// Horizontal sums of four vectors.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(in crate::backend::cpu) fn reduce4_512(a: [__m512; 4]) -> [f32; 4] {
        [
            _mm512_reduce_add_ps(a[0]),
            _mm512_reduce_add_ps(a[1]),
            _mm512_reduce_add_ps(a[2]),
            _mm512_reduce_add_ps(a[3]),
        ]
    }

    /// # Safety
    /// AVX-512F and VL available; `w` holds 4 rows of `x.len()` floats.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot4_f32_avx512(x: &[f32], w: &[f32], prefetch: bool) -> [f32; 4] {
        let k = x.len();
        assert!(w.len() >= 4 * k);
        let mut acc = [_mm512_setzero_ps(); 4];
        // A step reads 4 rows × 64 bytes: as many of the next rows' lines.
        let ahead = prefetch_base(w.as_ptr().cast(), 16 * k).filter(|_| prefetch);
        let mut i = 0;
        while i + 16 <= k {
            prefetch_lines::<4>(ahead, 16 * i);
            // SAFETY: i + 16 <= k, and row r spans w[r·k .. (r+1)·k].
            unsafe {
                let xv = _mm512_loadu_ps(x.as_ptr().add(i));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w.as_ptr().add(r * k + i)), *a);
                }
            }
            i += 16;
        }
        let mut out = reduce4_512(acc);
        for (r, o) in out.iter_mut().enumerate() {
            *o += (i..k).map(|j| x[j] * w[r * k + j]).sum::<f32>();
        }
        out
    }

    /// # Safety
    /// AVX-512F and VL available; `w` holds 4 rows of `x.len()` bf16 values.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot4_bf16_avx512(x: &[f32], w: &[bf16], prefetch: bool) -> [f32; 4] {
        let k = x.len();
        assert!(w.len() >= 4 * k);
        let mut acc = [_mm512_setzero_ps(); 4];
        // 32 weights per load: as 32-bit lanes, a lane's low bf16 (an even element) shifted up
        // and its high bf16 (the odd one) masked are both f32 already, so they pair with x's
        // even and odd elements (split once per 32 for all four rows) instead of being
        // widened one by one: 5 instructions per 32 weights instead of 8.
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        // A step reads 4 rows × 64 bytes: as many of the next rows' lines.
        let ahead = prefetch_base(w.as_ptr().cast(), 8 * k).filter(|_| prefetch);
        let mut i = 0;
        while i + 32 <= k {
            prefetch_lines::<4>(ahead, 8 * i);
            // SAFETY: i + 32 <= k; a bf16 is a u16, 32 of them are one 512-bit load within row r.
            unsafe {
                let (x0, x1) = (
                    _mm512_loadu_ps(x.as_ptr().add(i)),
                    _mm512_loadu_ps(x.as_ptr().add(i + 16)),
                );
                let xe = _mm512_permutex2var_ps(x0, evens, x1);
                let xo = _mm512_permutex2var_ps(x0, odds, x1);
                for (r, a) in acc.iter_mut().enumerate() {
                    let raw = _mm512_loadu_si512(w.as_ptr().add(r * k + i).cast());
                    let lo = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                    let hi = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
                    *a = _mm512_fmadd_ps(xe, lo, *a);
                    *a = _mm512_fmadd_ps(xo, hi, *a);
                }
            }
            i += 32;
        }
        while i + 16 <= k {
            prefetch_lines::<2>(ahead, 8 * i);
            // SAFETY: i + 16 <= k; a bf16 is a u16, 16 of them are one 256-bit load within row r.
            unsafe {
                let xv = _mm512_loadu_ps(x.as_ptr().add(i));
                for (r, a) in acc.iter_mut().enumerate() {
                    let raw = _mm256_loadu_si256(w.as_ptr().add(r * k + i).cast());
                    let wv =
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)));
                    *a = _mm512_fmadd_ps(xv, wv, *a);
                }
            }
            i += 16;
        }
        let mut out = reduce4_512(acc);
        for (r, o) in out.iter_mut().enumerate() {
            *o += (i..k).map(|j| x[j] * w[r * k + j].to_f32()).sum::<f32>();
        }
        out
    }

    /// `x` with each 32 values as their 16 even elements then their 16 odd ones (the last
    /// `x.len() % 32` dropped): how the FP4 kernels take their input (the order in which 16
    /// packed bytes' low and high nibbles decode) and [`dot_rows_bf16_avx512`] (the order in
    /// which a 32-bit lane's low and high bf16 widen), split once per input for every row it
    /// meets (`vpermt2ps` twice per 32 columns, which the kernels would otherwise pay for every
    /// row or four).
    #[target_feature(enable = "avx512f,avx512vl")]
    pub fn split_even_odd(x: &[f32]) -> Vec<f32> {
        let evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let mut out = vec![0.0f32; x.len() / 32 * 32];
        for (o, c) in out.chunks_exact_mut(32).zip(x.chunks_exact(32)) {
            // SAFETY: `c` holds 32 floats and `o` room for 32.
            unsafe {
                let (x0, x1) = (
                    _mm512_loadu_ps(c.as_ptr()),
                    _mm512_loadu_ps(c.as_ptr().add(16)),
                );
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_permutex2var_ps(x0, evens, x1));
                _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_permutex2var_ps(x0, odds, x1));
            }
        }
        out
    }

    /// How far ahead (in values: 2 KiB) the one-row-at-a-time kernels below prefetch their
    /// rows. The hardware prefetcher alone kept too few lines in flight on an Intel Xeon
    /// (AMX-era VM, two threads): the bf16 kernel alone read at 0.59-0.61 of the
    /// plain read's rate, 0.85-0.92 with this (1 KiB ahead 0.80-0.87, 4 KiB alike); the f32
    /// one 0.69 -> 0.72-0.80. Decode b1 of the bench's FP8 model 167-181 -> 197-216 tok/s.
    const PREFETCH_BF16: usize = 1024;
    /// The f32 kernel's distance (2 KiB of f32), one prefetch per 64-byte line.
    const PREFETCH_F32: usize = 512;

    /// Dot products of one input with consecutive bf16 rows, one row after another: `out[t]`
    /// is row `t` of `rows` (`out.len()` rows of `x.len()` values) with `x`; `split` is `x`
    /// through [`split_even_odd`]. Rows taken one at a time make the matrix one sequential
    /// stream, which the hardware prefetcher follows at the plain read's rate: four rows read
    /// side by side are four streams of a row's length, too short for it (rows of 2 KiB: 26
    /// GB/s unaided, ~37 with software prefetch, against ~50 for one stream, two threads). A
    /// row's 32-column steps alternate between two pairs of sums (its even and odd columns),
    /// so no sum waits on the FMA before it.
    ///
    /// # Safety
    /// AVX-512F and VL available.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot_rows_bf16_avx512(x: &[f32], split: &[f32], rows: &[bf16], out: &mut [f32]) {
        let k = x.len();
        let k32 = k / 32 * 32;
        assert!(split.len() == k32 && rows.len() >= out.len() * k);
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let xs = split.as_ptr();
        for (t, o) in out.iter_mut().enumerate() {
            let row = &rows[t * k..(t + 1) * k];
            let r = row.as_ptr();
            let mut a = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            // SAFETY: every load is within the row's first k32 values and `split`'s k32.
            unsafe {
                let half = |a: &mut [__m512], i: usize| {
                    // A hint: it never faults, past the matrix's end included.
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(i + PREFETCH_BF16).cast());
                    let raw = _mm512_loadu_si512(r.add(i).cast());
                    let lo = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw));
                    let hi = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
                    a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xs.add(i)), lo, a[0]);
                    a[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xs.add(i + 16)), hi, a[1]);
                };
                while i + 64 <= k32 {
                    half(&mut a[..2], i);
                    half(&mut a[2..], i + 32);
                    i += 64;
                }
                if i < k32 {
                    half(&mut a[..2], i);
                }
            }
            *o = sum4(a) + (k32..k).map(|j| x[j] * row[j].to_f32()).sum::<f32>();
        }
    }

    /// The sum of a row's four partial sums' lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    fn sum4(a: [__m512; 4]) -> f32 {
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(a[0], a[1]),
            _mm512_add_ps(a[2], a[3]),
        ))
    }

    /// [`dot_rows_bf16_avx512`] for f32 rows: `out[t]` is row `t` of `rows` (`out.len()` rows
    /// of `x.len()` values) with `x`, each row's 16-column steps alternating between four sums.
    ///
    /// # Safety
    /// AVX-512F and VL available.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot_rows_f32_avx512(x: &[f32], rows: &[f32], out: &mut [f32]) {
        let k = x.len();
        let k16 = k / 16 * 16;
        assert!(rows.len() >= out.len() * k);
        let xp = x.as_ptr();
        for (t, o) in out.iter_mut().enumerate() {
            let row = &rows[t * k..(t + 1) * k];
            let r = row.as_ptr();
            let mut a = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            // SAFETY: every load is within the row's and `x`'s first k16 values.
            unsafe {
                while i + 64 <= k16 {
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(i + PREFETCH_F32).cast());
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(i + PREFETCH_F32 + 16).cast());
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(i + PREFETCH_F32 + 32).cast());
                    _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(i + PREFETCH_F32 + 48).cast());
                    for (q, a) in a.iter_mut().enumerate() {
                        let c = i + 16 * q;
                        *a = _mm512_fmadd_ps(
                            _mm512_loadu_ps(xp.add(c)),
                            _mm512_loadu_ps(r.add(c)),
                            *a,
                        );
                    }
                    i += 64;
                }
                let mut q = 0;
                while i < k16 {
                    a[q] = _mm512_fmadd_ps(
                        _mm512_loadu_ps(xp.add(i)),
                        _mm512_loadu_ps(r.add(i)),
                        a[q],
                    );
                    (i, q) = (i + 16, q + 1);
                }
            }
            *o = sum4(a) + (k16..k).map(|j| x[j] * row[j]).sum::<f32>();
        }
    }

    /// Loads 16 weights of row `r` at column `i` as f32.
    ///
    /// # Safety
    /// AVX-512F and VL available; `i + 16 <= k` and `w` holds 4 rows of `k` values.
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn load16(w: super::Rows4, k: usize, r: usize, i: usize) -> __m512 {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            match w {
                super::Rows4::F32(v) => _mm512_loadu_ps(v.as_ptr().add(r * k + i)),
                super::Rows4::Bf16(v) => {
                    let raw = _mm256_loadu_si256(v.as_ptr().add(r * k + i).cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
                }
            }
        }
    }

    /// Dot products of four inputs with four weight rows: `out[input][row]`.
    ///
    /// # Safety
    /// AVX-512F and VL available; every input has `k` floats and `w` holds 4 rows of `k` values.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot4x4_avx512(
        x: [&[f32]; 4],
        w: super::Rows4,
        k: usize,
        prefetch: bool,
    ) -> [[f32; 4]; 4] {
        assert!(x.iter().all(|xi| xi.len() >= k));
        assert!(match w {
            super::Rows4::F32(v) => v.len() >= 4 * k,
            super::Rows4::Bf16(v) => v.len() >= 4 * k,
        });
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        // A step reads 4 rows × 16 values: 4 lines of the next rows (f32), or 2 (bf16).
        let (base, size): (*const u8, usize) = match w {
            super::Rows4::F32(v) => (v.as_ptr().cast(), 4),
            super::Rows4::Bf16(v) => (v.as_ptr().cast(), 2),
        };
        let ahead = prefetch_base(base, 4 * k * size).filter(|_| prefetch);
        let mut i = 0;
        while i + 16 <= k {
            if size == 4 {
                prefetch_lines::<4>(ahead, 16 * i);
            } else {
                prefetch_lines::<2>(ahead, 8 * i);
            }
            // SAFETY: i + 16 <= k for every load; the bounds are asserted above.
            unsafe {
                let wv = [
                    load16(w, k, 0, i),
                    load16(w, k, 1, i),
                    load16(w, k, 2, i),
                    load16(w, k, 3, i),
                ];
                for (xi, acc_i) in x.iter().zip(acc.iter_mut()) {
                    let xv = _mm512_loadu_ps(xi.as_ptr().add(i));
                    for (a, &wr) in acc_i.iter_mut().zip(&wv) {
                        *a = _mm512_fmadd_ps(xv, wr, *a);
                    }
                }
            }
            i += 16;
        }
        let mut out = [[0.0f32; 4]; 4];
        for (xi_n, (xi, acc_i)) in x.iter().zip(&acc).enumerate() {
            out[xi_n] = reduce4_512(*acc_i);
            for (r, o) in out[xi_n].iter_mut().enumerate() {
                *o += (i..k)
                    .map(|j| {
                        xi[j]
                            * match w {
                                super::Rows4::F32(v) => v[r * k + j],
                                super::Rows4::Bf16(v) => v[r * k + j].to_f32(),
                            }
                    })
                    .sum::<f32>();
            }
        }
        out
    }

    /// Dot products of `N` inputs with two bf16 rows (`k` columns each, back to back in
    /// `rows`): `out[input][row]`, each 16 weights widened in registers once for all `N`
    /// inputs (a batch's decode step). The sums are formed in the order
    /// [`dot4x4_avx512`] forms them, so the results are bit for bit its.
    ///
    /// # Safety
    /// AVX-512F and VL available; `xi` holds `N` inputs of `k` floats (a multiple of 16)
    /// interleaved by 16 (`paired::Interleaved`) and `rows` 2 rows of `k` values.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn dot2xn_bf16_avx512<const N: usize>(
        xi: &[f32],
        k: usize,
        rows: &[bf16],
    ) -> [[f32; 2]; N] {
        assert!(xi.len() >= N * k && rows.len() >= 2 * k && k.is_multiple_of(16));
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        // A step reads 2 rows × 32 bytes: one line of the next pair of rows.
        let ahead = prefetch_base(rows.as_ptr().cast(), 4 * k);
        let (r0, r1) = (rows.as_ptr(), rows.as_ptr().wrapping_add(k));
        let xp = xi.as_ptr();
        for c in (0..k).step_by(16) {
            prefetch_lines::<1>(ahead, 4 * c);
            // SAFETY: c + 16 <= k; row r spans rows[r·k .. (r+1)·k] (a bf16 is a u16: 16 of
            // them are one 256-bit load); the 16-column chunk c / 16 of `xi` is N × 16 floats
            // at N · c.
            unsafe {
                let widen = |p: *const bf16| {
                    let raw = _mm256_loadu_si256(p.cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
                };
                let (w0, w1) = (widen(r0.add(c)), widen(r1.add(c)));
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

    /// `out[h, c] = Σ_j p[h, j] · v[j, c]` for four heads at a time.
    ///
    /// # Safety
    /// AVX-512F and VL available; `heads % 4 == 0`, `width % 16 == 0`, `p` is `[heads, n]`, `v` is
    /// `[n, width]` and `out` is `[heads, width]`.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn weighted_rows_avx512(
        p: &[f32],
        heads: usize,
        n: usize,
        v: &[f32],
        width: usize,
        out: &mut [f32],
    ) {
        assert!(heads.is_multiple_of(4) && width.is_multiple_of(16));
        assert!(p.len() >= heads * n && v.len() >= n * width && out.len() >= heads * width);
        // Four heads by four 16-column chunks per key: the four weights broadcast once serve
        // 16 FMAs (one chunk at a time, a key's 4 weights and its row were 5 loads for 4 FMAs:
        // load-bound). Every output still sums its keys in order, so the bits do not depend
        // on how columns are grouped.
        for h0 in (0..heads).step_by(4) {
            let mut c = 0;
            while c + 64 <= width {
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for j in 0..n {
                    let w = [0, 1, 2, 3].map(|t| _mm512_set1_ps(p[(h0 + t) * n + j]));
                    for (u, row) in acc.iter_mut().enumerate() {
                        // SAFETY: c + 64 <= width and j < n, so the load is inside `v`.
                        let vv = unsafe { _mm512_loadu_ps(v.as_ptr().add(j * width + c + 16 * u)) };
                        for (a, &wt) in row.iter_mut().zip(&w) {
                            *a = _mm512_fmadd_ps(wt, vv, *a);
                        }
                    }
                }
                for (u, row) in acc.iter().enumerate() {
                    for (t, a) in row.iter().enumerate() {
                        // SAFETY: (h0 + t) < heads and c + 64 <= width: inside `out`.
                        unsafe {
                            _mm512_storeu_ps(
                                out.as_mut_ptr().add((h0 + t) * width + c + 16 * u),
                                *a,
                            )
                        };
                    }
                }
                c += 64;
            }
            while c < width {
                let mut acc = [_mm512_setzero_ps(); 4];
                for j in 0..n {
                    // SAFETY: c + 16 <= width and j < n, so the load is inside `v`.
                    let vv = unsafe { _mm512_loadu_ps(v.as_ptr().add(j * width + c)) };
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(p[(h0 + t) * n + j]), vv, *a);
                    }
                }
                for (t, a) in acc.iter().enumerate() {
                    // SAFETY: (h0 + t) < heads and c + 16 <= width, so the store is inside `out`.
                    unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((h0 + t) * width + c), *a) };
                }
                c += 16;
            }
        }
    }

    /// # Safety
    /// AVX2 and FMA available; `w` holds 4 rows of `x.len()` floats.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4_f32_avx2(x: &[f32], w: &[f32]) -> [f32; 4] {
        let k = x.len();
        assert!(w.len() >= 4 * k);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= k {
            // SAFETY: i + 8 <= k, and row r spans w[r·k .. (r+1)·k].
            unsafe {
                let xv = _mm256_loadu_ps(x.as_ptr().add(i));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w.as_ptr().add(r * k + i)), *a);
                }
            }
            i += 8;
        }
        let mut out = [0.0f32; 4];
        for (r, o) in out.iter_mut().enumerate() {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
            *o = lanes.iter().sum::<f32>() + (i..k).map(|j| x[j] * w[r * k + j]).sum::<f32>();
        }
        out
    }
}

/// Attention scores of one query: `out[h·n + j] = q_h · key_j` for `heads` query heads of
/// width `dim` and `n` contiguous keys.
pub(super) fn attention_scores(
    q: &[f32],
    heads: usize,
    dim: usize,
    keys: &[f32],
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd() == Simd::Avx512 && heads.is_multiple_of(4) {
        let mut padded = Vec::new();
        for j0 in (0..n).step_by(4) {
            let take = (n - j0).min(4);
            let quad = if take == 4 {
                Rows4::F32(&keys[j0 * dim..(j0 + 4) * dim])
            } else {
                padded.clear();
                padded.extend_from_slice(&keys[j0 * dim..(j0 + take) * dim]);
                padded.resize(4 * dim, 0.0);
                Rows4::F32(&padded)
            };
            for h0 in (0..heads).step_by(4) {
                let four = [
                    &q[h0 * dim..(h0 + 1) * dim],
                    &q[(h0 + 1) * dim..(h0 + 2) * dim],
                    &q[(h0 + 2) * dim..(h0 + 3) * dim],
                    &q[(h0 + 3) * dim..(h0 + 4) * dim],
                ];
                // SAFETY: AVX-512F was detected; each head has `dim` floats, `quad` 4 rows of dim.
                // The next keys are prefetched once, with the first heads.
                let d = unsafe { x86::dot4x4_avx512(four, quad, dim, h0 == 0 && take == 4) };
                for (t, row) in d.iter().enumerate() {
                    let at = (h0 + t) * n + j0;
                    // A whole quad as one fixed-size copy (a copy of `take` values is a
                    // `memcpy` call, eight a quad).
                    if take == 4 {
                        out[at..at + 4].copy_from_slice(row);
                    } else {
                        out[at..at + take].copy_from_slice(&row[..take]);
                    }
                }
            }
        }
        return;
    }
    super::gemm::product(q, heads, dim, keys, n, out);
}

/// Attention output of one query: `out[h, c] = Σ_j p[h, j] · v[j, c]`.
pub(super) fn attention_values(
    p: &[f32],
    heads: usize,
    n: usize,
    v: &[f32],
    width: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd() == Simd::Avx512 && heads.is_multiple_of(4) && width.is_multiple_of(16) {
        // SAFETY: AVX-512F was detected; the shapes satisfy the kernel's contract.
        unsafe { x86::weighted_rows_avx512(p, heads, n, v, width, out) };
        return;
    }
    super::gemm::weighted_sum(p, heads, n, v, width, out);
}

/// The same contract as [`super::gemm::gemm_into`], for `rows <= MAX_ROWS`.
pub(super) fn gemv_into(
    x: &[f32],
    x_at: Strided,
    rows: usize,
    w: &CpuMatrix,
    w_rows: Range<usize>,
    dst: &mut [f32],
    dst_at: Strided,
) {
    gemv_with(x, x_at, rows, w, w_rows, dst, dst_at, true)
}

/// [`gemv_into`], on the AMX tiles where [`super::amx_decode::takes`] the product and
/// `tiles` allows (tests of the vector kernels say no).
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv_with(
    x: &[f32],
    x_at: Strided,
    rows: usize,
    w: &CpuMatrix,
    w_rows: Range<usize>,
    dst: &mut [f32],
    dst_at: Strided,
    tiles: bool,
) {
    // Stacked parts: each part's rows, into their columns of the destination.
    if w.for_each_part(&w_rows, dst_at, |m, part_rows, at| {
        gemv_with(x, x_at, rows, m, part_rows, dst, at, tiles)
    }) {
        return;
    }
    let k = w.cols;
    let n = w_rows.len();
    if rows == 0 || n == 0 {
        return;
    }
    assert!(rows <= MAX_ROWS);
    assert!(
        x.len() >= x_at.offset + (rows - 1) * x_at.row_stride + k,
        "lhs too short"
    );
    assert!(
        dst.len() >= dst_at.offset + (rows - 1) * dst_at.row_stride + n,
        "dst too short"
    );
    let level = simd();
    let inputs: Vec<&[f32]> = (0..rows)
        .map(|r| &x[x_at.offset + r * x_at.row_stride..][..k])
        .collect();
    if tiles && super::amx_decode::takes(&inputs, w) {
        super::amx_decode::gemv_into(&inputs, w, w_rows, dst, dst_at);
        return;
    }
    // Blocks of weight rows (multiples of 4) in parallel; each returns [row][input] results.
    // Tiny products run in one block: a fork-join costs more than their microsecond or two. A
    // step keeps its workers spinning (`hot`), so a fork costs little more than that: the
    // mHC's 24 × 4096 f32 mixes (~30 µs on one thread, 16 a decode step) run on every worker.
    // Blocks hold at least 16 rows (4 for long rows), so no block is only a few microseconds.
    let threads = rayon::current_num_threads().max(1);
    let block = if n * k * rows < 1 << 16 {
        n
    } else {
        let min_rows = (16 * 1024 / k.max(1)).clamp(4, 16).next_multiple_of(4);
        n.div_ceil(threads * 4).next_multiple_of(4).max(min_rows)
    };
    // With two or more inputs, rows are decoded (FP8, FP4) or widened (bf16) in registers two
    // at a time for all of them (eight at a time: a product of 9-16 inputs takes two passes),
    // instead of once per input (the fused one-input kernels) or into a buffer read back for
    // every four inputs. Measured on a 4096 x 1024 matrix, 2 threads: FP8 2-3 inputs
    // 0.24 / 0.36 ms one at a time against 0.24 for four paired; 12 and 16 inputs 100-110
    // GFLOP/s decoded against 160 for eight paired; FP4 and bf16 alike, by less.
    let paired = (2..=MAX_ROWS).contains(&rows)
        && match &w.data {
            MatrixData::Native(q) => q.pairs(k),
            MatrixData::Bf16(_) => level == Simd::Avx512 && k.is_multiple_of(16),
            _ => false,
        };
    // One input and bf16 or f32 rows: the rows one after another (`dot_rows_bf16_avx512`,
    // `dot_rows_f32_avx512`).
    #[cfg(target_arch = "x86_64")]
    let bf16_split = match &w.data {
        // SAFETY: AVX-512F/VL detected.
        MatrixData::Bf16(_) if rows == 1 && level == Simd::Avx512 => {
            Some(unsafe { x86::split_even_odd(inputs[0]) })
        }
        _ => None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let bf16_split: Option<Vec<f32>> = None;
    let interleaved = paired.then(|| match &w.data {
        MatrixData::Native(q) => q.paired_inputs(k, &inputs),
        _ => Interleaved::new(&inputs, k),
    });
    // Native rows not paired (one input; else no paired kernel here): decoded in registers for
    // each input (fused kernels) where a kernel does that.
    let fused = match &w.data {
        MatrixData::Native(q) => rows < 4 && !paired && q.fuses(k),
        _ => false,
    };
    // The inputs as the fused kernels take them, made once for the product's blocks.
    let fused_inputs: Vec<super::quant::FusedInput<'_>> = match &w.data {
        MatrixData::Native(q) if fused => inputs.iter().map(|x| q.fused_input(k, x)).collect(),
        _ => Vec::new(),
    };
    let results: Vec<Vec<f32>> = (0..n.div_ceil(block))
        .into_par_iter()
        .map(|b| {
            let start = w_rows.start + b * block;
            let end = (start + block).min(w_rows.end);
            let mut out = vec![0.0f32; (end - start) * rows];
            let mut j = start;
            // Native rows not fused (below) nor paired: decoded here four at a time, once for
            // every input row (and an odd last row after pairs).
            let mut decoded = match &w.data {
                MatrixData::Native(_) if !fused && !paired => vec![0.0f32; 4 * k],
                _ => Vec::new(),
            };
            if let Some(il) = &interleaved {
                // Every row but an odd last one (below).
                let even = start + (end - start) / 2 * 2;
                match &w.data {
                    MatrixData::Native(q) => q
                        .dot_rows(k, (start, even), il, &mut out)
                        .expect("a paired kernel (`pairs`)"),
                    #[cfg(target_arch = "x86_64")]
                    MatrixData::Bf16(v) => il.for_pairs((start, even), &mut out, |j, n, xi| {
                        let rows = &v[j * k..(j + 2) * k];
                        // SAFETY: AVX-512F/VL detected (`paired`); `xi` holds `n` inputs of
                        // `k` floats interleaved by 16, `rows` two rows of `k`; k % 16 == 0.
                        unsafe { by_inputs!(n, x86::dot2xn_bf16_avx512, [], (xi, k, rows)) }
                    }),
                    _ => unreachable!("paired products are native (FP8, FP4) or bf16"),
                }
                j = even;
            }
            #[cfg(target_arch = "x86_64")]
            if let (Some(split), MatrixData::Bf16(v)) = (&bf16_split, &w.data) {
                // SAFETY: AVX-512F/VL detected (`bf16_split`); rows start..end of k values.
                unsafe {
                    x86::dot_rows_bf16_avx512(inputs[0], split, &v[start * k..end * k], &mut out)
                };
                j = end;
            }
            #[cfg(target_arch = "x86_64")]
            if let (1, Simd::Avx512, MatrixData::F32(v)) = (rows, level, &w.data) {
                // SAFETY: AVX-512F/VL detected; rows start..end of k values.
                unsafe { x86::dot_rows_f32_avx512(inputs[0], &v[start * k..end * k], &mut out) };
                j = end;
            }
            while j < end {
                let take = (end - j).min(4);
                let mut padded_f32;
                let mut padded_bf16;
                let quad: Rows4 = match &w.data {
                    MatrixData::Stacked(_) => {
                        unreachable!("stacked parts are multiplied part by part")
                    }
                    MatrixData::Native(_) if fused && take == 4 => Rows4::F32(&[]),
                    MatrixData::Native(q) => {
                        if decoded.is_empty() {
                            decoded = vec![0.0f32; 4 * k];
                        }
                        decoded[take * k..].fill(0.0);
                        for (t, out) in decoded.chunks_exact_mut(k).take(take).enumerate() {
                            q.decode_row(k, j + t, out);
                        }
                        Rows4::F32(&decoded)
                    }
                    MatrixData::F32(v) if take == 4 => Rows4::F32(&v[j * k..(j + 4) * k]),
                    MatrixData::Bf16(v) if take == 4 => Rows4::Bf16(&v[j * k..(j + 4) * k]),
                    // The last 1-3 rows: pad to four with zeros.
                    MatrixData::F32(v) => {
                        padded_f32 = vec![0.0f32; 4 * k];
                        padded_f32[..take * k].copy_from_slice(&v[j * k..(j + take) * k]);
                        Rows4::F32(&padded_f32)
                    }
                    MatrixData::Bf16(v) => {
                        padded_bf16 = vec![bf16::ZERO; 4 * k];
                        padded_bf16[..take * k].copy_from_slice(&v[j * k..(j + take) * k]);
                        Rows4::Bf16(&padded_bf16)
                    }
                };
                let mut ri = 0;
                // A native matrix with fewer than four inputs: decoded in registers per input
                // (the decoded quad above serves four or more).
                if let (MatrixData::Native(q), true, 4) = (&w.data, fused, take) {
                    for (ri, xi) in fused_inputs.iter().enumerate() {
                        let d = q.dot4(k, j, xi).expect("a fused kernel (`fuses`)");
                        for (t, &value) in d.iter().enumerate() {
                            out[(j - start + t) * rows + ri] = value;
                        }
                    }
                    j += take;
                    continue;
                }
                // The matrix's next rows are prefetched once, with the first inputs (not
                // after a padded quad or rows decoded into a buffer).
                let stream = take == 4 && !matches!(w.data, MatrixData::Native(_));
                #[cfg(target_arch = "x86_64")]
                if level == Simd::Avx512 {
                    while ri + 4 <= rows {
                        let four = [inputs[ri], inputs[ri + 1], inputs[ri + 2], inputs[ri + 3]];
                        // SAFETY: AVX-512F was detected; inputs have k floats, `quad` 4 rows of k.
                        let d = unsafe { x86::dot4x4_avx512(four, quad, k, stream && ri == 0) };
                        for (n, row) in d.iter().enumerate() {
                            for (t, &value) in row.iter().enumerate().take(take) {
                                out[(j - start + t) * rows + ri + n] = value;
                            }
                        }
                        ri += 4;
                    }
                }
                for (ri, xi) in inputs.iter().enumerate().skip(ri) {
                    let d = dot4(level, xi, quad, stream && ri == 0);
                    for (t, &value) in d.iter().enumerate().take(take) {
                        out[(j - start + t) * rows + ri] = value;
                    }
                }
                j += take;
            }
            out
        })
        .collect();
    for (b, block_out) in results.iter().enumerate() {
        for (jj, values) in block_out.chunks(rows).enumerate() {
            let j = b * block + jj;
            for (r, &v) in values.iter().enumerate() {
                dst[dst_at.offset + r * dst_at.row_stride + j] = v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_four_by_four_kernel_agrees_with_four_row_kernels() {
        let k = 100;
        let xs: Vec<Vec<f32>> = (0..4)
            .map(|n| (0..k).map(|i| ((i + 7 * n) as f32 * 0.3).sin()).collect())
            .collect();
        let w: Vec<f32> = (0..4 * k).map(|i| (i as f32 * 0.17).cos()).collect();
        let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        #[cfg(target_arch = "x86_64")]
        if simd() == Simd::Avx512 {
            for quad in [Rows4::F32(&w), Rows4::Bf16(&w16)] {
                let four = [&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]];
                // SAFETY: AVX-512F was detected; the slices have the sizes the kernel needs.
                let got = unsafe { x86::dot4x4_avx512(four, quad, k, true) };
                for n in 0..4 {
                    let expected = dot4_portable(&xs[n], quad);
                    for r in 0..4 {
                        assert!((got[n][r] - expected[r]).abs() < 1e-3);
                    }
                }
            }
        }
    }

    #[test]
    fn attention_kernels_match_plain_loops() {
        let (heads, dim, n) = (8, 48, 11);
        let q: Vec<f32> = (0..heads * dim).map(|i| (i as f32 * 0.13).sin()).collect();
        let keys: Vec<f32> = (0..n * dim).map(|i| (i as f32 * 0.07).cos()).collect();
        let mut scores = vec![0.0; heads * n];
        attention_scores(&q, heads, dim, &keys, n, &mut scores);
        let mut out = vec![0.0; heads * dim];
        attention_values(&scores, heads, n, &keys, dim, &mut out);
        for h in 0..heads {
            for j in 0..n {
                let expected: f32 = (0..dim).map(|c| q[h * dim + c] * keys[j * dim + c]).sum();
                assert!((scores[h * n + j] - expected).abs() < 1e-4);
            }
            for c in 0..dim {
                let expected: f32 = (0..n).map(|j| scores[h * n + j] * keys[j * dim + c]).sum();
                assert!((out[h * dim + c] - expected).abs() < 1e-3);
            }
        }
    }

    /// The weighted-rows kernel sums each output's keys in order with one FMA per key, in
    /// whatever column groups it takes them: bit for bit a scalar `mul_add` chain, for widths
    /// with and without a 64-column remainder.
    #[test]
    fn weighted_rows_are_one_fma_chain_per_output_in_key_order() {
        for (heads, n, width) in [(8, 37, 512), (4, 5, 80), (4, 33, 16)] {
            let p: Vec<f32> = (0..heads * n).map(|i| (i as f32 * 0.37).sin()).collect();
            let v: Vec<f32> = (0..n * width).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut out = vec![0.0; heads * width];
            attention_values(&p, heads, n, &v, width, &mut out);
            #[cfg(target_arch = "x86_64")]
            if simd() == Simd::Avx512 {
                for h in 0..heads {
                    for c in 0..width {
                        let want = (0..n)
                            .fold(0.0f32, |acc, j| p[h * n + j].mul_add(v[j * width + c], acc));
                        assert_eq!(
                            out[h * width + c].to_bits(),
                            want.to_bits(),
                            "heads {heads} keys {n} width {width}: head {h} column {c}"
                        );
                    }
                }
                continue;
            }
            for h in 0..heads {
                for c in 0..width {
                    let want: f32 = (0..n).map(|j| p[h * n + j] * v[j * width + c]).sum();
                    assert!((out[h * width + c] - want).abs() < 1e-3);
                }
            }
        }
    }

    /// With two or more inputs, bf16 rows are widened two at a time for all inputs
    /// (`dot2xn_bf16_avx512`, eight inputs a pass): bit for bit what the four-row kernel
    /// gives, an odd last row included; every input count within f32 rounding of exact f64
    /// dot products.
    #[test]
    fn paired_bf16_products_equal_the_four_row_kernel() {
        #[cfg(target_arch = "x86_64")]
        if simd() == Simd::Avx512 {
            let (n, k) = (7, 96);
            let w16: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32((i as f32 * 0.11).cos()))
                .collect();
            let m = CpuMatrix {
                rows: n,
                cols: k,
                data: MatrixData::Bf16(w16.clone()),
            };
            let at = |stride| Strided {
                offset: 0,
                row_stride: stride,
            };
            for rows in 1..=16 {
                let x: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let mut y = vec![f32::NAN; rows * n];
                // The vector kernels (the tiles sum in another order).
                gemv_with(&x, at(k), rows, &m, 0..n, &mut y, at(n), false);
                let mut quad = vec![bf16::ZERO; 8 * k];
                quad[..n * k].copy_from_slice(&w16);
                for r in 0..rows {
                    let xr = &x[r * k..(r + 1) * k];
                    for j in 0..n {
                        let q = Rows4::Bf16(&quad[j / 4 * 4 * k..][..4 * k]);
                        // SAFETY: AVX-512F/VL detected; each input and row has k values.
                        let want = unsafe { x86::dot4x4_avx512([xr; 4], q, k, false) }[0][j % 4];
                        let got = y[r * n + j];
                        // One input, and the odd last row's inputs past the last four, take
                        // the one-input kernel, which sums in another order.
                        if rows >= 2 && (j < n / 2 * 2 || r < rows / 4 * 4) {
                            assert_eq!(got.to_bits(), want.to_bits(), "{rows} inputs: {r}, {j}");
                        }
                        let exact: f64 = (0..k)
                            .map(|i| f64::from(xr[i]) * f64::from(w16[j * k + i].to_f32()))
                            .sum();
                        assert!(
                            (f64::from(got) - exact).abs() < 1e-4,
                            "{rows}: {got} {exact}"
                        );
                    }
                }
            }
            return;
        }
        println!("skipped: no AVX-512 on this CPU, so there is no paired bf16 kernel to compare");
    }

    /// One input against bf16 or f32 rows takes them one row after another
    /// (`dot_rows_bf16_avx512`, `dot_rows_f32_avx512`): within f32 rounding of exact f64 dot
    /// products for widths with and without 64-, 32- and 16-column remainders, every row of a
    /// block (not only multiples of four) written, through `gemv_into` as the model calls it.
    #[test]
    fn one_input_rows_one_after_another_match_exact_dot_products() {
        let at = |stride| Strided {
            offset: 0,
            row_stride: stride,
        };
        for (n, k) in [(7, 1024), (33, 96), (5, 80), (3, 31), (300, 512), (9, 48)] {
            let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
            let cases = [
                (
                    "bf16",
                    MatrixData::Bf16(w16.clone()),
                    w16.iter().map(|v| v.to_f32()).collect(),
                ),
                ("f32", MatrixData::F32(w.clone()), w.clone()),
            ];
            for (name, data, values) in cases {
                let m = CpuMatrix {
                    rows: n,
                    cols: k,
                    data,
                };
                let mut y = vec![f32::NAN; n];
                gemv_into(&x, at(k), 1, &m, 0..n, &mut y, at(n));
                for (j, &got) in y.iter().enumerate() {
                    let exact: f64 = (0..k)
                        .map(|i| f64::from(x[i]) * f64::from(values[j * k + i]))
                        .sum();
                    assert!(
                        (f64::from(got) - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                        "{name} {n} x {k}: row {j}: {got} against {exact}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_kernel_agrees_with_exact_dot_products() {
        for k in [1, 7, 16, 33, 100, 1024] {
            let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..4 * k).map(|i| (i as f32 * 0.11).cos()).collect();
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            for r in 0..4 {
                let exact = |row: &dyn Fn(usize) -> f32| -> f64 {
                    (0..k)
                        .map(|i| f64::from(x[i]) * f64::from(row(r * k + i)))
                        .sum()
                };
                let e32 = exact(&|i| w[i]);
                let e16 = exact(&|i| w16[i].to_f32());
                for level in [simd(), Simd::Portable] {
                    let got = dot4(level, &x, Rows4::F32(&w), true)[r];
                    assert!((f64::from(got) - e32).abs() < 1e-3, "{level:?} f32 k={k}");
                    let got = dot4(level, &x, Rows4::Bf16(&w16), true)[r];
                    assert!((f64::from(got) - e16).abs() < 1e-3, "{level:?} bf16 k={k}");
                }
            }
        }
    }
}
