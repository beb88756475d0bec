//! Decode-step products (up to ten inputs) on Intel AMX tiles, the weight rows as the tiles'
//! A operand.
//!
//! Why: on the AVX-512 kernels a one-input FP8 product decodes and multiplies 16 weights in
//! four vector operations (widen, shift, mask, FMA), ~8 bytes a cycle, below the memory
//! stream, which it does not overlap (docs/model.md §4.2, stop 49); the kernels for two to
//! sixteen inputs are bound by their FMAs (7–17 GB/s). Here 16 weight rows × 32 columns go to
//! one A tile as bf16 — bf16 rows loaded straight from the matrix, FP8 rows decoded in three
//! integer operations per 32 values — and one tile product multiplies them by every input's
//! three bf16 parts (an f32 split into parts that sum to it exactly, as [`super::amx`] does):
//! three B columns an input, two B tiles for up to ten inputs. The tile unit multiplies ~16×
//! what the vector units do a cycle, so the decode is the only per-weight work left.
//!
//! FP8: an e4m3 byte sign-extended to 16 bits, shifted up 4 and masked with 0x87F0 is the bf16
//! of its value times 2⁻¹²⁰ (the e4m3 exponent becomes the low bits of bf16's), so the inputs
//! are multiplied by 2¹²⁰ first (exact; [`takes`] keeps |x| < 2⁷, so it stays finite) and each
//! tile product is the f32 one. One C tile sums a scale block (128 columns); each row's sum is
//! then scaled by its power of two and added in f32. An e4m3 subnormal (exponent bits 0)
//! becomes a bf16 subnormal, which the tiles read as zero: rows' blocks with one
//! (`subnormal_blocks`) get those codes' products added afterwards in f32. NaN codes would read
//! as numbers: matrices with them keep the AVX-512 kernels.
//!
//! Results agree with the f32 kernels to f32 rounding (sums in another order), with the
//! differences [`super::amx`]'s doc lists for the prefill tiles (bf16 weights under 2⁻¹²⁶ read
//! as zero).
//!
//! Where it pays (bench model, 2-vCPU Xeon VM; docs/model.md §4.2, stop 50): two to ten
//! inputs whose B tiles stay in L1 — decode b8's 256- and 512-column products 1.4–1.5× the
//! paired AVX-512 kernels. Not taken: one input (decode b1 with it ran at 0.90 of the AVX-512
//! kernels' rate, though on 2048–4096-row matrices alone the two were level) and
//! B tiles past L1 (1024–2048 columns at b8: 0.7–1.0×, also with the columns taken in L1-sized
//! ranges). What tiles cost here, measured: a tile load 2.2 ns from 64-byte-aligned rows, 16
//! ns when rows straddle lines; 16 stores then a tile load of them ~20 ns (two chunks later:
//! ~7); a `tdpbf16ps` 4.5 ns, dependent or not. In a product's loop, though, with A rows from
//! L2, a load costs 10–13 ns and the loads do not overlap the products: the loop stripped to
//! its tile instructions takes 21–23 ns a 16 × 32 chunk, this kernel about twice that (stop 51
//! in docs/model.md §4.2 lists what was tried).

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use super::amx::{self, tile_load, tile_product, tile_store, TileConfig, CHUNK, TILE};
use super::gemm::{Dst, Strided};
use super::quant::{scale_of, Native};
use super::{CpuMatrix, MatrixData};

/// Inputs a product may have here: three bf16 parts each, in two B tiles of 16 columns.
pub(super) const MAX_INPUTS: usize = 10;
/// bf16 parts an input is split into.
const PARTS: usize = 3;
/// Most weight rows one pass takes: two 16-row strips, so each B tile load serves both.
const PASS: usize = 2 * TILE;
/// How far ahead in each row (bytes) the weights are prefetched.
const PREFETCH: usize = 512;
/// The FP8 integer decode's values are 2⁻¹²⁰ times the code's: the inputs are scaled up by this.
const FP8_UP: f32 = f32::from_bits((127 + 120) << 23);

/// A matrix's rows as this path reads them.
enum Weights<'w> {
    Bf16(&'w [bf16]),
    Fp8 {
        values: &'w [u8],
        exponents: &'w [u8],
        block: usize,
        subnormal_blocks: &'w [u8],
    },
}

impl Weights<'_> {
    /// Columns one C tile sums before the rows' scales apply (bf16: the whole row).
    fn block(&self, k: usize) -> usize {
        match self {
            Weights::Bf16(_) => k,
            Weights::Fp8 { block, .. } => *block,
        }
    }
}

fn weights(w: &CpuMatrix) -> Option<Weights<'_>> {
    match &w.data {
        MatrixData::Bf16(v) => Some(Weights::Bf16(v)),
        MatrixData::Native(Native::Fp8 {
            values,
            exponents,
            block,
            nan_free: true,
            subnormal_blocks,
        }) if block.is_multiple_of(CHUNK) => Some(Weights::Fp8 {
            values,
            exponents,
            block: *block,
            subnormal_blocks,
        }),
        _ => None,
    }
}

/// Bytes of B tiles per input per column: three parts of a bf16 each.
const B_BYTES_PER_VALUE: usize = PARTS * 2;
/// The most B tile bytes a product takes here: every pass reads them all, so they must stay in
/// L1 (48 KiB), beside the pass's weights. Measured on the bench model (2 threads, Xeon with
/// AMX), decode b8: rows 256 and 512 wide 1.4–1.5× faster than the paired AVX-512 kernels,
/// 1024 and 2048 (48 and 96 KiB of B) 0.7–1.0×.
const MAX_B_BYTES: usize = 24 << 10;

/// Whether a product of `inputs` (each `w.cols` or more long) with `w` runs here: two to ten
/// inputs (one input: decode b1 ran at 0.90 of the AVX-512 kernels' rate with it, see the
/// module doc), their B tiles within [`MAX_B_BYTES`], rows
/// a whole number of 32-column chunks, bf16 weights or FP8 ones without NaN codes (scale blocks
/// of whole chunks), inputs finite (FP8: under 2⁷ in magnitude), and the tiles on.
pub(super) fn takes(inputs: &[&[f32]], w: &CpuMatrix) -> bool {
    let k = w.cols;
    if !(2..=MAX_INPUTS).contains(&inputs.len()) || k == 0 || !k.is_multiple_of(CHUNK) {
        return false;
    }
    if B_BYTES_PER_VALUE * inputs.len() * k > MAX_B_BYTES {
        return false;
    }
    let Some(weights) = weights(w) else {
        return false;
    };
    if !amx::enabled() {
        return false;
    }
    match weights {
        Weights::Bf16(_) => inputs.iter().all(|x| x[..k].iter().all(|v| v.is_finite())),
        // False for NaN too.
        Weights::Fp8 { .. } => inputs
            .iter()
            .all(|x| x[..k].iter().all(|v| v.abs() < 128.0)),
    }
}

/// The inputs' parts as the B tiles read them: for each 32-column chunk, tile 0 (16 rows of
/// `n[0]` pair words) then tile 1 (16 rows of `n[1]`); column `q` of the two (tile `q / 16`)
/// holds part `q % 3` of input `q / 3`, and row `kk` the pair of its columns 2·kk, 2·kk + 1.
struct Columns {
    /// From a 64-byte line on (a tile row across two lines loads ~7× slower), bit patterns.
    words: amx::Words,
    n: [usize; 2],
}

impl Columns {
    fn chunk_words(&self) -> usize {
        TILE * (self.n[0] + self.n[1])
    }
}

/// `inputs` times `up` (a power of two), split into parts and laid out as [`Columns`].
///
/// # Safety
/// AVX-512F/BW available; every input holds `k` (a multiple of 32) values.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn columns(inputs: &[&[f32]], k: usize, up: f32) -> Columns {
    let q = PARTS * inputs.len();
    let n = [q.min(TILE), q.saturating_sub(TILE)];
    let chunk_words = TILE * q;
    let mut words = amx::Words::new(k / CHUNK * chunk_words);
    let base = words.slice_mut().as_mut_ptr().cast::<u32>();
    let up = _mm512_set1_ps(up);
    let parts = |v: __m512| amx::parts(_mm512_mul_ps(v, up));
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Word kk of a column goes to row kk of its tile: `n[t]` words on.
    let index = [
        _mm512_mullo_epi32(lanes, _mm512_set1_epi32(n[0] as i32)),
        _mm512_mullo_epi32(lanes, _mm512_set1_epi32(n[1] as i32)),
    ];
    for (i, x) in inputs.iter().enumerate() {
        assert!(x.len() >= k);
        for c in 0..k / CHUNK {
            // SAFETY: columns c·32 .. c·32 + 32 lie in the input (asserted); each scatter
            // writes 16 words of chunk c's tile t, inside `words` (k / 32 chunks of
            // `chunk_words`).
            unsafe {
                let at = x.as_ptr().add(c * CHUNK);
                let a = parts(_mm512_loadu_ps(at));
                let b = parts(_mm512_loadu_ps(at.add(TILE)));
                for p in 0..PARTS {
                    let column = PARTS * i + p;
                    let (t, col) = (column / TILE, column % TILE);
                    let start = c * chunk_words + t * TILE * n[0] + col;
                    _mm512_i32scatter_epi32::<4>(
                        base.add(start).cast(),
                        index[t],
                        amx::top_halves(a[p], b[p]),
                    );
                }
            }
        }
    }
    Columns { words, n }
}

/// Tiles 0–3 accumulate, 4–5 hold weights, 6–7 inputs. One B tile (`n[1]` = 0): every
/// accumulator `n[0]` columns, tiles 6 and 7 both `n[0]` (they alternate by chunk); two: tiles
/// 0, 1 and 6 `n[0]` columns, tiles 2, 3 and 7 `n[1]` (see [`task`]).
fn config(n: [usize; 2]) -> TileConfig {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        bytes_per_row: [0; 16],
        rows: [0; 16],
    };
    let mut set = |tiles: &[usize], bytes: usize| {
        for &t in tiles {
            c.bytes_per_row[t] = bytes as u16;
            c.rows[t] = TILE as u8;
        }
    };
    if n[1] == 0 {
        set(&[0, 1, 2, 3, 6, 7], 4 * n[0]);
    } else {
        set(&[0, 1, 6], 4 * n[0]);
        set(&[2, 3, 7], 4 * n[1]);
    }
    set(&[4, 5], 64);
    c
}

/// Chunks the A tiles are written ahead of their loads: a tile load of lines still in the
/// store buffer waits for them (16 stores then the load: ~20 ns against ~7 two chunks later).
const AHEAD: usize = 2;

/// 64-byte-aligned scratch: a ring of `AHEAD + 1` chunks' A tiles for two strips, and one C tile.
#[repr(C, align(64))]
struct Scratch {
    a: [[[u16; TILE * CHUNK]; 2]; AHEAD + 1],
    c: [f32; TILE * TILE],
}

/// [`super::gemv::gemv_into`]'s product on the tiles for `inputs` (as [`takes`] accepts them):
/// `dst[dst_at.offset + i · dst_at.row_stride + j]` = input i · row `w_rows.start + j`. The
/// caller has checked `dst`'s extent.
pub(super) fn gemv_into(
    inputs: &[&[f32]],
    w: &CpuMatrix,
    w_rows: Range<usize>,
    dst: &mut [f32],
    dst_at: Strided,
) {
    let k = w.cols;
    let weights = weights(w).expect("checked by `takes`");
    assert!(w_rows.end <= w.rows && k.is_multiple_of(CHUNK) && inputs.len() <= MAX_INPUTS);
    let n = w_rows.len();
    if n == 0 || inputs.is_empty() {
        return;
    }
    assert!(dst.len() >= dst_at.offset + (inputs.len() - 1) * dst_at.row_stride + n);
    let up = match weights {
        Weights::Bf16(_) => 1.0,
        Weights::Fp8 { .. } => FP8_UP,
    };
    // SAFETY: AVX-512F/BW come with the tiles (`amx::supported`); inputs hold k values
    // (`takes`).
    let columns = unsafe { columns(inputs, k, up) };
    let config = config(columns.n);
    // Tasks of whole strips, four a thread (the model's products have a few hundred rows:
    // whole passes left one thread up to 1.6× the other's rows); small products in one.
    let threads = rayon::current_num_threads().max(1);
    let block = if n * k < 1 << 16 {
        n.next_multiple_of(TILE)
    } else {
        n.div_ceil(4 * threads).next_multiple_of(TILE)
    };
    let out = Dst(dst.as_mut_ptr());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let start = w_rows.start + b * block;
        let end = (start + block).min(w_rows.end);
        // SAFETY: tiles granted (`takes`); the rows lie in the matrix (asserted) and this task
        // writes only its own columns start..end of the destination (extent asserted).
        unsafe {
            task(
                &weights,
                k,
                start..end,
                &columns,
                inputs,
                &config,
                out.get(),
                dst_at,
                w_rows.start,
            )
        };
    });
    columns.words.give();
}

/// Where a strip's A tile for a chunk is read from (the matrix itself for a whole strip of
/// bf16 rows, else the scratch ring) and its row stride in bytes.
type ATile = (*const u8, usize);

/// The A tile of rows `r0..r0 + 16` (those below `end`, zeros past it), columns `c..c + 32`:
/// FP8 decoded into `buf`, bf16 named in place (a partial strip copied into `buf`).
///
/// # Safety
/// AVX-512F/BW available; rows `r0..end` and columns `c..c + 32` inside the matrix.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fill(
    w: &Weights<'_>,
    k: usize,
    (r0, end, pass): (usize, usize, usize),
    c: usize,
    buf: &mut [u16; TILE * CHUNK],
) -> ATile {
    // Prefetched: each row `PREFETCH` bytes on, or past its end the same row of the next
    // pass (`pass` rows on): a pass reads its rows side by side, 16 or 32 streams, more than
    // the hardware prefetcher follows, and its rows' next bytes are the next pass's.
    let ahead = |bytes: usize, row_bytes: usize| {
        if bytes + PREFETCH < row_bytes {
            PREFETCH
        } else {
            pass * row_bytes + PREFETCH - row_bytes
        }
    };
    if end < r0 + TILE {
        // SAFETY: forwarded.
        return unsafe { fill_partial(w, k, (r0, end), c, buf) };
    }
    // SAFETY: rows r0..r0 + 16 and columns c..c + 32 lie in the matrix (the caller's
    // contract); `buf` holds 16 rows of 32 u16 and is 64-byte aligned (`Scratch`); a
    // prefetch is a hint that never faults (past the matrix's end included).
    unsafe {
        match w {
            Weights::Fp8 { values, .. } => {
                let mask = _mm512_set1_epi16(0x87f0u16 as i16);
                let row = values.as_ptr().add(r0 * k + c);
                let to = buf.as_mut_ptr();
                // A 64-byte line holds two chunks of a row.
                let prefetch = c.is_multiple_of(64);
                let lead = ahead(c, k);
                for r in 0..TILE {
                    let from = row.add(r * k);
                    if prefetch {
                        _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(lead).cast());
                    }
                    let v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(from.cast()));
                    let v = _mm512_and_si512(_mm512_slli_epi16::<4>(v), mask);
                    _mm512_store_si512(to.add(r * CHUNK).cast(), v);
                }
                (to.cast(), 64)
            }
            Weights::Bf16(v) => {
                let row = v.as_ptr().add(r0 * k + c);
                let lead = ahead(2 * c, 2 * k);
                for r in 0..TILE {
                    let p = row.add(r * k).cast::<u8>().wrapping_add(lead);
                    _mm_prefetch::<_MM_HINT_T0>(p.cast());
                }
                (row.cast(), 2 * k)
            }
        }
    }
}

/// [`fill`] for a strip with fewer than 16 rows left (the last of a product).
///
/// # Safety
/// As [`fill`]'s.
#[cold]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fill_partial(
    w: &Weights<'_>,
    k: usize,
    (r0, end): (usize, usize),
    c: usize,
    buf: &mut [u16; TILE * CHUNK],
) -> ATile {
    buf.fill(0);
    for (r, out) in buf.chunks_exact_mut(CHUNK).enumerate() {
        let row = r0 + r;
        if row >= end {
            break;
        }
        match w {
            Weights::Bf16(v) => {
                for (o, x) in out.iter_mut().zip(&v[row * k + c..][..CHUNK]) {
                    *o = x.to_bits();
                }
            }
            Weights::Fp8 { values, .. } => {
                for (o, &b) in out.iter_mut().zip(&values[row * k + c..][..CHUNK]) {
                    *o = ((b as i8 as i16 as u16) << 4) & 0x87f0;
                }
            }
        }
    }
    (buf.as_ptr().cast(), 64)
}

/// One task's weight rows `rows`, a pass at a time: with one B tile (up to five inputs) two
/// strips a pass, each chunk's B tile alternating between tiles 6 and 7 (a tile load waits
/// for the products still reading its tile); with two, one strip, its A tile alternating
/// between 4 and 5. Blocks alternate between two sets of C tiles (set s: tiles s and s + 2),
/// and a block's sums are stored after the next block's first products are issued, so the
/// tile unit never drains.
///
/// # Safety
/// Tiles granted and AVX-512F/BW available; `config` made by [`config`] for `columns`; `rows`
/// inside the matrix; `dst` valid for the columns `rows − first` of every input's row and
/// written by no one else meanwhile.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn task(
    w: &Weights<'_>,
    k: usize,
    rows: Range<usize>,
    columns: &Columns,
    inputs: &[&[f32]],
    config: &TileConfig,
    dst: *mut f32,
    dst_at: Strided,
    first: usize,
) {
    let two = columns.n[1] > 0;
    let pass = if two { TILE } else { 2 * TILE };
    let block = w.block(k);
    let nb = k.div_ceil(block);
    let chunks = k / CHUNK;
    let chunk_words = columns.chunk_words();
    let b_base = columns.words.as_ptr().cast::<u32>();
    let (b0_stride, b1_stride) = (4 * columns.n[0], 4 * columns.n[1]);
    let mut scratch = Scratch {
        a: [[[0; TILE * CHUNK]; 2]; AHEAD + 1],
        c: [0.0; TILE * TILE],
    };
    let mut acc = [[0.0f32; 2 * TILE]; PASS];
    // SAFETY (every asm and pointer below): the configuration is loaded first and names every
    // tile used; A loads read 16 rows of 64 bytes inside the matrix (whole strips of bf16
    // rows) or the scratch ring; B loads read chunk c's tiles inside `columns.words`; C
    // stores write `scratch.c`; tiles are released before returning; the AVX-512 functions
    // called need only what this one has.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) config, options(nostack, readonly, preserves_flags));
        for p0 in rows.clone().step_by(pass) {
            let end = (p0 + pass).min(rows.end);
            let strips = (end - p0).div_ceil(TILE);
            acc.fill([0.0; 2 * TILE]);
            let mut ahead = [[(std::ptr::null(), 0); 2]; AHEAD + 1];
            let fill_chunk = |c: usize, slot: &mut [[u16; TILE * CHUNK]; 2]| {
                let mut tiles = [(std::ptr::null(), 0); 2];
                for (s, (t, buf)) in tiles.iter_mut().zip(slot).enumerate().take(strips) {
                    *t = fill(w, k, (p0 + s * TILE, end, pass), c * CHUNK, buf);
                }
                tiles
            };
            for (c, slot) in scratch.a.iter_mut().enumerate().take(AHEAD.min(chunks)) {
                ahead[c] = fill_chunk(c, slot);
            }
            // The block whose sums wait in their C tiles.
            let mut pending = None;
            for c in 0..chunks {
                let next = c + AHEAD;
                if next < chunks {
                    let slot = next % (AHEAD + 1);
                    ahead[slot] = fill_chunk(next, &mut scratch.a[slot]);
                }
                let col = c * CHUNK;
                let b = col / block;
                let set = b % 2;
                if col.is_multiple_of(block) {
                    match set {
                        0 => asm!(
                            "tilezero tmm0",
                            "tilezero tmm2",
                            options(nostack, nomem, preserves_flags)
                        ),
                        _ => asm!(
                            "tilezero tmm1",
                            "tilezero tmm3",
                            options(nostack, nomem, preserves_flags)
                        ),
                    }
                }
                let a = ahead[c % (AHEAD + 1)];
                let bp = b_base.add(c * chunk_words);
                macro_rules! one_b {
                    ($b:literal, $c0:literal, $c1:literal) => {{
                        tile_load!($b, bp, b0_stride);
                        tile_load!(4, a[0].0, a[0].1);
                        tile_product!($c0, 4, $b);
                        if strips == 2 {
                            tile_load!(5, a[1].0, a[1].1);
                            tile_product!($c1, 5, $b);
                        }
                    }};
                }
                macro_rules! two_b {
                    ($a:literal, $c0:literal, $c1:literal) => {{
                        tile_load!(6, bp, b0_stride);
                        tile_load!(7, bp.add(TILE * columns.n[0]), b1_stride);
                        tile_load!($a, a[0].0, a[0].1);
                        tile_product!($c0, $a, 6);
                        tile_product!($c1, $a, 7);
                    }};
                }
                match (two, set, c % 2) {
                    (false, 0, 0) => one_b!(6, 0, 2),
                    (false, 0, _) => one_b!(7, 0, 2),
                    (false, _, 0) => one_b!(6, 1, 3),
                    (false, _, _) => one_b!(7, 1, 3),
                    (true, 0, 0) => two_b!(4, 0, 2),
                    (true, 0, _) => two_b!(5, 0, 2),
                    (true, _, 0) => two_b!(4, 1, 3),
                    (true, _, _) => two_b!(5, 1, 3),
                }
                if let Some(done) = pending.filter(|&d| d != b) {
                    block_sums(w, (nb, done), (p0, end), two, &mut scratch.c, &mut acc);
                    pending = None;
                }
                if (col + CHUNK).is_multiple_of(block) || c + 1 == chunks {
                    pending = Some(b);
                }
            }
            if let Some(done) = pending {
                block_sums(w, (nb, done), (p0, end), two, &mut scratch.c, &mut acc);
            }
            if let Weights::Fp8 {
                values,
                exponents,
                subnormal_blocks,
                ..
            } = w
            {
                add_subnormal_codes(
                    (values, exponents, subnormal_blocks),
                    (k, block),
                    p0..end,
                    inputs,
                    &mut acc,
                );
            }
            for (r, sums) in acc.iter().take(end - p0).enumerate() {
                let j = p0 + r - first;
                for i in 0..inputs.len() {
                    let q = PARTS * i;
                    let v = (sums[q] + sums[q + 1]) + sums[q + 2];
                    *dst.add(dst_at.offset + i * dst_at.row_stride + j) = v;
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem, preserves_flags));
    }
}

/// Block `b`'s sums (in C tile set `b % 2`: tiles s and s + 2) of the pass's rows `p0..end`,
/// each row's times its scale, added to the pass's sums: with one B tile, tile `set + 2s`
/// holds strip s's 16 columns; with two, tile `set + 2t` holds B tile t's columns of the one
/// strip.
///
/// # Safety
/// Tiles configured by [`task`] and the block's products issued; AVX-512F available.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn block_sums(
    w: &Weights<'_>,
    (nb, b): (usize, usize),
    (p0, end): (usize, usize),
    two: bool,
    c: &mut [f32; TILE * TILE],
    acc: &mut [[f32; 2 * TILE]; PASS],
) {
    let set = b % 2;
    let tiles = if two { 2 } else { (end - p0).div_ceil(TILE) };
    for j in 0..tiles {
        let cp = c.as_mut_ptr();
        // SAFETY: the tile is configured (16 rows of at most 64 bytes) and `c` holds 16 rows
        // of 64 bytes.
        unsafe {
            match set + 2 * j {
                0 => tile_store!(0, cp, 64usize),
                1 => tile_store!(1, cp, 64usize),
                2 => tile_store!(2, cp, 64usize),
                _ => tile_store!(3, cp, 64usize),
            }
        }
        let (r0, col) = if two {
            (p0, j * TILE)
        } else {
            (p0 + j * TILE, 0)
        };
        let live = end.saturating_sub(r0).min(TILE);
        for r in 0..live {
            let scale = match w {
                Weights::Bf16(_) => 1.0,
                Weights::Fp8 { exponents, .. } => scale_of(exponents[(r0 + r) * nb + b]),
            };
            let sums = &mut acc[r0 - p0 + r][col..col + TILE];
            // SAFETY: 16 floats each at `sums` and row r of `c`.
            unsafe {
                let v = _mm512_loadu_ps(c.as_ptr().add(r * TILE));
                let a = _mm512_loadu_ps(sums.as_ptr());
                let a = _mm512_fmadd_ps(v, _mm512_set1_ps(scale), a);
                _mm512_storeu_ps(sums.as_mut_ptr(), a);
            }
        }
    }
}

/// Adds the products of the FP8 subnormal codes in rows `rows` (which the tiles read as zero)
/// to their rows' last-part sums (`acc[r − rows.start][3·i + 2]` for input i), block by block
/// where `subnormal_blocks` marks one.
///
/// # Safety
/// AVX-512F/BW available.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn add_subnormal_codes(
    (values, exponents, subnormal_blocks): (&[u8], &[u8], &[u8]),
    (k, block): (usize, usize),
    rows: Range<usize>,
    inputs: &[&[f32]],
    acc: &mut [[f32; 2 * TILE]; PASS],
) {
    let nb = k.div_ceil(block);
    // The rows' bits are one run: whole zero bytes (almost all) are skipped.
    let (from, to) = (rows.start * nb, rows.end * nb);
    for (byte, &bits) in subnormal_blocks
        .iter()
        .enumerate()
        .take(to.div_ceil(8))
        .skip(from / 8)
    {
        let mut bits = bits;
        while bits != 0 {
            let bit = byte * 8 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if !(from..to).contains(&bit) {
                continue;
            }
            let (row, b) = (bit / nb, bit % nb);
            // An e4m3 subnormal is its 3 mantissa bits times 2⁻⁹.
            let unit = scale_of(exponents[row * nb + b]) / 512.0;
            let span = b * block..((b + 1) * block).min(k);
            // 64 codes at a time (a block holds ~1 subnormal in 60 on rounded weights).
            for c0 in span.clone().step_by(64) {
                let codes = &values[row * k + c0..row * k + span.end.min(c0 + 64)];
                let mut found = subnormal_codes(codes);
                while found != 0 {
                    let col = c0 + found.trailing_zeros() as usize;
                    found &= found - 1;
                    let code = values[row * k + col];
                    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
                    let v = sign * f32::from(code & 0x07) * unit;
                    for (i, x) in inputs.iter().enumerate() {
                        acc[row - rows.start][PARTS * i + 2] += v * x[col];
                    }
                }
            }
        }
    }
}

/// Bit i set where `codes[i]` (at most 64) is an e4m3 subnormal: exponent bits 0, mantissa not.
#[target_feature(enable = "avx512f,avx512bw")]
fn subnormal_codes(codes: &[u8]) -> u64 {
    assert!(codes.len() <= 64);
    let live = u64::MAX >> (64 - codes.len());
    // SAFETY: the mask loads only the slice's bytes (masked lanes do not fault).
    let v = unsafe { _mm512_maskz_loadu_epi8(live, codes.as_ptr().cast()) };
    let exponent_zero = _mm512_testn_epi8_mask(v, _mm512_set1_epi8(0x78));
    let mantissa = _mm512_test_epi8_mask(v, _mm512_set1_epi8(0x07));
    exponent_zero & mantissa & live
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::test_data::values;
    use crate::backend::weights::{WeightData, WeightFormat};
    use crate::formats::e4m3_decode;

    /// Whether these tests cannot run here (no AMX): says so.
    fn skipped_without_tiles() -> bool {
        if amx::supported() {
            return false;
        }
        println!(
            "skipped: this CPU (or kernel) has no AMX tiles, so the decode kernels run instead"
        );
        true
    }

    /// Every non-NaN FP8 code (subnormals and zeros included, ~1 in 10 a subnormal so most
    /// blocks hold one) in rows of `k` with scales 2⁻¹⁸ .. 2⁴.
    fn fp8_matrix(rows: usize, k: usize, seed: u64) -> (CpuMatrix, Vec<f32>) {
        let codes: Vec<u8> = values(seed, rows * k)
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let c = ((v.abs() * 1e4) as usize + i) % 256;
                let c = if i % 10 == 3 { c & 0x87 } else { c } as u8;
                if c & 0x7f == 0x7f {
                    0x3c
                } else {
                    c
                }
            })
            .collect();
        let tiles = (rows.div_ceil(128), k.div_ceil(128));
        let scales: Vec<f32> = (0..tiles.0 * tiles.1)
            .map(|i| 2f32.powi(i as i32 % 23 - 18))
            .collect();
        let weight = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &codes,
            scales.clone(),
            rows,
            k,
        );
        let exact: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let (r, col) = (i / k, i % k);
                e4m3_decode(c) * scales[r / 128 * tiles.1 + col / 128]
            })
            .collect();
        let m = CpuMatrix {
            rows,
            cols: k,
            data: MatrixData::Native(Native::of(&weight).unwrap()),
        };
        (m, exact)
    }

    /// The tiles' products of `inputs` with rows `w_rows` against f64 sums of the exact
    /// weights: within f32 accumulation error (a few ulps of Σ|x·w|), nothing written outside
    /// the rows' columns.
    fn check(inputs: &[&[f32]], w: &CpuMatrix, exact: &[f32], w_rows: Range<usize>) {
        let (n, k) = (w_rows.len(), w.cols);
        let dst_at = Strided {
            offset: 3,
            row_stride: n + 5,
        };
        let mut dst = vec![f32::NAN; dst_at.offset + inputs.len() * dst_at.row_stride];
        gemv_into(inputs, w, w_rows.clone(), &mut dst, dst_at);
        for (i, x) in inputs.iter().enumerate() {
            for j in 0..n {
                let row = &exact[(w_rows.start + j) * k..][..k];
                let terms = x
                    .iter()
                    .zip(row)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b));
                let want: f64 = terms.clone().sum();
                let size: f64 = terms.map(f64::abs).sum();
                let got = f64::from(dst[dst_at.offset + i * dst_at.row_stride + j]);
                assert!(
                    (got - want).abs() <= 1e-6 * size + 1e-35,
                    "{} inputs, {n} x {k}: input {i} row {j}: {got} vs {want} (size {size})",
                    inputs.len()
                );
            }
            let row = &dst[dst_at.offset + i * dst_at.row_stride..];
            assert!(row[n..dst_at.row_stride.min(row.len())]
                .iter()
                .all(|v| v.is_nan()));
        }
        assert!(dst[..dst_at.offset].iter().all(|v| v.is_nan()));
    }

    /// Inputs over six orders of magnitude (under 2⁷), some exactly zero.
    fn inputs(count: usize, k: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|i| {
                values(100 + i as u64, k)
                    .iter()
                    .enumerate()
                    .map(|(j, &v)| {
                        if j % 13 == 0 {
                            0.0
                        } else {
                            v * 10f32.powi((j % 6) as i32 - 4)
                        }
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn fp8_products_on_the_tiles_match_f64_sums() {
        if skipped_without_tiles() {
            return;
        }
        let _keeps_buffers = super::super::CpuBackend::new(2).unwrap();
        // Rows: partial strips and passes, several tasks; columns: a partial scale block (96,
        // 160), one chunk, several blocks.
        for &(rows, k) in &[
            (17, 32),
            (40, 96),
            (100, 160),
            (300, 256),
            (64, 512),
            (530, 128),
        ] {
            let (m, exact) = fp8_matrix(rows + 3, k, rows as u64);
            for count in [1, 2, 3, 5, 6, 8, 10] {
                let xs = inputs(count, k);
                let xs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                check(&xs, &m, &exact, 2..2 + rows);
            }
        }
    }

    #[test]
    fn bf16_products_on_the_tiles_match_f64_sums() {
        if skipped_without_tiles() {
            return;
        }
        let _keeps_buffers = super::super::CpuBackend::new(2).unwrap();
        for &(rows, k) in &[(16, 32), (33, 64), (250, 192), (70, 1024)] {
            let w: Vec<bf16> = values(rows as u64, (rows + 1) * k)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let exact: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
            let m = CpuMatrix {
                rows: rows + 1,
                cols: k,
                data: MatrixData::Bf16(w),
            };
            for count in [1, 4, 7, 10] {
                // bf16 takes inputs of any finite size.
                let xs: Vec<Vec<f32>> = inputs(count, k)
                    .into_iter()
                    .map(|x| x.iter().map(|v| v * 1e6).collect())
                    .collect();
                let xs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
                check(&xs, &m, &exact, 1..1 + rows);
            }
        }
    }

    /// What the tiles cannot do exactly stays on the AVX-512 kernels: FP8 inputs of 2⁷ or more
    /// (scaled by 2¹²⁰ they would overflow), NaN or infinite inputs, NaN codes, rows not whole
    /// chunks, one input or more than ten, B tiles past L1.
    #[test]
    fn products_the_tiles_cannot_do_exactly_are_left_to_the_vector_kernels() {
        if skipped_without_tiles() {
            return;
        }
        let k = 64;
        let (m, _) = fp8_matrix(32, k, 1);
        let x = vec![1.0f32; k];
        let two = [&x[..], &x[..]];
        assert!(takes(&two, &m));
        assert!(!takes(&two[..1], &m));
        assert!(!takes(&[&x[..]; MAX_INPUTS + 1], &m));
        for bad in [128.0, -200.0, f32::NAN, f32::INFINITY] {
            let mut y = x.clone();
            y[5] = bad;
            assert!(!takes(&[&x[..], &y[..]], &m), "input {bad}");
        }
        let w: Vec<bf16> = vec![bf16::ONE; 32 * k];
        let bf = CpuMatrix {
            rows: 32,
            cols: k,
            data: MatrixData::Bf16(w),
        };
        let mut big = x.clone();
        big[0] = 1e30;
        assert!(takes(&[&x[..], &big[..]], &bf));
        big[0] = f32::INFINITY;
        assert!(!takes(&[&x[..], &big[..]], &bf));
        let mut codes = vec![0x38u8; 32 * k];
        codes[40] = 0x7f;
        let nan = WeightData::whole(
            WeightFormat::Fp8E4m3 { block: [128, 128] },
            &codes,
            vec![1.0],
            32,
            k,
        );
        let nan = CpuMatrix {
            rows: 32,
            cols: k,
            data: MatrixData::Native(Native::of(&nan).unwrap()),
        };
        assert!(!takes(&two, &nan));
        let (odd, _) = fp8_matrix(32, 48, 2);
        let x48 = [1.0f32; 48];
        assert!(!takes(&[&x48[..], &x48[..]], &odd));
        let wide = 4096;
        let (m, _) = fp8_matrix(1, wide, 3);
        let xw = vec![1.0f32; wide];
        assert!(
            !takes(&[&xw[..], &xw[..]], &m),
            "two inputs of 4096: 48 KiB of B"
        );
    }
}
