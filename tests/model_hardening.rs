//! Hostile model directories and corrupt weights (issue 12): files that are not regular files,
//! Hugging Face snapshots made of symbolic links, NaN or infinite values in the small tensors
//! scanned at load, and NaN in a large matrix found by the diagnostic re-run.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dsv4::config::params::WeightDtype;
use dsv4::config::{AttentionKind, Params};
use dsv4::engine::Engine;
use dsv4::ErrorKind;
use serde_json::json;

use common::{fixture, load_model, pools};

fn params(model_path: &Path) -> Params {
    Params::from_value(&json!({
        "model_path": model_path.to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "64MiB", "max_running_requests": 4}
    }))
    .unwrap()
}

/// Engine creation on another thread, failing the test (instead of hanging it) after 60 s.
/// Today's loader blocks forever opening a FIFO; the fix answers in milliseconds.
fn create_within(model_path: &Path) -> dsv4::Result<Engine> {
    let (tx, rx) = mpsc::channel();
    let params = params(model_path);
    std::thread::spawn(move || {
        let _ = tx.send(Engine::create(params));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(result) => result,
        Err(_) => panic!(
            "engine creation on {} did not return within 60 s (blocked opening a FIFO?)",
            model_path.display()
        ),
    }
}

fn refused(result: dsv4::Result<Engine>) -> dsv4::Error {
    match result {
        Ok(_) => panic!("engine creation should have failed"),
        Err(e) => e,
    }
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn empty(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dsv4-hardening-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// A copy of a fixture checkpoint directory.
    fn copy(tag: &str, from: &str) -> Self {
        let s = Self::empty(tag);
        for entry in std::fs::read_dir(fixture(from)).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, s.0.join(path.file_name().unwrap())).unwrap();
        }
        s
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn mkfifo(&self, name: &str) {
        let status = Command::new("mkfifo")
            .arg(self.path(name))
            .status()
            .unwrap();
        assert!(status.success(), "mkfifo failed");
    }

    /// Rewrites `file` after `edit` changes its (name → (dtype, shape, bytes)) map.
    fn edit(&self, file: &str, edit: impl FnOnce(&mut common::TensorMap)) {
        common::edit_safetensors(&self.path(file), edit);
    }

    /// Sets byte(s) of one stored tensor.
    fn poke(&self, file: &str, tensor: &str, offset: usize, bytes: &[u8]) {
        self.edit(file, |t| {
            let data = &mut t.get_mut(tensor).unwrap_or_else(|| panic!("no {tensor}")).2;
            data[offset..offset + bytes.len()].copy_from_slice(bytes);
        });
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// --- files that are not regular files --------------------------------------------------------

#[test]
fn a_fifo_named_like_a_shard_is_refused_at_once() {
    // No model.safetensors and no index: the loader takes every *.safetensors of the directory.
    let s = Scratch::copy("fifo-glob", "flash-like/official-fp8");
    std::fs::rename(
        s.path("model.safetensors"),
        s.path("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    s.mkfifo("extra.safetensors");
    let started = Instant::now();
    let e = refused(create_within(&s.0));
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    let m = e.message();
    assert!(m.contains("extra.safetensors") && m.contains("FIFO"), "{e}");
    assert!(
        m.contains("not a regular file") && m.contains("remove it"),
        "{e}"
    );
}

#[test]
fn a_fifo_in_place_of_the_single_file_or_a_listed_shard_is_refused() {
    let s = Scratch::copy("fifo-single", "flash-like/official-fp8");
    std::fs::remove_file(s.path("model.safetensors")).unwrap();
    s.mkfifo("model.safetensors");
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(e.message().contains("model.safetensors is a FIFO"), "{e}");

    let s = Scratch::copy("fifo-shard", "flash-like/hf-fp8");
    std::fs::remove_file(s.path("model-00002-of-00002.safetensors")).unwrap();
    s.mkfifo("model-00002-of-00002.safetensors");
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(
        e.message()
            .contains("model-00002-of-00002.safetensors is a FIFO"),
        "{e}"
    );

    // The shard index itself.
    let s = Scratch::copy("fifo-index", "flash-like/hf-fp8");
    std::fs::remove_file(s.path("model.safetensors.index.json")).unwrap();
    s.mkfifo("model.safetensors.index.json");
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(e.message().contains("index.json is a FIFO"), "{e}");
}

#[test]
fn a_directory_or_a_fifo_config_is_refused_not_waited_on() {
    let s = Scratch::copy("dir-shard", "flash-like/official-fp8");
    std::fs::rename(s.path("model.safetensors"), s.path("a.safetensors")).unwrap();
    std::fs::create_dir(s.path("b.safetensors")).unwrap();
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(e.message().contains("b.safetensors is a directory"), "{e}");

    let s = Scratch::copy("fifo-config", "flash-like/official-fp8");
    std::fs::remove_file(s.path("config.json")).unwrap();
    s.mkfifo("config.json");
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
}

/// A Hugging Face cache snapshot: every file is a relative symbolic link into `blobs/`.
#[test]
fn a_snapshot_of_symbolic_links_loads_and_a_dangling_link_is_named() {
    let root = Scratch::empty("hf-snapshot");
    let blobs = root.path("blobs");
    let snap = root.path("snapshots/0123abcd");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (i, entry) in std::fs::read_dir(fixture("flash-like/hf-fp8"))
        .unwrap()
        .enumerate()
    {
        let path = entry.unwrap().path();
        let blob = format!("blob{i:02}");
        std::fs::copy(&path, blobs.join(&blob)).unwrap();
        std::os::unix::fs::symlink(
            format!("../../blobs/{blob}"),
            snap.join(path.file_name().unwrap()),
        )
        .unwrap();
    }
    let engine = create_within(&snap).unwrap();
    let ids: Vec<i32> = common::ids("flash-like")[..8]
        .iter()
        .map(|&t| t as i32)
        .collect();
    let linked = engine.score(&ids).unwrap();
    drop(engine);
    let plain = create_within(&fixture("flash-like/hf-fp8"))
        .unwrap()
        .score(&ids)
        .unwrap();
    assert_eq!(linked, plain);

    // A link whose blob is gone (an interrupted download).
    let blob = std::fs::read_link(snap.join("model-00001-of-00002.safetensors")).unwrap();
    std::fs::remove_file(snap.join(&blob)).unwrap();
    let e = refused(create_within(&snap));
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(
        e.message().contains("model-00001-of-00002.safetensors")
            && e.message().contains("download"),
        "{e}"
    );
}

// --- NaN and infinity in the tensors scanned at load -----------------------------------------

const BF16_NAN: [u8; 2] = [0xc0, 0x7f];

#[test]
fn a_nan_in_a_norm_weight_is_refused_naming_tensor_and_index() {
    let s = Scratch::copy("nan-norm", "flash-like/official-fp8");
    // layers.3.ffn_norm.weight is BF16 [160]: element 17.
    s.poke(
        "model.safetensors",
        "layers.3.ffn_norm.weight",
        34,
        &BF16_NAN,
    );
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(
        e.message()
            .contains("`layers.3.ffn_norm.weight`: element [17] is NaN"),
        "{e}"
    );
    assert!(e.message().contains("download it again"), "{e}");
}

#[test]
fn non_finite_scales_and_small_tensors_are_refused() {
    // An FP8 block scale (e8m0 0xff is NaN).
    let s = Scratch::copy("nan-fp8-scale", "flash-like/official-fp8");
    s.poke("model.safetensors", "layers.2.attn.wq_a.scale", 1, &[0xff]);
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(
        e.message().contains(
            "scale `layers.2.attn.wq_a.scale` of `layers.2.attn.wq_a.weight`: block [0, 1] is \
             NaN"
        ),
        "{e}"
    );

    // An FP4 expert scale [160, 1]: row 7.
    let s = Scratch::copy("nan-fp4-scale", "flash-like/official-fp8");
    s.poke(
        "model.safetensors",
        "layers.4.ffn.experts.3.w2.scale",
        7,
        &[0xff],
    );
    let e = refused(create_within(&s.0));
    assert!(
        e.message()
            .contains("scale `layers.4.ffn.experts.3.w2.scale` of `layers.4.ffn.experts.3.w2.weight`: block [7, 0] is NaN"),
        "{e}"
    );

    // An infinite hyper-connection scale (F32 [3]) and attention sink (F32 [4]).
    let s = Scratch::copy("inf-hc", "flash-like/official-fp8");
    s.poke(
        "model.safetensors",
        "layers.0.hc_attn_scale",
        4,
        &f32::INFINITY.to_le_bytes(),
    );
    s.poke(
        "model.safetensors",
        "layers.5.attn.attn_sink",
        8,
        &f32::NEG_INFINITY.to_le_bytes(),
    );
    let e = refused(create_within(&s.0));
    let m = e.message();
    assert!(
        m.contains("`layers.0.hc_attn_scale`: element [1] is inf"),
        "{e}"
    );
    assert!(
        m.contains("`layers.5.attn.attn_sink`: element [2] is -inf"),
        "{e}"
    );

    // A stacked Hugging Face scale holds every expert's scales: reported once, under the
    // expert weight that reads the bad one, with its index in the stored tensor.
    let s = Scratch::copy("nan-hf-stacked", "flash-like/hf-fp8");
    s.poke(
        "model-00001-of-00002.safetensors",
        "model.layers.1.mlp.experts.down_proj_scale_inv",
        160 + 3,
        &[0xff],
    );
    let e = refused(create_within(&s.0));
    let m = e.message();
    assert_eq!(m.matches("down_proj_scale_inv").count(), 1, "{e}");
    assert!(
        m.contains(
            "scale `model.layers.1.mlp.experts.down_proj_scale_inv` of \
             `layers.1.ffn.experts.1.w2.weight`: block [1, 3, 0] is NaN"
        ),
        "{e}"
    );
}

// --- NaN in a large matrix: the diagnostic re-run ---------------------------------------------

/// The fixture's first `n` tokens.
fn tokens(n: usize) -> Vec<u32> {
    common::ids("flash-like")[..n].to_vec()
}

fn free_units(kv: &dsv4::kv::KvPools<dsv4::backend::cpu::CpuBackend>) -> (usize, usize) {
    (
        kv.page_allocator().free_count(),
        kv.slot_allocator().free_count(),
    )
}

#[test]
fn a_nan_in_a_large_matrix_loads_and_the_diagnostic_names_its_layer() {
    let s = Scratch::copy("nan-wo-b", "flash-like/official-fp8");
    // layers.1.attn.wo_b.weight is FP8 e4m3 [160, 64]; 0x7f is e4m3fn's NaN. Row 9.
    s.poke(
        "model.safetensors",
        "layers.1.attn.wo_b.weight",
        9 * 64 + 5,
        &[0x7f],
    );
    // Large matrices are not scanned at load.
    let model = load_model(&s.0, WeightDtype::F32, 2);
    let mut kv = pools(&model);
    let ids = tokens(40);
    let logits = common::full(&model, &mut kv, &ids);
    assert!(
        logits.iter().any(|v| !v.is_finite()),
        "the NaN reaches the logits"
    );

    let before = free_units(&kv);
    let found = model
        .diagnose_nonfinite(&mut kv, &ids, 0)
        .unwrap()
        .expect("a non-finite value is found");
    assert_eq!(free_units(&kv), before, "the scratch sequence is closed");
    assert_eq!(found.layer, Some(1));
    assert_eq!(found.kind, Some(AttentionKind::Csa));
    assert_eq!(found.step, "attention output");
    assert_eq!(found.weights, vec!["layers.1.attn.wo_b.weight".to_string()]);
    assert!(found.value.is_nan());
    assert_eq!(found.position, 0);
    assert_eq!(
        found.to_string(),
        "layer 1 (CSA) attention output: NaN at position 0 (weights: layers.1.attn.wo_b.weight)"
    );
    assert!(found.message().contains("download the checkpoint again"));

    // Chunked the same way as a prefill: the first chunk already shows it.
    let chunked = model.diagnose_nonfinite(&mut kv, &ids, 7).unwrap().unwrap();
    // (NaN != NaN, so compare what is reported.)
    assert_eq!(chunked.to_string(), found.to_string());
    assert_eq!(free_units(&kv), before);
}

#[test]
fn the_diagnostic_names_a_later_layer_and_position_and_is_quiet_on_good_weights() {
    let s = Scratch::copy("nan-shared-w1", "flash-like/official-fp8");
    // layers.4.ffn.shared_experts.w1.weight is FP8 [32, 160]: an infinity would saturate; a
    // NaN in row 3 taints every token's gate.
    s.poke(
        "model.safetensors",
        "layers.4.ffn.shared_experts.w1.weight",
        3 * 160 + 100,
        &[0xff],
    );
    let model = load_model(&s.0, WeightDtype::Bf16, 2);
    let mut kv = pools(&model);
    let found = model
        .diagnose_nonfinite(&mut kv, &tokens(20), 0)
        .unwrap()
        .expect("found");
    assert_eq!(
        (found.layer, found.kind, found.step),
        (
            Some(4),
            Some(AttentionKind::Hca),
            "shared expert gate/up projection"
        ),
        "{found}"
    );
    assert!(found
        .weights
        .contains(&"layers.4.ffn.shared_experts.w1.weight".to_string()));

    // The unmodified checkpoint: nothing to report, pools unchanged.
    let model = load_model(&fixture("flash-like/official-fp8"), WeightDtype::F32, 2);
    let mut kv = pools(&model);
    let before = free_units(&kv);
    assert_eq!(
        model.diagnose_nonfinite(&mut kv, &tokens(30), 8).unwrap(),
        None
    );
    assert_eq!(free_units(&kv), before);
    let e = model.diagnose_nonfinite(&mut kv, &[], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

/// Silent NaN, engine side: before the fix the request FINISHED normally with token 0 (greedy)
/// and logprob NaN. Now it ends with an ERROR event, MODEL_FORMAT, whose message names the
/// layer and weights the diagnostic re-run found; the engine keeps serving, nothing leaks.
#[test]
fn a_request_on_nan_weights_ends_with_model_format_naming_the_layer() {
    use dsv4::engine::{EventKind, RequestSpec, SamplingParams, ShutdownMode};
    let s = Scratch::copy("nan-engine", "flash-like/official-fp8");
    s.poke(
        "model.safetensors",
        "layers.1.attn.wo_b.weight",
        9 * 64 + 5,
        &[0x7f],
    );
    let engine = create_within(&s.0).expect("large matrices are not scanned at load");
    let spec = RequestSpec {
        prompt: tokens(40),
        max_new_tokens: 4,
        logprobs: true,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    };
    let id = engine.submit(spec).unwrap();
    let mut events = Vec::new();
    let start = Instant::now();
    while !events.iter().any(|e: &dsv4::engine::Event| e.is_terminal()) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no terminal event"
        );
        events.extend(engine.poll(16, Some(Duration::from_millis(100))).unwrap());
    }
    assert!(
        events.iter().all(|e| e.kind() != EventKind::Token),
        "no token sampled from NaN logits: {events:?}"
    );
    let end = events.last().unwrap();
    assert_eq!((end.request_id(), end.kind()), (id, EventKind::Error));
    assert_eq!(end.error_kind(), Some(ErrorKind::ModelFormat));
    let message = end.message().unwrap();
    assert!(
        message.contains("layer 1 (CSA) attention output")
            && message.contains("layers.1.attn.wo_b.weight"),
        "{message}"
    );
    let m = engine.metrics();
    assert_eq!(m.pools.device_slots.used, 0, "the slot came back");
    engine.shutdown(ShutdownMode::Drain, None).unwrap();
}

/// A shard index that lists one tensor twice is refused naming the key (it was last-wins).
#[test]
fn a_shard_index_listing_a_tensor_twice_is_refused() {
    let s = Scratch::copy("dup-index", "flash-like/hf-fp8");
    let path = s.path("model.safetensors.index.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let at = text.find("\"weight_map\": {").expect("a weight_map") + "\"weight_map\": {".len();
    let first_entry_end = at + text[at..].find(',').unwrap() + 1;
    let duplicated = format!(
        "{}{}{}",
        &text[..first_entry_end],
        &text[at..first_entry_end],
        &text[first_entry_end..]
    );
    std::fs::write(&path, duplicated).unwrap();
    let e = refused(create_within(&s.0));
    assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
    assert!(e.message().contains("appears twice"), "{e}");
}
