//! Sequence state export/import (kv::state): a sequence exported mid-generation from one set
//! of pools and imported into another continues with logits bit-equal to the uninterrupted
//! run, in both pools; bad imports are refused and take nothing.

mod common;

use std::time::Instant;

use common::{ids, model, pools_with, prefill, step};
use dsv4::backend::cpu::CpuBackend;
use dsv4::error::ErrorKind;
use dsv4::kv::layout::PoolId;
use dsv4::kv::state::{self, SequenceState};
use dsv4::kv::{KvPools, PrefixCache, Request, SeqKv};
use dsv4::model::{Logits, Model};
use serde_json::{json, Value};

/// Decode steps after the export.
const AFTER: usize = 8;

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `n` tokens of the fixture's golden ids (repeated when shorter).
fn prompt(name: &str, n: usize) -> Vec<u32> {
    ids(name).into_iter().cycle().take(n).collect()
}

/// Greedy generation: the logits after the prompt (one chunk) and after each of `steps` fed
/// tokens (one at a time), and the tokens fed.
fn uninterrupted(
    m: &Model<CpuBackend>,
    kv: Value,
    prompt: &[u32],
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut pools = pools_with(m, kv);
    let mut seq = pools.open().unwrap();
    let mut logits = vec![step(m, &mut pools, &mut seq, prompt, Logits::Last)];
    let mut fed = Vec::new();
    for _ in 0..steps {
        let t = argmax(logits.last().unwrap());
        fed.push(t);
        logits.push(step(m, &mut pools, &mut seq, &[t], Logits::Last));
    }
    pools.close(seq);
    (logits, fed)
}

/// Overwrites every byte of every pool with `0xff` (NaN in f32, bf16 and e4m3): whatever an
/// import fails to write shows up in the logits.
fn poison(pools: &mut KvPools<CpuBackend>) {
    for (i, (_, bytes)) in pools.allocated_bytes().into_iter().enumerate() {
        pools
            .write_bytes(PoolId::ALL[i], 0, &vec![0xff; bytes as usize])
            .unwrap();
    }
}

fn free_counts(pools: &KvPools<CpuBackend>) -> (usize, usize, usize) {
    (
        pools.page_allocator().free_count(),
        pools.slot_allocator().free_count(),
        pools.snapshot_allocator().free_count(),
    )
}

/// Steps `seq` greedily from `logits` for `AFTER` tokens, checking every step against the
/// reference (`want[k]` are the logits after the k-th token after the export).
fn continue_and_check(
    m: &Model<CpuBackend>,
    pools: &mut KvPools<CpuBackend>,
    seq: &mut SeqKv,
    mut logits: Vec<f32>,
    want: &[Vec<f32>],
    want_fed: &[u32],
    what: &str,
) {
    for k in 0..AFTER {
        let t = argmax(&logits);
        assert_eq!(t, want_fed[k], "{what}: token {k} after the export");
        logits = step(m, pools, seq, &[t], Logits::Last);
        assert!(
            bits(&logits) == bits(&want[k + 1]),
            "{what}: logits {} steps after the export differ from the uninterrupted run",
            k + 1
        );
    }
}

/// Prefill `len` tokens, decode `before` steps, export from pools A, import into pools B
/// (poisoned, with other units in use so the ids differ), decode `AFTER` more steps in both.
fn check_case(m: &Model<CpuBackend>, name: &str, kv: &Value, len: usize, before: usize) {
    let what = format!("{name} {kv} prompt {len} + {before} decoded");
    let prompt = prompt(name, len);
    let (want, want_fed) = uninterrupted(m, kv.clone(), &prompt, before + AFTER);

    let mut a = pools_with(m, kv.clone());
    let mut seq = a.open().unwrap();
    let mut logits = step(m, &mut a, &mut seq, &prompt, Logits::Last);
    for (k, &want_t) in want_fed[..before].iter().enumerate() {
        let t = argmax(&logits);
        assert_eq!(t, want_t, "{what}: token {k}");
        logits = step(m, &mut a, &mut seq, &[t], Logits::Last);
    }
    assert!(
        bits(&logits) == bits(&want[before]),
        "{what}: before the export"
    );
    let position = len + before;
    assert_eq!(seq.position(), position);

    let mut exported = state::export(&a, &seq);
    exported.last_token = Some(argmax(&logits));
    exported.rng = Some(0x5eed_0000_0000_0001);
    assert_eq!(exported.position, position);
    assert_eq!(exported.pages, a.pages_for(position));
    let bytes = state::read(&a, &exported).unwrap();
    assert_eq!(bytes.len(), exported.byte_len());

    // The state survives a round trip through its serialized form (a transfer sends it).
    let json = serde_json::to_string(&exported).unwrap();
    let received: SequenceState = serde_json::from_str(&json).unwrap();
    assert_eq!(received, exported);

    let mut b = pools_with(m, kv.clone());
    let mut other = b.open().unwrap();
    b.reserve(&mut other, 3 * b.page_size()).unwrap();
    poison(&mut b);
    let baseline = free_counts(&b);
    let mut imported = state::import(&mut b, &received, &bytes).unwrap();
    assert_eq!(imported.position(), position);
    assert_eq!(imported.pages().len(), exported.pages);
    assert_ne!(
        imported.slot(),
        seq.slot(),
        "{what}: B should use another slot"
    );
    assert_eq!(
        free_counts(&b),
        (baseline.0 - exported.pages, baseline.1 - 1, baseline.2)
    );
    // The imported sequence's state reads back as the same bytes.
    assert!(
        state::read(&b, &state::export(&b, &imported)).unwrap() == bytes,
        "{what}: imported bytes read back differently"
    );
    let next = &want[before..];
    let next_fed = &want_fed[before..];
    continue_and_check(
        m,
        &mut b,
        &mut imported,
        logits.clone(),
        next,
        next_fed,
        &format!("{what}, imported into B"),
    );
    continue_and_check(
        m,
        &mut a,
        &mut seq,
        logits,
        next,
        next_fed,
        &format!("{what}, continued in A"),
    );
    a.close(seq);
    b.close(imported);
    b.close(other);
    a.check().unwrap();
    b.check().unwrap();
    assert_eq!(
        b.page_allocator().free_count(),
        b.page_allocator().capacity()
    );
    assert_eq!(
        b.slot_allocator().free_count(),
        b.slot_allocator().capacity()
    );
}

/// (prompt length, decode steps before the export). With 128-token pages and windows of 32
/// (flash-like) / 48 (pro-like) tokens, ratios 4 and 128, the export lands at 1 and 6 (inside
/// the window), 20, 34 (past the flash-like window, inside the pro-like one), 124 (8 tokens
/// before a page boundary: the continuation crosses it), 127 (mid-page, mid CSA window),
/// 128 exactly on a page boundary (from prefill and from decode), 129, 130 and 200 (mid-way
/// through a 128-token compression group), 256 and 302 (second and third page).
const CASES: [(usize, usize); 13] = [
    (1, 0),
    (1, 5),
    (20, 0),
    (30, 4),
    (124, 0),
    (127, 0),
    (128, 0),
    (125, 3),
    (129, 0),
    (126, 4),
    (200, 0),
    (256, 0),
    (300, 2),
];

#[test]
fn flash_like_continues_bit_equal_after_import() {
    let m = model("flash-like");
    for (len, before) in CASES {
        check_case(&m, "flash-like", &json!({}), len, before);
    }
}

#[test]
fn pro_like_continues_bit_equal_after_import() {
    let m = model("pro-like");
    for (len, before) in CASES {
        check_case(&m, "pro-like", &json!({}), len, before);
    }
}

/// Encoded rows (bf16, fp8 kv with fp4 indexer keys) move as bytes too.
#[test]
fn low_precision_rows_continue_bit_equal_after_import() {
    let m = model("flash-like");
    for kv in [
        json!({"dtype": "bf16", "indexer_dtype": "bf16"}),
        json!({"dtype": "fp8", "indexer_dtype": "fp4"}),
    ] {
        for (len, before) in [(20, 0), (129, 0), (200, 3)] {
            check_case(&m, "flash-like", &kv, len, before);
        }
    }
}

/// A sequence of `len` tokens in fresh pools, its state and bytes.
fn exported(
    m: &Model<CpuBackend>,
    kv: Value,
    len: usize,
) -> (KvPools<CpuBackend>, SeqKv, SequenceState, Vec<u8>) {
    let mut pools = pools_with(m, kv);
    let mut seq = pools.open().unwrap();
    step(
        m,
        &mut pools,
        &mut seq,
        &prompt("flash-like", len),
        Logits::None,
    );
    let s = state::export(&pools, &seq);
    let bytes = state::read(&pools, &s).unwrap();
    (pools, seq, s, bytes)
}

#[test]
fn wrong_byte_length_is_refused_and_nothing_leaks() {
    let m = model("flash-like");
    let (_a, _seq, s, bytes) = exported(&m, json!({}), 200);
    let mut b = pools_with(&m, json!({}));
    let baseline = free_counts(&b);
    for wrong in [
        bytes[..bytes.len() - 1].to_vec(),
        [bytes.as_slice(), &[0]].concat(),
        Vec::new(),
    ] {
        let e = state::import(&mut b, &s, &wrong).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(
            e.message().contains(&format!("{} bytes", s.byte_len()))
                && e.message().contains(&format!("{} were given", wrong.len())),
            "{e}"
        );
        assert_eq!(free_counts(&b), baseline);
        b.check().unwrap();
    }
    // A state whose regions were altered is refused the same way.
    let mut altered = s.clone();
    altered.regions[0].len -= 1;
    let e = state::import(&mut b, &altered, &bytes[1..]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(free_counts(&b), baseline);
}

#[test]
fn another_layout_is_refused_naming_both() {
    let m = model("flash-like");
    let (_a, _seq, s, bytes) = exported(&m, json!({}), 200);
    for (kv, ours, theirs) in [
        (json!({"dtype": "bf16"}), "F32, 256 B", "Bf16, 128 B"),
        (json!({"page_size": 256}), "page_size: 128", "vs 256"),
        (
            json!({"indexer_dtype": "fp8"}),
            "indexer rows: F32",
            "Fp8Index",
        ),
    ] {
        let mut b = pools_with(&m, kv.clone());
        let baseline = free_counts(&b);
        let e = state::import(&mut b, &s, &bytes).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let msg = e.message();
        assert!(
            msg.contains(ours) && msg.contains(theirs),
            "{kv}: the error should name both layouts: {msg}"
        );
        assert!(msg.contains(&s.layout.to_string()), "{msg}");
        assert!(msg.contains(&b.layout().fingerprint().to_string()), "{msg}");
        assert_eq!(free_counts(&b), baseline);
        b.check().unwrap();
    }
    // Another model.
    let pro = model("pro-like");
    let mut b = pools_with(&pro, json!({}));
    let e = state::import(&mut b, &s, &bytes).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("layers: SCHCHS vs"), "{e}");
}

#[test]
fn no_free_slot_or_pages_is_capacity_and_nothing_leaks() {
    let m = model("flash-like");
    let (_a, _seq, s, bytes) = exported(&m, json!({}), 300);
    assert_eq!(s.pages, 3);

    // Every slot in use.
    let mut b = pools_with(&m, json!({}));
    let mut held = Vec::new();
    while let Ok(seq) = b.open() {
        held.push(seq);
    }
    let baseline = free_counts(&b);
    let e = state::import(&mut b, &s, &bytes).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
    assert!(e.message().contains("slots"), "{e}");
    assert_eq!(free_counts(&b), baseline);
    b.check().unwrap();
    b.close(held.pop().unwrap());

    // A slot but two pages free: all three or none.
    let free = b.page_allocator().free_count();
    let taken = b.alloc_pages(free - 2).unwrap();
    let baseline = free_counts(&b);
    let e = state::import(&mut b, &s, &bytes).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
    assert!(e.message().contains("needs 3 KV pages"), "{e}");
    assert_eq!(free_counts(&b), baseline);
    b.check().unwrap();

    // With one more page it fits.
    b.release_page(taken[0]);
    let seq = state::import(&mut b, &s, &bytes).unwrap();
    assert_eq!(b.page_allocator().free_count(), 0);
    b.close(seq);
    for &p in &taken[1..] {
        b.release_page(p);
    }
    for seq in held {
        b.close(seq);
    }
    b.check().unwrap();
    assert_eq!(
        b.page_allocator().free_count(),
        b.page_allocator().capacity()
    );
}

fn cache_step(
    m: &Model<CpuBackend>,
    cache: &mut PrefixCache<CpuBackend>,
    req: &mut Request,
    tokens: &mut Vec<u32>,
    t: u32,
) -> Vec<f32> {
    let end = req.position() + 1;
    cache.reserve(req, end).unwrap();
    let l = m
        .forward(
            cache.pools_mut(),
            &mut [dsv4::model::Chunk {
                tokens: &[t],
                seq: req.kv_mut(),
                logits: Logits::Last,
            }],
        )
        .unwrap()
        .remove(0);
    tokens.push(t);
    cache.after_step(req, tokens).unwrap();
    l
}

/// Through the prefix cache: a request resumed from a cache hit (shared pages, restored
/// snapshot) is exported mid-decode and imported into another cache whose free pages are all
/// taken by cached prefixes (the import evicts them); both continue bit-equal across a page
/// boundary, both caches' books balance, and a later prompt hits what `finish` cached from the
/// imported request exactly as it hits the original's.
#[test]
fn a_prefix_hit_moves_between_caches() {
    let m = model("flash-like");
    let ids = prompt("flash-like", 700);
    let mut a = PrefixCache::new(pools_with(&m, json!({})), 128).unwrap();
    // Cache the first 256 tokens, then start a prompt sharing them.
    let mut first = a.start(None, &ids[..300]).unwrap();
    prefill(&m, &mut a, &mut first, &ids[..300]).unwrap();
    a.finish(first, &ids[..300]);
    let p = [&ids[..256], &ids[400..470]].concat();
    let mut req = a.start(None, &p).unwrap();
    assert_eq!(req.reused_tokens(), 256, "the second prompt should hit");
    let mut logits = prefill(&m, &mut a, &mut req, &p).unwrap();
    let mut tokens = p.clone();
    for _ in 0..50 {
        let t = argmax(&logits);
        logits = cache_step(&m, &mut a, &mut req, &mut tokens, t);
    }
    let s = a.export(&req).unwrap();
    assert_eq!(s.position, 376);
    let bytes = state::read(a.pools(), &s).unwrap();

    // B: a cached prefix of 3 pages and every other page taken.
    let mut b = PrefixCache::new(pools_with(&m, json!({})), 128).unwrap();
    let other = &ids[300..700];
    let mut r = b.start(None, &other[..384]).unwrap();
    prefill(&m, &mut b, &mut r, &other[..384]).unwrap();
    b.finish(r, &other[..384]);
    let free = b.pools().page_allocator().free_count();
    let taken = b.pools_mut().alloc_pages(free).unwrap();
    let mut imported = b.import(None, p.len(), &s, &bytes).unwrap();
    assert!(b.stats().evicted_pages >= 3, "{:?}", b.stats());
    for p in taken {
        b.pools_mut().release_page(p);
    }
    let mut tokens_b = tokens.clone();
    let mut logits_b = logits.clone();
    for k in 0..AFTER {
        let t = argmax(&logits);
        assert_eq!(argmax(&logits_b), t, "token {k} after the move");
        logits = cache_step(&m, &mut a, &mut req, &mut tokens, t);
        logits_b = cache_step(&m, &mut b, &mut imported, &mut tokens_b, t);
        assert!(
            bits(&logits) == bits(&logits_b),
            "logits {} steps after the move differ",
            k + 1
        );
    }
    b.check(&[&imported]).unwrap();
    a.check(&[&req]).unwrap();
    // Both passed 384 while decoding: `finish` caches that boundary in each tree, B's from
    // pages and a snapshot that came out of the import. A later prompt hits it in both.
    a.finish(req, &tokens);
    b.finish(imported, &tokens_b);
    a.check(&[]).unwrap();
    b.check(&[]).unwrap();
    let next = [&tokens[..384], &ids[600..610]].concat();
    let mut ra = a.start(None, &next).unwrap();
    let mut rb = b.start(None, &next).unwrap();
    assert_eq!((ra.reused_tokens(), rb.reused_tokens()), (384, 384));
    let la = prefill(&m, &mut a, &mut ra, &next).unwrap();
    let lb = prefill(&m, &mut b, &mut rb, &next).unwrap();
    assert!(
        bits(&la) == bits(&lb),
        "a hit on the imported request's pages differs"
    );
    a.abort(ra);
    b.abort(rb);

    // Nothing evictable and no page free: Capacity, nothing taken.
    b.clear();
    let free = b.pools().page_allocator().free_count();
    let taken = b.pools_mut().alloc_pages(free).unwrap();
    let e = b.import(None, p.len(), &s, &bytes).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
    for p in taken {
        b.pools_mut().release_page(p);
    }
    b.check(&[]).unwrap();
}

/// A state can only be read while its sequence holds its units, and only as exported.
#[test]
fn reading_a_closed_sequence_is_refused() {
    let m = model("flash-like");
    let (mut a, seq, s, _) = exported(&m, json!({}), 200);
    // An altered region list is not read (it could point anywhere).
    let mut altered = s.clone();
    altered.regions[0].offset += 1 << 40;
    let e = state::read(&a, &altered).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("altered"), "{e}");
    a.close(seq);
    let e = state::read(&a, &s).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.message().contains("no longer in use"), "{e}");
    // A position no pools could hold is Capacity, before anything is allocated.
    let mut huge = s.clone();
    huge.position = 1 << 40;
    huge.pages = a.pages_for(huge.position);
    let baseline = free_counts(&a);
    let e = state::import(&mut a, &huge, &[]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
    assert_eq!(free_counts(&a), baseline);
}

/// Informational: export + read + import against a plain memcpy of the same bytes.
#[test]
fn transfer_cost_against_memcpy() {
    let m = model("flash-like");
    for len in [20, 300] {
        let (a, seq, s, bytes) = exported(&m, json!({}), len);
        let mut b = pools_with(&m, json!({}));
        const N: usize = 500;
        let per = |started: Instant| started.elapsed().as_secs_f64() / N as f64 * 1e6;
        // Fresh output buffer each time (what `read` does).
        let round = |b: &mut KvPools<CpuBackend>| {
            let s = state::export(&a, &seq);
            let bytes = state::read(&a, &s).unwrap();
            let seq = state::import(b, &s, &bytes).unwrap();
            b.close(seq);
        };
        for _ in 0..N / 10 {
            round(&mut b);
        }
        let started = Instant::now();
        for _ in 0..N {
            round(&mut b);
        }
        let fresh = per(started);
        // One reused output buffer (`read_into`).
        let mut buf = vec![0u8; bytes.len()];
        let started = Instant::now();
        for _ in 0..N {
            let s = state::export(&a, &seq);
            state::read_into(&a, &s, &mut buf).unwrap();
            let seq = state::import(&mut b, &s, &buf).unwrap();
            b.close(seq);
        }
        let reused = per(started);
        // Two copies (out of A, into B), as read + import do.
        let mut mid = vec![0u8; bytes.len()];
        let mut dst = vec![0u8; bytes.len()];
        let mut src = bytes.clone();
        let n = src.len();
        let started = Instant::now();
        for i in 0..N {
            src[i % n] = i as u8;
            mid.copy_from_slice(&src);
            dst.copy_from_slice(std::hint::black_box(&mid));
            std::hint::black_box(&mut dst);
        }
        let memcpy = per(started);
        println!(
            "sequence state at {len} tokens: {} bytes in {} regions; export+read+import \
             {fresh:.1} µs (read_into a reused buffer: {reused:.1} µs), 2× memcpy {memcpy:.1} µs \
             (ratios {:.2} / {:.2})",
            s.byte_len(),
            s.regions.len(),
            fresh / memcpy.max(1e-9),
            reused / memcpy.max(1e-9)
        );
    }
}

/// What a PD prefill sends early: the complete pages of a prompt still computing, at their
/// offsets in the finished prompt's state, are exactly those bytes of the state read once the
/// whole prompt is in (chunk by chunk, several page sizes, with and without pages from an
/// earlier chunk already sent).
#[test]
fn complete_pages_are_the_final_states_bytes_at_their_offsets() {
    let m = model("flash-like");
    for (page_size, len, chunk) in [
        (128, 300, 64),
        (128, 256, 100),
        (256, 700, 256),
        (128, 130, 7),
    ] {
        let kv = json!({"page_size": page_size});
        let tokens = prompt("flash-like", len);
        let mut pools = pools_with(&m, kv);
        let mut seq = pools.open().unwrap();
        let mut sent: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut from = 0;
        let mut at = 0;
        while at < len {
            let end = (at + chunk).min(len);
            step(&m, &mut pools, &mut seq, &tokens[at..end], Logits::Last);
            at = end;
            let (pieces, done) = state::complete_pages(&pools, &seq, len, from).unwrap();
            assert_eq!(done, (at / page_size).min(seq.pages().len()));
            assert!(done >= from);
            from = done;
            sent.extend(pieces);
        }
        let all = state::read(&pools, &state::export(&pools, &seq)).unwrap();
        let full_pages = len / page_size;
        // Every complete page of every paged pool was sent once, none past the end, and each
        // piece is the final state's bytes at its offset.
        let paged_pools = [PoolId::C4Kv, PoolId::C4Indexer, PoolId::C128Kv]
            .iter()
            .filter(|&&p| pools.layout().unit_bytes(p) > 0)
            .count();
        assert_eq!(
            sent.len(),
            full_pages * paged_pools,
            "page size {page_size}, {len} tokens"
        );
        let mut offsets: Vec<usize> = sent.iter().map(|(o, _)| *o).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(offsets.len(), sent.len(), "a page sent twice");
        for (offset, bytes) in &sent {
            assert!(offset + bytes.len() <= all.len());
            assert!(
                all[*offset..offset + bytes.len()] == bytes[..],
                "page size {page_size}, {len} tokens: the piece at {offset} differs"
            );
        }
        pools.close(seq);
    }
}
