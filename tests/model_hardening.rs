//! Hostile model directories (issue 12): files that are not regular files and Hugging Face
//! snapshots made of symbolic links.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dsv4::config::Params;
use dsv4::engine::Engine;
use dsv4::ErrorKind;
use serde_json::json;

use common::fixture;

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
