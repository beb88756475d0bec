//! Token sampling: greedy, temperature, top-k, top-p, min-p and logit bias, seeded per request.
//!
//! Order (as in SGLang and vLLM): logit bias is added; temperature 0 takes the argmax (lowest id
//! on ties); otherwise logits are divided by the temperature and softmaxed, then top-k keeps the
//! k most probable, top-p the smallest prefix (by probability, descending) whose mass reaches p,
//! min-p drops tokens below `min_p × p_max`; the rest is renormalised and sampled with the
//! request's RNG. The reported log-probability is the chosen token's under the model's
//! distribution with the logit bias applied (before temperature and filters).

/// A request's sampling parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: u32,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// Samples one request's tokens.
pub struct Sampler {
    params: SamplingParams,
    rng: fastrand::Rng,
}

impl Sampler {
    /// The RNG's exact state: a sampler made with it as the seed draws what this one would
    /// draw next (sequence export/import).
    pub fn rng_state(&self) -> u64 {
        self.rng.get_seed()
    }

    pub fn new(params: SamplingParams, seed: u64) -> Self {
        Self {
            params,
            rng: fastrand::Rng::with_seed(seed),
        }
    }

    /// The next token and its log-probability (see the module docs).
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        let mut z: Vec<f32> = logits.to_vec();
        for &(t, b) in &self.params.logit_bias {
            if let Some(v) = z.get_mut(t as usize) {
                *v += b;
            }
        }
        let token = if self.params.temperature == 0.0 {
            argmax(&z)
        } else {
            let kept = filtered(&z, &self.params);
            let u = self.rng.f64();
            let mut acc = 0.0;
            let mut chosen = kept.last().map_or(0, |k| k.0);
            for &(t, p) in &kept {
                acc += p;
                if u < acc {
                    chosen = t;
                    break;
                }
            }
            chosen
        };
        (token, log_softmax_at(&z, token))
    }
}

fn argmax(z: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = i;
        }
    }
    best as u32
}

fn log_softmax_at(z: &[f32], token: u32) -> f32 {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = z.iter().map(|&v| f64::from(v - max).exp()).sum();
    (f64::from(z[token as usize] - max) - sum.ln()) as f32
}

/// The tokens that survive the filters with their renormalised probabilities, most probable
/// first (ties: lower id first).
pub fn filtered(z: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let t = f64::from(p.temperature);
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f64)> = z
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, (f64::from(v - max) / t).exp()))
        .collect();
    let total: f64 = probs.iter().map(|x| x.1).sum();
    probs.iter_mut().for_each(|x| x.1 /= total);
    let by_prob = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = if p.top_k > 0 {
        (p.top_k as usize).min(probs.len())
    } else {
        probs.len()
    };
    if k < probs.len() {
        probs.select_nth_unstable_by(k, by_prob);
        probs.truncate(k);
    }
    probs.sort_unstable_by(by_prob);
    if p.top_p < 1.0 {
        let mass: f64 = probs.iter().map(|x| x.1).sum();
        let target = f64::from(p.top_p) * mass;
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, x) in probs.iter().enumerate() {
            acc += x.1;
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let floor = f64::from(p.min_p) * probs[0].1;
        probs.retain(|x| x.1 >= floor);
    }
    let mass: f64 = probs.iter().map(|x| x.1).sum();
    probs.iter_mut().for_each(|x| x.1 /= mass);
    probs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_biased_argmax_and_reports_its_log_probability() {
        let logits = [0.5, 2.0, 1.0, 2.0];
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                logit_bias: vec![(2, 5.0)],
                ..SamplingParams::default()
            },
            1,
        );
        let (t, lp) = s.sample(&logits);
        assert_eq!(t, 2);
        let z = [0.5f64, 2.0, 6.0, 2.0];
        let expected = 6.0 - z.iter().map(|v| v.exp()).sum::<f64>().ln();
        assert!((f64::from(lp) - expected).abs() < 1e-6);
        // Ties go to the lower id.
        let mut g = Sampler::new(
            SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            1,
        );
        assert_eq!(g.sample(&[0.5, 2.0, 1.0, 2.0]).0, 1);
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams::default(), seed);
            (0..64).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }
}
