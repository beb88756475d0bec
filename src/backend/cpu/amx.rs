//! Prefill products on Intel AMX tiles (Sapphire Rapids and later) at f32 working precision.
//!
//! A tile product multiplies bf16 values and accumulates in f32. Every f32 input is split into
//! three bf16 parts that sum to it exactly (its 24 significant bits, 8 at a time), and the
//! weights are bf16 already or FP8/FP4 values times a power-of-two scale (exact in bf16 too).
//! A product of two bf16 values is exact in f32, so the only rounding is the accumulation's,
//! as in the f32 kernels (in another order: sums agree to the last few bits, not bit for bit).
//! Three passes triple the bf16 work and still beat the f32 FMA kernels several times over: one
//! core's tile unit multiplies ~16× the values of its AVX-512 units per cycle.
//!
//! Where the f32 path differs: the tile unit reads subnormal bf16 values as zero and flushes
//! subnormal results, so an input under 2^-103 loses its last part (under 2^-126, all of it)
//! and sums under 2^-126 become zero; an infinite input becomes NaN (its parts are Inf and
//! Inf − Inf), as does a finite one times an infinite weight (a zero part times Inf). NaN
//! stays NaN. Activations and checkpoint weights live far from those ranges.
//!
//! Linux lends the tile registers to a process that asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
//! as oneDNN does; `DSV4_CPU_AMX=0` in the environment keeps the library from asking (a host
//! whose threads run on small signal stacks: the kernel refuses those afterwards).

use std::arch::asm;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use rayon::prelude::*;

use super::gemm::{Dst, Strided};
use super::{recycle, CpuMatrix, MatrixData};

/// Rows of every tile; columns of an accumulator tile.
pub(super) const TILE: usize = 16;
/// Input columns one tile product takes (a 64-byte row of bf16).
pub(super) const CHUNK: usize = 32;
/// Bytes of one task's packed weights: the panel stays in L2 (2 MiB a core on Sapphire
/// Rapids) while every row strip passes it.
const PANEL_BYTES: usize = 1 << 20;

static OFF: AtomicBool = AtomicBool::new(false);

/// Turns the AMX products off (`false`) or back on where the CPU has them: benchmarks and
/// tests compare the two paths in one process.
pub fn set_amx(on: bool) {
    OFF.store(!on, Ordering::Relaxed);
}

/// Whether prefill products run on the tiles now.
pub(super) fn enabled() -> bool {
    !OFF.load(Ordering::Relaxed) && supported()
}

/// Whether a product of `rows` input rows with `w` runs on the tiles: more rows than the
/// decode kernels take, some input columns, weights not f32, and the tiles on.
pub(super) fn takes(rows: usize, w: &CpuMatrix) -> bool {
    rows > super::gemv::MAX_ROWS && w.cols > 0 && !matches!(w.data, MatrixData::F32(_)) && enabled()
}

/// The CPU has AMX-TILE and AMX-BF16, the environment does not say `DSV4_CPU_AMX=0`, and the
/// kernel granted this process the tile data (asked once).
pub fn supported() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        if std::env::var("DSV4_CPU_AMX").is_ok_and(|v| v == "0" || v == "off") {
            return false;
        }
        detect_and_request()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect_and_request() -> bool {
    // The split and the packing use AVX-512 (every AMX CPU has it, but a VM may hide it).
    if !(std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl"))
    {
        return false;
    }
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    if std::arch::x86_64::__get_cpuid_max(0).0 < 7 {
        return false;
    }
    let leaf = std::arch::x86_64::__cpuid_count(7, 0);
    if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes which state components this process
    // may use; it fails cleanly (nonzero) on a kernel without AMX support.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    granted == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect_and_request() -> bool {
    false
}

/// What `ldtilecfg` reads: the palette, then each tile's bytes a row and rows.
#[repr(C, align(64))]
pub(super) struct TileConfig {
    pub palette: u8,
    pub start_row: u8,
    pub reserved: [u8; 14],
    pub bytes_per_row: [u16; 16],
    pub rows: [u8; 16],
}

/// The prefill's tiles, each 16 rows of 64 bytes: 0-3 accumulators (16 × 16 f32), 4-5 input
/// parts (16 rows × 32 bf16), 6-7 weights (16 rows of pairs: 16 columns × 2 bf16).
const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// f32 storage (from `recycle`) holding bf16 pairs as bit patterns, from a 64-byte line on.
pub(super) struct Words {
    buf: Vec<f32>,
    pad: usize,
}

impl Words {
    pub(super) fn new(len: usize) -> Self {
        let buf = recycle::overwritten(len + 16);
        let pad = (buf.as_ptr() as usize / 4).wrapping_neg() % 16;
        Words { buf, pad }
    }

    pub(super) fn slice_mut(&mut self) -> &mut [f32] {
        let pad = self.pad;
        &mut self.buf[pad..]
    }

    pub(super) fn as_ptr(&self) -> *const f32 {
        self.buf[self.pad..].as_ptr()
    }

    pub(super) fn give(self) {
        recycle::give(self.buf);
    }
}

/// One bf16 pair as the tiles read it: `a` in the low half, `b` in the high.
fn pair(a: u32, b: u32) -> f32 {
    f32::from_bits(a | (b << 16))
}

/// The input rows split into three parts, laid out as the tiles read them: for each 16-row
/// tile of rows and each 32-column chunk, the three parts' 16 × 32 bf16 tiles (1 KiB each,
/// zeros past the last row and column) one after another. Contiguous tiles: a row-major plane
/// of 2^n-byte rows put all 16 rows of a tile in one L1 set.
struct Parts {
    words: Words,
    padded_rows: usize,
    chunks: usize,
}

/// Words (4 bytes) in one 16 × 32 bf16 tile.
const TILE_WORDS: usize = TILE * CHUNK / 2;

/// The top halves of 32 f32 bit patterns (`a` then `b`, their low halves ignored) as 32
/// bf16 values in order: 16 pair words.
///
/// # Safety
/// AVX-512F/BW available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn top_halves(
    a: std::arch::x86_64::__m512i,
    b: std::arch::x86_64::__m512i,
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // packus interleaves its operands by 128-bit lane (4 values of each); the permutation
    // puts them back in order.
    let order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    let (a, b) = (_mm512_srli_epi32::<16>(a), _mm512_srli_epi32::<16>(b));
    _mm512_permutexvar_epi64(order, _mm512_packus_epi32(a, b))
}

/// `out[i]` = the pair (`x[2i]`, `x[2i + 1]`) for values exact in bf16 (decoded FP8/FP4), 32
/// at a time; `x.len()` a multiple of 32, `out` half as long.
///
/// # Safety
/// AVX-512F/BW available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pair_words(x: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(x.len().is_multiple_of(CHUNK) && out.len() >= x.len() / 2);
    for (i, chunk) in x.chunks_exact(CHUNK).enumerate() {
        // SAFETY: 32 values read from `chunk`, 16 words written at out[16i..] (asserted).
        unsafe {
            let a = _mm512_castps_si512(_mm512_loadu_ps(chunk.as_ptr()));
            let b = _mm512_castps_si512(_mm512_loadu_ps(chunk.as_ptr().add(TILE)));
            let words = top_halves(a, b);
            _mm512_storeu_si512(out.as_mut_ptr().add(i * TILE) as *mut __m512i, words);
        }
    }
}

/// Sixteen f32 values as three vectors of f32 bit patterns whose top halves are bf16 values
/// summing to them exactly (24 significant bits, 8 at a time; low halves zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) fn parts(v: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m512i; 3] {
    use std::arch::x86_64::*;
    let keep = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let hi = _mm512_and_si512(_mm512_castps_si512(v), keep);
    let rest = _mm512_sub_ps(v, _mm512_castsi512_ps(hi));
    let mid = _mm512_and_si512(_mm512_castps_si512(rest), keep);
    let lo = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(mid)));
    [hi, mid, lo]
}

/// Row `x`'s parts into its place in a row tile's run of `chunks` × 3 tiles (`out` is that run
/// from the row's first 64 bytes on).
///
/// # Safety
/// AVX-512F/BW available; `out` valid for the run (`chunks` · 3 tiles, less the row offset);
/// `x.len()` ≤ `chunks` · 32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_row(x: &[f32], chunks: usize, out: *mut f32) {
    use std::arch::x86_64::*;
    for c in 0..chunks {
        let from = c * CHUNK;
        let take = x.len().saturating_sub(from).min(CHUNK);
        let mask = ((1u64 << take) - 1) as u32;
        // SAFETY: lanes past `x.len()` are masked off (masked loads do not fault there); each
        // store writes this row's 64 bytes of tile (c, part), inside the run.
        unsafe {
            let at = x.as_ptr().add(from.min(x.len()));
            let a = parts(_mm512_maskz_loadu_ps(mask as u16, at));
            let b = parts(_mm512_maskz_loadu_ps(
                (mask >> 16) as u16,
                at.add(TILE.min(take)),
            ));
            for part in 0..3 {
                let packed = top_halves(a[part], b[part]);
                let to = out.add((c * 3 + part) * TILE_WORDS);
                _mm512_storeu_si512(to as *mut __m512i, packed);
            }
        }
    }
}

fn split_rows(x: &[f32], x_at: Strided, rows: usize, k: usize) -> Parts {
    let chunks = k.div_ceil(CHUNK);
    let padded_rows = rows.next_multiple_of(2 * TILE);
    let run = chunks * 3 * TILE_WORDS;
    let mut words = Words::new(padded_rows / TILE * run);
    words.slice_mut()[..padded_rows / TILE * run]
        .par_chunks_mut(run)
        .enumerate()
        .for_each(|(t, tiles)| {
            for i in 0..TILE {
                let r = t * TILE + i;
                let out = tiles[i * CHUNK / 2..].as_mut_ptr();
                let row = if r < rows {
                    let start = x_at.offset + r * x_at.row_stride;
                    &x[start..start + k]
                } else {
                    &[][..]
                };
                // SAFETY: the tile path runs only where AMX is, and every AMX CPU has
                // AVX-512F/BW; `out` is row i's place in this row tile's run (`tiles`).
                unsafe { split_row(row, chunks, out) }
            }
        });
    Parts {
        words,
        padded_rows,
        chunks,
    }
}

/// Weight rows `rows` packed as the tiles read them, `groups` of 16 output columns (zeros past
/// the last row): group g's tile for input chunk c holds, in row p, column j, the pair (row
/// g·16 + j's columns c·32 + 2p and c·32 + 2p + 1); tiles follow each other by chunk, then
/// group.
fn pack(w: &CpuMatrix, rows: Range<usize>, k: usize, chunks: usize, groups: usize) -> Words {
    let row_words = chunks * CHUNK / 2;
    let group_words = row_words * TILE;
    let mut panel = Words::new(groups * group_words);
    let mut pairs = vec![0.0f32; TILE * row_words];
    let mut widened = vec![0.0f32; k];
    for g in 0..groups {
        for (t, out) in pairs.chunks_exact_mut(row_words).enumerate() {
            let r = rows.start + g * TILE + t;
            if r >= rows.end {
                out.fill(0.0);
                continue;
            }
            match &w.data {
                MatrixData::Bf16(v) => {
                    let row = &v[r * k..(r + 1) * k];
                    // A bf16 row's bytes are its pairs already (little-endian words).
                    // SAFETY: `out` holds row_words ≥ k / 2 words (4 bytes each) and `row`
                    // k bf16 values; 2·(k − k % 2) bytes are copied; distinct buffers.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            row.as_ptr() as *const u8,
                            out.as_mut_ptr() as *mut u8,
                            2 * (k - k % 2),
                        )
                    };
                    if k % 2 == 1 {
                        out[k / 2] = pair(row[k - 1].to_bits() as u32, 0);
                    }
                    out[k.div_ceil(2)..].fill(0.0);
                }
                MatrixData::Native(q) => {
                    q.decode_row(k, r, &mut widened);
                    // Decoded FP8/FP4 values have at most 4 significant bits: the top half
                    // of each is the value.
                    let whole = k - k % CHUNK;
                    // SAFETY: the tile path runs only where AMX is, and every AMX CPU has
                    // AVX-512F/BW; `whole` is a multiple of 32 and `out` holds ≥ whole / 2.
                    unsafe { pair_words(&widened[..whole], out) };
                    for (o, p) in out[whole / 2..].iter_mut().zip(widened[whole..].chunks(2)) {
                        *o = pair(
                            p[0].to_bits() >> 16,
                            p.get(1).map_or(0, |b| b.to_bits() >> 16),
                        );
                    }
                    out[k.div_ceil(2)..].fill(0.0);
                }
                MatrixData::F32(_) | MatrixData::Stacked(_) => {
                    unreachable!("f32 weights take the f32 kernels; stacked parts go one by one")
                }
            }
        }
        let dst = &mut panel.slice_mut()[g * group_words..(g + 1) * group_words];
        for c0 in (0..row_words).step_by(TILE) {
            // SAFETY: AVX-512F/VL (every AMX CPU has them); `pairs` holds 16 rows of
            // `row_words` ≥ c0 + 16 words (a multiple of 16) and `dst` row_words columns of 16.
            unsafe { super::gemm::x86::transpose16(&pairs, row_words, c0, dst, TILE, 0) };
        }
    }
    panel
}

macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly, preserves_flags)
        )
    };
}

macro_rules! tile_store {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}*1], tmm", $t),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, preserves_flags)
        )
    };
}

macro_rules! tile_product {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem, preserves_flags)
        )
    };
}

// The decode kernels (`amx_decode`) issue the same instructions.
pub(super) use {tile_load, tile_product, tile_store};

/// One task's output columns: `dst[r, j] = Σ_k x[r, k] · w[j, k]` for the `rows` rows and the
/// panel's `n` (≤ groups · 16) columns, written at `dst` with `dst_stride` floats a row.
///
/// # Safety
/// Tile data granted (`supported()`); `parts` and `panel` as `split_rows` and `pack` made them
/// (same chunk count; `groups` even); `dst` valid for `rows` rows of `n` floats at that stride and
/// written by no one else meanwhile.
unsafe fn multiply(
    parts: &Parts,
    panel: &Words,
    groups: usize,
    n: usize,
    rows: usize,
    dst: *mut f32,
    dst_stride: usize,
) {
    let chunks = parts.chunks;
    let a_base = parts.words.as_ptr() as *const u8;
    // Bytes from one row tile's run of tiles to the next.
    let run_bytes = chunks * 3 * 1024;
    let b_base = panel.as_ptr() as *const u8;
    let group_bytes = chunks * TILE * 64;
    let mut edge = Edge([0.0; TILE * TILE]);
    // SAFETY (every asm below): the configuration is loaded first; each load reads 16 rows of
    // 64 bytes inside `parts` or `panel` (their layouts above), each store writes inside
    // `dst` or `edge`; tiles are released before returning.
    unsafe {
        asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags));
        for m0 in (0..parts.padded_rows).step_by(2 * TILE) {
            let a_run = a_base.add(m0 / TILE * run_bytes);
            for g in (0..groups).step_by(2) {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem, preserves_flags)
                );
                let b0 = b_base.add(g * group_bytes);
                let b1 = b0.add(group_bytes);
                for c in 0..chunks {
                    tile_load!(6, b0.add(c * 1024), 64usize);
                    tile_load!(7, b1.add(c * 1024), 64usize);
                    for part in 0..3 {
                        let a = a_run.add((c * 3 + part) * 1024);
                        tile_load!(4, a, 64usize);
                        tile_load!(5, a.add(run_bytes), 64usize);
                        tile_product!(0, 4, 6);
                        tile_product!(1, 4, 7);
                        tile_product!(2, 5, 6);
                        tile_product!(3, 5, 7);
                    }
                }
                let j0 = g * TILE;
                let out = |i: usize, j: usize| (m0 + i * TILE, j0 + j * TILE);
                macro_rules! store {
                    ($t:literal, $i:expr, $j:expr) => {{
                        let (r, col) = out($i, $j);
                        let (take_r, take_c) = (
                            rows.saturating_sub(r).min(TILE),
                            n.saturating_sub(col).min(TILE),
                        );
                        if take_r == TILE && take_c == TILE {
                            tile_store!($t, dst.add(r * dst_stride + col), dst_stride * 4);
                        } else if take_r > 0 && take_c > 0 {
                            tile_store!($t, edge.0.as_mut_ptr(), TILE * 4);
                            for i in 0..take_r {
                                std::ptr::copy_nonoverlapping(
                                    edge.0.as_ptr().add(i * TILE),
                                    dst.add((r + i) * dst_stride + col),
                                    take_c,
                                );
                            }
                        }
                    }};
                }
                store!(0, 0, 0);
                store!(1, 0, 1);
                store!(2, 1, 0);
                store!(3, 1, 1);
            }
        }
        asm!("tilerelease", options(nostack, nomem, preserves_flags));
    }
}

#[repr(C, align(64))]
struct Edge([f32; TILE * TILE]);

/// One task: weight rows `rows` of `w` times input `input` into the destination columns at
/// `dst_offset`.
struct Task<'w> {
    input: usize,
    w: &'w CpuMatrix,
    rows: Range<usize>,
    dst_offset: usize,
}

/// One product of a call: input columns at `x_at` (k = `w.cols` wide) times weight rows
/// `w_rows`, into the destination at `dst_at`.
pub(super) struct Product<'w> {
    pub x_at: Strided,
    pub w: &'w CpuMatrix,
    pub w_rows: Range<usize>,
    pub dst_at: Strided,
}

/// [`super::gemm::gemm_into`]'s product on the tiles, for `rows` > 16 (callers check
/// [`enabled`]; [`products`] asserts the bounds).
pub(super) fn gemm_into(
    x: &[f32],
    x_at: Strided,
    rows: usize,
    w: &CpuMatrix,
    w_rows: Range<usize>,
    dst: &mut [f32],
    dst_at: Strided,
) {
    let product = Product {
        x_at,
        w,
        w_rows,
        dst_at,
    };
    products(x, rows, &[product], dst)
}

/// Several products of `rows` input rows, in one parallel loop (a grouped projection's groups;
/// callers check [`enabled`] and that the products write disjoint columns; the bounds are
/// asserted here). Each input is split once for every part of a stacked matrix (a fused
/// projection); f32 parts take the f32 kernels.
pub(super) fn products(x: &[f32], rows: usize, products: &[Product<'_>], dst: &mut [f32]) {
    if rows == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    let mut tasks = Vec::new();
    for (input, p) in products.iter().enumerate() {
        let k = p.w.cols;
        // The tasks write through a raw pointer: every product's extents are checked here.
        assert!(p.w_rows.end <= p.w.rows, "weight rows out of range");
        assert!(
            x.len() >= p.x_at.offset + (rows - 1) * p.x_at.row_stride + k,
            "lhs too short"
        );
        assert!(
            dst.len() >= p.dst_at.offset + (rows - 1) * p.dst_at.row_stride + p.w_rows.len(),
            "dst too short"
        );
        let mut parts_of_w: Vec<(&CpuMatrix, Range<usize>, Strided)> = Vec::new();
        if !p.w.for_each_part(&p.w_rows, p.dst_at, |m, part_rows, at| {
            parts_of_w.push((m, part_rows, at))
        }) {
            parts_of_w.push((p.w, p.w_rows.clone(), p.dst_at));
        }
        for (m, part_rows, at) in parts_of_w {
            if matches!(m.data, MatrixData::F32(_)) {
                super::gemm::gemm_into(x, p.x_at, rows, m, part_rows, dst, at);
                continue;
            }
            let n = part_rows.len();
            let block = n
                .div_ceil(threads)
                .next_multiple_of(2 * TILE)
                .min((PANEL_BYTES / (2 * k.max(1)) / (2 * TILE) * (2 * TILE)).max(2 * TILE));
            for j0 in (0..n).step_by(block.max(1)) {
                let j1 = (j0 + block).min(n);
                tasks.push(Task {
                    input,
                    w: m,
                    rows: part_rows.start + j0..part_rows.start + j1,
                    dst_offset: at.offset + j0,
                });
            }
        }
    }
    if tasks.is_empty() {
        return;
    }
    let inputs: Vec<Parts> = products
        .par_iter()
        .map(|p| split_rows(x, p.x_at, rows, p.w.cols))
        .collect();
    let dst_ptr = Dst(dst.as_mut_ptr());
    tasks.par_iter().for_each(|task| {
        let parts = &inputs[task.input];
        let n = task.rows.len();
        let groups = n.div_ceil(2 * TILE) * 2;
        let panel = pack(task.w, task.rows.clone(), task.w.cols, parts.chunks, groups);
        // SAFETY: AMX granted (`enabled`); `parts`/`panel` built above with the same chunk
        // count and an even group count; this task writes rows [0, rows) of its own columns
        // (a part's block: disjoint from every other task's), inside `dst` (checked by the
        // caller for every product).
        unsafe {
            multiply(
                parts,
                &panel,
                groups,
                n,
                rows,
                dst_ptr.get().add(task.dst_offset),
                products[task.input].dst_at.row_stride,
            )
        };
        panel.give();
    });
    inputs.into_iter().for_each(|p| p.words.give());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::test_data::values;
    use crate::backend::weights::{WeightData, WeightFormat};
    use half::bf16;

    /// Whether a tile test cannot run here (no AMX): says so, with what runs instead.
    fn skipped_without_tiles(instead: &str) -> bool {
        if supported() {
            return false;
        }
        println!("skipped: this CPU (or kernel) has no AMX tiles, so {instead}");
        true
    }

    /// The three parts sum to the value exactly, over f32's normal range and both signs, and
    /// land in their tiles: row i of tile (row tile, chunk, part) holds columns chunk·32.. of
    /// input row 16·(row tile) + i, zeros past the last column and row.
    #[test]
    fn parts_sum_to_the_value_exactly_in_their_tiles() {
        if skipped_without_tiles("no split runs") {
            return;
        }
        let _keeps_buffers = super::super::CpuBackend::new(2).unwrap();
        let (rows, k) = (37, 1000);
        let mut s = 0x9e37_79b9u32;
        let x: Vec<f32> = (0..rows * k)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                // Exponents 2^-100 .. 2^100 (the last part stays normal), every mantissa.
                let exp = 27 + (s >> 8) % 200;
                let bits =
                    (s & 0x8000_0000) | (exp << 23) | (s.rotate_left(i as u32 % 32) & 0x7f_ffff);
                if i % 97 == 0 {
                    0.0
                } else {
                    f32::from_bits(bits)
                }
            })
            .collect();
        let at = Strided {
            offset: 0,
            row_stride: k,
        };
        let parts = split_rows(&x, at, rows, k);
        assert_eq!((parts.padded_rows, parts.chunks), (64, 32));
        let words = &parts.words.buf[parts.words.pad..];
        let half = |word: usize, high: bool| {
            let bits = words[word].to_bits();
            f32::from_bits(if high { bits & 0xffff_0000 } else { bits << 16 }) as f64
        };
        for r in 0..parts.padded_rows {
            for col in 0..parts.chunks * CHUNK {
                let (t, i, c) = (r / TILE, r % TILE, col / CHUNK);
                let sum: f64 = (0..3)
                    .map(|p| {
                        let tile = (t * parts.chunks + c) * 3 + p;
                        half(
                            tile * TILE_WORDS + i * CHUNK / 2 + col % CHUNK / 2,
                            col % 2 == 1,
                        )
                    })
                    .sum();
                let want = if r < rows && col < k {
                    x[r * k + col] as f64
                } else {
                    0.0
                };
                assert_eq!(sum, want, "row {r} column {col}");
            }
        }
        parts.words.give();
    }

    /// Row `r` of a product against the same sums in f64: the tiles' only rounding is the f32
    /// accumulation's, so the error stays within a few ulps of Σ|x·w|.
    fn check(
        x: &[f32],
        x_at: Strided,
        rows: usize,
        w: &CpuMatrix,
        wf: &[f32],
        w_rows: Range<usize>,
    ) {
        let (n, k) = (w_rows.len(), w.cols);
        let dst_at = Strided {
            offset: 5,
            row_stride: n + 7,
        };
        let mut dst = vec![f32::NAN; dst_at.offset + rows * dst_at.row_stride];
        gemm_into(x, x_at, rows, w, w_rows.clone(), &mut dst, dst_at);
        for r in 0..rows {
            let xr = &x[x_at.offset + r * x_at.row_stride..][..k];
            for j in 0..n {
                let wr = &wf[(w_rows.start + j) * k..][..k];
                let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let size: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = dst[dst_at.offset + r * dst_at.row_stride + j] as f64;
                assert!(
                    (got - exact).abs() <= 1e-6 * size + 1e-30,
                    "{rows}x{n}x{k} [{r}, {j}]: {got} vs {exact} (size {size})"
                );
            }
            // Nothing written between rows.
            let gap = &dst[dst_at.offset + r * dst_at.row_stride + n..]
                [..7.min(dst.len() - (dst_at.offset + r * dst_at.row_stride + n))];
            assert!(
                gap.iter().all(|v| v.is_nan()),
                "row {r}: wrote past its columns"
            );
        }
        assert!(dst[..dst_at.offset].iter().all(|v| v.is_nan()));
    }

    #[test]
    fn tile_products_match_f64_sums_for_bf16_fp8_and_fp4_weights() {
        if skipped_without_tiles("the f32 kernels run instead") {
            return;
        }
        let _keeps_buffers = super::super::CpuBackend::new(2).unwrap();
        for &(rows, n, k) in &[
            (17, 33, 64),
            (19, 40, 33),
            (32, 32, 32),
            (45, 300, 130),
            (100, 520, 1024),
            (300, 64, 256),
        ] {
            let out = n + 3;
            // Inputs over six orders of magnitude, some exactly zero.
            let x_at = Strided {
                offset: 3,
                row_stride: k + 5,
            };
            let x: Vec<f32> = values(rows as u64, x_at.offset + rows * x_at.row_stride)
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    if i % 11 == 0 {
                        0.0
                    } else {
                        v * 10f32.powi((i % 7) as i32 - 3)
                    }
                })
                .collect();
            let wv = values(n as u64 + 1, out * k);
            let w16: Vec<bf16> = wv.iter().map(|&v| bf16::from_f32(v)).collect();
            let bf = CpuMatrix {
                rows: out,
                cols: k,
                data: MatrixData::Bf16(w16.clone()),
            };
            let bf_f32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            check(&x, x_at, rows, &bf, &bf_f32, 2..2 + n);
            let fp8: Vec<u8> = (0..out * k)
                .map(|i| (i * 37 % 256) as u8)
                .map(|b| if b & 0x7f == 0x7f { 0x41 } else { b })
                .collect();
            let scales: Vec<f32> = (0..out.div_ceil(128) * k.div_ceil(128))
                .map(|i| 2f32.powi(i as i32 % 5 - 2))
                .collect();
            let fp4: Vec<u8> = (0..out * k / 2).map(|i| (i * 91 % 256) as u8).collect();
            let exps: Vec<f32> = (0..out * k / 32)
                .map(|i| 2f32.powi(i as i32 % 9 - 4))
                .collect();
            let mut natives = vec![WeightData::whole(
                WeightFormat::Fp8E4m3 { block: [128, 128] },
                &fp8,
                scales,
                out,
                k,
            )];
            if k % 32 == 0 {
                natives.push(WeightData::whole(
                    WeightFormat::Fp4E2m1 { block: 32 },
                    &fp4,
                    exps,
                    out,
                    k,
                ));
            }
            // A fused projection: bf16, then each native format, then f32 rows, multiplied
            // across the parts' edges (the input split once for all of them).
            let mut stacked = vec![(0, bf)];
            let mut all = bf_f32;
            for weight in natives {
                let wf = weight.to_f32();
                let m = CpuMatrix {
                    rows: out,
                    cols: k,
                    data: MatrixData::Native(super::super::quant::Native::of(&weight).unwrap()),
                };
                check(&x, x_at, rows, &m, &wf, 1..1 + n);
                stacked.push((all.len() / k, m));
                all.extend(wf);
            }
            stacked.push((
                all.len() / k,
                CpuMatrix {
                    rows: out,
                    cols: k,
                    data: MatrixData::F32(wv.clone()),
                },
            ));
            all.extend(&wv);
            let fused = CpuMatrix {
                rows: all.len() / k,
                cols: k,
                data: MatrixData::Stacked(stacked),
            };
            check(
                &x,
                x_at,
                rows,
                &fused,
                &all,
                out / 2..all.len() / k - out / 3,
            );
        }
    }

    /// A grouped projection's groups in one call: group g's input columns times its weight
    /// rows into its output columns, each against an f64 sum.
    #[test]
    fn grouped_products_match_f64_sums() {
        if skipped_without_tiles("the f32 kernels run instead") {
            return;
        }
        let _keeps_buffers = super::super::CpuBackend::new(2).unwrap();
        let (rows, groups, k, n) = (40, 3, 96, 48);
        let x = values(7, rows * groups * k);
        let w16: Vec<bf16> = values(8, groups * n * k)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let w = CpuMatrix {
            rows: groups * n,
            cols: k,
            data: MatrixData::Bf16(w16.clone()),
        };
        let products: Vec<Product<'_>> = (0..groups)
            .map(|g| Product {
                x_at: Strided {
                    offset: g * k,
                    row_stride: groups * k,
                },
                w: &w,
                w_rows: g * n..(g + 1) * n,
                dst_at: Strided {
                    offset: g * n,
                    row_stride: groups * n,
                },
            })
            .collect();
        let mut dst = vec![f32::NAN; rows * groups * n];
        super::products(&x, rows, &products, &mut dst);
        for r in 0..rows {
            for g in 0..groups {
                let xr = &x[r * groups * k + g * k..][..k];
                for j in 0..n {
                    let wr = &w16[(g * n + j) * k..][..k];
                    let terms = xr
                        .iter()
                        .zip(wr)
                        .map(|(&a, b)| a as f64 * b.to_f32() as f64);
                    let exact: f64 = terms.clone().sum();
                    let size: f64 = terms.map(f64::abs).sum();
                    let got = dst[r * groups * n + g * n + j] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-6 * size,
                        "row {r} group {g} column {j}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}
