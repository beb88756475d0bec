//! RoPE inverse frequencies for the `main` and `compress` sets (docs/model.md §2.4),
//! computed in f32 like transformers' `_compute_yarn_parameters` (truncated correction range,
//! no magnitude scaling).

use crate::config::model::Rope;

/// One inverse frequency per rotated pair of a `rope_dim`-wide slice.
pub fn inv_freq(rope: &Rope, rope_dim: usize) -> Vec<f32> {
    let half = rope_dim / 2;
    let base = rope.theta as f32;
    let plain: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / rope_dim as f32))
        .collect();
    let Some(yarn) = rope.yarn else {
        return plain;
    };
    let correction_dim = |rotations: f64| {
        rope_dim as f64
            * (yarn.original_max_position_embeddings as f64
                / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
            / (2.0 * rope.theta.ln())
    };
    let low = correction_dim(yarn.beta_fast).floor().max(0.0);
    let mut high = correction_dim(yarn.beta_slow)
        .ceil()
        .min(rope_dim as f64 - 1.0);
    if low == high {
        high += 0.001;
    }
    let factor = yarn.factor as f32;
    plain
        .iter()
        .enumerate()
        .map(|(i, &extrapolated)| {
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            extrapolated / factor * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::model::Yarn;

    #[test]
    fn flash_yarn_keeps_low_pairs_and_divides_high_pairs() {
        // docs/model.md §1.2: rd = 64, base 160000, orig 65536 → pairs 0-15 keep their
        // frequency, pairs ≥ 25 are divided by 16, pairs 16-24 ramp linearly.
        let rope = Rope {
            theta: 160_000.0,
            yarn: Some(Yarn {
                factor: 16.0,
                original_max_position_embeddings: 65536,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
        };
        let plain = inv_freq(
            &Rope {
                theta: 160_000.0,
                yarn: None,
            },
            64,
        );
        let yarn = inv_freq(&rope, 64);
        assert_eq!(yarn.len(), 32);
        for i in 0..=15 {
            assert_eq!(yarn[i], plain[i], "pair {i}");
        }
        for i in 25..32 {
            assert!(
                (yarn[i] - plain[i] / 16.0).abs() <= 1e-7 * plain[i],
                "pair {i}"
            );
        }
        for i in 16..=24 {
            assert!(yarn[i] < plain[i] && yarn[i] > plain[i] / 16.0, "pair {i}");
        }
        assert_eq!(plain[0], 1.0);
    }
}
