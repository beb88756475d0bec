//! The CUDA backend's device side: one context and stream per engine, tensors, indices and KV
//! pool buffers in device memory, host ↔ device copies, and GEMMs through cuBLAS (f32 with
//! TF32 off, so results follow the CPU's f32 arithmetic up to summation order).
//!
//! Ops whose kernels come with "CUDA 2" (hyper-connections, the compressor, the indexer,
//! attention, MoE) return `DSV4_ERR_UNSUPPORTED` naming the op; the engine refuses
//! `backend = cuda` until they land, so only the GPU op tests reach them.

use std::ops::Range;
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};

use super::probe::{self, Gpu};
use crate::backend::{
    AttentionArgs, Backend, CompressArgs, CopyDirection, CopyRegion, Expert, HcMix, HcParams,
    HostPtr, IndexerArgs, Precision, RouteArgs, Routing, RowLayout, Rows, Ticket, TierCopy,
    WeightData,
};
use crate::error::{Error, ErrorKind, Result};
use crate::formats::rows::RowCodec;

/// f32 activations in device memory.
pub struct CudaTensor(pub CudaSlice<f32>);

/// A weight matrix `[rows, cols]` in device memory (f32; the checkpoint formats are widened at
/// upload until the dequant kernels are wired).
pub struct CudaMatrix {
    pub data: CudaSlice<f32>,
    pub rows: usize,
    pub cols: usize,
}

/// i32 indices in device memory.
pub struct CudaIndex(pub CudaSlice<i32>);

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
        let stream = ctx.new_stream().map_err(driver("stream"))?;
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
        })
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

    fn matrix(&self, weight: &WeightData<'_>, _precision: Precision) -> Result<CudaMatrix> {
        weight.check().map_err(Error::internal)?;
        let data = weight.to_f32();
        Ok(CudaMatrix {
            data: self.upload(&data)?,
            rows: weight.rows(),
            cols: weight.cols,
        })
    }

    fn matrix_shape(&self, m: &CudaMatrix) -> (usize, usize) {
        (m.rows, m.cols)
    }

    fn matrix_bytes(&self, m: &CudaMatrix) -> usize {
        m.data.num_bytes()
    }

    fn index(&self, data: &[i32]) -> Result<CudaIndex> {
        self.upload(data).map(CudaIndex)
    }

    fn read_index(&self, i: &CudaIndex) -> Result<Vec<i32>> {
        self.download(&i.0)
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
        _dst: &mut CudaBuffer,
        _layout: &RowLayout<'_, CudaIndex>,
        _first: usize,
        _x: &CudaTensor,
        _rows: Range<usize>,
    ) -> Result<()> {
        Err(later("KV row encode"))
    }

    fn read_rows(&self, _rows: &Rows<'_, Self>, _range: Range<usize>) -> Result<CudaTensor> {
        Err(later("KV row decode"))
    }

    fn codec_round_trip(&self, _x: &mut CudaTensor, _width: usize, _codec: RowCodec) -> Result<()> {
        Err(later("KV row codec"))
    }

    fn embed(&self, _table: &CudaMatrix, _ids: &CudaIndex) -> Result<CudaTensor> {
        Err(later("embedding gather"))
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
        // SAFETY: the shapes above match the allocations: w holds out × in, x rows × in, y
        // rows × out values, and the leading dimensions follow the row-major layouts.
        unsafe { self.blas.gemm(cfg, &w.data, &x.0, &mut y.0) }
            .map_err(|e| Error::internal(format!("cuBLAS sgemm: {e}")))?;
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
        _x: &CudaTensor,
        _vectors: usize,
        _dim: usize,
        _weight: Option<&CudaTensor>,
        _eps: f32,
    ) -> Result<CudaTensor> {
        Err(later("RMSNorm"))
    }

    fn rope_apply(
        &self,
        _x: &mut CudaTensor,
        _heads: usize,
        _head_dim: usize,
        _rope: &CudaRope,
        _positions: &CudaIndex,
        _inverse: bool,
    ) -> Result<()> {
        Err(later("RoPE"))
    }

    fn add_assign(&self, _a: &mut CudaTensor, _b: &CudaTensor) -> Result<()> {
        Err(later("add"))
    }

    fn split(&self, _x: &CudaTensor, _rows: usize, _widths: &[usize]) -> Result<Vec<CudaTensor>> {
        Err(later("split"))
    }

    fn take_rows(&self, _x: &CudaTensor, _cols: usize, _rows: &[usize]) -> Result<CudaTensor> {
        Err(later("row gather"))
    }

    fn swiglu(
        &self,
        _gate_up: &CudaTensor,
        _rows: usize,
        _inter: usize,
        _limit: f32,
    ) -> Result<CudaTensor> {
        Err(later("SwiGLU"))
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

    fn route(&self, _args: &RouteArgs<'_, Self>) -> Result<Routing<Self>> {
        Err(later("router"))
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
