//! The backend seam: buffers and the fused operations the DeepSeek V4 forward pass needs.
//!
//! `model/` drives a forward step only through this trait and never reads or writes buffer
//! contents itself, so a CUDA backend can implement the same trait without changing `model/`.
//! Layout conventions shared by every op:
//! - activations are f32, row-major: a `[rows, cols]` tensor stores row r at `r * cols`;
//! - a weight matrix is `[out, in]` (one row per output feature), like a checkpoint's linear;
//! - a "batch" is the concatenation of every sequence's new tokens in a step; per-sequence ops
//!   take that sequence's row range within the batch.

pub mod cpu;
pub mod cuda;
pub mod tier;
pub mod weights;

use std::ops::Range;

use crate::error::Result;
use crate::formats::rows::RowCodec;
pub use tier::{CopyDirection, HostPtr, Ticket, TierCopy};
pub use weights::{WeightData, WeightFormat, WeightPart};

/// Where a weight matrix keeps its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    /// As the checkpoint stores it: FP8 / FP4 kept and decoded where used (on backends that
    /// can), bf16 kept, f32 / f16 as f32.
    Native,
}

/// The router's expert choice for one MoE layer.
pub enum RouteKind<'a, B: Backend + ?Sized> {
    /// Top-k over `score + bias` (bias affects selection only).
    TopK { bias: Option<&'a B::Tensor> },
    /// The fixed token-id → experts table `[vocab, k]`.
    Hash {
        table: &'a B::Index,
        /// The step's token ids (uploaded once per step).
        token_ids: &'a B::Index,
    },
}

/// Router score function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// Routing parameters of one MoE layer.
pub struct RouteArgs<'a, B: Backend + ?Sized> {
    /// `[rows, experts]` router logits.
    pub logits: &'a B::Tensor,
    pub rows: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    pub normalize: bool,
    pub scale: f32,
    pub kind: RouteKind<'a, B>,
}

/// Chosen experts and their weights, `[rows, top_k]` each.
pub struct Routing<B: Backend + ?Sized> {
    pub experts: B::Index,
    pub weights: B::Tensor,
    pub top_k: usize,
}

/// One routed expert: `w13 = [w1; w3]` stacked `[2·inter, hidden]`, `w2 = [hidden, inter]`.
pub struct Expert<B: Backend + ?Sized> {
    pub w13: B::Matrix,
    pub w2: B::Matrix,
}

/// The hyper-connection mixing weights of one `hc_pre`.
pub struct HcMix<B: Backend + ?Sized> {
    /// `[rows, dim]`: the streams collapsed with the `pre` weights.
    pub collapsed: B::Tensor,
    /// `[rows, hc]`.
    pub post: B::Tensor,
    /// `[rows, hc, hc]` doubly stochastic (after Sinkhorn).
    pub comb: B::Tensor,
}

/// The parameters of one hyper-connection instance.
pub struct HcParams<'a, B: Backend + ?Sized> {
    /// `[(2 + hc)·hc, hc·dim]` (or `[hc, hc·dim]` for the head).
    pub fn_: &'a B::Matrix,
    pub base: &'a B::Tensor,
    pub scale: &'a B::Tensor,
    pub hc: usize,
    pub dim: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub norm_eps: f32,
}

/// A compressor's per-sequence frontier and how to advance it.
pub struct CompressArgs<'a, B: Backend + ?Sized> {
    /// `[rows, coff·width]` projected kv and gate of the whole batch.
    pub kv: &'a B::Tensor,
    pub gate: &'a B::Tensor,
    /// This sequence's rows in `kv` / `gate`.
    pub rows: Range<usize>,
    /// Absolute position of the first of those rows.
    pub start_pos: usize,
    /// `[ratio, coff·width]` learned position bias.
    pub ape: &'a B::Tensor,
    pub ratio: usize,
    pub width: usize,
    /// CSA pools the previous window's first half with the current window's second half.
    pub overlap: bool,
}

/// A sequence's page table as a host-side op reads it: page `i`'s unit index. A backend whose
/// index lives in device memory reads it in its kernels instead and need not implement this.
pub trait PageTable {
    fn page(&self, i: usize) -> usize;
}

impl PageTable for [u32] {
    fn page(&self, i: usize) -> usize {
        self[i] as usize
    }
}

/// Where the rows of one layer live inside a pool buffer. `P` is the page table: a backend
/// index uploaded once per step (`B::Index`) for the ops, host page ids for host-side code.
pub enum Placement<'a, P: ?Sized = [u32]> {
    /// Growing rows: row r is row `r % rows_per_unit` of unit `pages[r / rows_per_unit]`,
    /// units being `unit_bytes` apart.
    Paged {
        pages: &'a P,
        rows_per_unit: usize,
        unit_bytes: usize,
    },
    /// A ring of `rows` rows: row r (a position) is stored at `r % rows`.
    Ring { rows: usize },
}

// By hand: a derive would require `P: Clone`, which an unsized page table is not.
impl<P: ?Sized> Clone for Placement<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P: ?Sized> Copy for Placement<'_, P> {}

impl<P: ?Sized> std::fmt::Debug for Placement<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Paged {
                rows_per_unit,
                unit_bytes,
                ..
            } => write!(
                f,
                "Paged {{ rows_per_unit: {rows_per_unit}, unit_bytes: {unit_bytes} }}"
            ),
            Self::Ring { rows } => write!(f, "Ring {{ rows: {rows} }}"),
        }
    }
}

/// The format and placement of one layer's rows in a pool buffer.
#[derive(Debug)]
pub struct RowLayout<'a, P: ?Sized = [u32]> {
    /// Byte offset of the layer's first row inside each unit (paged) or in the buffer (ring).
    pub offset: usize,
    pub row_bytes: usize,
    /// Values per row.
    pub width: usize,
    pub codec: RowCodec,
    pub placement: Placement<'a, P>,
}

impl<P: ?Sized> Clone for RowLayout<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P: ?Sized> Copy for RowLayout<'_, P> {}

impl<'a, P: ?Sized> RowLayout<'a, P> {
    /// The same rows addressed through another page table `pages` (the backend's copy of the
    /// same page ids).
    pub fn with_pages<Q: ?Sized>(&self, pages: &'a Q) -> RowLayout<'a, Q> {
        RowLayout {
            offset: self.offset,
            row_bytes: self.row_bytes,
            width: self.width,
            codec: self.codec,
            placement: match self.placement {
                Placement::Paged {
                    rows_per_unit,
                    unit_bytes,
                    ..
                } => Placement::Paged {
                    pages,
                    rows_per_unit,
                    unit_bytes,
                },
                Placement::Ring { rows } => Placement::Ring { rows },
            },
        }
    }
}

impl<P: PageTable + ?Sized> RowLayout<'_, P> {
    /// Byte offset of row `r` in the buffer.
    pub fn row_offset(&self, r: usize) -> usize {
        match self.placement {
            Placement::Paged {
                pages,
                rows_per_unit,
                unit_bytes,
            } => {
                pages.page(r / rows_per_unit) * unit_bytes
                    + self.offset
                    + (r % rows_per_unit) * self.row_bytes
            }
            Placement::Ring { rows } => self.offset + (r % rows) * self.row_bytes,
        }
    }
}

/// Rows a step reads: a layout in a buffer (its page table the backend's index), and how many
/// rows are valid.
pub struct Rows<'a, B: Backend + ?Sized> {
    pub buffer: &'a B::Buffer,
    pub layout: RowLayout<'a, B::Index>,
    pub count: usize,
}

/// One copy between two buffers, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRegion {
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

/// Sparse/windowed attention of one sequence's new tokens.
pub struct AttentionArgs<'a, B: Backend + ?Sized> {
    /// `[batch_rows, heads·head_dim]` queries (normed, roped).
    pub q: &'a B::Tensor,
    /// `[batch_rows, head_dim]` the new tokens' K=V rows (normed, roped).
    pub kv: &'a B::Tensor,
    pub rows: Range<usize>,
    pub start_pos: usize,
    /// The window ring (rows are positions; only positions before `start_pos` are read).
    pub ring: Rows<'a, B>,
    pub window: usize,
    /// This sequence's compressed rows, every window closed so far.
    pub compressed: Option<Rows<'a, B>>,
    pub ratio: usize,
    /// `[new_rows, k]` CSA selection (indices into `compressed`, −1 = none); `None` attends to
    /// every causally visible compressed row (HCA).
    pub selection: Option<(&'a B::Index, usize)>,
    /// `[heads]` per-head sink logits.
    pub sinks: &'a B::Tensor,
    pub heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Lightning-indexer scoring and top-k of one sequence's new tokens.
pub struct IndexerArgs<'a, B: Backend + ?Sized> {
    /// `[batch_rows, heads·dim]` indexer queries (roped).
    pub q: &'a B::Tensor,
    /// `[batch_rows, heads]` per-head weights.
    pub weights: &'a B::Tensor,
    pub rows: Range<usize>,
    pub start_pos: usize,
    /// The sequence's indexer key rows (`count` of them).
    pub keys: Rows<'a, B>,
    pub ratio: usize,
    pub top_k: usize,
    pub heads: usize,
    pub dim: usize,
    /// Multiplies `Σ_h w_h · relu(q_h·k)` (transformers: `dim^-0.5 · heads^-0.5`).
    pub score_scale: f32,
}

/// Storage and compute for the model. See the module docs for layout conventions.
pub trait Backend: Send + Sync + 'static {
    /// f32 activations and per-sequence state.
    type Tensor: Send + Sync;
    /// A weight matrix `[out, in]`.
    type Matrix: Send + Sync;
    /// i32 indices (routing tables, selections).
    type Index: Send + Sync;
    /// A RoPE frequency set.
    type Rope: Send + Sync;
    /// Raw bytes of one KV pool (device memory; host RAM on the CPU backend).
    type Buffer: Send + Sync;

    /// A short name for logs and reports ("cpu").
    fn name(&self) -> &'static str;

    /// Runs `f` with the backend's workers ready (the CPU backend enters its thread pool once
    /// for a whole forward step instead of once per op).
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;

    /// The engine has nothing to compute: working memory kept for the next step's reuse
    /// (outside the memory plan) that has gone unused for a while can go back to the system.
    fn release_idle_memory(&self) {}

    // --- memory -------------------------------------------------------------------------
    fn tensor(&self, data: &[f32]) -> Result<Self::Tensor>;
    fn zeros(&self, len: usize) -> Result<Self::Tensor>;
    fn len(&self, t: &Self::Tensor) -> usize;
    /// Copies a tensor back to the host (outputs such as logits).
    fn read(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// A weight matrix from its checkpoint bytes ([`WeightData`]: F32, BF16, F16, FP8 e4m3 with
    /// block scales, packed FP4 e2m1 with row scales), stored at `precision` or, where the
    /// backend supports it, in the checkpoint's own format.
    fn matrix(&self, weight: &WeightData<'_>, precision: Precision) -> Result<Self::Matrix>;
    /// `(rows, cols)` of a matrix.
    fn matrix_shape(&self, m: &Self::Matrix) -> (usize, usize);
    /// Bytes a matrix occupies.
    fn matrix_bytes(&self, m: &Self::Matrix) -> usize;
    /// A matrix's bytes by the format they are held in ("f32", "bf16", "fp8_e4m3",
    /// "fp4_e2m1"; stacked parts may differ).
    fn matrix_bytes_by_dtype(&self, m: &Self::Matrix) -> Vec<(&'static str, usize)>;
    fn index(&self, data: &[i32]) -> Result<Self::Index>;
    fn read_index(&self, i: &Self::Index) -> Result<Vec<i32>>;
    /// A RoPE frequency set from its inverse frequencies (one per rotated pair).
    fn rope(&self, inv_freq: &[f32]) -> Result<Self::Rope>;

    // --- pool memory ---------------------------------------------------------------------
    /// A zeroed buffer of exactly `bytes` bytes; an allocation failure is a capacity error.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;
    /// Makes every byte of the buffer resident now (`kv.prefault`), so that no later write
    /// waits on a page fault; an error when the memory cannot be backed. A no-op where
    /// allocations are resident from the start (device memory).
    fn prefault(&self, _b: &mut Self::Buffer) -> Result<()> {
        Ok(())
    }
    /// Bytes the buffer's allocation holds.
    fn buffer_bytes(&self, b: &Self::Buffer) -> usize;
    /// Where the buffer's memory is: `(base address, bytes)`, what a copy engine or a network
    /// transport registers once (the KV pools publish it as `kv::PoolRegion`). Valid while the
    /// buffer lives; a device address on a GPU backend, a host address on the CPU backend.
    fn buffer_region(&self, b: &Self::Buffer) -> (u64, usize);
    /// Whether [`Self::buffer_region`] addresses are host memory another thread may write
    /// directly (the CPU backend): a PD decode then receives a room's bytes straight into its
    /// destination pages instead of through a buffer and `write_bytes`.
    fn buffers_in_host_memory(&self) -> bool {
        false
    }
    /// Copies `out.len()` bytes at `offset` to the host.
    fn read_bytes(&self, b: &Self::Buffer, offset: usize, out: &mut [u8]) -> Result<()>;
    /// Copies host bytes into the buffer at `offset`.
    fn write_bytes(&self, b: &mut Self::Buffer, offset: usize, data: &[u8]) -> Result<()>;
    /// Starts asynchronous copies between pool `buffer` and host memory and adds one part to
    /// `ticket`, completed once every byte has landed. Until then the caller keeps the host
    /// memory alive and does not touch the ranges being copied (the pools pin the pages).
    fn copy_tier(
        &self,
        buffer: &Self::Buffer,
        direction: CopyDirection,
        copies: Vec<TierCopy>,
        ticket: &std::sync::Arc<Ticket>,
    ) -> Result<()>;
    /// Prepares host memory for fast tier copies (CUDA: `cudaHostRegister`; CPU: nothing).
    fn register_host(&self, _ptr: HostPtr, _len: usize) -> Result<()> {
        Ok(())
    }
    /// Copies regions from one buffer to another (snapshots, restores, transfers).
    fn copy_regions(
        &self,
        src: &Self::Buffer,
        dst: &mut Self::Buffer,
        regions: &[CopyRegion],
    ) -> Result<()>;
    /// Encodes rows `rows` of `x` (`[_, layout.width]`) into rows `first..` of the layout.
    fn write_rows(
        &self,
        dst: &mut Self::Buffer,
        layout: &RowLayout<'_, Self::Index>,
        first: usize,
        x: &Self::Tensor,
        rows: Range<usize>,
    ) -> Result<()>;
    /// Decodes rows `range` to f32 `[range.len(), width]`.
    fn read_rows(&self, rows: &Rows<'_, Self>, range: Range<usize>) -> Result<Self::Tensor>;
    /// Replaces every `width`-wide row of `x` by its value after a trip through `codec`, so
    /// rows used straight from a step equal the stored ones.
    fn codec_round_trip(&self, x: &mut Self::Tensor, width: usize, codec: RowCodec) -> Result<()>;

    // --- dense ops ----------------------------------------------------------------------
    /// Rows `ids` of `table`, as f32 `[ids.len(), cols]`.
    fn embed(&self, table: &Self::Matrix, ids: &Self::Index) -> Result<Self::Tensor>;
    /// `x [rows, in] @ wᵀ` → `[rows, out]`.
    fn matmul(&self, x: &Self::Tensor, rows: usize, w: &Self::Matrix) -> Result<Self::Tensor>;
    /// Block-diagonal: `x [rows, groups·in_g]`, `w [groups·out_g, in_g]` → `[rows, groups·out_g]`
    /// where group g multiplies `x[:, g·in_g..]` by `w[g·out_g..]`.
    fn matmul_grouped(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Matrix,
        groups: usize,
    ) -> Result<Self::Tensor>;
    /// RMS-normalises every `dim`-wide vector of `x` (`vectors` of them), times `weight` when
    /// given: `x / sqrt(mean(x²) + eps) · w`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        vectors: usize,
        dim: usize,
        weight: Option<&Self::Tensor>,
        eps: f32,
    ) -> Result<Self::Tensor>;
    /// Interleaved RoPE on the last `2 · pairs` channels of every head: row r (one per entry of
    /// `positions`), head h rotates pairs `(x[2i], x[2i+1])` by `positions[r] · θ_i` (by its
    /// negation when `inverse`).
    fn rope_apply(
        &self,
        x: &mut Self::Tensor,
        heads: usize,
        head_dim: usize,
        rope: &Self::Rope,
        positions: &Self::Index,
        inverse: bool,
    ) -> Result<()>;
    /// `a += b`.
    fn add_assign(&self, a: &mut Self::Tensor, b: &Self::Tensor) -> Result<()>;
    /// Splits `[rows, Σ widths]` by columns into one `[rows, width]` tensor per width.
    fn split(&self, x: &Self::Tensor, rows: usize, widths: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// `split(matmul(x, rows, w), rows, widths)`: a fused projection's parts (`Σ widths` =
    /// `w`'s rows), which a backend may write where they go instead of through the whole
    /// product (the default makes the product, then splits it).
    fn matmul_split(
        &self,
        x: &Self::Tensor,
        rows: usize,
        w: &Self::Matrix,
        widths: &[usize],
    ) -> Result<Vec<Self::Tensor>> {
        let y = self.matmul(x, rows, w)?;
        self.split(&y, rows, widths)
    }
    /// Rows `rows` of a `[_, cols]` tensor.
    fn take_rows(&self, x: &Self::Tensor, cols: usize, rows: &[usize]) -> Result<Self::Tensor>;
    /// SwiGLU with DeepSeek's clamp: `silu(min(gate, limit)) · clamp(up, ±limit)` for a
    /// `[rows, 2·inter]` input holding gate then up (limit 0 = no clamp).
    fn swiglu(
        &self,
        gate_up: &Self::Tensor,
        rows: usize,
        inter: usize,
        limit: f32,
    ) -> Result<Self::Tensor>;

    // --- official numerics (emulating the release's FP8/FP4 kernels) ---------------------
    /// FP8 round trip of channels `[0, channels)` of every `width`-wide row, in blocks of
    /// `block` channels with ue8m0 scales (`crate::formats::fp8_round_trip`).
    fn fp8_round_trip(
        &self,
        x: &mut Self::Tensor,
        width: usize,
        channels: usize,
        block: usize,
    ) -> Result<()>;
    /// Normalised Hadamard transform of every `dim`-wide vector, then an FP4 round trip in
    /// blocks of `block` (`crate::formats::fp4_round_trip`).
    fn hadamard_fp4_round_trip(&self, x: &mut Self::Tensor, dim: usize, block: usize)
        -> Result<()>;

    // --- hyper-connections --------------------------------------------------------------
    /// Collapses `x [rows, hc·dim]` with the mixing weights of one block input.
    fn hc_pre(&self, x: &Self::Tensor, rows: usize, p: &HcParams<'_, Self>) -> Result<HcMix<Self>>;
    /// `x'[k] = post[k] · out + Σ_j comb[j, k] · x[j]` per row.
    fn hc_post(
        &self,
        out: &Self::Tensor,
        x: &Self::Tensor,
        mix: &HcMix<Self>,
        rows: usize,
        hc: usize,
        dim: usize,
    ) -> Result<Self::Tensor>;
    /// [`Self::hc_post`], then [`Self::hc_pre`] of the next block (`next`) on its result:
    /// the new streams and their mix. `x` is consumed: a backend may write the new streams
    /// over it, and do both in one pass over the streams.
    #[allow(clippy::too_many_arguments)]
    fn hc_post_pre(
        &self,
        out: &Self::Tensor,
        x: Self::Tensor,
        mix: &HcMix<Self>,
        rows: usize,
        hc: usize,
        dim: usize,
        next: &HcParams<'_, Self>,
    ) -> Result<(Self::Tensor, HcMix<Self>)> {
        let streams = self.hc_post(out, &x, mix, rows, hc, dim)?;
        let mix = self.hc_pre(&streams, rows, next)?;
        Ok((streams, mix))
    }
    /// The final collapse (no Sinkhorn): `Σ_i (sigmoid(mix_i·scale + base_i) + eps) · x[i]`.
    fn hc_head(
        &self,
        x: &Self::Tensor,
        rows: usize,
        p: &HcParams<'_, Self>,
    ) -> Result<Self::Tensor>;
    /// `x [rows, dim]` repeated into `hc` identical streams `[rows, hc·dim]`.
    fn hc_expand(
        &self,
        x: &Self::Tensor,
        rows: usize,
        hc: usize,
        dim: usize,
    ) -> Result<Self::Tensor>;

    // --- attention state ----------------------------------------------------------------
    /// Advances a compressor frontier — f32 `[coff·ratio, 2·coff·width]` (rows of kv ‖ score,
    /// the overlap window first when `overlap`) at byte offset `frontier` of `state` — by the
    /// sequence's new rows and returns the rows of every window they closed, pooled but not
    /// yet normed or roped, `[n_new, width]`.
    fn compress(
        &self,
        state: &mut Self::Buffer,
        frontier: usize,
        args: &CompressArgs<'_, Self>,
    ) -> Result<(Self::Tensor, usize)>;
    /// For each sequence: scores every causally visible indexer key for each new token and
    /// keeps the top k: `[new_rows, k]`, k = `min(top_k, n_keys)`, ascending, −1 where fewer
    /// are visible. Sequences may run in parallel.
    fn indexer_top_k(&self, seqs: &[IndexerArgs<'_, Self>]) -> Result<Vec<(Self::Index, usize)>>;
    /// Attention with sinks over each new token's window plus its compressed rows, for every
    /// sequence of the batch (in parallel); each writes its rows of `out`
    /// (`[batch_rows, heads·head_dim]`).
    fn attention(&self, seqs: &[AttentionArgs<'_, Self>], out: &mut Self::Tensor) -> Result<()>;

    // --- mixture of experts -------------------------------------------------------------
    fn route(&self, args: &RouteArgs<'_, Self>) -> Result<Routing<Self>>;
    /// `Σ_k weight_k · expert_k(x)` per row, experts with SwiGLU + clamp.
    fn moe(
        &self,
        x: &Self::Tensor,
        rows: usize,
        routing: &Routing<Self>,
        experts: &[Expert<Self>],
        inter: usize,
        limit: f32,
    ) -> Result<Self::Tensor>;
}
