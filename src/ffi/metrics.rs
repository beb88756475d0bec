//! Engine metrics across the ABI: a versioned struct for hosts that export their own way, and
//! the Prometheus text exposition for those that serve `/metrics`.

use std::ffi::c_char;

use super::boundary::guard;
use super::engine::{dsv4_engine, engine_ref, engine_text};
use super::status::{dsv4_status, DSV4_ERR_BUFFER_TOO_SMALL, DSV4_OK};
use super::versioned::{assert_offsets, write_out, Layout, PlainData};
use crate::engine::{MetricsSnapshot, Outcome, Rejection, Units};
use crate::error::Error;

/// Used and total units of one pool kind on one tier, and their bytes.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct dsv4_units {
    pub used: u64,
    pub total: u64,
    pub used_bytes: u64,
    pub total_bytes: u64,
}

/// A metrics snapshot (version 1: 504 bytes). Counters (`*_total`) count from engine
/// creation; the rest are gauges at the instant of the call (pool gauges as of the last forward
/// step). Fields are only appended in later versions. docs/metrics.md describes each one.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct dsv4_metrics {
    /// Set to `sizeof(dsv4_metrics)` before the call; the library sets it to the bytes it
    /// filled (the smaller of yours and its own): read a field appended after version 1 only
    /// if its offset is below it.
    pub struct_size: u32,
    /// Requests taking part in forward steps.
    pub num_running_reqs: u64,
    /// Requests waiting for a host-tier load-back before they can run.
    pub num_loading_reqs: u64,
    /// Accepted requests waiting to run (retracted ones included).
    pub num_queue_reqs: u64,
    /// Prompt tokens accepted and not yet prefilled.
    pub num_queue_tokens: u64,
    /// KV pages (one id across `c4_kv`, `c4_indexer`, `c128_kv`; bytes cover all three).
    pub device_pages: dsv4_units,
    /// Per-request slots (SWA ring and compressor frontiers).
    pub device_slots: dsv4_units,
    /// Prefix-cache snapshots.
    pub device_snapshots: dsv4_units,
    /// Host-tier (HiCache) pages and snapshots; zero without HiCache.
    pub host_pages: dsv4_units,
    pub host_snapshots: dsv4_units,
    /// Requests accepted by `dsv4_submit`.
    pub requests_total: u64,
    /// Terminal events: stop token or EOS, length, abort, timeout, error.
    pub finished_stop_total: u64,
    pub finished_length_total: u64,
    pub aborted_total: u64,
    pub timed_out_total: u64,
    pub failed_total: u64,
    /// Submits refused: `DSV4_ERR_QUEUE_FULL`, `DSV4_ERR_CAPACITY`,
    /// `DSV4_ERR_INVALID_ARGUMENT`, `DSV4_ERR_SHUTDOWN`.
    pub rejected_queue_full_total: u64,
    pub rejected_capacity_total: u64,
    pub rejected_invalid_total: u64,
    pub rejected_shutdown_total: u64,
    /// Running requests retracted when the KV pools ran out during decode.
    pub retractions_total: u64,
    /// Prompt tokens of requests that started running.
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Prompt tokens served from the prefix cache, by the tier they came from.
    pub cached_tokens_device_total: u64,
    pub cached_tokens_host_total: u64,
    pub forward_steps_total: u64,
    pub forward_tokens_total: u64,
    /// HiCache copies.
    pub loadback_tokens_total: u64,
    pub loadback_bytes_total: u64,
    pub loadback_seconds_total: f64,
    pub backup_tokens_total: u64,
    pub backup_bytes_total: u64,
    pub backup_seconds_total: f64,
    /// Device evictions that kept a host copy, that dropped the prefix; host-tier evictions.
    pub evictions_device_to_host_total: u64,
    pub evictions_device_dropped_total: u64,
    pub evictions_host_total: u64,
    /// KV transfer between prefill and decode engines: rooms transferred whole, their bytes,
    /// seconds from claim to done, failed rooms.
    pub kv_transfer_requests_total: u64,
    pub kv_transfer_bytes_total: u64,
    pub kv_transfer_seconds_total: f64,
    pub kv_transfer_failures_total: u64,
    /// Sums (seconds) and counts of the latency histograms; the buckets are in the
    /// Prometheus exposition.
    pub ttft_seconds_sum: f64,
    pub ttft_count: u64,
    pub itl_seconds_sum: f64,
    pub itl_count: u64,
    pub e2e_seconds_sum: f64,
    pub e2e_count: u64,
    pub queue_seconds_sum: f64,
    pub queue_count: u64,
    /// Prefill/decode rooms (appended after version 1; zero in the unified role; SGLang's
    /// names). Prefill: rooms waiting for the decode's claim; claimed rooms being computed or
    /// sent. Decode: rooms waiting for their destination pages; rooms reserved and claimed.
    pub num_prefill_bootstrap_queue_reqs: u64,
    pub num_prefill_inflight_queue_reqs: u64,
    pub num_decode_prealloc_queue_reqs: u64,
    pub num_decode_transfer_queue_reqs: u64,
    /// Device pages held by requests whose room is in flight.
    pub pd_pages_held: u64,
    /// Prefill: claims that arrived before their request.
    pub pd_early_claims: u64,
    /// Connected peer engines.
    pub pd_peers: u64,
    /// Failed rooms by reason (their sum is `kv_transfer_failures_total`).
    pub kv_transfer_failures_timeout_total: u64,
    pub kv_transfer_failures_peer_dead_total: u64,
    pub kv_transfer_failures_aborted_total: u64,
    pub kv_transfer_failures_layout_total: u64,
    pub kv_transfer_failures_mismatch_total: u64,
    pub kv_transfer_failures_checksum_total: u64,
    pub kv_transfer_failures_capacity_total: u64,
    /// PD rooms claimed: seconds from registration to claim, summed, and how many (prefill:
    /// waiting for the decode's claim; decode: waiting for destination pages). The buckets,
    /// and those of the transfer latency and bytes per room, are in the Prometheus exposition.
    pub kv_transfer_claim_wait_seconds_sum: f64,
    pub kv_transfer_claim_wait_count: u64,
    /// State bytes sent (prefill) or received (decode) while the prompt was still computing:
    /// complete pages overlapping the transfer with compute.
    pub kv_transfer_early_bytes_total: u64,
    /// Of the bytes transferred, those written by RMA straight into the decode's pool memory
    /// (`pd.transport = "ucx"` with host-memory pools); 0 over TCP.
    pub kv_transfer_rma_bytes_total: u64,
}

// SAFETY: repr(C); integers and floats only.
unsafe impl PlainData for dsv4_units {}
// SAFETY: repr(C); integers, floats and dsv4_units only.
unsafe impl PlainData for dsv4_metrics {}

/// `sizeof(dsv4_units)`, frozen (it has no struct_size: it never changes; a new unit kind is a
/// new field of dsv4_metrics).
const _: () = assert!(std::mem::size_of::<dsv4_units>() == 32);
assert_offsets!(dsv4_units {
    used: 0,
    total: 8,
    used_bytes: 16,
    total_bytes: 24
});

/// `sizeof(dsv4_metrics)` of version 1, frozen: callers built against that header pass it.
const METRICS_V1: usize = 504;
assert_offsets!(dsv4_metrics {
    struct_size: 0,
    num_running_reqs: 8,
    num_loading_reqs: 16,
    num_queue_reqs: 24,
    num_queue_tokens: 32,
    device_pages: 40,
    device_slots: 72,
    device_snapshots: 104,
    host_pages: 136,
    host_snapshots: 168,
    requests_total: 200,
    finished_stop_total: 208,
    finished_length_total: 216,
    aborted_total: 224,
    timed_out_total: 232,
    failed_total: 240,
    rejected_queue_full_total: 248,
    rejected_capacity_total: 256,
    rejected_invalid_total: 264,
    rejected_shutdown_total: 272,
    retractions_total: 280,
    prompt_tokens_total: 288,
    generation_tokens_total: 296,
    cached_tokens_device_total: 304,
    cached_tokens_host_total: 312,
    forward_steps_total: 320,
    forward_tokens_total: 328,
    loadback_tokens_total: 336,
    loadback_bytes_total: 344,
    loadback_seconds_total: 352,
    backup_tokens_total: 360,
    backup_bytes_total: 368,
    backup_seconds_total: 376,
    evictions_device_to_host_total: 384,
    evictions_device_dropped_total: 392,
    evictions_host_total: 400,
    kv_transfer_requests_total: 408,
    kv_transfer_bytes_total: 416,
    kv_transfer_seconds_total: 424,
    kv_transfer_failures_total: 432,
    ttft_seconds_sum: 440,
    ttft_count: 448,
    itl_seconds_sum: 456,
    itl_count: 464,
    e2e_seconds_sum: 472,
    e2e_count: 480,
    queue_seconds_sum: 488,
    queue_count: 496,
});
// A field appended to dsv4_metrics starts at or after METRICS_V1 (its offset asserted here).
assert_offsets!(dsv4_metrics {
    num_prefill_bootstrap_queue_reqs: METRICS_V1,
    kv_transfer_failures_capacity_total: 608,
    kv_transfer_claim_wait_seconds_sum: 616,
    kv_transfer_claim_wait_count: 624,
    kv_transfer_early_bytes_total: 632,
    kv_transfer_rma_bytes_total: 640,
});
const _: () = assert!(std::mem::size_of::<dsv4_metrics>() == 648);
const METRICS_SIZE: usize = std::mem::size_of::<dsv4_metrics>();
/// `struct_size` is at most 4096 bytes: room for hundreds more fields, and an uninitialised
/// field is caught.
const METRICS: Layout = Layout {
    name: "dsv4_metrics",
    v1: METRICS_V1,
    max: 4096,
};

fn units(u: &Units) -> dsv4_units {
    dsv4_units {
        used: u.used,
        total: u.total,
        used_bytes: u.used_bytes,
        total_bytes: u.total_bytes,
    }
}

fn to_c(m: &MetricsSnapshot) -> dsv4_metrics {
    let c = &m.cache;
    dsv4_metrics {
        struct_size: METRICS_SIZE as u32,
        num_running_reqs: m.running,
        num_loading_reqs: m.loading,
        num_queue_reqs: m.queued,
        num_queue_tokens: m.queued_tokens,
        device_pages: units(&m.pools.device_pages),
        device_slots: units(&m.pools.device_slots),
        device_snapshots: units(&m.pools.device_snapshots),
        host_pages: units(&m.pools.host_pages),
        host_snapshots: units(&m.pools.host_snapshots),
        requests_total: m.requests,
        finished_stop_total: m.finished(Outcome::Stop),
        finished_length_total: m.finished(Outcome::Length),
        aborted_total: m.finished(Outcome::Aborted),
        timed_out_total: m.finished(Outcome::Timeout),
        failed_total: m.finished(Outcome::Error),
        rejected_queue_full_total: m.rejected(Rejection::QueueFull),
        rejected_capacity_total: m.rejected(Rejection::Capacity),
        rejected_invalid_total: m.rejected(Rejection::InvalidArgument),
        rejected_shutdown_total: m.rejected(Rejection::Shutdown),
        retractions_total: m.retractions,
        prompt_tokens_total: m.prompt_tokens,
        generation_tokens_total: m.generation_tokens,
        cached_tokens_device_total: m.cached_tokens_device,
        cached_tokens_host_total: m.cached_tokens_host,
        forward_steps_total: m.forward_steps,
        forward_tokens_total: m.forward_tokens,
        loadback_tokens_total: c.loadback_tokens,
        loadback_bytes_total: c.loadback_bytes,
        loadback_seconds_total: c.loadback_seconds,
        backup_tokens_total: c.backup_tokens,
        backup_bytes_total: c.backup_bytes,
        backup_seconds_total: c.backup_seconds,
        evictions_device_to_host_total: c.evicted_to_host,
        evictions_device_dropped_total: c.evicted_dropped,
        evictions_host_total: c.host_evictions,
        kv_transfer_requests_total: m.kv_transfer.requests,
        kv_transfer_bytes_total: m.kv_transfer.bytes,
        kv_transfer_seconds_total: m.kv_transfer.seconds,
        kv_transfer_failures_total: m.kv_transfer.failures,
        ttft_seconds_sum: m.ttft.sum,
        ttft_count: m.ttft.count,
        itl_seconds_sum: m.itl.sum,
        itl_count: m.itl.count,
        e2e_seconds_sum: m.e2e.sum,
        e2e_count: m.e2e.count,
        queue_seconds_sum: m.queue_time.sum,
        queue_count: m.queue_time.count,
        num_prefill_bootstrap_queue_reqs: m.pd.prefill_bootstrap,
        num_prefill_inflight_queue_reqs: m.pd.prefill_inflight,
        num_decode_prealloc_queue_reqs: m.pd.decode_prealloc,
        num_decode_transfer_queue_reqs: m.pd.decode_transfer,
        pd_pages_held: m.pd.pages_held,
        pd_early_claims: m.pd.early_claims,
        pd_peers: m.pd.peers,
        kv_transfer_failures_timeout_total: m.pd.failures[0],
        kv_transfer_failures_peer_dead_total: m.pd.failures[1],
        kv_transfer_failures_aborted_total: m.pd.failures[2],
        kv_transfer_failures_layout_total: m.pd.failures[3],
        kv_transfer_failures_mismatch_total: m.pd.failures[4],
        kv_transfer_failures_checksum_total: m.pd.failures[5],
        kv_transfer_failures_capacity_total: m.pd.failures[6],
        kv_transfer_claim_wait_seconds_sum: m.claim_wait.sum,
        kv_transfer_claim_wait_count: m.claim_wait.count,
        kv_transfer_early_bytes_total: m.kv_transfer.early_bytes,
        kv_transfer_rma_bytes_total: m.kv_transfer.rma_bytes,
    }
}

/// Fills `*out` with the engine's metrics. Set `out->struct_size = sizeof(dsv4_metrics)`
/// first (at least version 1's size and at most 4096, else `DSV4_ERR_INVALID_ARGUMENT`): a
/// caller built against an older header gets the fields it knows, one built against a newer
/// header the fields the library knows. Writes at most `out->struct_size` bytes and sets it to
/// the number written; bytes past them are untouched. Thread-safe and cheap (one short lock;
/// never waits for a forward step), so it suits a scrape loop.
///
/// # Safety
/// `engine` is a live handle; `out` is valid for `out->struct_size` bytes of reads and writes.
#[no_mangle]
pub unsafe extern "C" fn dsv4_metrics_get(
    engine: *const dsv4_engine,
    out: *mut dsv4_metrics,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        if out.is_null() {
            return Err(Error::invalid_argument(
                "out is NULL: pass a dsv4_metrics with struct_size set",
            ));
        }
        // SAFETY: `out` is non-NULL and its first field is readable per the contract (an
        // unaligned read: the library assumes nothing of the caller's alignment).
        let size = unsafe { std::ptr::addr_of!((*out).struct_size).read_unaligned() } as usize;
        METRICS.check(
            "out->struct_size",
            size,
            "set it to sizeof(dsv4_metrics) before the call",
        )?;
        let mut filled = to_c(&engine.metrics());
        filled.struct_size = size.min(METRICS_SIZE) as u32;
        // SAFETY: `out` is valid for `size` bytes of writes per the contract and `write_out`
        // writes at most that many; `filled` is a local, so they do not overlap.
        unsafe { write_out(&filled, out, size) };
        Ok(())
    })
}

/// Writes the metrics in the Prometheus text format (version 0.0.4): `dsv4_` names following
/// SGLang's where it has the series (`num_running_reqs`, `num_queue_reqs`, `token_usage`,
/// `cached_tokens_total{cache_source}`, `time_to_first_token_seconds`, …), counters and
/// histograms, every sample labelled with `metrics.labels`. Serve it as
/// `text/plain; version=0.0.4`. `(buf, cap, needed)` convention; thread-safe; never waits for
/// a forward step. The node-health series (free memory, the stall clock, resident memory)
/// change between calls, so a size query or a too-small buffer reports `*needed` with 256
/// bytes of headroom: a buffer of that size fits the next call's text.
///
/// # Safety
/// `engine` is a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid
/// for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_metrics_prometheus(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    // SAFETY: forwarded from the caller's contract.
    let status = unsafe { engine_text(engine, buf, cap, needed, |e| Ok(e.prometheus())) };
    let asked_size = status == DSV4_ERR_BUFFER_TOO_SMALL || (status == DSV4_OK && buf.is_null());
    if asked_size && !needed.is_null() {
        // SAFETY: non-NULL and valid per the caller's contract; engine_text just wrote it.
        unsafe { needed.write(needed.read().saturating_add(PROMETHEUS_HEADROOM)) };
    }
    status
}

/// Headroom in a size query's answer for values that grow between the two calls.
const PROMETHEUS_HEADROOM: usize = 256;
