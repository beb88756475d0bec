//! Forward-pass speed on the CPU backend: prefill tokens/s and decode tokens/s at batch 1 and 8,
//! on a committed fixture and on a larger random model (hidden 1024, 8 layers, every layer kind)
//! generated here. `make bench-forward` runs this and, when torch is installed, transformers on
//! the same weights (scripts/bench_forward.py), and prints the ratios.
//!
//!     cargo run --release --example bench_forward -- [--model fixture|large] [--threads N]
//!         [--weights f32|bf16|native|auto] [--kv f32|bf16|fp8] [--phase prefill|decode1|decode8]
//!         [--bandwidth] [--json] [--op-times] [--batch N]
//!
//! `--batch N` also measures decode at batch N (N sequences of the prompt, one token each a
//! step) and prints it on a line of its own.
//!
//! `--op-times` also prints, for one prefill and for the b1 and b8 decode steps, the wall time of
//! each backend op on the step's thread (products by shape and storage), per step and as a
//! share of the step: what the step spends its time on, waits for parts included.
//!
//! `--model large-fp8` is the large model written as an official FP8/FP4 checkpoint (the same
//! weights rounded), `large-fp8-deq` its dequantised f32 copy (what transformers loads).
//!
//! The generated models go under `target/bench` of the source tree, or under `DSV4_BENCH_DIR`
//! when set (a machine that runs the built binary without the tree: `scripts/gpu-check.sh`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dsv4::backend::cpu::{amx_supported, record_op_times, set_amx, take_op_times, CpuBackend};
use dsv4::config::params::Params;
use dsv4::config::params::WeightDtype;
use dsv4::config::tensors::{checkpoint_tensors, Storage};
use dsv4::config::ModelConfig;
use dsv4::formats::{e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, E2M1};
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

/// One tensor of the large model: its values (f32, or the hash router's i64 table as bytes).
enum Values {
    F32(Vec<f32>),
    I64(Vec<u8>),
}

/// The large model's random weights, deterministic.
fn large_values(config: &ModelConfig) -> Vec<(dsv4::config::tensors::TensorSpec, Values)> {
    let mut rng = Rng(7);
    let mut out = Vec::new();
    for spec in checkpoint_tensors(config) {
        let n = spec.elements() as usize;
        let name = spec.name.as_str();
        let values = if spec.storage == Storage::Index {
            let k = spec.shape[1];
            let e = config.n_routed_experts as u64;
            let mut v = Vec::with_capacity(n * 8);
            for _ in 0..spec.shape[0] {
                let first = rng.next_u64() % e;
                for j in 0..k as u64 {
                    v.extend_from_slice(&(((first + j) % e) as i64).to_le_bytes());
                }
            }
            Values::I64(v)
        } else {
            let fan_in = *spec.shape.last().unwrap() as f32;
            Values::F32(
                (0..n)
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
                    .collect(),
            )
        };
        out.push((spec, values));
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_checkpoint(
    dir: &Path,
    config_text: &str,
    blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    std::fs::create_dir_all(dir).unwrap();
    let views: Vec<(String, TensorView)> = blobs
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("config.json"), config_text).unwrap();
}

/// Writes config.json and an official-named fp32 checkpoint with random weights, once.
fn write_large(dir: &Path) -> ModelConfig {
    let config_text = serde_json::to_string_pretty(&large_config()).unwrap();
    let config = ModelConfig::from_json_str(&config_text, "bench-large").unwrap();
    if dir.join("model.safetensors").is_file() {
        return config;
    }
    let blobs = large_values(&config)
        .into_iter()
        .map(|(spec, v)| match v {
            Values::I64(b) => (spec.name, Dtype::I64, spec.shape, b),
            Values::F32(v) => (spec.name, Dtype::F32, spec.shape, f32_bytes(&v)),
        })
        .collect();
    write_checkpoint(dir, &config_text, blobs);
    config
}

/// The e8m0 exponent byte of the smallest power of two `s` with `amax / s <= max`.
fn e8m0_for(amax: f32, max: f32) -> u8 {
    if amax == 0.0 {
        return 127;
    }
    ((amax / max).log2().ceil() as i32 + 127).clamp(1, 254) as u8
}

/// The same large model as an official FP8/FP4 checkpoint, once: dense linears rounded to FP8
/// e4m3 with 128 × 128 e8m0 block scales, routed experts to FP4 e2m1 with 1 × 32 e8m0 scales
/// (the release's formats), the other matrices bf16 and vectors f32. `dequantised` gets the rounded values as f32
/// (what transformers and the f32 comparison load: the same weights).
fn write_large_fp8(dir: &Path, dequantised: &Path) -> ModelConfig {
    let mut doc = large_config();
    doc["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]});
    doc["expert_dtype"] = json!("fp4");
    doc["torch_dtype"] = json!("bfloat16");
    let config_text = serde_json::to_string_pretty(&doc).unwrap();
    let config = ModelConfig::from_json_str(&config_text, "bench-large-fp8").unwrap();
    if dir.join("model.safetensors").is_file() && dequantised.join("model.safetensors").is_file() {
        return config;
    }
    let (mut quant, mut deq) = (Vec::new(), Vec::new());
    for (spec, v) in large_values(&config) {
        let scale_name = format!("{}.scale", spec.name.trim_end_matches(".weight"));
        let v = match v {
            Values::I64(b) => {
                quant.push((spec.name.clone(), Dtype::I64, spec.shape.clone(), b.clone()));
                deq.push((spec.name, Dtype::I64, spec.shape, b));
                continue;
            }
            Values::F32(v) => v,
        };
        let (rows, cols) = (spec.shape[0], spec.shape.get(1).copied().unwrap_or(1));
        let mut back = v.clone();
        match spec.storage {
            Storage::Linear => {
                let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
                let mut exps = vec![0u8; br * bc];
                for (t, e) in exps.iter_mut().enumerate() {
                    let (r0, c0) = ((t / bc) * 128, (t % bc) * 128);
                    let amax = (r0..(r0 + 128).min(rows))
                        .flat_map(|r| (c0..(c0 + 128).min(cols)).map(move |c| r * cols + c))
                        .map(|i| v[i].abs())
                        .fold(0.0f32, f32::max);
                    *e = e8m0_for(amax, 448.0);
                }
                let q: Vec<u8> = (0..rows * cols)
                    .map(|i| {
                        let s = e8m0_decode(exps[(i / cols / 128) * bc + (i % cols) / 128]);
                        let code = e4m3_encode(v[i] / s);
                        back[i] = e4m3_decode(code) * s;
                        code
                    })
                    .collect();
                quant.push((spec.name.clone(), Dtype::F8_E4M3, spec.shape.clone(), q));
                quant.push((scale_name, Dtype::F8_E8M0, vec![br, bc], exps));
            }
            Storage::Expert => {
                let nb = cols / 32;
                let mut exps = vec![0u8; rows * nb];
                let mut packed = vec![0u8; rows * cols / 2];
                for r in 0..rows {
                    for b in 0..nb {
                        let block = &v[r * cols + b * 32..r * cols + b * 32 + 32];
                        let e = e8m0_for(block.iter().fold(0.0f32, |m, x| m.max(x.abs())), 6.0);
                        exps[r * nb + b] = e;
                        let s = e8m0_decode(e);
                        for (j, &x) in block.iter().enumerate() {
                            let code = e2m1_encode(x / s);
                            let at = r * cols + b * 32 + j;
                            back[at] = E2M1[code as usize] * s;
                            packed[at / 2] |= if at % 2 == 0 { code } else { code << 4 };
                        }
                    }
                }
                quant.push((spec.name.clone(), Dtype::I8, vec![rows, cols / 2], packed));
                quant.push((scale_name, Dtype::F8_E8M0, vec![rows, nb], exps));
            }
            // As in the release: unquantised matrices (embeddings, head, compressor
            // projections, router gate) in bf16.
            Storage::Unquantized if spec.shape.len() == 2 => {
                let mut raw = Vec::with_capacity(2 * v.len());
                for (x, b) in v.iter().zip(back.iter_mut()) {
                    let h = half::bf16::from_f32(*x);
                    *b = h.to_f32();
                    raw.extend_from_slice(&h.to_le_bytes());
                }
                quant.push((spec.name.clone(), Dtype::BF16, spec.shape.clone(), raw));
            }
            _ => quant.push((
                spec.name.clone(),
                Dtype::F32,
                spec.shape.clone(),
                f32_bytes(&v),
            )),
        }
        deq.push((spec.name, Dtype::F32, spec.shape, f32_bytes(&back)));
    }
    write_checkpoint(dir, &config_text, quant);
    let plain = serde_json::to_string_pretty(&large_config()).unwrap();
    write_checkpoint(dequantised, &plain, deq);
    config
}

/// Bytes of weights one decode step reads with one token per sequence and `batch` sequences:
/// every matrix once, except the routed experts (only those that fired: at most `batch × k`
/// per MoE layer, counted as `min(batch × k, n) / n` of them) and the embedding table (one row
/// per token). Bytes per element as the CPU backend holds them with `weights`.
fn step_bytes(config: &ModelConfig, weights: WeightDtype, quantised: bool, batch: usize) -> f64 {
    let native = weights.resolve(config) == WeightDtype::Native && quantised;
    let bf16 = weights == WeightDtype::Bf16;
    let fired = (batch * config.n_activated_experts).min(config.n_routed_experts) as f64
        / config.n_routed_experts as f64;
    checkpoint_tensors(config)
        .iter()
        .map(|spec| {
            let n = spec.elements() as f64;
            let per = match spec.storage {
                Storage::Index => 0.0,
                _ if spec.shape.len() < 2 => 4.0,
                Storage::Float32 => 4.0,
                Storage::Linear if native => 1.0 + 1.0 / 128.0,
                Storage::Expert if native => 0.5 + 1.0 / 32.0,
                Storage::Unquantized if native => 2.0,
                _ if bf16 => 2.0,
                _ => 4.0,
            };
            let share = match spec.storage {
                Storage::Expert => fired,
                _ if spec.name == "embed.weight" => batch as f64 / spec.shape[0] as f64,
                _ => 1.0,
            };
            n * per * share
        })
        .sum()
}

/// Matrix-vector products alone (batch 1) on one large matrix per storage format (copies of it
/// beyond the caches, taken in turn), through the backend as the model calls it: weight bytes
/// read per second, the median product.
fn kernel_rates(backend: &CpuBackend) -> Vec<(&'static str, f64)> {
    use dsv4::backend::{Backend, Precision, WeightData, WeightFormat};
    let (rows, cols) = (8192usize, 4096usize);
    let mut rng = Rng(11);
    let f32s: Vec<u8> = (0..rows * cols)
        .flat_map(|_| (rng.normal() * 0.02).to_le_bytes())
        .collect();
    // FP8 codes as a checkpoint's: normal values rounded with the tile's largest near 448
    // (scale 1), so no NaN codes and a few subnormals (uniform random codes would make one in
    // 37 subnormal, which the integer decoder hands to the f16 route); FP4 any nibbles.
    let fp8: Vec<u8> = (0..rows * cols)
        .map(|_| dsv4::formats::e4m3_encode((rng.normal() * 100.0).clamp(-448.0, 448.0)))
        .collect();
    let bytes: Vec<u8> = (0..rows * cols / 2)
        .map(|_| (rng.next_u64() % 256) as u8)
        .collect();
    let cases: Vec<(&'static str, WeightData<'_>, Precision)> = vec![
        (
            "f32",
            WeightData::whole(WeightFormat::F32, &f32s, vec![], rows, cols),
            Precision::F32,
        ),
        (
            "bf16",
            WeightData::whole(WeightFormat::F32, &f32s, vec![], rows, cols),
            Precision::Bf16,
        ),
        (
            "fp8",
            WeightData::whole(
                WeightFormat::Fp8E4m3 { block: [128, 128] },
                &fp8,
                vec![1.0; (rows / 128) * (cols / 128)],
                rows,
                cols,
            ),
            Precision::Native,
        ),
        (
            "fp4",
            WeightData::whole(
                WeightFormat::Fp4E2m1 { block: 32 },
                &bytes,
                vec![0.5; rows * cols / 32],
                rows,
                cols,
            ),
            Precision::Native,
        ),
    ];
    let x = backend
        .tensor(
            &(0..cols)
                .map(|i| (i as f32 * 0.01).sin())
                .collect::<Vec<_>>(),
        )
        .unwrap();
    cases
        .into_iter()
        .map(|(name, w, precision)| {
            // Copies of the matrix, 256 MiB or more in all, taken in turn: one matrix of FP4
            // (16 MiB) or FP8 (32 MiB) fits this machine's 32 MiB L3 and was read from it
            // again, not from memory (the kernels "alone" then beat the plain read).
            let first = backend.matrix(&w, precision).unwrap();
            let held = backend.matrix_bytes(&first) as f64;
            let copies = ((256u64 << 20) as f64 / held).ceil().max(1.0) as usize;
            let mut ms = vec![first];
            ms.extend((1..copies).map(|_| backend.matrix(&w, precision).unwrap()));
            let mut t: Vec<f64> = (0..15 * copies)
                .map(|i| {
                    let start = Instant::now();
                    std::hint::black_box(backend.matmul(&x, 1, &ms[i % copies]).unwrap());
                    start.elapsed().as_secs_f64()
                })
                .collect();
            t.sort_by(f64::total_cmp);
            (name, held / t[t.len() / 2])
        })
        .collect()
}

/// The op times recorded over `seconds` of wall time in `per` steps: each op's calls and
/// milliseconds per step and its share of the step (stderr, so `--json` stays one line).
fn print_op_times(what: &str, seconds: f64, per: usize) {
    let ops = take_op_times();
    let in_ops: f64 = ops.iter().map(|o| o.seconds).sum();
    let ms = |s: f64| 1e3 * s / per as f64;
    eprintln!(
        "op times, {what}: {:.3} ms, of which ops {:.3} ms ({:.1} %; the rest is between ops)",
        ms(seconds),
        ms(in_ops),
        100.0 * in_ops / seconds
    );
    for o in &ops {
        // Products: weight bytes read and FLOPs per second of their own time.
        let rates = if o.bytes > 0 {
            format!(
                " {:>6.1} GB/s {:>6.1} GFLOP/s",
                o.bytes as f64 / o.seconds / 1e9,
                o.flops as f64 / o.seconds / 1e9
            )
        } else {
            String::new()
        };
        eprintln!(
            "  {:<48} {:>6.1} calls {:>8.3} ms {:>5.1} %{rates}",
            o.op,
            o.calls as f64 / per as f64,
            ms(o.seconds),
            100.0 * o.seconds / seconds
        );
    }
}

/// Read bandwidth of this machine with `threads` threads: a plain sum over a buffer far larger
/// than the caches, on huge pages like the weights (best of 3), bytes per second.
fn read_bandwidth(threads: usize) -> f64 {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    // 1 GiB, on huge pages as the weights are (a plain `Vec` got 4 KiB pages: 40-47 GB/s in
    // a C probe against 50-51 on huge pages).
    let mut buf: Vec<u64> = dsv4::backend::cpu::huge_page_vec(1 << 27);
    buf.extend(0..(1u64 << 27));
    pool.install(|| {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                let sum: u64 = buf
                    .par_chunks(1 << 16)
                    .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                    .reduce(|| 0, u64::wrapping_add);
                std::hint::black_box(sum);
                (buf.len() * 8) as f64 / t.elapsed().as_secs_f64()
            })
            .fold(0.0, f64::max)
    })
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

    /// Seconds of one full prefill with the backend's op times recorded, after one not
    /// recorded (the first pays the page faults of fresh intermediate tensors, which the
    /// best-of-5 rate does not see).
    fn recorded_prefill(&mut self) -> f64 {
        let ids = self.tokens(1, self.prompt);
        let mut seq = self.kv.open().unwrap();
        self.prefill(&mut seq, &ids);
        self.kv.close(seq);
        let mut seq = self.kv.open().unwrap();
        record_op_times(true);
        let t = Instant::now();
        self.prefill(&mut seq, &ids);
        let seconds = t.elapsed().as_secs_f64();
        record_op_times(false);
        self.kv.close(seq);
        seconds
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
        self.decode_steps(batch, false).0
    }

    /// `decode_rate`, and the steps' total seconds; with `record`, the backend's op times are
    /// recorded over the steps alone (not the prompts' prefills).
    fn decode_steps(&mut self, batch: usize, record: bool) -> (f64, f64) {
        let mut seqs: Vec<SeqKv> = (0..batch).map(|_| self.kv.open().unwrap()).collect();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let ids = self.tokens(10 + i as u64, self.prompt);
            self.prefill(seq, &ids);
        }
        let next: Vec<Vec<u32>> = (0..batch)
            .map(|i| self.tokens(100 + i as u64, self.steps))
            .collect();
        let mut times = Vec::with_capacity(self.steps);
        record_op_times(record);
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
        record_op_times(false);
        for seq in seqs {
            self.kv.close(seq);
        }
        let total = times.iter().sum();
        times.sort_by(f64::total_cmp);
        (batch as f64 / times[times.len() / 2], total)
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
    let extra_batch: Option<usize> = value("--batch").map(|b| b.parse().expect("--batch N"));
    let weights = match value("--weights").as_deref() {
        Some("bf16") => WeightDtype::Bf16,
        Some("native") => WeightDtype::Native,
        Some("auto") => WeightDtype::Auto,
        _ => WeightDtype::F32,
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated =
        std::env::var_os("DSV4_BENCH_DIR").map_or_else(|| root.join("target/bench"), PathBuf::from);
    let (dir, config, prompt, steps): (PathBuf, ModelConfig, usize, usize) = match which.as_str() {
        "fixture" => {
            let dir = root.join("tests/fixtures/flash-like/hf-f32");
            let config = ModelConfig::load(&dir).unwrap();
            (dir, config, 256, 64)
        }
        // The same model rounded to FP8/FP4 (official formats), and its dequantised f32 copy.
        "large-fp8" | "large-fp8-deq" => {
            let (q, deq) = (generated.join("large-fp8"), generated.join("large-fp8-deq"));
            let quantised = write_large_fp8(&q, &deq);
            if which == "large-fp8" {
                (q, quantised, 512, 32)
            } else {
                let config = ModelConfig::load(&deq).unwrap();
                (deq, config, 512, 32)
            }
        }
        _ => {
            let dir = generated.join("large");
            let config = write_large(&dir);
            (dir, config, 512, 32)
        }
    };
    let quantised = which == "large-fp8";
    let backend = Arc::new(CpuBackend::new(threads).unwrap());
    let threads = backend.threads();
    let model = Model::load(&dir, config.clone(), backend.clone(), weights).unwrap();
    let resident = model.info()["bytes_by_dtype"].clone();
    let (bytes_b1, bytes_b8) = (
        step_bytes(&config, weights, quantised, 1),
        step_bytes(&config, weights, quantised, 8),
    );
    let steps = value("--steps").map_or(steps, |s| s.parse().unwrap());
    let kv_dtype = value("--kv").unwrap_or_else(|| "f32".into());
    let params = Params::from_value(&json!({"kv": {
        "dtype": kv_dtype, "device_memory_bytes": "1GiB",
        "max_running_requests": extra_batch.unwrap_or(8).max(8),
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
    // The read bandwidth is sampled before the measurements and after them, and the best
    // taken: this VM's plain read swings 35-60 GB/s from one minute to the next (neighbours on
    // the host), and one sample taken in a slow minute made every fraction look better.
    let measure_bandwidth = args.iter().any(|a| a == "--bandwidth");
    let bandwidth_before = if measure_bandwidth {
        read_bandwidth(threads)
    } else {
        0.0
    };
    let prefill = if run("prefill") {
        bench.prefill_rate()
    } else {
        0.0
    };
    // Prefill again with the AMX tile products off (the f32 kernels), where the CPU has them:
    // what the tiles are worth, in the same process.
    let prefill_no_amx = if run("prefill") && amx_supported() {
        set_amx(false);
        let rate = bench.prefill_rate();
        set_amx(true);
        rate
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
    // Decode b8 again with the tiles off: its products of eight inputs take the paired
    // AVX-512 kernels instead of the decode tiles (`amx_decode`), in the same process.
    let b8_no_amx = if run("decode8") && amx_supported() {
        set_amx(false);
        let rate = bench.decode_rate(8);
        set_amx(true);
        rate
    } else {
        0.0
    };
    if let Some(n) = extra_batch {
        let rate = bench.decode_rate(n);
        println!(
            "dsv4 {which} ({threads} threads, {prompt}-token prompt): decode b{n} {rate:.1} tok/s"
        );
    }
    if args.iter().any(|a| a == "--op-times") {
        let seconds = bench.recorded_prefill();
        print_op_times(&format!("one {prompt}-token prefill"), seconds, 1);
        for batch in [1, 8] {
            let (_, seconds) = bench.decode_steps(batch, true);
            print_op_times(&format!("decode b{batch}, per step"), seconds, bench.steps);
        }
    }
    // Sampled again after the model runs, with the same thread count.
    let bandwidth_after = if measure_bandwidth {
        read_bandwidth(threads)
    } else {
        0.0
    };
    let bandwidth = bandwidth_before.max(bandwidth_after);
    // Each kernel alone against that bandwidth (what the decode step's kernels can reach).
    let kernels: serde_json::Map<String, serde_json::Value> = if bandwidth > 0.0 {
        kernel_rates(bench.model.backend())
            .into_iter()
            .map(|(name, rate)| (name.to_string(), json!(rate / bandwidth)))
            .collect()
    } else {
        Default::default()
    };
    let report = json!({
        "model": which, "checkpoint": dir, "threads": threads, "prompt": prompt,
        "decode_steps": steps, "weights": weights.resolve(&bench.model.config).name(),
        "kv": kv_dtype,
        "prefill_tok_s": prefill, "decode_b1_tok_s": b1, "decode_b8_tok_s": b8,
        "amx": amx_supported(), "prefill_no_amx_tok_s": prefill_no_amx,
        "decode_b8_no_amx_tok_s": b8_no_amx,
        "resident_bytes": resident, "step_bytes_b1": bytes_b1, "step_bytes_b8": bytes_b8,
        "read_bandwidth": bandwidth,
        "read_bandwidth_samples": [bandwidth_before, bandwidth_after],
        // Batch-1 matrix-vector products alone, bytes read per second ÷ the read bandwidth.
        "kernel_bw_fraction": kernels,
        // Weight bytes a decode step reads ÷ its time ÷ the machine's read bandwidth.
        "bw_fraction_b1": if bandwidth > 0.0 { bytes_b1 * b1 / bandwidth } else { 0.0 },
        "bw_fraction_b8": if bandwidth > 0.0 { bytes_b8 * b8 / 8.0 / bandwidth } else { 0.0 },
    });
    if args.iter().any(|a| a == "--json") {
        println!("{report}");
    } else {
        println!(
            "dsv4 {which} ({threads} threads, {prompt}-token prompt, {} weights): prefill \
             {prefill:.1} tok/s, decode b1 {b1:.1} tok/s, decode b8 {b8:.1} tok/s (b8/b1 {:.2}); \
             a b1 step reads {:.1} MB of weights{}",
            weights.resolve(&bench.model.config).name(),
            b8 / b1,
            bytes_b1 / 1e6,
            if bandwidth > 0.0 {
                format!(
                    ", {:.1} GB/s of {:.1} GB/s measured ({:.0} %)",
                    bytes_b1 * b1 / 1e9,
                    bandwidth / 1e9,
                    100.0 * bytes_b1 * b1 / bandwidth
                )
            } else {
                String::new()
            }
        );
    }
}
