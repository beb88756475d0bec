//! What a caller submits, checked before the engine accepts it.

use super::sampling::SamplingParams;
use crate::error::{Error, Result};
use xxhash_rust::xxh3::Xxh3;

/// The largest total logit bias one token may get: far beyond any logit, yet small enough that
/// logit + bias stays finite in f32.
pub const MAX_LOGIT_BIAS: f64 = 1e6;

/// The most tokens a request's stop sequences may hold together: every generated token is
/// compared against each sequence's tail, so this bounds that work per token (a few thousand
/// compares at most); real stop strings are a handful of tokens each.
pub const MAX_STOP_SEQUENCE_TOKENS: usize = 4096;

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    /// At least 1.
    pub max_new_tokens: u32,
    /// Ending tokens besides the model's EOS (which stops unless `ignore_eos`).
    pub stop_tokens: Vec<u32>,
    /// Ending token sequences: the request finishes STOP once its generated tokens (never the
    /// prompt) end with one of them. Each holds at least one token. The matched tokens were
    /// already emitted as TOKEN events (they stream as they arrive, before the match is known);
    /// the last of them is the request's last TOKEN event, as with a stop token.
    pub stop_sequences: Vec<Vec<u32>>,
    /// The model's EOS tokens do not end the request (they are sampled and emitted like any
    /// other token); `stop_tokens`, `stop_sequences` and the length limit still do.
    pub ignore_eos: bool,
    pub sampling: SamplingParams,
    /// 0 = drawn from the engine's RNG.
    pub seed: u64,
    /// Higher runs first among waiting requests; FCFS within a priority.
    pub priority: i32,
    /// From submit, covering waiting and running; 0 = none.
    pub deadline_ms: u32,
    /// Requests share cached prefixes only with the same salt.
    pub cache_salt: Option<String>,
    /// Echoed in every event.
    pub user_tag: u64,
    /// Fill `Event::logprob`.
    pub logprobs: bool,
    /// PD roles: the room the host's router gave this request on both engines (required,
    /// non-zero, unique among one engine's live requests); 0 in the unified role.
    pub pd_room: u64,
    /// Decode role: the prefill engine's endpoint (`tcp://host:port`, what its
    /// `Engine::pd_endpoint` returned).
    pub pd_peer: Option<String>,
}

impl Default for RequestSpec {
    fn default() -> Self {
        Self {
            prompt: Vec::new(),
            max_new_tokens: 128,
            stop_tokens: Vec::new(),
            stop_sequences: Vec::new(),
            ignore_eos: false,
            sampling: SamplingParams::default(),
            seed: 0,
            priority: 0,
            deadline_ms: 0,
            cache_salt: None,
            user_tag: 0,
            logprobs: false,
            pd_room: 0,
            pd_peer: None,
        }
    }
}

impl RequestSpec {
    /// Every problem with the request at once; token ids are checked against `vocab`.
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let mut problems = Vec::new();
        if self.prompt.is_empty() {
            problems.push("the prompt is empty: pass at least one token".to_string());
        }
        let bad = |what: &str, ids: &[u32], problems: &mut Vec<String>| {
            // The maximum first (a vectorised pass: this runs on the caller's thread for every
            // prompt token of every submit), the position only when something is out.
            if ids.iter().max().is_none_or(|&m| (m as usize) < vocab) {
                return;
            }
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                problems.push(format!(
                    "{what} token id {id} at index {i} is outside the vocabulary (ids 0..{vocab})"
                ));
            }
        };
        bad("prompt", &self.prompt, &mut problems);
        bad("stop", &self.stop_tokens, &mut problems);
        for (i, seq) in self.stop_sequences.iter().enumerate() {
            if seq.is_empty() {
                problems.push(format!(
                    "stop sequence {i} is empty: give each stop sequence at least one token (or \
                     drop it)"
                ));
            }
            bad(&format!("stop sequence {i}:"), seq, &mut problems);
        }
        let stop_total: usize = self.stop_sequences.iter().map(Vec::len).sum();
        if stop_total > MAX_STOP_SEQUENCE_TOKENS {
            problems.push(format!(
                "the stop sequences hold {stop_total} tokens together, more than \
                 {MAX_STOP_SEQUENCE_TOKENS}: keep fewer or shorter stop sequences"
            ));
        }
        let biased: Vec<u32> = self.sampling.logit_bias.iter().map(|b| b.0).collect();
        bad("logit_bias", &biased, &mut problems);
        if self.max_new_tokens == 0 {
            problems.push("max_new_tokens is 0: ask for at least 1 token".into());
        }
        let s = &self.sampling;
        if !(s.temperature.is_finite() && s.temperature >= 0.0) {
            problems.push(format!(
                "temperature = {} must be ≥ 0 (0 = greedy)",
                s.temperature
            ));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            problems.push(format!("top_p = {} must be in (0, 1] (1 = off)", s.top_p));
        }
        if !(0.0..=1.0).contains(&s.min_p) {
            problems.push(format!("min_p = {} must be in [0, 1] (0 = off)", s.min_p));
        }
        if let Some(b) = s.logit_bias.iter().find(|b| !b.1.is_finite()) {
            problems.push(format!(
                "logit_bias for token {} is {}: use a finite value",
                b.0, b.1
            ));
        } else {
            // Entries for one token add up: their sum, added to a logit, must stay finite.
            let mut sums = std::collections::HashMap::new();
            for &(t, b) in &s.logit_bias {
                *sums.entry(t).or_insert(0.0f64) += f64::from(b);
            }
            let mut over: Vec<(u32, f64)> = sums
                .into_iter()
                .filter(|(_, v)| v.abs() > MAX_LOGIT_BIAS)
                .collect();
            over.sort_unstable_by_key(|o| o.0);
            if let Some((t, v)) = over.first() {
                problems.push(format!(
                    "logit_bias for token {t} adds up to {v:e} over its entries: keep each \
                     token's total within ±{MAX_LOGIT_BIAS:e} (−1e6 already bans a token)"
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::from_problems(
                crate::error::ErrorKind::InvalidArgument,
                "the request",
                &problems,
            ))
        }
    }
}

impl RequestSpec {
    /// Whether `generated` (this request's generated tokens so far, the newest last) ends
    /// with one of its stop sequences. Only generated tokens count: a sequence that would
    /// straddle the prompt and the output does not match.
    pub fn ends_with_stop_sequence(&self, generated: &[u32]) -> bool {
        self.stop_sequences
            .iter()
            .any(|seq| !seq.is_empty() && generated.ends_with(seq))
    }
}

impl RequestSpec {
    /// What a PD room's two engines must agree on, as one 64-bit XXH3 digest: the prompt, the
    /// sampling params, the seed and the cache salt (a claim whose digest differs from the
    /// prefill's fails the room). Stable across processes and builds: fixed byte encoding.
    pub fn pd_digest(&self) -> u64 {
        let mut h = Xxh3::new();
        h.update(&(self.prompt.len() as u64).to_le_bytes());
        // Little-endian token bytes: the prompt's own memory where the target is little-endian
        // (no copy: the digest runs at every submit), else a few KiB at a time.
        if cfg!(target_endian = "little") {
            h.update(bytemuck::cast_slice(&self.prompt));
        } else {
            let mut buf = [0u8; 4096];
            for chunk in self.prompt.chunks(buf.len() / 4) {
                for (b, &t) in buf.chunks_exact_mut(4).zip(chunk) {
                    b.copy_from_slice(&t.to_le_bytes());
                }
                h.update(&buf[..4 * chunk.len()]);
            }
        }
        let s = &self.sampling;
        h.update(&s.temperature.to_bits().to_le_bytes());
        h.update(&s.top_k.to_le_bytes());
        h.update(&s.top_p.to_bits().to_le_bytes());
        h.update(&s.min_p.to_bits().to_le_bytes());
        h.update(&(s.logit_bias.len() as u64).to_le_bytes());
        for &(t, b) in &s.logit_bias {
            h.update(&t.to_le_bytes());
            h.update(&b.to_bits().to_le_bytes());
        }
        h.update(&self.seed.to_le_bytes());
        match &self.cache_salt {
            Some(salt) => {
                h.update(&(salt.len() as u64 + 1).to_le_bytes());
                h.update(salt.as_bytes());
            }
            None => h.update(&0u64.to_le_bytes()),
        }
        h.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_first_id_outside_the_vocabulary_of_each_list() {
        let mut prompt: Vec<u32> = (0..8000).map(|i| i % 100).collect();
        // The largest bad id is not the first one: the message names the first.
        (prompt[7000], prompt[7500]) = (150, 900);
        let spec = RequestSpec {
            prompt,
            stop_tokens: vec![3, 4],
            sampling: SamplingParams {
                logit_bias: vec![(5, 1.0), (120, -1.0)],
                ..SamplingParams::default()
            },
            ..RequestSpec::default()
        };
        let e = spec.validate(100).unwrap_err().to_string();
        assert!(
            e.contains("prompt token id 150 at index 7000 is outside the vocabulary (ids 0..100)"),
            "{e}"
        );
        assert!(e.contains("logit_bias token id 120 at index 1"), "{e}");
        assert!(!e.contains("stop token"), "{e}");
        let ok = RequestSpec {
            prompt: (0..8000).map(|i| i % 100).collect(),
            ..RequestSpec::default()
        };
        ok.validate(100).unwrap();
    }

    #[test]
    fn stop_sequences_match_the_generated_tail_only() {
        let spec = RequestSpec {
            stop_sequences: vec![vec![5, 6, 7], vec![9]],
            ..Default::default()
        };
        assert!(!spec.ends_with_stop_sequence(&[]));
        assert!(!spec.ends_with_stop_sequence(&[5, 6]));
        assert!(spec.ends_with_stop_sequence(&[1, 5, 6, 7]));
        assert!(!spec.ends_with_stop_sequence(&[5, 6, 7, 8]));
        assert!(spec.ends_with_stop_sequence(&[9]));
        // A partial match followed by a different token, then the full one.
        assert!(!spec.ends_with_stop_sequence(&[5, 6, 5]));
        assert!(spec.ends_with_stop_sequence(&[5, 6, 5, 6, 7]));
    }

    #[test]
    fn pd_digest_is_xxh3_of_the_documented_encoding() {
        // Built here in one piece: the chunked token encoding (3000 tokens cross chunks) and
        // every field in order, little-endian.
        let mut spec = RequestSpec {
            prompt: (0..3000u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect(),
            seed: 7,
            cache_salt: Some("salt".into()),
            ..Default::default()
        };
        spec.sampling.logit_bias = vec![(5, -1.5)];
        let s = &spec.sampling;
        let mut b = Vec::new();
        b.extend((spec.prompt.len() as u64).to_le_bytes());
        spec.prompt.iter().for_each(|t| b.extend(t.to_le_bytes()));
        b.extend(s.temperature.to_bits().to_le_bytes());
        b.extend(s.top_k.to_le_bytes());
        b.extend(s.top_p.to_bits().to_le_bytes());
        b.extend(s.min_p.to_bits().to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(5u32.to_le_bytes());
        b.extend((-1.5f32).to_bits().to_le_bytes());
        b.extend(7u64.to_le_bytes());
        b.extend(5u64.to_le_bytes());
        b.extend(b"salt");
        assert_eq!(spec.pd_digest(), xxhash_rust::xxh3::xxh3_64(&b));
    }

    #[test]
    fn pd_digest_covers_prompt_sampling_seed_and_salt() {
        let base = RequestSpec {
            prompt: vec![1, 2, 3],
            ..Default::default()
        };
        let d = base.pd_digest();
        // Fields the digest does not cover (routing and output options) leave it alone.
        let same = RequestSpec {
            user_tag: 9,
            priority: 3,
            logprobs: true,
            pd_room: 5,
            ..base.clone()
        };
        assert_eq!(same.pd_digest(), d);
        let mut variants = vec![
            RequestSpec {
                prompt: vec![1, 2],
                ..base.clone()
            },
            RequestSpec {
                prompt: vec![1, 2, 4],
                ..base.clone()
            },
            RequestSpec {
                seed: 1,
                ..base.clone()
            },
            RequestSpec {
                cache_salt: Some(String::new()),
                ..base.clone()
            },
            RequestSpec {
                cache_salt: Some("a".into()),
                ..base.clone()
            },
        ];
        let mut s = base.clone();
        s.sampling.temperature = 0.5;
        variants.push(s);
        let mut s = base.clone();
        s.sampling.logit_bias = vec![(1, -1.0)];
        variants.push(s);
        let mut seen = std::collections::HashSet::from([d]);
        for v in variants {
            assert!(seen.insert(v.pd_digest()), "{v:?}");
        }
        // XXH3-64 itself: the empty input's published digest.
        assert_eq!(xxhash_rust::xxh3::xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    }
}
