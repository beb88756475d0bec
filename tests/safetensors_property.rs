//! Property tests over safetensors files fed to the checkpoint loading path: random headers
//! (wrong lengths, bogus dtypes, overflowing shapes, inconsistent offsets, junk metadata, invalid
//! UTF-8) through `Checkpoint::open`, and well-formed files whose tensors have been renamed,
//! retyped, reshaped or dropped through `Model::load` of the built-in tiny model. Every outcome
//! must be `Ok` with consistent tensors or a `DSV4_ERR_MODEL_FORMAT` error naming the file —
//! never a panic. Case counts keep each property to a few seconds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::WeightDtype;
use dsv4::config::ModelConfig;
use dsv4::model::weights::Checkpoint;
use dsv4::model::Model;
use dsv4::ErrorKind;
use proptest::prelude::*;
use proptest::sample::{select, Index};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Map, Value};

/// A scratch directory per test, removed when the test ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("dsv4-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn write(&self, bytes: &[u8]) -> &Path {
        std::fs::write(self.0.join("model.safetensors"), bytes).unwrap();
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Random headers through Checkpoint::open.

const DTYPES: &[&str] = &[
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "I16", "U16", "F16", "BF16", "I32",
    "U32", "F32", "F64", "I64", "U64", "C64", "f32", "Q4", "",
];

fn bits(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "F4" => 4,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "F64" | "I64" | "U64" | "C64" => 64,
        _ => return None,
    })
}

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
    /// `None`: the offsets that make the file consistent; `Some`: these instead.
    offsets: Option<(i64, i64)>,
}

fn entry() -> impl Strategy<Value = Entry> {
    let dim = prop_oneof![
        4 => 0u64..5,
        1 => select(vec![1u64 << 31, 1 << 32, u64::MAX / 2, u64::MAX]),
    ];
    (
        prop_oneof![
            "[a-z.]{1,12}",
            Just("__metadata__".to_string()),
            "\\PC{0,8}"
        ],
        select(DTYPES),
        prop::collection::vec(dim, 0..4),
        prop::option::weighted(0.2, (any::<i64>(), any::<i64>())),
    )
        .prop_map(|(name, dtype, shape, offsets)| Entry {
            name,
            dtype,
            shape,
            offsets,
        })
}

#[derive(Debug, Clone)]
enum Prefix {
    /// The header's real length.
    Exact,
    /// A length off by this much (saturating).
    Off(i64),
    Raw(u64),
}

#[derive(Debug, Clone)]
struct File {
    entries: Vec<Entry>,
    metadata: Option<Value>,
    prefix: Prefix,
    /// Bytes added to (or, negative, cut from) the data the header implies.
    data_delta: i64,
    /// A byte of the header replaced (invalid UTF-8, a broken quote, …).
    corrupt: Option<(Index, u8)>,
}

fn file() -> impl Strategy<Value = File> {
    (
        prop::collection::vec(entry(), 0..5),
        prop::option::weighted(
            0.2,
            prop_oneof![
                Just(json!({"format": "pt"})),
                Just(json!({"format": 1})),
                Just(json!([])),
                Just(json!("x")),
            ],
        ),
        prop_oneof![
            6 => Just(Prefix::Exact),
            1 => (-16i64..16).prop_map(Prefix::Off),
            1 => select(vec![0u64, 1, 7, 100_000_001, u64::MAX]).prop_map(Prefix::Raw),
        ],
        prop_oneof![6 => Just(0i64), 1 => -8i64..8],
        prop::option::weighted(0.1, (any::<Index>(), any::<u8>())),
    )
        .prop_map(|(entries, metadata, prefix, data_delta, corrupt)| File {
            entries,
            metadata,
            prefix,
            data_delta,
            corrupt,
        })
}

/// Lays the file out. A tensor that would need more than 1 MiB of data gets offsets for 1 MiB
/// only: such a header is inconsistent, and still worth feeding.
fn layout(f: &File) -> Vec<u8> {
    let mut header = Map::new();
    let mut end: u64 = 0;
    for e in &f.entries {
        let size = bits(e.dtype).and_then(|b| {
            e.shape
                .iter()
                .try_fold(b as u64, |acc, &d| acc.checked_mul(d))
                .map(|bits| bits.div_ceil(8))
        });
        let (start, stop) = match e.offsets {
            Some((a, b)) => (json!(a), json!(b)),
            None => {
                let size = size.unwrap_or(0).min(1 << 20);
                let range = (json!(end), json!(end + size));
                end += size;
                range
            }
        };
        header.insert(
            e.name.clone(),
            json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [start, stop]}),
        );
    }
    if let Some(meta) = &f.metadata {
        header.insert("__metadata__".into(), meta.clone());
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).unwrap();
    if let Some((at, byte)) = f.corrupt {
        let at = at.index(text.len());
        text[at] = byte;
    }
    let len = text.len() as u64;
    let prefix = match f.prefix {
        Prefix::Exact => len,
        Prefix::Off(d) => len.saturating_add_signed(d),
        Prefix::Raw(n) => n,
    };
    let data = end.saturating_add_signed(f.data_delta).min(2 << 20);
    let mut bytes = prefix.to_le_bytes().to_vec();
    bytes.extend_from_slice(&text);
    bytes.resize(bytes.len() + data as usize, 0x3c);
    bytes
}

#[test]
fn random_headers_open_consistently_or_fail_cleanly() {
    let scratch = Scratch::new("st-headers");
    proptest!(config(512), |(f in file())| {
        let dir = scratch.write(&layout(&f));
        match Checkpoint::open(dir) {
            Ok(ckpt) => {
                // Whatever was accepted must be readable exactly as the header describes it.
                let names: Vec<String> = ckpt.names().map(str::to_string).collect();
                for name in &names {
                    let t = ckpt.get(name).unwrap();
                    let elements: usize = t.shape.iter().product();
                    prop_assert_eq!(t.bytes.len() * 8, elements * t.dtype.bitsize(), "{}", name);
                }
            }
            Err(e) => {
                prop_assert_eq!(e.kind(), ErrorKind::ModelFormat, "{}", e);
                prop_assert!(e.message().contains("model.safetensors"), "{}", e);
                prop_assert!(e.message().contains("download it again"), "{}", e);
            }
        }
    });
}

#[test]
fn any_bytes_open_or_fail_cleanly() {
    let scratch = Scratch::new("st-bytes");
    proptest!(config(512), |(bytes in prop::collection::vec(any::<u8>(), 0..256))| {
        if let Err(e) = Checkpoint::open(scratch.write(&bytes)) {
            prop_assert_eq!(e.kind(), ErrorKind::ModelFormat, "{}", e);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Well-formed files with the wrong tensors through Model::load.

struct Tiny {
    dir: Scratch,
    config: ModelConfig,
    /// (name, dtype, shape, data) of every stored tensor, in file order.
    tensors: Vec<Stored>,
    backend: Arc<CpuBackend>,
}

impl Tiny {
    fn new() -> Self {
        let dir = Scratch::new("st-tiny");
        dsv4::model::tiny::write_checkpoint(&dir.0).unwrap();
        let config = ModelConfig::load(&dir.0).unwrap();
        let bytes = std::fs::read(dir.0.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<_> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                (
                    name,
                    view.dtype(),
                    view.shape().to_vec(),
                    view.data().to_vec(),
                )
            })
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let backend = Arc::new(CpuBackend::new(1).unwrap());
        Self {
            dir,
            config,
            tensors,
            backend,
        }
    }
}

#[derive(Debug, Clone)]
enum Change {
    Drop,
    Rename(String),
    Retype(Dtype),
    /// Shape changed; data resized to match.
    Reshape(Vec<usize>),
    /// A dimension swapped with another (same element count).
    Transpose,
    /// The data replaced by bytes that decode to NaN/inf/huge values (e8m0 scale 0xff, …).
    Poison(u8),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        Just(Change::Drop),
        "[a-z_.0-9]{1,24}".prop_map(Change::Rename),
        select(vec![
            Dtype::F32,
            Dtype::BF16,
            Dtype::F16,
            Dtype::F8_E4M3,
            Dtype::F8_E8M0,
            Dtype::I8,
            Dtype::U8,
            Dtype::I32,
            Dtype::I64,
            Dtype::F64,
        ])
        .prop_map(Change::Retype),
        prop::collection::vec(0usize..70, 0..4).prop_map(Change::Reshape),
        Just(Change::Transpose),
        select(vec![0x00u8, 0x7f, 0xff, 0x80]).prop_map(Change::Poison),
    ]
}

type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

fn rewrite(original: &[Stored], changes: &[(Index, Change)]) -> Vec<u8> {
    let mut tensors = original.to_vec();
    for (which, change) in changes {
        if tensors.is_empty() {
            break;
        }
        let i = which.index(tensors.len());
        let (name, dtype, shape, data) = &mut tensors[i];
        let resize = |data: &mut Vec<u8>, dtype: Dtype, shape: &[usize]| {
            let elements: usize = shape.iter().product();
            data.resize((elements * dtype.bitsize()).div_ceil(8), 0);
        };
        match change {
            Change::Drop => {
                tensors.remove(i);
            }
            Change::Rename(new) => *name = new.clone(),
            Change::Retype(new) => {
                *dtype = *new;
                resize(data, *dtype, shape);
            }
            Change::Reshape(new) => {
                *shape = new.clone();
                resize(data, *dtype, shape);
            }
            Change::Transpose => shape.reverse(),
            Change::Poison(byte) => data.fill(*byte),
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.dedup_by(|a, b| a.0 == b.0);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .filter_map(|(name, dtype, shape, data)| {
            // A combination safetensors itself refuses to write (e.g. an odd F4 count) is
            // left out: this test is about files that are valid safetensors.
            TensorView::new(*dtype, shape.clone(), data)
                .ok()
                .map(|view| (name.clone(), view))
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn wrong_tensors_load_or_fail_with_a_model_format_error() {
    let t = Tiny::new();
    // Each case loads the tiny model (a few milliseconds).
    proptest!(config(96), |(changes in prop::collection::vec((any::<Index>(), change()), 1..4))| {
        let dir = t.dir.write(&rewrite(&t.tensors, &changes));
        let loaded = Model::load(dir, t.config.clone(), t.backend.clone(), WeightDtype::F32);
        if let Err(e) = loaded {
            prop_assert_eq!(e.kind(), ErrorKind::ModelFormat, "{}", e);
            prop_assert!(!e.message().trim().is_empty());
        }
    });
}
