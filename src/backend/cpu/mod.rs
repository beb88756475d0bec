//! The CPU backend: host memory, f32 activations, f32 or bf16 weights, every op parallelised
//! on the engine's own rayon pool (`threads` param; no global pool).

mod aligned;
#[cfg(target_arch = "x86_64")]
mod amx;
mod amx_decode;
mod arena;
mod attention;
mod copier;
mod exp;
mod gemm;
mod gemv;
mod hc;
mod hot;
mod huge_pages;
mod moe;
mod op_times;
mod ops;
mod paired;
mod pool;
mod quant;
mod recycle;
#[cfg(test)]
mod test_data;

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use half::bf16;

use super::{
    AttentionArgs, Backend, CompressArgs, CopyDirection, CopyRegion, Expert, HcMix, HcParams,
    IndexerArgs, PageTable, Precision, RouteArgs, Routing, RowLayout, Rows, Ticket, TierCopy,
    WeightData, WeightFormat,
};
use crate::error::{Error, Result};
use crate::formats::rows::RowCodec;
#[cfg(target_arch = "x86_64")]
pub use amx::{set_amx, supported as amx_supported};
pub use op_times::{record_op_times, take_op_times, OpTime};

/// No AMX on this architecture: nothing to turn off.
#[cfg(not(target_arch = "x86_64"))]
pub fn set_amx(_on: bool) {}

/// No AMX on this architecture.
#[cfg(not(target_arch = "x86_64"))]
pub fn amx_supported() -> bool {
    false
}
pub use pool::CpuBuffer;

/// An empty vector with room for `capacity` values, on 2 MiB pages where the kernel allows
/// (as this backend holds its weights): for a measurement that should see memory as the
/// weights do, such as `bench_forward`'s plain read (4 KiB pages read 5-15 % slower here).
pub fn huge_page_vec<T>(capacity: usize) -> Vec<T> {
    huge_pages::reserve(capacity)
}

/// f32 values in host memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuTensor(pub(crate) Vec<f32>);

/// Values below which `split` copies on the calling thread.
const SPLIT_PAR_MIN: usize = 1 << 18;

/// A product's output: every value is written by the product (`gemm_into` assigns), so a
/// kept buffer is not zeroed first; a matrix with no columns writes nothing (zeros).
fn product_output(len: usize, w: &CpuMatrix) -> Vec<f32> {
    if w.cols == 0 {
        recycle::zeroed(len)
    } else {
        recycle::overwritten(len)
    }
}

impl CpuTensor {
    /// Its values, taken out (a tensor that drops hands them to `recycle` instead).
    fn into_vec(mut self) -> Vec<f32> {
        std::mem::take(&mut self.0)
    }
}

/// A large tensor's buffer goes back to `recycle` for the next op (pages kept resident).
impl Drop for CpuTensor {
    fn drop(&mut self) {
        recycle::give(std::mem::take(&mut self.0));
    }
}

/// A weight matrix `[rows, cols]`, row-major.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    rows: usize,
    cols: usize,
    data: MatrixData,
}

#[derive(Debug, Clone)]
enum MatrixData {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    /// FP8 / FP4 as the checkpoint stores them, decoded where used (`quant`).
    Native(quant::Native),
    /// Row blocks in different formats (a fused projection whose parts are stored apart:
    /// FP8 linears stacked with bf16 compressor projections), each with its first row.
    Stacked(Vec<(usize, CpuMatrix)>),
}

impl CpuMatrix {
    /// How it is stored, for op labels: `fp8`, `bf16`, parts joined with `+`.
    fn storage(&self) -> String {
        match &self.data {
            MatrixData::F32(_) => "f32".into(),
            MatrixData::Bf16(_) => "bf16".into(),
            MatrixData::Native(n) => n.name().into(),
            MatrixData::Stacked(parts) => {
                let names: Vec<String> = parts.iter().map(|(_, m)| m.storage()).collect();
                names.join("+")
            }
        }
    }

    /// The values, row-major, where the matrix is stored as f32.
    fn f32_values(&self) -> Option<&[f32]> {
        match &self.data {
            MatrixData::F32(v) => Some(v),
            _ => None,
        }
    }

    /// For a stacked matrix, calls `f(part, its rows, destination)` for each part overlapping
    /// `w_rows` (rows local to the part, the destination moved to the part's first column)
    /// and returns `true`; `false` for any other matrix.
    fn for_each_part<'a>(
        &'a self,
        w_rows: &Range<usize>,
        dst_at: gemm::Strided,
        mut f: impl FnMut(&'a CpuMatrix, Range<usize>, gemm::Strided),
    ) -> bool {
        let MatrixData::Stacked(parts) = &self.data else {
            return false;
        };
        for (first, m) in parts {
            let (lo, hi) = (w_rows.start.max(*first), w_rows.end.min(first + m.rows));
            if lo < hi {
                let at = gemm::Strided {
                    offset: dst_at.offset + (lo - w_rows.start),
                    row_stride: dst_at.row_stride,
                };
                f(m, lo - first..hi - first, at);
            }
        }
        true
    }
}

impl MatrixData {
    /// Puts the weights on huge pages where the kernel can (see `huge_pages`).
    fn advise_huge_pages(&self) {
        match self {
            MatrixData::F32(v) => huge_pages::advise(v),
            MatrixData::Bf16(v) => huge_pages::advise(v),
            MatrixData::Native(n) => n.for_each_buffer(huge_pages::advise),
            // Each part was advised when it was made.
            MatrixData::Stacked(_) => {}
        }
    }

    /// Row `r` of a `cols`-wide matrix as f32 into `out[..cols]`.
    fn row_into(&self, cols: usize, r: usize, out: &mut [f32]) {
        match self {
            MatrixData::F32(v) => out[..cols].copy_from_slice(&v[r * cols..(r + 1) * cols]),
            MatrixData::Bf16(v) => {
                for (o, x) in out[..cols].iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
                    *o = x.to_f32();
                }
            }
            MatrixData::Native(n) => n.decode_row(cols, r, out),
            MatrixData::Stacked(parts) => {
                let (first, m) = parts
                    .iter()
                    .rev()
                    .find(|(first, _)| *first <= r)
                    .expect("row 0 starts the first part");
                m.data.row_into(cols, r - first, out);
            }
        }
    }
}

/// i32 values in host memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuIndex(pub(crate) Vec<i32>);

/// Page tables are uploaded as non-negative unit indices.
impl PageTable for CpuIndex {
    fn page(&self, i: usize) -> usize {
        self.0[i] as usize
    }
}

/// Inverse frequencies of one RoPE set.
#[derive(Debug, Clone)]
pub struct CpuRope(Vec<f32>);

/// The CPU backend and its thread pool.
pub struct CpuBackend {
    /// Dropped by hand in `Drop` (before waiting for its threads to exit).
    pool: ManuallyDrop<rayon::ThreadPool>,
    /// The pool's threads, joined on drop.
    handles: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Bytes held by live pool buffers.
    allocated: Arc<AtomicU64>,
    copier: copier::Copier,
    /// Counts this pool's threads among the process's while it lives (see `hot`).
    _counted: hot::PoolThreads,
}

impl CpuBackend {
    /// The op timer of a product of `rows` inputs with `w` (`matmul`, `matmul_split`).
    fn time_matmul(&self, rows: usize, w: &CpuMatrix) -> op_times::OpTimer {
        op_times::product(
            || format!("matmul {rows} x {} -> {} {}", w.cols, w.rows, w.storage()),
            || self.product_work(rows, w),
        )
    }

    /// A backend running on `threads` threads (0 = every core this process may use).
    pub fn new(threads: usize) -> Result<Self> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        // Rayon drops its pool without joining the threads; spawning them ourselves keeps their
        // handles so `Drop` can join them.
        let handles: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let spawned = Arc::clone(&handles);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .spawn_handler(move |thread| {
                let handle = std::thread::Builder::new()
                    .name(format!("dsv4-cpu-{}", thread.index()))
                    .spawn(move || {
                        crate::threads::mark_internal();
                        thread.run();
                    })?;
                spawned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(handle);
                Ok(())
            })
            .build()
            .map_err(|e| Error::internal(format!("cannot start {threads} CPU threads: {e}")))?;
        recycle::backend_opened();
        Ok(Self {
            pool: ManuallyDrop::new(pool),
            handles,
            allocated: Arc::default(),
            copier: copier::Copier::default(),
            _counted: hot::PoolThreads::count(threads),
        })
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Limits tier copies to `bytes_per_s` (None: unlimited). For tests and benchmarks that need
    /// a copy to stay in flight.
    pub fn throttle_tier_copies(&self, bytes_per_s: Option<f64>) {
        self.copier.set_throttle(bytes_per_s);
    }

    /// Bytes held by live pool buffers of this backend (measured at allocation and free).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Joins every pool thread: rayon's pool only signals its threads to stop when dropped, and
    /// a host that unloads the library after `dsv4_engine_destroy` must not have dsv4 code
    /// still running.
    fn join_threads(&self) {
        let handles = std::mem::take(&mut *self.handles.lock().unwrap_or_else(|e| e.into_inner()));
        for h in handles {
            if h.join().is_err() {
                log::error!("a CPU backend thread panicked while stopping");
            }
        }
    }

    fn wrap(&self, v: Vec<f32>) -> CpuTensor {
        CpuTensor(v)
    }

    fn wrap_index(&self, v: Vec<i32>) -> CpuIndex {
        CpuIndex(v)
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// A product's weight bytes read and FLOPs with `rows` inputs (for `op_times`).
    fn product_work(&self, rows: usize, w: &CpuMatrix) -> (u64, u64) {
        let flops = 2 * rows * w.rows * w.cols;
        (Backend::matrix_bytes(self, w) as u64, flops as u64)
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        // A pool thread cannot wait for itself (the last reference dropped inside `install`).
        let on_pool_thread = self.pool.current_thread_index().is_some();
        // SAFETY: `pool` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.pool) };
        if !on_pool_thread {
            self.join_threads();
        }
        recycle::backend_closed();
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Matrix = CpuMatrix;
    type Index = CpuIndex;
    type Rope = CpuRope;
    type Buffer = CpuBuffer;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        hot::run_step(&self.pool, f)
    }

    fn release_idle_memory(&self) {
        recycle::release_idle();
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        CpuBuffer::new(bytes, self.allocated.clone())
    }

    fn prefault(&self, b: &mut CpuBuffer) -> Result<()> {
        self.pool.install(|| b.prefault())
    }

    fn buffer_bytes(&self, b: &CpuBuffer) -> usize {
        b.len()
    }

    fn buffer_region(&self, b: &CpuBuffer) -> (u64, usize) {
        // Exposed so that a reader given this address (kv's checked `read_mapped`) may use it.
        (b.base().expose_provenance() as u64, b.len())
    }

    fn buffers_in_host_memory(&self) -> bool {
        true
    }

    fn read_bytes(&self, b: &CpuBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(b.get(offset, out.len())?);
        Ok(())
    }

    fn write_bytes(&self, b: &mut CpuBuffer, offset: usize, data: &[u8]) -> Result<()> {
        b.get_mut(offset, data.len())?.copy_from_slice(data);
        Ok(())
    }

    fn copy_tier(
        &self,
        buffer: &CpuBuffer,
        direction: CopyDirection,
        copies: Vec<TierCopy>,
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        for c in &copies {
            buffer.check(c.pool_offset, c.len)?;
        }
        self.copier.submit(buffer.base(), direction, copies, ticket);
        Ok(())
    }

    fn copy_regions(
        &self,
        src: &CpuBuffer,
        dst: &mut CpuBuffer,
        regions: &[CopyRegion],
    ) -> Result<()> {
        for r in regions {
            dst.get_mut(r.dst, r.len)?
                .copy_from_slice(src.get(r.src, r.len)?);
        }
        Ok(())
    }

    fn write_rows(
        &self,
        dst: &mut CpuBuffer,
        layout: &RowLayout<'_, CpuIndex>,
        first: usize,
        x: &CpuTensor,
        rows: Range<usize>,
    ) -> Result<()> {
        let _t = op_times::op("write_rows");
        pool::write_rows(dst, layout, first, &x.0, rows);
        Ok(())
    }

    fn read_rows(&self, rows: &Rows<'_, Self>, range: Range<usize>) -> Result<CpuTensor> {
        let _t = op_times::op("read_rows");
        Ok(CpuTensor(pool::gather(rows, range)))
    }

    fn codec_round_trip(&self, x: &mut CpuTensor, width: usize, codec: RowCodec) -> Result<()> {
        let _t = op_times::op("codec_round_trip");
        use rayon::prelude::*;
        if codec == RowCodec::F32 {
            return Ok(());
        }
        let row_bytes = codec.row_bytes(width);
        self.run(|| {
            x.0.par_chunks_mut(width).for_each_init(
                || vec![0u8; row_bytes],
                |bytes, row| {
                    codec.encode(row, bytes);
                    codec.decode(bytes, row);
                },
            )
        });
        Ok(())
    }

    fn tensor(&self, data: &[f32]) -> Result<CpuTensor> {
        Ok(CpuTensor(recycle::copied(data)))
    }

    fn zeros(&self, len: usize) -> Result<CpuTensor> {
        Ok(CpuTensor(recycle::zeroed(len)))
    }

    fn len(&self, t: &CpuTensor) -> usize {
        t.0.len()
    }

    fn read(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.0.clone())
    }

    fn matrix(&self, weight: &WeightData<'_>, precision: Precision) -> Result<CpuMatrix> {
        weight.check().map_err(Error::internal)?;
        let (rows, cols) = (weight.rows(), weight.cols);
        let all = |f: fn(WeightFormat) -> bool| weight.parts.iter().all(|p| f(p.format));
        let data = match precision {
            Precision::F32 => MatrixData::F32(weight.to_f32()),
            Precision::Bf16 => MatrixData::Bf16(ops::to_bf16(&weight.to_f32())),
            // FP8 / FP4 stay as stored; bf16 stays bf16 (exact); f32 and f16 become f32.
            Precision::Native => match quant::Native::of(weight) {
                Some(n) => MatrixData::Native(n),
                None if all(|f| f == WeightFormat::Bf16) => {
                    MatrixData::Bf16(ops::to_bf16(&weight.to_f32()))
                }
                // Parts in different formats: each run of one format kept its own way.
                None if weight.parts.windows(2).any(|w| w[0].format != w[1].format) => {
                    let mut parts = Vec::new();
                    let mut first = 0;
                    for run in weight.parts.chunk_by(|a, b| a.format == b.format) {
                        let part = WeightData {
                            cols,
                            parts: run.to_vec(),
                        };
                        let m = self.matrix(&part, precision)?;
                        let rows = m.rows;
                        parts.push((first, m));
                        first += rows;
                    }
                    MatrixData::Stacked(parts)
                }
                None => MatrixData::F32(weight.to_f32()),
            },
        };
        data.advise_huge_pages();
        Ok(CpuMatrix { rows, cols, data })
    }

    fn matrix_shape(&self, m: &CpuMatrix) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn matrix_bytes_by_dtype(&self, m: &CpuMatrix) -> Vec<(&'static str, usize)> {
        match &m.data {
            MatrixData::F32(v) => vec![("f32", v.len() * 4)],
            MatrixData::Bf16(v) => vec![("bf16", v.len() * 2)],
            MatrixData::Native(n) => vec![(n.name(), n.bytes())],
            MatrixData::Stacked(parts) => parts
                .iter()
                .flat_map(|(_, p)| self.matrix_bytes_by_dtype(p))
                .collect(),
        }
    }

    fn matrix_bytes(&self, m: &CpuMatrix) -> usize {
        match &m.data {
            MatrixData::F32(v) => v.len() * 4,
            MatrixData::Bf16(v) => v.len() * 2,
            MatrixData::Native(n) => n.bytes(),
            MatrixData::Stacked(parts) => parts.iter().map(|(_, p)| self.matrix_bytes(p)).sum(),
        }
    }

    fn index(&self, data: &[i32]) -> Result<CpuIndex> {
        Ok(CpuIndex(data.to_vec()))
    }

    fn read_index(&self, i: &CpuIndex) -> Result<Vec<i32>> {
        Ok(i.0.clone())
    }

    fn rope(&self, inv_freq: &[f32]) -> Result<CpuRope> {
        Ok(CpuRope(inv_freq.to_vec()))
    }

    fn embed(&self, table: &CpuMatrix, ids: &CpuIndex) -> Result<CpuTensor> {
        let _t = op_times::op("embed");
        Ok(self.run(|| CpuTensor(ops::embed(table, &ids.0))))
    }

    fn matmul(&self, x: &CpuTensor, rows: usize, w: &CpuMatrix) -> Result<CpuTensor> {
        let _t = self.time_matmul(rows, w);
        let mut out = product_output(rows * w.rows, w);
        let at = |stride| gemm::Strided {
            offset: 0,
            row_stride: stride,
        };
        self.run(|| gemm::gemm_into(&x.0, at(w.cols), rows, w, 0..w.rows, &mut out, at(w.rows)));
        Ok(CpuTensor(out))
    }

    fn matmul_grouped(
        &self,
        x: &CpuTensor,
        rows: usize,
        w: &CpuMatrix,
        groups: usize,
    ) -> Result<CpuTensor> {
        let _t = op_times::product(
            || {
                let (cols, out) = (w.cols, w.rows);
                format!(
                    "matmul_grouped {rows} x {groups}x{cols} -> {out} {}",
                    w.storage()
                )
            },
            || self.product_work(rows, w),
        );
        let (in_g, out_g) = (w.cols, w.rows / groups);
        let mut out = product_output(rows * w.rows, w);
        let x_at = |g: usize| gemm::Strided {
            offset: g * in_g,
            row_stride: groups * in_g,
        };
        let dst_at = |g: usize| gemm::Strided {
            offset: g * out_g,
            row_stride: w.rows,
        };
        // On AMX tiles every group's blocks share one parallel loop (one after another, each
        // group's split and two blocks left a thread idle at every join).
        #[cfg(target_arch = "x86_64")]
        if amx::takes(rows, w) {
            let products: Vec<amx::Product<'_>> = (0..groups)
                .map(|g| amx::Product {
                    x_at: x_at(g),
                    w,
                    w_rows: g * out_g..(g + 1) * out_g,
                    dst_at: dst_at(g),
                })
                .collect();
            self.run(|| amx::products(&x.0, rows, &products, &mut out));
            return Ok(CpuTensor(out));
        }
        self.run(|| {
            for g in 0..groups {
                let w_rows = g * out_g..(g + 1) * out_g;
                gemm::gemm_into(&x.0, x_at(g), rows, w, w_rows, &mut out, dst_at(g));
            }
        });
        Ok(CpuTensor(out))
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        vectors: usize,
        dim: usize,
        weight: Option<&CpuTensor>,
        eps: f32,
    ) -> Result<CpuTensor> {
        let _t = op_times::op("rms_norm");
        debug_assert_eq!(x.0.len(), vectors * dim);
        Ok(self.run(|| {
            CpuTensor(ops::rms_norm(
                &x.0,
                dim,
                weight.map(|w| w.0.as_slice()),
                eps,
            ))
        }))
    }

    fn rope_apply(
        &self,
        x: &mut CpuTensor,
        heads: usize,
        head_dim: usize,
        rope: &CpuRope,
        positions: &CpuIndex,
        inverse: bool,
    ) -> Result<()> {
        let _t = op_times::op("rope_apply");
        self.run(|| ops::rope(&mut x.0, heads, head_dim, &rope.0, &positions.0, inverse));
        Ok(())
    }

    fn add_assign(&self, a: &mut CpuTensor, b: &CpuTensor) -> Result<()> {
        let _t = op_times::op("add_assign");
        a.0.iter_mut().zip(&b.0).for_each(|(x, y)| *x += y);
        Ok(())
    }

    fn split(&self, x: &CpuTensor, rows: usize, widths: &[usize]) -> Result<Vec<CpuTensor>> {
        let _t = op_times::op("split");
        let total: usize = widths.iter().sum();
        debug_assert_eq!(x.0.len(), rows * total);
        if rows * total < SPLIT_PAR_MIN || total == 0 {
            let mut parts: Vec<Vec<f32>> = widths
                .iter()
                .map(|w| recycle::with_capacity(rows * w))
                .collect();
            for row in x.0.chunks(total.max(1)) {
                let mut at = 0;
                for (part, &w) in parts.iter_mut().zip(widths) {
                    part.extend_from_slice(&row[at..at + w]);
                    at += w;
                }
            }
            return Ok(parts.into_iter().map(CpuTensor).collect());
        }
        // A prefill's fused projection (megabytes): each part's rows copied in parallel.
        let starts = widths.iter().scan(0, |at, &w| {
            *at += w;
            Some(*at - w)
        });
        let mut parts: Vec<(Vec<f32>, usize, usize)> = widths
            .iter()
            .zip(starts)
            .map(|(&w, at)| (recycle::overwritten(rows * w), at, w))
            .collect();
        self.run(|| {
            use rayon::prelude::*;
            parts.par_iter_mut().for_each(|(part, at, w)| {
                if *w > 0 {
                    part.par_chunks_mut(*w)
                        .zip(x.0.par_chunks(total))
                        .for_each(|(dst, row)| dst.copy_from_slice(&row[*at..*at + *w]));
                }
            })
        });
        Ok(parts.into_iter().map(|(p, _, _)| CpuTensor(p)).collect())
    }

    fn matmul_split(
        &self,
        x: &CpuTensor,
        rows: usize,
        w: &CpuMatrix,
        widths: &[usize],
    ) -> Result<Vec<CpuTensor>> {
        // A prefill's fused projection: each part's columns written into its own tensor by
        // its own product over its weight rows (the products' sums are the same: each output
        // is one row of `w` against one row of `x`), instead of the whole product written and
        // then copied out part by part (24 splits, ~6 ms of a 512-token prefill of the bench
        // model). A decode step's is kept whole: a product a part would fork and join the
        // workers once a part, which costs more there than the copy of a few rows.
        if rows <= gemv::MAX_ROWS || widths.iter().sum::<usize>() != w.rows {
            let y = self.matmul(x, rows, w)?;
            return self.split(&y, rows, widths);
        }
        let _t = self.time_matmul(rows, w);
        let at = |stride| gemm::Strided {
            offset: 0,
            row_stride: stride,
        };
        Ok(self.run(|| {
            let mut start = 0;
            widths
                .iter()
                .map(|&width| {
                    let mut out = product_output(rows * width, w);
                    let part = start..start + width;
                    if width > 0 {
                        gemm::gemm_into(&x.0, at(w.cols), rows, w, part, &mut out, at(width));
                    }
                    start += width;
                    CpuTensor(out)
                })
                .collect()
        }))
    }

    fn take_rows(&self, x: &CpuTensor, cols: usize, rows: &[usize]) -> Result<CpuTensor> {
        let _t = op_times::op("take_rows");
        Ok(CpuTensor(ops::take_rows(&x.0, cols, rows)))
    }

    fn swiglu(
        &self,
        gate_up: &CpuTensor,
        _rows: usize,
        inter: usize,
        limit: f32,
    ) -> Result<CpuTensor> {
        let _t = op_times::op("swiglu");
        Ok(self.run(|| CpuTensor(ops::swiglu(&gate_up.0, inter, limit))))
    }

    fn fp8_round_trip(
        &self,
        x: &mut CpuTensor,
        width: usize,
        channels: usize,
        block: usize,
    ) -> Result<()> {
        let _t = op_times::op("fp8_round_trip");
        self.run(|| ops::fp8_round_trip(&mut x.0, width, channels, block));
        Ok(())
    }

    fn hadamard_fp4_round_trip(&self, x: &mut CpuTensor, dim: usize, block: usize) -> Result<()> {
        let _t = op_times::op("hadamard_fp4_round_trip");
        self.run(|| ops::hadamard_fp4_round_trip(&mut x.0, dim, block));
        Ok(())
    }

    fn hc_pre(&self, x: &CpuTensor, rows: usize, p: &HcParams<'_, Self>) -> Result<HcMix<Self>> {
        let _t = op_times::op("hc_pre");
        Ok(self.run(|| hc::pre(self, &x.0, rows, p)))
    }

    fn hc_post(
        &self,
        out: &CpuTensor,
        x: &CpuTensor,
        mix: &HcMix<Self>,
        _rows: usize,
        hc: usize,
        dim: usize,
    ) -> Result<CpuTensor> {
        let _t = op_times::op("hc_post");
        Ok(self.run(|| CpuTensor(hc::post(&out.0, &x.0, mix, hc, dim))))
    }

    fn hc_post_pre(
        &self,
        out: &CpuTensor,
        x: CpuTensor,
        mix: &HcMix<Self>,
        rows: usize,
        hc: usize,
        dim: usize,
        next: &HcParams<'_, Self>,
    ) -> Result<(CpuTensor, HcMix<Self>)> {
        let _t = op_times::op("hc_post_pre");
        debug_assert_eq!((next.hc, next.dim), (hc, dim));
        // Fewer rows than a tile per worker (decode): apart, where each product splits over
        // the workers instead.
        if rows < hc::TILE * rayon::current_num_threads().max(2) {
            let streams = self.hc_post(out, &x, mix, rows, hc, dim)?;
            let mix = self.hc_pre(&streams, rows, next)?;
            return Ok((streams, mix));
        }
        let (streams, mix) = self.run(|| hc::post_pre(self, &out.0, x.into_vec(), mix, rows, next));
        Ok((CpuTensor(streams), mix))
    }

    fn hc_head(&self, x: &CpuTensor, rows: usize, p: &HcParams<'_, Self>) -> Result<CpuTensor> {
        let _t = op_times::op("hc_head");
        Ok(self.run(|| CpuTensor(hc::head(&x.0, rows, p))))
    }

    fn hc_expand(&self, x: &CpuTensor, _rows: usize, hc: usize, dim: usize) -> Result<CpuTensor> {
        let _t = op_times::op("hc_expand");
        Ok(hc::expand(self, &x.0, hc, dim))
    }

    fn compress(
        &self,
        state: &mut CpuBuffer,
        frontier: usize,
        args: &CompressArgs<'_, Self>,
    ) -> Result<(CpuTensor, usize)> {
        let _t = op_times::op("compress");
        let coff = if args.overlap { 2 } else { 1 };
        let len = coff * args.ratio * 2 * coff * args.width * 4;
        let values: &mut [f32] = bytemuck::cast_slice_mut(state.range_mut(frontier, len));
        let (rows, n) = attention::compress(values, args);
        Ok((CpuTensor(rows), n))
    }

    fn indexer_top_k(&self, seqs: &[IndexerArgs<'_, Self>]) -> Result<Vec<(CpuIndex, usize)>> {
        let _t = op_times::op("indexer_top_k");
        use rayon::prelude::*;
        Ok(self.run(|| {
            seqs.par_iter()
                .map(|args| {
                    let (sel, k) = attention::indexer_top_k(args);
                    (CpuIndex(sel), k)
                })
                .collect()
        }))
    }

    fn attention(&self, seqs: &[AttentionArgs<'_, Self>], out: &mut CpuTensor) -> Result<()> {
        let _t = op_times::op("attention");
        self.run(|| attention::attention(seqs, out));
        Ok(())
    }

    fn route(&self, args: &RouteArgs<'_, Self>) -> Result<Routing<Self>> {
        let _t = op_times::op("route");
        moe::route(self, args)
    }

    fn moe(
        &self,
        x: &CpuTensor,
        rows: usize,
        routing: &Routing<Self>,
        experts: &[Expert<Self>],
        inter: usize,
        limit: f32,
    ) -> Result<CpuTensor> {
        let _t = op_times::op("moe");
        Ok(self.run(|| CpuTensor(moe::moe(&x.0, rows, routing, experts, inter, limit))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ops that write every value of their output into a kept buffer without zeroing it
    /// first (embed, RMS norm, SwiGLU) leave none of its old values: kept buffers of their
    /// sizes are seeded with NaN, and every output value is the formula's.
    #[test]
    fn ops_writing_into_kept_buffers_leave_none_of_their_old_values() {
        use crate::backend::{Precision, WeightData, WeightFormat};
        let cpu = CpuBackend::new(2).unwrap();
        // The second size's buffers (2 and 1 MiB) are ones the pool keeps (checked).
        for (rows, dim) in [(3, 40), (2048, 256)] {
            if rows * dim * 2 >= recycle::MIN_BYTES {
                recycle::give(vec![f32::NAN; rows * dim / 2]);
                let probe = recycle::overwritten(rows * dim / 2);
                assert!(probe.iter().all(|v| v.is_nan()), "the pool keeps this size");
                recycle::give(probe);
            }
            for len in [rows * dim, rows * dim / 2] {
                recycle::give(vec![f32::NAN; len]);
            }
            let x: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.31).sin()).collect();
            let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 * 0.01).collect();
            let y = cpu
                .rms_norm(
                    &CpuTensor(x.clone()),
                    rows,
                    dim,
                    Some(&CpuTensor(w.clone())),
                    1e-6,
                )
                .unwrap();
            for (r, (row, got)) in x.chunks(dim).zip(y.0.chunks(dim)).enumerate() {
                let ms: f64 = row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    / dim as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for (c, &g) in got.iter().enumerate() {
                    let want = f64::from(row[c]) * inv * f64::from(w[c]);
                    assert!(
                        (f64::from(g) - want).abs() < 1e-5,
                        "rms_norm {rows} x {dim}: {r}, {c}"
                    );
                }
            }
            recycle::give(vec![f32::NAN; rows * dim / 2]);
            let s = cpu
                .swiglu(&CpuTensor(x.clone()), rows, dim / 2, 0.0)
                .unwrap();
            for (r, (gu, got)) in x.chunks(dim).zip(s.0.chunks(dim / 2)).enumerate() {
                for (c, &g) in got.iter().enumerate() {
                    let (a, u) = (gu[c], gu[dim / 2 + c]);
                    let want = a / (1.0 + (-a).exp()) * u;
                    assert!((g - want).abs() < 1e-6, "swiglu {rows} x {dim}: {r}, {c}");
                }
            }
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let table = WeightData::whole(WeightFormat::F32, &bytes, vec![], rows, dim);
            let table = cpu.matrix(&table, Precision::F32).unwrap();
            let ids: Vec<i32> = (0..rows as i32).rev().collect();
            recycle::give(vec![f32::NAN; rows * dim]);
            let e = cpu.embed(&table, &cpu.index(&ids).unwrap()).unwrap();
            for (got, &id) in e.0.chunks(dim).zip(&ids) {
                let id = id as usize;
                assert_eq!(
                    got,
                    &x[id * dim..(id + 1) * dim],
                    "embed {rows} x {dim}: {id}"
                );
            }
        }
    }

    /// A fused projection's parts made where they go (`matmul_split`, a prefill's rows) are
    /// bit for bit the whole product split (`split(matmul)`, what a decode step's rows and
    /// the default take), for a matrix of FP8 and bf16 parts stacked (parts' boundaries not
    /// the widths') and a plain f32 one, with a part of width 0.
    #[test]
    fn parts_made_where_they_go_equal_the_product_split() {
        use crate::backend::{Precision, WeightData, WeightFormat, WeightPart};
        let cpu = CpuBackend::new(2).unwrap();
        let cols = 256;
        let fp8: Vec<u8> = (0..256 * cols).map(|i| ((i * 37) % 254) as u8).collect();
        let bf16s: Vec<u8> = (0..64 * cols)
            .flat_map(|i| half::bf16::from_f32((i as f32 * 0.013).sin()).to_le_bytes())
            .collect();
        let part = |format, bytes, scales, rows: usize| WeightPart {
            format,
            bytes,
            scales,
            stored_rows: rows,
            rows: 0..rows,
        };
        let stacked = WeightData {
            cols,
            parts: vec![
                part(
                    WeightFormat::Fp8E4m3 { block: [128, 128] },
                    &fp8[..],
                    vec![0.5, 0.25, 2.0, 1.0],
                    256,
                ),
                part(WeightFormat::Bf16, &bf16s[..], vec![], 64),
            ],
        };
        let f32s: Vec<u8> = (0..96 * cols)
            .flat_map(|i| ((i as f32 * 0.07).cos()).to_le_bytes())
            .collect();
        let plain = WeightData::whole(WeightFormat::F32, &f32s, vec![], 96, cols);
        for (weight, widths) in [(stacked, vec![100, 0, 200, 20]), (plain, vec![32, 64])] {
            let m = cpu.matrix(&weight, Precision::Native).unwrap();
            for rows in [3, 40, 200] {
                let x: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
                let x = CpuTensor(x);
                let whole = cpu.matmul(&x, rows, &m).unwrap();
                let want = cpu.split(&whole, rows, &widths).unwrap();
                let got = cpu.matmul_split(&x, rows, &m, &widths).unwrap();
                assert_eq!(got.len(), widths.len());
                for (p, (g, w)) in got.iter().zip(&want).enumerate() {
                    let bits = |t: &CpuTensor| t.0.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(g), bits(w), "{rows} rows, part {p}");
                }
            }
        }
    }

    /// Each part is its columns of every row, on the serial path and the parallel one (a
    /// prefill's fused projection), with a part of width 0 and kept buffers seeded with NaNs.
    #[test]
    fn split_parts_are_the_column_ranges() {
        let cpu = CpuBackend::new(2).unwrap();
        for (rows, widths) in [(3, vec![2, 0, 5]), (512, vec![448, 0, 1024, 64, 3])] {
            let total: usize = widths.iter().sum();
            let x: Vec<f32> = (0..rows * total).map(|i| i as f32).collect();
            for &w in &widths {
                recycle::give(vec![f32::NAN; rows * w]);
            }
            let parts = cpu.split(&CpuTensor(x.clone()), rows, &widths).unwrap();
            let mut at = 0;
            for (part, &w) in parts.iter().zip(&widths) {
                let want: Vec<f32> = x
                    .chunks(total)
                    .flat_map(|row| row[at..at + w].iter().copied())
                    .collect();
                assert_eq!(part.0, want, "{rows} rows, part at {at} of width {w}");
                at += w;
            }
        }
    }
}
