//! Prefix-cache speed: radix match + insert on a tree of more than a million tokens, next to a
//! `memcmp` over the same token bytes in the same run (the floor any exact prefix match pays),
//! LRU eviction of that tree one victim per pass (what `reserve` asks for when one page is
//! short), and page alloc/free per second.
//!
//!     cargo run --release --example bench_radix -- [--page 128] [--json]

use std::hint::black_box;
use std::time::Instant;

use dsv4::kv::radix::EvictTier;
use dsv4::kv::{PageId, RadixTree, SnapshotId, UnitAllocator};
use serde_json::json;

/// `n` random token ids from a V4-sized vocabulary.
fn tokens(rng: &mut fastrand::Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.u32(..129_280)).collect()
}

/// Best of `runs` timings of `f`, in seconds.
fn best(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let page: usize = args
        .iter()
        .position(|a| a == "--page")
        .and_then(|i| args.get(i + 1))
        .map_or(128, |v| v.parse().unwrap());
    // 128 shared "system prompts" of 8 pages, each with 8 conversations of 8 more pages:
    // 1024 sequences, 128·8 + 1024·8 pages of tokens in the tree.
    let (prefixes, per_prefix, prefix_pages, tail_pages) = (128, 8, 8, 8);
    let mut rng = fastrand::Rng::with_seed(7);
    let heads: Vec<Vec<u32>> = (0..prefixes)
        .map(|_| tokens(&mut rng, prefix_pages * page))
        .collect();
    let seqs: Vec<Vec<u32>> = heads
        .iter()
        .flat_map(|h| {
            (0..per_prefix)
                .map(|_| {
                    let mut s = h.clone();
                    s.extend(tokens(&mut rng, tail_pages * page));
                    s
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let seq_tokens: usize = seqs.iter().map(Vec::len).sum();
    let tree_tokens = (prefixes * prefix_pages + seqs.len() * tail_pages) * page;
    let pages_for = |i: usize, n: usize| -> Vec<PageId> {
        (0..n).map(|j| PageId((i * n + j) as u32)).collect()
    };

    // Insert: every sequence, with a snapshot at its end, into a fresh tree.
    let mut tree = RadixTree::new(page);
    let insert_s = best(3, || {
        tree = RadixTree::new(page);
        for (i, s) in seqs.iter().enumerate() {
            let n = s.len() / page;
            black_box(tree.insert(
                None,
                s,
                &pages_for(i, n),
                &[(s.len(), SnapshotId(i as u32))],
            ));
        }
    });
    assert_eq!(tree.pages_held() * page, tree_tokens);
    // Match (+ lock and unlock) every sequence.
    let match_s = best(5, || {
        for s in &seqs {
            let m = tree.match_prefix(None, s, false);
            debug_assert_eq!(m.reusable_tokens, s.len());
            if let Some(node) = m.lock {
                tree.unlock(node);
            }
            black_box(m.pages.len());
        }
    });
    // memcmp over the same token bytes: each query against a stored copy.
    let stored: Vec<Vec<u32>> = seqs.clone();
    let memcmp_s = best(5, || {
        for (q, s) in seqs.iter().zip(&stored) {
            black_box(black_box(q.as_slice()) == black_box(s.as_slice()));
        }
    });

    // Eviction: the whole tree, one victim per pass (each `reserve` short of a page starts a
    // pass), leaves before the prefixes they hang off. The tree is rebuilt between runs.
    let build = |tree: &mut RadixTree| {
        *tree = RadixTree::new(page);
        for (i, s) in seqs.iter().enumerate() {
            let n = s.len() / page;
            tree.insert(
                None,
                s,
                &pages_for(i, n),
                &[(s.len(), SnapshotId(i as u32))],
            );
        }
    };
    let victims = tree.node_count() - 1;
    let mut evict_s = f64::INFINITY;
    for _ in 0..3 {
        build(&mut tree);
        let t = Instant::now();
        let mut evicted = 0;
        while let Some(mut pass) = tree.eviction_pass(EvictTier::Device) {
            let v = tree.next_victim(&mut pass).expect("a pass has a victim");
            black_box(tree.remove_subtree(v));
            evicted += 1;
        }
        evict_s = evict_s.min(t.elapsed().as_secs_f64());
        assert_eq!((evicted, tree.pages_held()), (victims, 0));
    }
    build(&mut tree);

    // Page alloc/free: one page at a time, and 16 at a time (a 2k-token prefill chunk).
    let capacity = 1 << 16;
    let mut alloc = UnitAllocator::<PageId>::new(capacity);
    let ops = 1 << 20;
    let single_s = best(3, || {
        for _ in 0..ops {
            let p = alloc.alloc(1).unwrap();
            black_box(&p);
            alloc.release(p[0]);
        }
    });
    let batch_s = best(3, || {
        for _ in 0..ops / 16 {
            let p = alloc.alloc(16).unwrap();
            for &u in black_box(&p) {
                alloc.release(u);
            }
        }
    });

    let match_rate = seq_tokens as f64 / match_s;
    let insert_rate = seq_tokens as f64 / insert_s;
    let memcmp_rate = seq_tokens as f64 / memcmp_s;
    let report = json!({
        "page_size": page, "tree_tokens": tree_tokens, "tree_nodes": tree.node_count(),
        "sequences": seqs.len(), "query_tokens": seq_tokens,
        "match_tok_s": match_rate, "insert_tok_s": insert_rate, "memcmp_tok_s": memcmp_rate,
        "match_vs_memcmp": match_rate / memcmp_rate, "insert_vs_memcmp": insert_rate / memcmp_rate,
        "evict_victims": victims, "evict_victims_per_s": victims as f64 / evict_s,
        "page_alloc_free_per_s": ops as f64 / single_s,
        "page_alloc_free_per_s_batch16": ops as f64 / batch_s,
    });
    if args.iter().any(|a| a == "--json") {
        println!("{report}");
    } else {
        println!(
            "radix ({} tokens in the tree, {} nodes, {page}-token pages): match {:.3e} tok/s, \
             insert {:.3e} tok/s, memcmp {:.3e} tok/s → match/memcmp {:.2}, insert/memcmp {:.2}; \
             evict {} victims one per pass {:.3e} victims/s; \
             page alloc+free {:.3e}/s (batches of 16: {:.3e}/s)",
            tree_tokens,
            tree.node_count(),
            match_rate,
            insert_rate,
            memcmp_rate,
            match_rate / memcmp_rate,
            insert_rate / memcmp_rate,
            victims,
            victims as f64 / evict_s,
            ops as f64 / single_s,
            ops as f64 / batch_s
        );
    }
}
