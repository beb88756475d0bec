//! `config.json` text through `ModelConfig::from_json_str`, and an accepted config through
//! `checkpoint_tensors` (what the loader and the planner size everything by).

use dsv4::config::model::{EPS_RANGE, INT_LIMITS};
use dsv4::config::tensors::checkpoint_tensors;
use dsv4::config::ModelConfig;
use dsv4::ErrorKind;

fn limit(key: &str) -> usize {
    INT_LIMITS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(usize::MAX, |&(_, max)| max as usize)
}

fn main() {
    afl::fuzz!(|data: &[u8]| {
        // ModelConfig::load refuses invalid UTF-8 before this point.
        let Ok(text) = std::str::from_utf8(data) else {
            return;
        };
        match ModelConfig::from_json_str(text, "fuzz") {
            Ok(c) => {
                // What an accepted config guarantees (docs/params.md, "Limits").
                assert!((1..=limit("hc_sinkhorn_iters")).contains(&c.hc_sinkhorn_iters));
                assert!((1..=limit("num_hidden_layers")).contains(&c.num_layers));
                assert_eq!(c.attention.len(), c.num_layers);
                assert_eq!(c.mlp.len(), c.num_layers);
                for id in c.eos_token_ids.iter().chain(&c.bos_token_id) {
                    assert!((*id as usize) < c.vocab_size);
                }
                assert!(EPS_RANGE.contains(&c.rms_norm_eps) && EPS_RANGE.contains(&c.hc_eps));
                // Every tensor the config implies can be listed and sized without overflow.
                let elements: u64 = checkpoint_tensors(&c)
                    .iter()
                    .map(|t| t.shape.iter().map(|&d| d as u64).product::<u64>())
                    .sum();
                assert!(elements > 0);
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::ModelFormat, "{e}");
                assert!(!e.message().trim().is_empty());
                assert!(e.message().len() <= 64 << 10, "{} bytes", e.message().len());
            }
        }
    });
}
