//! HiCache copy speed: backup (device → host) and load-back (host → device) of whole pages on
//! the V4-Flash geometry, next to a plain memcpy of the same bytes in the same run, and the
//! host pools' allocation + pre-touch rate.
//!
//!     cargo run --release --example bench_hicache -- [--pages 1024] [--json]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use dsv4::backend::cpu::CpuBackend;
use dsv4::backend::{CopyDirection, Ticket};
use dsv4::config::params::Params;
use dsv4::kv::hicache::{HostMemory, HostPools};
use dsv4::kv::{HostPageId, KvPools, PageId};
use dsv4::plan;
use serde_json::json;

fn best(runs: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..runs).map(|_| f()).fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pages: usize = args
        .iter()
        .position(|a| a == "--pages")
        .and_then(|i| args.get(i + 1))
        .map_or(1024, |v| v.parse().unwrap());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let params = Params::from_value(&json!({
        "model_path": root.join("configs/deepseek-v4-flash").to_str().unwrap(),
        "kv": {"dtype": "fp8", "indexer_dtype": "fp8", "device_memory_bytes": "2GiB",
               "max_running_requests": 4, "page_size": 256},
        "hicache": {"enabled": true, "ratio": 1.0},
    }))
    .unwrap();
    let plan = plan::plan(&params).unwrap();
    let backend = Arc::new(CpuBackend::new(0).unwrap());
    let threads = backend.threads();
    let pools = KvPools::new(backend.clone(), &plan).unwrap();
    let t = Instant::now();
    let host = HostPools::new(&plan, backend.as_ref(), threads).unwrap();
    let alloc_s = t.elapsed().as_secs_f64();
    let host_bytes: u64 = host.allocated_bytes().iter().map(|x| x.1).sum();
    let pages = pages
        .min(pools.page_allocator().capacity())
        .min(host.page_allocator().capacity());
    let pairs: Vec<(PageId, HostPageId)> = (0..pages as u32)
        .map(|p| (PageId(p), HostPageId(p)))
        .collect();
    let page_bytes = host.page_bytes();
    let bytes = (pages * page_bytes) as f64;
    let copy = |dir: CopyDirection| {
        let ticket = Ticket::new();
        let t = Instant::now();
        host.copy_pages(&pools, dir, &pairs, &ticket).unwrap();
        ticket.seal();
        ticket.wait();
        t.elapsed().as_secs_f64()
    };
    // Touch both sides once so page faults are not measured.
    copy(CopyDirection::FromHost);
    copy(CopyDirection::ToHost);
    let backup_s = best(5, || copy(CopyDirection::ToHost));
    let load_s = best(5, || copy(CopyDirection::FromHost));
    // memcpy of the same bytes, page-sized pieces, between two touched buffers.
    let src = vec![1u8; pages * page_bytes];
    let mut dst = vec![0u8; pages * page_bytes];
    let memcpy_s = best(5, || {
        let t = Instant::now();
        for (d, s) in dst.chunks_mut(page_bytes).zip(src.chunks(page_bytes)) {
            d.copy_from_slice(s);
        }
        std::hint::black_box(&dst);
        t.elapsed().as_secs_f64()
    });
    // Allocation + pre-touch alone, one pool-sized block.
    let block = 1usize << 30;
    let (_, report) =
        HostMemory::allocate(block, plan.numa.node.as_ref().map(|n| n.index), threads).unwrap();
    let gb = |s: f64| bytes / s / 1e9;
    let report_json = json!({
        "pages": pages, "page_bytes": page_bytes, "bytes": bytes,
        "backup_gb_s": gb(backup_s), "loadback_gb_s": gb(load_s), "memcpy_gb_s": gb(memcpy_s),
        "backup_vs_memcpy": memcpy_s / backup_s, "loadback_vs_memcpy": memcpy_s / load_s,
        "host_pools_bytes": host_bytes, "host_pools_alloc_s": alloc_s,
        "host_pools_gib_s": host_bytes as f64 / (1u64 << 30) as f64 / alloc_s,
        "alloc_pretouch_1gib_gib_s": report.gib_per_s(), "threads": threads,
        "numa_node": report.bound_node,
    });
    if args.iter().any(|a| a == "--json") {
        println!("{report_json}");
    } else {
        println!(
            "hicache ({pages} V4-Flash fp8 pages of {page_bytes} B = {:.2} GB): backup {:.2} GB/s, \
             load-back {:.2} GB/s, memcpy {:.2} GB/s → backup/memcpy {:.2}, load-back/memcpy {:.2}; \
             host pools {:.2} GiB allocated + pre-touched at {:.2} GiB/s ({threads} threads); \
             1 GiB block {:.2} GiB/s",
            bytes / 1e9,
            gb(backup_s),
            gb(load_s),
            gb(memcpy_s),
            memcpy_s / backup_s,
            memcpy_s / load_s,
            host_bytes as f64 / (1u64 << 30) as f64,
            host_bytes as f64 / (1u64 << 30) as f64 / alloc_s,
            report.gib_per_s()
        );
    }
}
