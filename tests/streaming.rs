//! Chunked prefill, token-by-token decode and batched steps give the same logits as one full
//! pass (≤ 1e-4 in fp32) on every fixture, including chunks that end inside CSA windows and
//! exactly on 4-, 128- and page-multiples. State lives in the planner-sized KV pools.

mod common;

use common::{fixture, full, ids, max_diff, model, plan_for, pools, step};
use dsv4::backend::cpu::CpuBackend;
use dsv4::kv::{KvLayout, KvPools};
use dsv4::model::{Chunk, Logits, Model};
use serde_json::json;

/// Runs `ids` in chunks of the given sizes (the rest token by token) and returns all logits.
fn chunked(
    model: &Model<CpuBackend>,
    kv: &mut KvPools<CpuBackend>,
    ids: &[u32],
    sizes: &[usize],
) -> Vec<f32> {
    let mut seq = kv.open().unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = sizes.iter().copied();
    while at < ids.len() {
        let n = sizes.next().unwrap_or(1).min(ids.len() - at);
        out.extend(step(model, kv, &mut seq, &ids[at..at + n], Logits::All));
        at += n;
    }
    assert_eq!(seq.position(), ids.len());
    kv.close(seq);
    out
}

fn check_schedules(name: &str) {
    let model = model(name);
    let mut kv = pools(&model);
    let ids = ids(name);
    let reference = full(&model, &mut kv, &ids);
    let schedules: &[(&str, Vec<usize>)] = &[
        (
            "odd chunks inside CSA windows",
            vec![61, 69, 1, 128, 41, 3, 5, 7],
        ),
        ("multiples of 4", vec![4, 8, 12, 40, 100, 4]),
        ("multiples of 128 (HCA windows, pages)", vec![128, 128]),
        ("a 256-token page then decode", vec![256]),
        ("one token at a time", vec![]),
        ("prefill 137 then decode", vec![137]),
    ];
    for (what, sizes) in schedules {
        let got = chunked(&model, &mut kv, &ids, sizes);
        let diff = max_diff(&got, &reference);
        eprintln!("{name}: {what}: max diff {diff:.2e}");
        assert!(diff <= 1e-4, "{name}: {what}: {diff}");
    }
    kv.check().unwrap();
    assert_eq!(kv.page_allocator().used_count(), 0, "pages leaked");
    assert_eq!(kv.slot_allocator().used_count(), 0, "slots leaked");
}

#[test]
fn flash_like_chunking_matches_the_full_pass() {
    check_schedules("flash-like");
}

#[test]
fn pro_like_chunking_matches_the_full_pass() {
    check_schedules("pro-like");
}

#[test]
fn a_batch_of_sequences_in_different_phases_matches_each_alone() {
    let model = model("flash-like");
    let mut kv = pools(&model);
    let ids = ids("flash-like");
    let (a, b, c) = (&ids[..200], &ids[40..300], &ids[7..9]);
    let reference: Vec<Vec<f32>> = [a, b, c].iter().map(|s| full(&model, &mut kv, s)).collect();
    let vocab = model.config.vocab_size;
    let mut seqs_kv: Vec<_> = (0..3).map(|_| kv.open().unwrap()).collect();
    let mut got: Vec<Vec<f32>> = vec![Vec::new(); 3];
    // Step 1: A prefills 150, B prefills 7, C prefills both tokens.
    // Step 2..: A finishes its prompt in one chunk and decodes; B prefills in 64-token chunks.
    let mut at = [0usize; 3];
    let seqs = [a, b, c];
    let plan = |step: usize, s: usize| -> usize {
        match (s, step) {
            (0, 0) => 150,
            (0, 1) => 45,
            (0, _) => 1,
            (1, 0) => 7,
            (1, _) => 64,
            _ => 2,
        }
    };
    let mut step_no = 0;
    while (0..3).any(|s| at[s] < seqs[s].len()) {
        let mut chunks = Vec::new();
        let mut which = Vec::new();
        for (s, seq) in seqs_kv.iter_mut().enumerate() {
            if at[s] >= seqs[s].len() {
                continue;
            }
            let n = plan(step_no, s).min(seqs[s].len() - at[s]);
            kv.reserve(seq, at[s] + n).unwrap();
            chunks.push(Chunk {
                tokens: &seqs[s][at[s]..at[s] + n],
                seq,
                logits: Logits::All,
            });
            which.push((s, n));
        }
        let outs = model.forward(&mut kv, &mut chunks).unwrap();
        for ((s, n), logits) in which.into_iter().zip(outs) {
            assert_eq!(logits.len(), n * vocab);
            got[s].extend(logits);
            at[s] += n;
        }
        step_no += 1;
    }
    for s in 0..3 {
        let diff = max_diff(&got[s], &reference[s]);
        assert!(diff <= 1e-4, "sequence {s}: {diff}");
    }
}

#[test]
fn the_window_pool_holds_a_ring_for_every_layer_and_the_mtp_block() {
    let plan = plan_for(&fixture("flash-like").join("official-fp8"), json!({}));
    let layout = KvLayout::new(&plan).unwrap();
    assert_eq!(layout.num_layers(), 6);
    assert_eq!(layout.swa_layers(), 7, "6 layers + 1 MTP block");
}

#[test]
fn last_logits_only_are_the_last_row() {
    let model = model("pro-like");
    let mut kv = pools(&model);
    let ids = ids("pro-like");
    let reference = full(&model, &mut kv, &ids[..50]);
    let mut seq = kv.open().unwrap();
    let last = step(&model, &mut kv, &mut seq, &ids[..50], Logits::Last);
    kv.close(seq);
    let vocab = model.config.vocab_size;
    assert!(max_diff(&last, &reference[49 * vocab..]) <= 1e-5);
}
