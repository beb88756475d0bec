//! Forward-pass speed on the CPU backend: prefill tokens/s and decode tokens/s at batch 1 and 8,
//! on a committed fixture and on a larger random model (hidden 1024, 8 layers, every layer kind)
//! generated here. `make bench-forward` runs this and, when torch is installed, transformers on
//! the same weights (scripts/bench_forward.py), and prints the ratios.
//!
//!     cargo run --release --example bench_forward -- [--model fixture|large] [--threads N]
//!         [--weights f32|bf16] [--kv f32|bf16|fp8] [--phase prefill|decode1|decode8] [--json]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::Params;
use dsv4::config::params::WeightDtype;
use dsv4::config::tensors::{checkpoint_tensors, Storage};
use dsv4::config::ModelConfig;
use dsv4::kv::{KvPools, SeqKv};
use dsv4::model::{Chunk, Logits, Model};
use dsv4::plan;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

/// The larger benchmark model: every layer kind, hash and scored MoE, real head and index dims.
fn large_config() -> serde_json::Value {
    json!({
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": 16384, "hidden_size": 1024, "num_hidden_layers": 8,
        "num_attention_heads": 8, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 256,
        "o_groups": 2, "o_lora_rank": 256, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 256, "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": true, "topk_method": "noaux_tc",
        "swiglu_limit": 10.0, "num_hash_layers": 2, "sliding_window": 128,
        "index_n_heads": 16, "index_head_dim": 128, "index_topk": 64,
        "compress_ratios": [0, 4, 128, 4, 128, 4, 128, 0], "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536, "num_nextn_predict_layers": 0,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false,
        "torch_dtype": "float32"
    })
}

/// SplitMix64 + Box–Muller: deterministic weights without a RNG dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f32::consts::PI * v).cos()
    }
}

/// Writes config.json and an official-named fp32 checkpoint with random weights, once.
fn write_large(dir: &Path) -> ModelConfig {
    let config_text = serde_json::to_string_pretty(&large_config()).unwrap();
    let config = ModelConfig::from_json_str(&config_text, "bench-large").unwrap();
    if dir.join("model.safetensors").is_file() {
        return config;
    }
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = Rng(7);
    let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for spec in checkpoint_tensors(&config) {
        let n = spec.elements() as usize;
        let name = spec.name.as_str();
        let (dtype, bytes) = if spec.storage == Storage::Index {
            let k = spec.shape[1];
            let e = config.n_routed_experts as u64;
            let mut v = Vec::with_capacity(n * 8);
            for _ in 0..spec.shape[0] {
                let first = rng.next_u64() % e;
                for j in 0..k as u64 {
                    v.extend_from_slice(&(((first + j) % e) as i64).to_le_bytes());
                }
            }
            (Dtype::I64, v)
        } else {
            let fan_in = *spec.shape.last().unwrap() as f32;
            let values: Vec<f32> = (0..n)
                .map(|_| {
                    if name.ends_with("norm.weight") {
                        1.0 + 0.1 * rng.normal()
                    } else if name.ends_with("_scale") {
                        0.5 + rng.uniform()
                    } else if spec.shape.len() == 2 && !name.ends_with(".ape") {
                        rng.normal() / fan_in.sqrt()
                    } else {
                        0.3 * rng.normal()
                    }
                })
                .collect();
            (
                Dtype::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            )
        };
        blobs.push((spec.name.clone(), dtype, spec.shape.clone(), bytes));
    }
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config_text).unwrap();
    config
}

struct Bench {
    model: Model<CpuBackend>,
    kv: KvPools<CpuBackend>,
    prompt: usize,
    steps: usize,
}

impl Bench {
    fn tokens(&self, seed: u64, n: usize) -> Vec<u32> {
        let mut rng = Rng(seed);
        let v = self.model.config.vocab_size as u64;
        (0..n)
            .map(|_| (2 + rng.next_u64() % (v - 2)) as u32)
            .collect()
    }

    fn prefill(&mut self, seq: &mut SeqKv, ids: &[u32]) {
        self.kv.reserve(seq, ids.len() + self.steps).unwrap();
        self.model
            .forward(
                &mut self.kv,
                &mut [Chunk {
                    tokens: ids,
                    seq,
                    logits: Logits::Last,
                }],
            )
            .unwrap();
    }

    /// Prompt tokens per second of one full prefill (best of 5).
    fn prefill_rate(&mut self) -> f64 {
        let ids = self.tokens(1, self.prompt);
        (0..5)
            .map(|_| {
                let mut seq = self.kv.open().unwrap();
                let t = Instant::now();
                self.prefill(&mut seq, &ids);
                let rate = self.prompt as f64 / t.elapsed().as_secs_f64();
                self.kv.close(seq);
                rate
            })
            .fold(0.0, f64::max)
    }

    /// Generated tokens per second with `batch` sequences decoding together, from the median
    /// step time (robust to a noisy machine).
    fn decode_rate(&mut self, batch: usize) -> f64 {
        let mut seqs: Vec<SeqKv> = (0..batch).map(|_| self.kv.open().unwrap()).collect();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let ids = self.tokens(10 + i as u64, self.prompt);
            self.prefill(seq, &ids);
        }
        let next: Vec<Vec<u32>> = (0..batch)
            .map(|i| self.tokens(100 + i as u64, self.steps))
            .collect();
        let mut times = Vec::with_capacity(self.steps);
        for step in 0..self.steps {
            let mut chunks: Vec<Chunk<'_>> = seqs
                .iter_mut()
                .zip(&next)
                .map(|(seq, ids)| Chunk {
                    tokens: &ids[step..step + 1],
                    seq,
                    logits: Logits::Last,
                })
                .collect();
            let t = Instant::now();
            self.model.forward(&mut self.kv, &mut chunks).unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
        for seq in seqs {
            self.kv.close(seq);
        }
        times.sort_by(f64::total_cmp);
        batch as f64 / times[times.len() / 2]
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let which = value("--model").unwrap_or_else(|| "large".into());
    let threads: usize = value("--threads").map_or(0, |t| t.parse().unwrap());
    let weights = match value("--weights").as_deref() {
        Some("bf16") => WeightDtype::Bf16,
        _ => WeightDtype::F32,
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (dir, config, prompt, steps): (PathBuf, ModelConfig, usize, usize) = match which.as_str() {
        "fixture" => {
            let dir = root.join("tests/fixtures/flash-like/hf-f32");
            let config = ModelConfig::load(&dir).unwrap();
            (dir, config, 256, 64)
        }
        _ => {
            let dir = root.join("target/bench/large");
            let config = write_large(&dir);
            (dir, config, 512, 32)
        }
    };
    let backend = Arc::new(CpuBackend::new(threads).unwrap());
    let threads = backend.threads();
    let model = Model::load(&dir, config.clone(), backend.clone(), weights).unwrap();
    let steps = value("--steps").map_or(steps, |s| s.parse().unwrap());
    let kv_dtype = value("--kv").unwrap_or_else(|| "f32".into());
    let params = Params::from_value(&json!({"kv": {
        "dtype": kv_dtype, "device_memory_bytes": "1GiB", "max_running_requests": 8,
        "page_size": 128}}))
    .unwrap();
    let plan = plan::plan_with(&params, config, &plan::numa::SystemProbe::new()).unwrap();
    let kv = KvPools::new(backend, &plan).unwrap();
    let mut bench = Bench {
        model,
        kv,
        prompt,
        steps,
    };
    // `--phase` runs one measurement alone (for profiling).
    let phase = value("--phase").unwrap_or_default();
    let run = |name: &str| phase.is_empty() || phase == name;
    let prefill = if run("prefill") {
        bench.prefill_rate()
    } else {
        0.0
    };
    let b1 = if run("decode1") {
        bench.decode_rate(1)
    } else {
        0.0
    };
    let b8 = if run("decode8") {
        bench.decode_rate(8)
    } else {
        0.0
    };
    let report = json!({
        "model": which, "checkpoint": dir, "threads": threads, "prompt": prompt,
        "decode_steps": steps, "weights": format!("{weights:?}").to_lowercase(), "kv": kv_dtype,
        "prefill_tok_s": prefill, "decode_b1_tok_s": b1, "decode_b8_tok_s": b8,
    });
    if args.iter().any(|a| a == "--json") {
        println!("{report}");
    } else {
        println!(
            "dsv4 {which} ({threads} threads, {prompt}-token prompt): prefill {prefill:.1} tok/s, \
             decode b1 {b1:.1} tok/s, decode b8 {b8:.1} tok/s (b8/b1 {:.2})",
            b8 / b1
        );
    }
}
