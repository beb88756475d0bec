//! The built-in tiny model (`dsv4::model::tiny`): written deterministically and only when
//! needed, repaired when damaged, laid out like the official release, and loadable by the real
//! loader into a model whose forward pass gives usable logits.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::model::MlpKind;
use dsv4::config::params::WeightDtype;
use dsv4::config::{AttentionKind, ModelConfig, Params};
use dsv4::engine::Engine;
use dsv4::model::{tiny, Model};
use safetensors::SafeTensors;
use serde_json::{json, Value};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir =
            std::env::temp_dir().join(format!("dsv4-tiny-{tag}-{}-{nanos}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

fn write(dir: &Path) -> bool {
    let started = Instant::now();
    let wrote = tiny::write_checkpoint(dir).unwrap();
    eprintln!(
        "write_checkpoint({}) = {wrote} in {:.3} s",
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    wrote
}

fn load(dir: &Path) -> dsv4::Result<Model<CpuBackend>> {
    let config = ModelConfig::load(dir)?;
    Model::load(
        dir,
        config,
        Arc::new(CpuBackend::new(2).unwrap()),
        WeightDtype::F32,
    )
}

/// name (digits → `#`) → (dtype, rank) of every tensor in a safetensors file.
fn layout(bytes: &[u8]) -> BTreeMap<String, (String, usize)> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let pattern: String = name
                .split('.')
                .map(|part| {
                    if part.chars().all(|c| c.is_ascii_digit()) {
                        "#"
                    } else {
                        part
                    }
                })
                .collect::<Vec<_>>()
                .join(".");
            (pattern, (format!("{:?}", view.dtype()), view.shape().len()))
        })
        .collect()
}

#[test]
fn writes_once_and_the_same_bytes_every_time() {
    let a = TempDir::new("a");
    assert!(write(&a.0), "the first call writes");
    assert!(
        !write(&a.0),
        "the second call finds an identical checkpoint"
    );
    let b = TempDir::new("b");
    assert!(write(&b.0));
    const FILES: [&str; 4] = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    for name in FILES {
        assert!(read(&a.0, name) == read(&b.0, name), "{name} differs");
    }
    let size = read(&a.0, "model.safetensors").len();
    eprintln!("model.safetensors: {size} bytes");
    let config: Value = serde_json::from_slice(&read(&a.0, "config.json")).unwrap();
    assert_eq!(config, tiny::config_json());
    // Only those files: no temporary left behind.
    let names: BTreeSet<String> = std::fs::read_dir(&a.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, FILES.iter().map(|n| n.to_string()).collect());
    // The tokenizer is the committed one, and a removed one is written again.
    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-model");
    assert!(read(&a.0, "tokenizer.json") == read(&committed, "tokenizer.json"));
    std::fs::remove_file(a.0.join("tokenizer.json")).unwrap();
    assert!(write(&a.0));
    assert!(read(&a.0, "tokenizer.json") == read(&committed, "tokenizer.json"));
}

#[test]
fn a_damaged_checkpoint_is_detected_and_rewritten() {
    let dir = TempDir::new("damaged");
    write(&dir.0);
    let weights = read(&dir.0, "model.safetensors");
    let config = read(&dir.0, "config.json");

    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.0.join("model.safetensors"))
        .unwrap();
    file.set_len(weights.len() as u64 / 2).unwrap();
    drop(file);
    let e = load(&dir.0).err().expect("a truncated file must not load");
    assert!(e.message().contains("truncated"), "{e}");
    assert!(write(&dir.0), "the truncated file is rewritten");
    assert!(read(&dir.0, "model.safetensors") == weights);

    // Same size, one flipped byte in the data: only a byte comparison sees it.
    let mut flipped = weights.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    std::fs::write(dir.0.join("model.safetensors"), &flipped).unwrap();
    assert!(write(&dir.0));
    assert!(read(&dir.0, "model.safetensors") == weights);

    std::fs::remove_file(dir.0.join("config.json")).unwrap();
    assert!(write(&dir.0), "a missing config.json is written");
    assert_eq!(read(&dir.0, "config.json"), config);
    assert!(!write(&dir.0));
    load(&dir.0).unwrap();
}

#[test]
fn errors_name_the_path_and_the_fix() {
    let dir = TempDir::new("blocked");
    // A file where the directory should be: create_dir_all fails on any platform.
    std::fs::write(&dir.0, b"not a directory").unwrap();
    let target = dir.0.join("model");
    let e = tiny::write_checkpoint(&target).unwrap_err();
    assert_eq!(e.kind(), dsv4::ErrorKind::Io);
    assert!(e.message().contains(&target.display().to_string()), "{e}");
    assert!(e.message().contains("DSV4_DEMO_MODEL_DIR"), "{e}");
    std::fs::remove_file(&dir.0).unwrap();

    let dir = TempDir::new("index");
    std::fs::create_dir_all(&dir.0).unwrap();
    std::fs::write(dir.0.join("model.safetensors.index.json"), b"{}").unwrap();
    let e = tiny::write_checkpoint(&dir.0).unwrap_err();
    assert!(e.message().contains("model.safetensors.index.json"), "{e}");
    assert!(e.message().contains("DSV4_DEMO_MODEL_DIR"), "{e}");
}

#[test]
fn the_layout_is_the_official_one() {
    // Every tensor kind of the official-FP8 fixture (written by the reference script), with the
    // same dtypes and ranks, and nothing else.
    let dir = TempDir::new("layout");
    write(&dir.0);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/flash-like/official-fp8/model.safetensors");
    let expected = layout(&std::fs::read(fixture).unwrap());
    let found = layout(&read(&dir.0, "model.safetensors"));
    assert_eq!(found, expected);
    // The same config keys as the fixture's official config.json.
    let fixture_config: Value = serde_json::from_slice(
        &std::fs::read(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/flash-like/official-fp8/config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let keys = |v: &Value| -> BTreeSet<String> { v.as_object().unwrap().keys().cloned().collect() };
    assert_eq!(keys(&tiny::config_json()), keys(&fixture_config));
}

#[test]
fn loads_every_layer_kind_and_scores_varied_finite_logits() {
    let dir = TempDir::new("score");
    write(&dir.0);
    let config = ModelConfig::load(&dir.0).unwrap();
    let kinds: BTreeSet<(String, String)> = config
        .attention
        .iter()
        .zip(&config.mlp)
        .map(|(a, m)| (format!("{a:?}"), format!("{m:?}")))
        .collect();
    for a in [AttentionKind::Swa, AttentionKind::Csa, AttentionKind::Hca] {
        for m in [MlpKind::HashMoe, MlpKind::Moe] {
            assert!(
                kinds.contains(&(format!("{a:?}"), format!("{m:?}"))),
                "no {a:?} layer with {m:?}: {kinds:?}"
            );
        }
    }
    assert_eq!((config.csa_ratio, config.hca_ratio), (4, 128));
    assert_eq!(config.vocab_size, 4096);
    assert!(config.max_position_embeddings >= 4096 + 1024);
    assert!(
        !config.hidden_size.is_multiple_of(128),
        "FP8 blocks should be ragged"
    );

    let started = Instant::now();
    let model = load(&dir.0).unwrap();
    eprintln!("Model::load: {:.3} s", started.elapsed().as_secs_f64());
    let info = model.info();
    assert!(info["parameters"].as_u64().unwrap() > 1_000_000, "{info}");
    assert_eq!(info["mtp_layers_loaded"], 1, "{info}");
    assert!(
        info["bytes_by_dtype"]["f32"].as_u64().unwrap() > 0,
        "{info}"
    );
    assert!(
        info["bytes_by_dtype"]["i32"].as_u64().unwrap() > 0,
        "{info}"
    );
    drop(model);

    let params = Params::from_value(&json!({
        "model_path": dir.0.to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "256MiB", "max_running_requests": 4}
    }))
    .unwrap();
    let engine = Engine::create(params).unwrap();
    let mut rng = fastrand::Rng::with_seed(2024);
    let tokens: Vec<i32> = (0..300).map(|_| rng.i32(0..4096)).collect();
    let started = Instant::now();
    let logits = engine.score(&tokens).unwrap();
    eprintln!(
        "score(300 tokens): {:.3} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(logits.len(), 300 * 4096);
    assert!(logits.iter().all(|v| v.is_finite()), "non-finite logits");
    let mut counts: HashMap<usize, usize> = HashMap::new();
    let mut spread = 0.0f64;
    for row in logits.chunks_exact(4096) {
        let (arg, _) =
            row.iter().enumerate().fold(
                (0, f32::MIN),
                |best, (i, &v)| if v > best.1 { (i, v) } else { best },
            );
        *counts.entry(arg).or_default() += 1;
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / 4096.0;
        spread += (row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / 4096.0)
            .sqrt()
            / 300.0;
    }
    let most = counts.values().max().copied().unwrap_or(0);
    eprintln!(
        "{} distinct argmax tokens over 300 positions (most frequent {most} times), mean logit \
         std {spread:.3}",
        counts.len()
    );
    assert!(counts.len() >= 30, "argmax barely varies: {counts:?}");
    assert!(most <= 150, "one token dominates: {counts:?}");
    assert!(spread > 0.1 && spread < 100.0, "logit spread {spread}");
}
