//! The exact forward pass against Hugging Face transformers 5.23.0 (goldens from
//! tests/reference/make_fixtures.py): every fixture, both naming schemes, fp32 and FP8/FP4.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::{NumericsMode, WeightDtype};
use dsv4::config::ModelConfig;
use dsv4::model::Model;
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Golden {
    ids: Vec<u32>,
    logits_f32: Vec<f32>,
    logits_q: Vec<f32>,
    ids_official: Vec<u32>,
    logits_q_official: Vec<f32>,
}

fn golden(name: &str) -> Golden {
    let bytes = std::fs::read(fixtures().join(name).join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let ids_of = |n: &str| -> Vec<u32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let ids = ids_of("input_ids");
    Golden {
        ids,
        logits_f32: f32s("logits_f32"),
        logits_q: f32s("logits_q"),
        ids_official: ids_of("input_ids_official"),
        logits_q_official: f32s("logits_q_official"),
    }
}

fn load(dir: &Path) -> Model<CpuBackend> {
    load_as(dir, WeightDtype::F32)
}

fn load_as(dir: &Path, dtype: WeightDtype) -> Model<CpuBackend> {
    let config = ModelConfig::load(dir).unwrap();
    let backend = Arc::new(CpuBackend::new(2).unwrap());
    Model::load(dir, config, backend, dtype).unwrap()
}

/// Every position's logits, with f32 KV pools sized by the planner.
fn score(model: &Model<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut kv = common::pools(model);
    common::full(model, &mut kv, ids)
}

/// Max abs error and argmax agreement of `ours` against `expected`, both `[n, vocab]`.
fn compare(ours: &[f32], expected: &[f32], vocab: usize) -> (f32, usize, usize) {
    assert_eq!(ours.len(), expected.len());
    let max_err = ours
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
            .unwrap()
    };
    let rows = ours.len() / vocab;
    let agree = ours
        .chunks(vocab)
        .zip(expected.chunks(vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    (max_err, agree, rows)
}

fn check(fixture: &str, variant: &str) {
    let g = golden(fixture);
    let model = load(&fixtures().join(fixture).join(variant));
    let expected = if variant == "hf-f32" {
        &g.logits_f32
    } else {
        &g.logits_q
    };
    let ours = score(&model, &g.ids);
    let (max_err, agree, rows) = compare(&ours, expected, model.config.vocab_size);
    eprintln!("{fixture}/{variant}: max abs error {max_err:.2e}, argmax {agree}/{rows}");
    assert!(
        max_err <= 1e-3,
        "{fixture}/{variant}: max abs logit error {max_err}"
    );
    assert_eq!(agree, rows, "{fixture}/{variant}: argmax disagreement");
}

#[test]
fn flash_like_hf_f32() {
    check("flash-like", "hf-f32");
}

#[test]
fn flash_like_official_fp8_fp4() {
    check("flash-like", "official-fp8");
}

#[test]
fn flash_like_hf_fp8_fp4_sharded() {
    check("flash-like", "hf-fp8");
}

#[test]
fn pro_like_hf_f32() {
    check("pro-like", "hf-f32");
}

#[test]
fn pro_like_official_fp8_fp4() {
    check("pro-like", "official-fp8");
}

#[test]
fn pro_like_hf_fp8_fp4_sharded() {
    check("pro-like", "hf-fp8");
}

/// FP8 and FP4 values times power-of-two scales (and bf16 tensors) are exact in bf16, so bf16
/// weights lose nothing on quantised checkpoints: the goldens hold at the same tolerance.
#[test]
fn bf16_weights_are_exact_for_quantised_checkpoints() {
    for fixture in ["flash-like", "pro-like"] {
        let g = golden(fixture);
        for variant in ["official-fp8", "hf-fp8"] {
            let model = load_as(&fixtures().join(fixture).join(variant), WeightDtype::Bf16);
            let ours = score(&model, &g.ids);
            let (max_err, agree, rows) = compare(&ours, &g.logits_q, model.config.vocab_size);
            eprintln!("{fixture}/{variant} bf16 weights: max abs error {max_err:.3e}, argmax {agree}/{rows}");
            assert!(max_err <= 1e-3, "{fixture}/{variant}: {max_err}");
            assert_eq!(agree, rows, "{fixture}/{variant}");
        }
    }
}

/// Official numerics (FP8 KV and Hadamard + FP4 indexer round trips) against transformers with
/// the same round trips inserted, on a sequence whose roundings are unambiguous (see
/// make_fixtures.py: one value rounded the other way moves logits far beyond 1e-3).
#[test]
fn official_numerics_match_the_emulated_golden() {
    for fixture in ["flash-like", "pro-like"] {
        let g = golden(fixture);
        for variant in ["official-fp8", "hf-fp8"] {
            let model =
                load(&fixtures().join(fixture).join(variant)).with_numerics(NumericsMode::Official);
            let ours = score(&model, &g.ids_official);
            let (max_err, agree, rows) =
                compare(&ours, &g.logits_q_official, model.config.vocab_size);
            eprintln!("{fixture}/{variant} official numerics: max abs error {max_err:.3e}, argmax {agree}/{rows}");
            assert!(max_err <= 1e-3, "{fixture}/{variant}: {max_err}");
            assert_eq!(agree, rows, "{fixture}/{variant}");
            // And they do differ from exact mode.
            let exact = score(
                &load(&fixtures().join(fixture).join(variant)),
                &g.ids_official,
            );
            let (exact_gap, _, _) = compare(&ours, &exact, model.config.vocab_size);
            assert!(
                exact_gap > 1e-2,
                "{fixture}/{variant}: official numerics changed nothing"
            );
        }
    }
}

/// Native weights (what `auto` means for these checkpoints): FP8 and FP4 kept as stored and
/// decoded inside the kernels give the goldens at the f32 tolerance, and the resident bytes
/// are the checkpoint's FP8/FP4 bytes, not f32's.
#[test]
fn native_weights_match_the_goldens_and_stay_fp8_fp4() {
    for fixture in ["flash-like", "pro-like"] {
        let g = golden(fixture);
        for variant in ["official-fp8", "hf-fp8"] {
            let dir = fixtures().join(fixture).join(variant);
            let config = ModelConfig::load(&dir).unwrap();
            assert_eq!(WeightDtype::Auto.resolve(&config), WeightDtype::Native);
            let model = load_as(&dir, WeightDtype::Auto);
            let ours = score(&model, &g.ids);
            let (max_err, agree, rows) = compare(&ours, &g.logits_q, model.config.vocab_size);
            eprintln!("{fixture}/{variant} native weights: max abs error {max_err:.3e}, argmax {agree}/{rows}");
            assert!(max_err <= 1e-3, "{fixture}/{variant}: {max_err}");
            assert_eq!(agree, rows, "{fixture}/{variant}");
            let bytes = &model.info()["bytes_by_dtype"];
            assert!(bytes["fp8_e4m3"].as_u64().unwrap() > 0, "{bytes}");
            assert!(bytes["fp4_e2m1"].as_u64().unwrap() > 0, "{bytes}");
            // Against the same model widened to f32: each FP8 byte kept (value and scale)
            // replaces ~4 bytes, each packed FP4 byte (two values and their scale) ~8.
            let f32_bytes = load_as(&dir, WeightDtype::F32).info()["bytes_by_dtype"]["f32"]
                .as_u64()
                .unwrap();
            let native: u64 = bytes
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap())
                .sum();
            eprintln!("{fixture}/{variant}: {native} bytes native, {f32_bytes} as f32");
            let kept = |k: &str| bytes[k].as_u64().unwrap() as f64;
            let saved = (f32_bytes - native) as f64;
            assert!(
                saved >= 2.9 * kept("fp8_e4m3") + 6.5 * kept("fp4_e2m1"),
                "{bytes} vs {f32_bytes}"
            );
        }
    }
    // An f32 checkpoint stays f32.
    let dir = fixtures().join("flash-like").join("hf-f32");
    let config = ModelConfig::load(&dir).unwrap();
    assert_eq!(WeightDtype::Auto.resolve(&config), WeightDtype::F32);
}
