//! Chunked prefill, token-by-token decode and batched steps give the same logits as one full
//! pass (≤ 1e-4 in fp32) on every fixture, including chunks that end inside CSA windows and
//! exactly on 4-, 128- and page-multiples.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::WeightDtype;
use dsv4::config::ModelConfig;
use dsv4::model::{Chunk, Logits, Model, SeqState};
use safetensors::SafeTensors;

fn fixture(parts: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(parts)
}

fn ids(name: &str) -> Vec<u32> {
    let bytes = std::fs::read(fixture(name).join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

fn model(name: &str) -> Model<CpuBackend> {
    let dir = fixture(name).join("hf-f32");
    let config = ModelConfig::load(&dir).unwrap();
    Model::load(
        &dir,
        config,
        Arc::new(CpuBackend::new(2).unwrap()),
        WeightDtype::F32,
    )
    .unwrap()
}

fn full(model: &Model<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut state = model.new_state();
    model
        .forward(&mut [Chunk {
            tokens: ids,
            state: &mut state,
            logits: Logits::All,
        }])
        .unwrap()
        .remove(0)
}

/// Runs `ids` in chunks of the given sizes (the rest token by token) and returns all logits.
fn chunked(model: &Model<CpuBackend>, ids: &[u32], sizes: &[usize]) -> Vec<f32> {
    let mut state = model.new_state();
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = sizes.iter().copied();
    while at < ids.len() {
        let n = sizes.next().unwrap_or(1).min(ids.len() - at);
        let logits = model
            .forward(&mut [Chunk {
                tokens: &ids[at..at + n],
                state: &mut state,
                logits: Logits::All,
            }])
            .unwrap()
            .remove(0);
        out.extend(logits);
        at += n;
    }
    assert_eq!(state.position, ids.len());
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_schedules(name: &str) {
    let model = model(name);
    let ids = ids(name);
    let reference = full(&model, &ids);
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
        let got = chunked(&model, &ids, sizes);
        let diff = max_diff(&got, &reference);
        eprintln!("{name}: {what}: max diff {diff:.2e}");
        assert!(diff <= 1e-4, "{name}: {what}: {diff}");
    }
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
    let ids = ids("flash-like");
    let (a, b, c) = (&ids[..200], &ids[40..300], &ids[7..9]);
    let reference: Vec<Vec<f32>> = [a, b, c].iter().map(|s| full(&model, s)).collect();
    let vocab = model.config.vocab_size;
    let mut states: Vec<SeqState<CpuBackend>> = (0..3).map(|_| model.new_state()).collect();
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
    let mut step = 0;
    while (0..3).any(|s| at[s] < seqs[s].len()) {
        let mut chunks = Vec::new();
        let mut which = Vec::new();
        for (s, state) in states.iter_mut().enumerate() {
            if at[s] >= seqs[s].len() {
                continue;
            }
            let n = plan(step, s).min(seqs[s].len() - at[s]);
            chunks.push(Chunk {
                tokens: &seqs[s][at[s]..at[s] + n],
                state,
                logits: Logits::All,
            });
            which.push((s, n));
        }
        let outs = model.forward(&mut chunks).unwrap();
        for ((s, n), logits) in which.into_iter().zip(outs) {
            assert_eq!(logits.len(), n * vocab);
            got[s].extend(logits);
            at[s] += n;
        }
        step += 1;
    }
    for s in 0..3 {
        let diff = max_diff(&got[s], &reference[s]);
        assert!(diff <= 1e-4, "sequence {s}: {diff}");
    }
}

#[test]
fn the_state_carries_an_mtp_window_when_the_checkpoint_has_mtp() {
    let dir = fixture("flash-like").join("official-fp8");
    let config = ModelConfig::load(&dir).unwrap();
    let with_mtp = Model::load(
        &dir,
        config,
        Arc::new(CpuBackend::new(1).unwrap()),
        WeightDtype::F32,
    )
    .unwrap();
    assert_eq!(with_mtp.new_state().mtp_windows(), 1);
    assert_eq!(model("flash-like").new_state().mtp_windows(), 0);
}

#[test]
fn last_logits_only_are_the_last_row() {
    let model = model("pro-like");
    let ids = ids("pro-like");
    let reference = full(&model, &ids[..50]);
    let mut state = model.new_state();
    let last = model
        .forward(&mut [Chunk {
            tokens: &ids[..50],
            state: &mut state,
            logits: Logits::Last,
        }])
        .unwrap()
        .remove(0);
    let vocab = model.config.vocab_size;
    assert!(max_diff(&last, &reference[49 * vocab..]) <= 1e-5);
}
