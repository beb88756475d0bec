//! The CUDA backend's device side: one context and stream per engine, tensors, indices and KV
//! pool buffers in device memory, host ↔ device copies, GEMMs through cuBLAS (f32 with TF32
//! off; bf16 weights with bf16 activations and f32 accumulation), and the kernels of
//! `kernels/` compiled by NVRTC for this GPU and launched from [`super::launch`]'s values.
//!
//! Weights arrive in their checkpoint formats and are converted on the device (FP8/FP4
//! dequant, f16/bf16/f32 conversion) into the precision the model asks for.
//!
//! Ops whose kernels come with "CUDA 2" (hyper-connections, the compressor, the indexer,
//! attention, MoE, grouped GEMMs, the activation FP8/FP4 round trips) return
//! `DSV4_ERR_UNSUPPORTED` naming the op; the engine refuses `backend = cuda` until they land,
//! so only the GPU op tests reach them.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use super::launch::{self, Arg, Launch};
use super::probe::{self, Gpu};
use super::{nvrtc, sources};
use crate::backend::{
    AttentionArgs, Backend, CompressArgs, CopyDirection, CopyRegion, Expert, HcMix, HcParams,
    HostPtr, IndexerArgs, Placement, Precision, RouteArgs, RouteKind, Routing, RowLayout, Rows,
    Scoring, Ticket, TierCopy, WeightData, WeightFormat,
};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::rows::RowCodec;

/// f32 activations in device memory.
pub struct CudaTensor(pub CudaSlice<f32>);

/// A weight matrix's values in device memory, in the precision the model asked for.
pub enum MatrixData {
    F32(CudaSlice<f32>),
    /// bf16 bits.
    Bf16(CudaSlice<u16>),
}

/// A weight matrix `[rows, cols]` in device memory (converted on the device from its
/// checkpoint format; native FP8/FP4 GEMMs come with the fast kernels).
pub struct CudaMatrix {
    pub data: MatrixData,
    pub rows: usize,
    pub cols: usize,
}

/// i32 indices in device memory, with the host's copy when they came from the host (page
/// tables, token ids): row kernels are bounds-checked against it before they write.
pub struct CudaIndex {
    pub dev: CudaSlice<i32>,
    pub host: Option<Vec<i32>>,
}

/// RoPE inverse frequencies in device memory.
pub struct CudaRope(pub CudaSlice<f32>);

/// One KV pool's bytes in device memory.
pub struct CudaBuffer(pub CudaSlice<u8>);

/// The CUDA backend on one GPU.
pub struct CudaBackend {
    pub gpu: Gpu,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Every entry point of `kernels/`, loaded from this GPU's architecture's cubins.
    kernels: HashMap<&'static str, CudaFunction>,
}

// SAFETY: cudarc's handles are used from one engine thread at a time (the engine thread owns
// the backend's work); the cuBLAS handle is bound to the backend's one stream.
unsafe impl Send for CudaBackend {}
// SAFETY: as above: every op goes through the backend's stream in call order.
unsafe impl Sync for CudaBackend {}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::internal(format!("CUDA {what}: {e}"))
}

fn oom(bytes: usize) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| {
        Error::new(
            ErrorKind::Capacity,
            format!(
                "cannot allocate {bytes} bytes of GPU memory ({e}): lower kv.device_memory_bytes \
                 or kv.device_memory_fraction"
            ),
        )
    }
}

/// The CUDA 2 ops, refused by name.
fn later(op: &str) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("the CUDA backend's {op} kernel lands with \"CUDA 2\"; use backend = cpu"),
    )
}

/// Compiles (or takes from the per-architecture cache) every kernel for `arch` and loads each
/// entry point into `ctx`.
fn load_kernels(ctx: &Arc<CudaContext>, arch: &str) -> Result<HashMap<&'static str, CudaFunction>> {
    let set = nvrtc::kernels_for(arch)?;
    let mut out = HashMap::new();
    for source in sources::SOURCES {
        let cubin = set
            .cubins
            .iter()
            .find(|c| c.file == source.file)
            .ok_or_else(|| Error::internal(format!("no {arch} cubin of {}", source.file)))?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.bytes.clone()))
            .map_err(driver("loading a kernel module"))?;
        for e in source.entries {
            let f = module
                .load_function(e.name)
                .map_err(|err| Error::internal(format!("kernel {}: {err}", e.name)))?;
            out.insert(e.name, f);
        }
    }
    Ok(out)
}

fn check_len(what: &str, have: usize, want: usize) -> Result<()> {
    if have != want {
        return Err(Error::internal(format!(
            "{what}: {have} values where {want} are needed"
        )));
    }
    Ok(())
}

fn check_range(len: usize, offset: usize, n: usize, what: &str) -> Result<()> {
    if offset.checked_add(n).is_none_or(|end| end > len) {
        return Err(Error::internal(format!(
            "{what}: bytes {offset}..{} are outside a buffer of {len}",
            offset.saturating_add(n)
        )));
    }
    Ok(())
}

impl CudaBackend {
    /// Opens GPU `ordinal` after checking that the driver, NVRTC and cuBLAS are loadable.
    pub fn new(ordinal: u32) -> Result<Self> {
        let gpu = probe::gpus(&[ordinal])?.remove(0);
        probe::require(
            &[probe::NVRTC, probe::CUBLAS, probe::CUBLASLT],
            probe::lib_dir().as_deref(),
        )?;
        let ctx = CudaContext::new(ordinal as usize).map_err(driver("context"))?;
        // SAFETY: every op runs on the one stream below in call order, so cudarc's per-slice
        // events (for ordering work across streams) are not needed; frees are stream-ordered.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver("stream"))?;
        let kernels = load_kernels(&ctx, &gpu.arch())?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::internal(format!("cuBLAS handle: {e}")))?;
        // SAFETY: a valid handle; CUBLAS_DEFAULT_MATH keeps f32 GEMMs in f32 (no TF32).
        let math = unsafe {
            blas_sys::cublasSetMathMode(*blas.handle(), blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
        };
        if math != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(Error::internal(format!("cublasSetMathMode: {math:?}")));
        }
        Ok(Self {
            gpu,
            ctx,
            stream,
            blas,
            kernels,
        })
    }

    /// A device pointer as a kernel argument.
    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// Launches one kernel on the backend's stream (nothing when it has no work).
    fn launch(&self, l: &Launch) -> Result<()> {
        let Some((grid, block)) = l.dims() else {
            return Ok(());
        };
        let f = self.kernels.get(l.kernel).ok_or_else(|| {
            Error::internal(format!("kernel {} is not loaded (a dsv4 bug)", l.kernel))
        })?;
        let mut b = self.stream.launch_builder(f);
        for a in &l.args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I32(v) => b.arg(v),
                Arg::I64(v) => b.arg(v),
                Arg::F32(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `launch` builds each argument list in the kernel's parameter order and
        // widths (kernels/README.md; checked against host builds of the same kernels by
        // backend::cuda::emulate), every pointer is a live allocation of this context sized
        // for the shape (checked by each op before it plans the launch), and all work is
        // ordered on this one stream.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| Error::internal(format!("launching {}: {e}", l.kernel)))
    }

    fn alloc_f32(&self, n: usize) -> Result<CudaTensor> {
        self.zeros(n)
    }

    fn index_from(&self, dev: CudaSlice<i32>) -> CudaIndex {
        CudaIndex { dev, host: None }
    }

    /// Checks that every row a layout addresses for rows `rows` lies inside `buffer_len`.
    fn check_rows(
        &self,
        layout: &RowLayout<'_, CudaIndex>,
        rows: Range<usize>,
        buffer_len: usize,
        what: &str,
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let end = match layout.placement {
            Placement::Ring { rows: ring } => {
                if ring == 0 {
                    return Err(Error::internal(format!("{what}: a ring of 0 rows")));
                }
                layout.offset + ring.min(rows.end) * layout.row_bytes
            }
            Placement::Paged {
                pages,
                rows_per_unit,
                unit_bytes,
            } => {
                let units = (rows.end - 1) / rows_per_unit.max(1) + 1;
                let Some(host) = pages.host.as_ref() else {
                    return Err(Error::internal(format!(
                        "{what}: the page table has no host copy to check against"
                    )));
                };
                if host.len() < units {
                    return Err(Error::internal(format!(
                        "{what}: rows up to {} need {units} pages, the table has {}",
                        rows.end,
                        host.len()
                    )));
                }
                let first = rows.start / rows_per_unit.max(1);
                let top = host[first..units].iter().copied().max().unwrap_or(0);
                if top < 0 {
                    return Err(Error::internal(format!("{what}: a negative page id")));
                }
                top as usize * unit_bytes + layout.offset + rows_per_unit * layout.row_bytes
            }
        };
        if end > buffer_len {
            return Err(Error::internal(format!(
                "{what}: rows {rows:?} reach byte {end} of a {buffer_len}-byte pool buffer"
            )));
        }
        Ok(())
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn upload<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> Result<CudaSlice<T>> {
        let bytes = std::mem::size_of_val(data);
        if data.is_empty() {
            return self.stream.alloc_zeros::<T>(0).map_err(oom(0));
        }
        self.stream.clone_htod(data).map_err(oom(bytes))
    }

    fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &CudaSlice<T>,
    ) -> Result<Vec<T>> {
        self.stream.clone_dtoh(s).map_err(driver("copy to host"))
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Matrix = CudaMatrix;
    type Index = CudaIndex;
    type Rope = CudaRope;
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    fn tensor(&self, data: &[f32]) -> Result<CudaTensor> {
        self.upload(data).map(CudaTensor)
    }

    fn zeros(&self, len: usize) -> Result<CudaTensor> {
        self.stream
            .alloc_zeros::<f32>(len)
            .map(CudaTensor)
            .map_err(oom(len * 4))
    }

    fn len(&self, t: &CudaTensor) -> usize {
        t.0.len()
    }

    fn read(&self, t: &CudaTensor) -> Result<Vec<f32>> {
        self.download(&t.0)
    }

    fn matrix(&self, weight: &WeightData<'_>, precision: Precision) -> Result<CudaMatrix> {
        weight.check().map_err(Error::internal)?;
        let (rows, cols) = (weight.rows(), weight.cols);
        let bf16 = precision == Precision::Bf16;
        let n = rows * cols;
        let data = if bf16 {
            MatrixData::Bf16(self.stream.alloc_zeros::<u16>(n).map_err(oom(n * 2))?)
        } else {
            MatrixData::F32(self.stream.alloc_zeros::<f32>(n).map_err(oom(n * 4))?)
        };
        let (base, elem) = match &data {
            MatrixData::F32(d) => (self.ptr(d), 4),
            MatrixData::Bf16(d) => (self.ptr(d), 2),
        };
        let mut at = 0usize;
        for part in &weight.parts {
            let dst = base + (at * cols * elem) as u64;
            let part_rows = part.rows.len();
            match part.format {
                WeightFormat::Fp8E4m3 { .. } | WeightFormat::Fp4E2m1 { .. } => {
                    // Uploaded as stored (a quarter or an eighth of f32's bytes), widened here.
                    let q = self.upload(part.bytes)?;
                    let scales = self.upload(&part.scales)?;
                    let l = launch::dequant(
                        part.format,
                        self.ptr(&q),
                        self.ptr(&scales),
                        dst,
                        part.rows.start,
                        part_rows,
                        cols,
                        bf16,
                    );
                    self.launch(&l.expect("a block format always converts"))?;
                }
                WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::F16 => {
                    let row_bytes = part.format.row_bytes(cols);
                    let stored =
                        &part.bytes[part.rows.start * row_bytes..part.rows.end * row_bytes];
                    let q = self.upload(stored)?;
                    match launch::dequant(
                        part.format,
                        self.ptr(&q),
                        0,
                        dst,
                        0,
                        part_rows,
                        cols,
                        bf16,
                    ) {
                        Some(l) => self.launch(&l)?,
                        // SAFETY: `dst` is rows at..at + part_rows of the matrix just
                        // allocated (elem bytes each value), `q` holds exactly those bytes.
                        None => unsafe {
                            cudarc::driver::result::memcpy_dtod_async(
                                dst,
                                self.ptr(&q),
                                stored.len(),
                                self.stream.cu_stream(),
                            )
                        }
                        .map_err(driver("copying a weight"))?,
                    }
                }
            }
            at += part_rows;
        }
        // The staging buffers are freed in stream order; wait so a failed conversion is
        // reported here, at load, not by a later op.
        self.stream
            .synchronize()
            .map_err(driver("converting a weight"))?;
        Ok(CudaMatrix { data, rows, cols })
    }

    fn matrix_shape(&self, m: &CudaMatrix) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn matrix_bytes_by_dtype(&self, m: &CudaMatrix) -> Vec<(&'static str, usize)> {
        let dtype = match &m.data {
            MatrixData::F32(_) => "f32",
            MatrixData::Bf16(_) => "bf16",
        };
        vec![(dtype, self.matrix_bytes(m))]
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        match &m.data {
            MatrixData::F32(d) => d.num_bytes(),
            MatrixData::Bf16(d) => d.num_bytes(),
        }
    }

    fn index(&self, data: &[i32]) -> Result<CudaIndex> {
        Ok(CudaIndex {
            dev: self.upload(data)?,
            host: Some(data.to_vec()),
        })
    }

    fn read_index(&self, i: &CudaIndex) -> Result<Vec<i32>> {
        self.download(&i.dev)
    }

    fn rope(&self, inv_freq: &[f32]) -> Result<CudaRope> {
        self.upload(inv_freq).map(CudaRope)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        self.stream
            .alloc_zeros::<u8>(bytes)
            .map(CudaBuffer)
            .map_err(oom(bytes))
    }

    fn buffer_bytes(&self, b: &CudaBuffer) -> usize {
        b.0.len()
    }

    fn buffer_region(&self, b: &CudaBuffer) -> (u64, usize) {
        let (ptr, _sync) = b.0.device_ptr(&self.stream);
        (ptr, b.0.len())
    }

    fn read_bytes(&self, b: &CudaBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        check_range(b.0.len(), offset, out.len(), "reading a pool buffer")?;
        if out.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_dtoh(&b.0.slice(offset..offset + out.len()), out)
            .map_err(driver("copy to host"))?;
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    fn write_bytes(&self, b: &mut CudaBuffer, offset: usize, data: &[u8]) -> Result<()> {
        check_range(b.0.len(), offset, data.len(), "writing a pool buffer")?;
        if data.is_empty() {
            return Ok(());
        }
        let mut view = b.0.slice_mut(offset..offset + data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(driver("copy to device"))?;
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    fn copy_tier(
        &self,
        buffer: &CudaBuffer,
        direction: CopyDirection,
        copies: Vec<TierCopy>,
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        for c in &copies {
            check_range(buffer.0.len(), c.pool_offset, c.len, "a host-tier copy")?;
        }
        // Synchronous for now (the copy stream and events come with the kernels' overlap work):
        // the part is complete when this returns.
        ticket.add_part();
        let mut bytes = 0u64;
        for c in &copies {
            let HostPtr(host) = c.host;
            // SAFETY: the caller keeps `len` bytes at `host` alive and untouched until the
            // ticket completes (the Backend::copy_tier contract); completion is below, after
            // the copy finished.
            let host = unsafe { std::slice::from_raw_parts_mut(host, c.len) };
            let view = buffer.0.slice(c.pool_offset..c.pool_offset + c.len);
            match direction {
                CopyDirection::ToHost => self
                    .stream
                    .memcpy_dtoh(&view, host)
                    .map_err(driver("tier copy to host"))?,
                CopyDirection::FromHost => {
                    // SAFETY: device memory of the pool buffer, written only through this
                    // stream; the range was checked above. The pools pin these pages.
                    let (dst, _sync) = view.device_ptr(&self.stream);
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            dst,
                            host,
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(driver("tier copy to device"))?
                }
            }
            bytes += c.len as u64;
        }
        self.stream.synchronize().map_err(driver("synchronize"))?;
        ticket.complete_part(bytes);
        Ok(())
    }

    fn copy_regions(
        &self,
        src: &CudaBuffer,
        dst: &mut CudaBuffer,
        regions: &[CopyRegion],
    ) -> Result<()> {
        for r in regions {
            check_range(src.0.len(), r.src, r.len, "copying regions (source)")?;
            check_range(dst.0.len(), r.dst, r.len, "copying regions (destination)")?;
        }
        for r in regions {
            let from = src.0.slice(r.src..r.src + r.len);
            let mut to = dst.0.slice_mut(r.dst..r.dst + r.len);
            self.stream
                .memcpy_dtod(&from, &mut to)
                .map_err(driver("copy between pools"))?;
        }
        Ok(())
    }

    fn write_rows(
        &self,
        dst: &mut CudaBuffer,
        layout: &RowLayout<'_, CudaIndex>,
        first: usize,
        x: &CudaTensor,
        rows: Range<usize>,
    ) -> Result<()> {
        if x.0.len() < rows.end * layout.width {
            return Err(Error::internal(format!(
                "writing KV rows {rows:?} of {} values from a tensor of {}",
                layout.width,
                x.0.len()
            )));
        }
        let n = rows.len();
        self.check_rows(layout, first..first + n, dst.0.len(), "writing KV rows")?;
        let pages = match layout.placement {
            Placement::Paged { pages, .. } => self.ptr(&pages.dev),
            Placement::Ring { .. } => 0,
        };
        let l = launch::kv_write(
            self.ptr(&x.0),
            rows.start,
            n,
            layout,
            self.ptr(&dst.0),
            pages,
            first,
        )?;
        self.launch(&l)
    }

    fn read_rows(&self, rows: &Rows<'_, Self>, range: Range<usize>) -> Result<CudaTensor> {
        let layout = &rows.layout;
        if range.end > rows.count {
            return Err(Error::internal(format!(
                "reading KV rows {range:?} of {} valid rows",
                rows.count
            )));
        }
        self.check_rows(
            layout,
            range.clone(),
            rows.buffer.0.len(),
            "reading KV rows",
        )?;
        let out = self.alloc_f32(range.len() * layout.width)?;
        let pages = match layout.placement {
            Placement::Paged { pages, .. } => self.ptr(&pages.dev),
            Placement::Ring { .. } => 0,
        };
        let l = launch::kv_read(
            self.ptr(&out.0),
            range.len(),
            layout,
            self.ptr(&rows.buffer.0),
            pages,
            range.start,
        )?;
        self.launch(&l)?;
        Ok(out)
    }

    fn codec_round_trip(&self, x: &mut CudaTensor, width: usize, codec: RowCodec) -> Result<()> {
        if width == 0 || !x.0.len().is_multiple_of(width) {
            return Err(Error::internal(format!(
                "a codec round trip of rows {width} wide over {} values",
                x.0.len()
            )));
        }
        let rows = x.0.len() / width;
        match launch::kv_round_trip(self.ptr(&x.0), rows, width, codec)? {
            Some(l) => self.launch(&l),
            None => Ok(()),
        }
    }

    fn embed(&self, table: &CudaMatrix, ids: &CudaIndex) -> Result<CudaTensor> {
        let rows = ids.dev.len();
        let out = self.alloc_f32(rows * table.cols)?;
        let (ptr, bf16) = match &table.data {
            MatrixData::F32(d) => (self.ptr(d), false),
            MatrixData::Bf16(d) => (self.ptr(d), true),
        };
        let l = launch::embed(
            ptr,
            bf16,
            self.ptr(&ids.dev),
            self.ptr(&out.0),
            rows,
            table.cols,
            table.rows,
        )?;
        self.launch(&l)?;
        Ok(out)
    }

    fn matmul(&self, x: &CudaTensor, rows: usize, w: &CudaMatrix) -> Result<CudaTensor> {
        let (out, inner) = (w.rows, w.cols);
        if x.0.len() != rows * inner {
            return Err(Error::internal(format!(
                "matmul: x holds {} values, not {rows} × {inner}",
                x.0.len()
            )));
        }
        let mut y = self.zeros(rows * out)?;
        if rows == 0 || out == 0 {
            return Ok(y);
        }
        // Row-major y[rows, out] = x[rows, in] · wᵀ is column-major yᵀ[out, rows] =
        // w[out, in] (column-major: wᵀ, transposed back) · xᵀ[in, rows].
        let cfg = GemmConfig {
            transa: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            transb: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            m: out as i32,
            n: rows as i32,
            k: inner as i32,
            alpha: 1.0f32,
            lda: inner as i32,
            ldb: inner as i32,
            beta: 0.0f32,
            ldc: out as i32,
        };
        match &w.data {
            // SAFETY: the shapes above match the allocations: w holds out × in, x rows × in,
            // y rows × out values, and the leading dimensions follow the row-major layouts.
            MatrixData::F32(wd) => unsafe { self.blas.gemm(cfg, wd, &x.0, &mut y.0) }
                .map_err(|e| Error::internal(format!("cuBLAS sgemm: {e}")))?,
            MatrixData::Bf16(wd) => {
                // bf16 × bf16 with f32 accumulation: the activations are rounded to bf16
                // first, as the tensor cores take them.
                let n = rows * inner;
                let xb = self.stream.alloc_zeros::<u16>(n).map_err(oom(n * 2))?;
                self.launch(&launch::convert(
                    "convert_f32_to_bf16",
                    self.ptr(&x.0),
                    self.ptr(&xb),
                    n,
                ))?;
                let (alpha, beta) = (1.0f32, 0.0f32);
                use blas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_32F};
                // SAFETY: as for sgemm: w is out × in bf16, xb rows × in bf16, y rows × out
                // f32; alpha and beta are f32 as CUBLAS_COMPUTE_32F requires.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *self.blas.handle(),
                        cfg.transa,
                        cfg.transb,
                        cfg.m,
                        cfg.n,
                        cfg.k,
                        (&alpha as *const f32).cast(),
                        self.ptr(wd) as *const std::ffi::c_void,
                        CUDA_R_16BF,
                        cfg.lda,
                        self.ptr(&xb) as *const std::ffi::c_void,
                        CUDA_R_16BF,
                        cfg.ldb,
                        (&beta as *const f32).cast(),
                        self.ptr(&y.0) as *mut std::ffi::c_void,
                        CUDA_R_32F,
                        cfg.ldc,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| Error::internal(format!("cuBLAS bf16 GEMM: {e}")))?;
            }
        }
        Ok(y)
    }

    fn matmul_grouped(
        &self,
        _x: &CudaTensor,
        _rows: usize,
        _w: &CudaMatrix,
        _groups: usize,
    ) -> Result<CudaTensor> {
        Err(later("grouped GEMM"))
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        vectors: usize,
        dim: usize,
        weight: Option<&CudaTensor>,
        eps: f32,
    ) -> Result<CudaTensor> {
        check_len("RMSNorm input", x.0.len(), vectors * dim)?;
        if let Some(w) = weight {
            check_len("RMSNorm weight", w.0.len(), dim)?;
        }
        let out = self.alloc_f32(vectors * dim)?;
        let l = launch::rms_norm(
            self.ptr(&x.0),
            weight.map(|w| self.ptr(&w.0)),
            self.ptr(&out.0),
            vectors,
            dim,
            eps,
        )?;
        self.launch(&l)?;
        Ok(out)
    }

    fn rope_apply(
        &self,
        x: &mut CudaTensor,
        heads: usize,
        head_dim: usize,
        rope: &CudaRope,
        positions: &CudaIndex,
        inverse: bool,
    ) -> Result<()> {
        let (rows, pairs) = (positions.dev.len(), rope.0.len());
        if 2 * pairs > head_dim {
            return Err(Error::internal(format!(
                "RoPE over {pairs} pairs does not fit heads of {head_dim}"
            )));
        }
        check_len("RoPE input", x.0.len(), rows * heads * head_dim)?;
        // (cos, sin) per row and pair, computed on the device from the positions.
        let cs = self.alloc_f32(rows * pairs * 2)?;
        self.launch(&launch::rope_cos_sin(
            self.ptr(&rope.0),
            self.ptr(&positions.dev),
            self.ptr(&cs.0),
            rows,
            pairs,
        )?)?;
        self.launch(&launch::rope_apply(
            self.ptr(&x.0),
            self.ptr(&cs.0),
            rows,
            heads,
            head_dim,
            pairs,
            inverse,
        )?)
    }

    fn add_assign(&self, a: &mut CudaTensor, b: &CudaTensor) -> Result<()> {
        check_len("add", b.0.len(), a.0.len())?;
        self.launch(&launch::add(self.ptr(&a.0), self.ptr(&b.0), a.0.len()))
    }

    fn split(&self, x: &CudaTensor, rows: usize, widths: &[usize]) -> Result<Vec<CudaTensor>> {
        let total: usize = widths.iter().sum();
        check_len("split", x.0.len(), rows * total)?;
        let mut start = 0;
        let mut parts = Vec::with_capacity(widths.len());
        for &w in widths {
            let out = self.alloc_f32(rows * w)?;
            self.launch(&launch::copy_cols(
                self.ptr(&x.0),
                self.ptr(&out.0),
                rows,
                total,
                start,
                w,
            ))?;
            parts.push(out);
            start += w;
        }
        Ok(parts)
    }

    fn take_rows(&self, x: &CudaTensor, cols: usize, rows: &[usize]) -> Result<CudaTensor> {
        let have = x.0.len().checked_div(cols).unwrap_or(0);
        if let Some(&bad) = rows.iter().find(|&&r| r >= have) {
            return Err(Error::internal(format!(
                "taking row {bad} of a tensor with {have} rows"
            )));
        }
        let index: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let index = self.upload(&index)?;
        let out = self.alloc_f32(rows.len() * cols)?;
        self.launch(&launch::gather_rows(
            self.ptr(&x.0),
            self.ptr(&index),
            self.ptr(&out.0),
            rows.len(),
            cols,
        ))?;
        Ok(out)
    }

    fn swiglu(
        &self,
        gate_up: &CudaTensor,
        rows: usize,
        inter: usize,
        limit: f32,
    ) -> Result<CudaTensor> {
        check_len("SwiGLU input", gate_up.0.len(), rows * 2 * inter)?;
        let out = self.alloc_f32(rows * inter)?;
        self.launch(&launch::swiglu(
            self.ptr(&gate_up.0),
            self.ptr(&out.0),
            rows,
            inter,
            limit,
        )?)?;
        Ok(out)
    }

    fn fp8_round_trip(
        &self,
        _x: &mut CudaTensor,
        _width: usize,
        _channels: usize,
        _block: usize,
    ) -> Result<()> {
        Err(later("FP8 round trip"))
    }

    fn hadamard_fp4_round_trip(
        &self,
        _x: &mut CudaTensor,
        _dim: usize,
        _block: usize,
    ) -> Result<()> {
        Err(later("Hadamard FP4 round trip"))
    }

    fn hc_pre(
        &self,
        _x: &CudaTensor,
        _rows: usize,
        _p: &HcParams<'_, Self>,
    ) -> Result<HcMix<Self>> {
        Err(later("hyper-connection pre"))
    }

    fn hc_post(
        &self,
        _out: &CudaTensor,
        _x: &CudaTensor,
        _mix: &HcMix<Self>,
        _rows: usize,
        _hc: usize,
        _dim: usize,
    ) -> Result<CudaTensor> {
        Err(later("hyper-connection post"))
    }

    fn hc_head(
        &self,
        _x: &CudaTensor,
        _rows: usize,
        _p: &HcParams<'_, Self>,
    ) -> Result<CudaTensor> {
        Err(later("hyper-connection head"))
    }

    fn hc_expand(
        &self,
        _x: &CudaTensor,
        _rows: usize,
        _hc: usize,
        _dim: usize,
    ) -> Result<CudaTensor> {
        Err(later("hyper-connection expand"))
    }

    fn compress(
        &self,
        _state: &mut CudaBuffer,
        _frontier: usize,
        _args: &CompressArgs<'_, Self>,
    ) -> Result<(CudaTensor, usize)> {
        Err(later("compressor"))
    }

    fn indexer_top_k(&self, _seqs: &[IndexerArgs<'_, Self>]) -> Result<Vec<(CudaIndex, usize)>> {
        Err(later("indexer top-k"))
    }

    fn attention(&self, _seqs: &[AttentionArgs<'_, Self>], _out: &mut CudaTensor) -> Result<()> {
        Err(later("attention"))
    }

    fn route(&self, args: &RouteArgs<'_, Self>) -> Result<Routing<Self>> {
        let (rows, e, k) = (args.rows, args.experts, args.top_k);
        check_len("router logits", args.logits.0.len(), rows * e)?;
        if k == 0 || k > e {
            return Err(Error::model_format(format!(
                "a router choosing {k} of {e} experts"
            )));
        }
        let experts = self
            .stream
            .alloc_zeros::<i32>(rows * k)
            .map_err(oom(rows * k * 4))?;
        let weights = self.alloc_f32(rows * k)?;
        let bad_row = self.upload(&[i32::MAX])?;
        let (bias, table, token_ids, vocab) = match &args.kind {
            RouteKind::TopK { bias } => {
                if let Some(b) = bias {
                    check_len("router bias", b.0.len(), e)?;
                }
                (bias.map_or(0, |b| self.ptr(&b.0)), 0, 0, 0)
            }
            RouteKind::Hash { table, token_ids } => {
                check_len("hash-routed token ids", token_ids.dev.len(), rows)?;
                (
                    0,
                    self.ptr(&table.dev),
                    self.ptr(&token_ids.dev),
                    table.dev.len() / k,
                )
            }
        };
        let scoring = match args.scoring {
            Scoring::SqrtSoftplus => 0,
            Scoring::Sigmoid => 1,
            Scoring::Softmax => 2,
        };
        let ptrs = launch::RoutePtrs {
            logits: self.ptr(&args.logits.0),
            bias,
            hash_table: table,
            token_ids,
            experts_out: self.ptr(&experts),
            weights_out: self.ptr(&weights.0),
            bad_row: self.ptr(&bad_row),
        };
        self.launch(&launch::route(
            ptrs,
            rows,
            e,
            k,
            scoring,
            args.normalize,
            args.scale,
            vocab,
        )?)?;
        let bad = self.download(&bad_row)?[0];
        if bad != i32::MAX {
            let token = match &args.kind {
                RouteKind::Hash { token_ids, .. } => token_ids
                    .host
                    .as_ref()
                    .and_then(|h| h.get(bad as usize).copied()),
                RouteKind::TopK { .. } => None,
            };
            return Err(Error::model_format(match token {
                Some(t) => format!(
                    "the hash router cannot route token {t} (row {bad}): the token id is outside \
                     the table's {vocab} rows or the table names an expert outside the layer's {e}"
                ),
                None => format!("the router could not route row {bad} of {rows}"),
            }));
        }
        Ok(Routing {
            experts: self.index_from(experts),
            weights,
            top_k: k,
        })
    }

    fn moe(
        &self,
        _x: &CudaTensor,
        _rows: usize,
        _routing: &Routing<Self>,
        _experts: &[Expert<Self>],
        _inter: usize,
        _limit: f32,
    ) -> Result<CudaTensor> {
        Err(later("MoE"))
    }
}
