//! Each sampling filter against the exact filtered distribution: χ² goodness of fit over many
//! seeded draws, and no token outside the filtered set ever drawn. The reference distribution
//! is computed here, independently, in f64 (vLLM's order: bias, temperature, top-k, then top-p
//! on the renormalised top-k, then min-p).

use dsv4::engine::{Sampler, SamplingParams};

fn logits() -> Vec<f32> {
    // 60 tokens with distinct, spread logits (no ties at the filter edges).
    (0..60)
        .map(|i| {
            let x = i as f64;
            (2.5 * (x * 0.37).sin() + 0.9 * (x * 1.91).cos() + 0.013 * x) as f32
        })
        .collect()
}

/// The exact distribution after the filters, as `(token, probability)`.
fn reference(z: &[f32], p: &SamplingParams) -> Vec<(usize, f64)> {
    let mut z: Vec<f64> = z.iter().map(|&v| f64::from(v)).collect();
    for &(t, b) in &p.logit_bias {
        z[t as usize] += f64::from(b);
    }
    let t = f64::from(p.temperature);
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|v| ((v - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    let mut probs: Vec<(usize, f64)> = e.iter().map(|v| v / s).enumerate().collect();
    probs.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    if p.top_k > 0 {
        probs.truncate(p.top_k as usize);
    }
    let s: f64 = probs.iter().map(|x| x.1).sum();
    for x in probs.iter_mut() {
        x.1 /= s;
    }
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = Vec::new();
        for &x in &probs {
            keep.push(x);
            cum += x.1;
            if cum >= f64::from(p.top_p) {
                break;
            }
        }
        probs = keep;
    }
    if p.min_p > 0.0 {
        let top = probs[0].1;
        probs.retain(|x| x.1 >= f64::from(p.min_p) * top);
    }
    let s: f64 = probs.iter().map(|x| x.1).sum();
    probs.into_iter().map(|(i, v)| (i, v / s)).collect()
}

/// Upper 0.1 % point of χ² with `df` degrees of freedom (Wilson–Hilferty).
fn chi2_critical(df: f64) -> f64 {
    let z = 3.090_232; // standard normal 0.999 quantile
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

fn check(name: &str, p: SamplingParams) {
    let z = logits();
    let expected = reference(&z, &p);
    let n = 60_000usize;
    let mut sampler = Sampler::new(p.clone(), 0x5eed ^ name.len() as u64);
    let mut counts = vec![0usize; z.len()];
    for _ in 0..n {
        counts[sampler.sample(&z).0 as usize] += 1;
    }
    let allowed: Vec<usize> = expected.iter().map(|x| x.0).collect();
    for (t, &c) in counts.iter().enumerate() {
        assert!(
            c == 0 || allowed.contains(&t),
            "{name}: token {t} drawn {c} times but filtered out"
        );
    }
    // Bins with an expected count ≥ 5; the rest pooled into one bin.
    let (mut chi2, mut bins) = (0.0, 0usize);
    let (mut pool_obs, mut pool_exp) = (0.0, 0.0);
    for &(t, prob) in &expected {
        let e = prob * n as f64;
        let o = counts[t] as f64;
        if e >= 5.0 {
            chi2 += (o - e).powi(2) / e;
            bins += 1;
        } else {
            pool_obs += o;
            pool_exp += e;
        }
    }
    if pool_exp > 0.0 {
        chi2 += (pool_obs - pool_exp).powi(2) / pool_exp.max(1e-9);
        bins += 1;
    }
    let df = (bins.max(2) - 1) as f64;
    let critical = chi2_critical(df);
    eprintln!(
        "{name}: {} tokens kept, χ² = {chi2:.1} (df {df}, 0.1 % critical {critical:.1})",
        expected.len()
    );
    assert!(chi2 < critical, "{name}: χ² {chi2} ≥ {critical}");
}

#[test]
fn every_filter_samples_its_exact_distribution() {
    let base = SamplingParams::default();
    check("temperature 1", base.clone());
    check(
        "temperature 0.6",
        SamplingParams {
            temperature: 0.6,
            ..base.clone()
        },
    );
    check(
        "temperature 2",
        SamplingParams {
            temperature: 2.0,
            ..base.clone()
        },
    );
    check(
        "top-k 7",
        SamplingParams {
            top_k: 7,
            ..base.clone()
        },
    );
    check(
        "top-p 0.8",
        SamplingParams {
            top_p: 0.8,
            ..base.clone()
        },
    );
    check(
        "min-p 0.15",
        SamplingParams {
            min_p: 0.15,
            ..base.clone()
        },
    );
    check(
        "logit bias",
        SamplingParams {
            logit_bias: vec![(3, 2.0), (40, -5.0), (17, 1.25)],
            ..base.clone()
        },
    );
    check(
        "all together",
        SamplingParams {
            temperature: 1.3,
            top_k: 20,
            top_p: 0.9,
            min_p: 0.05,
            logit_bias: vec![(5, 1.5)],
        },
    );
}

#[test]
fn a_wrong_distribution_is_caught() {
    // The same check against a deliberately different temperature must fail: the test has power.
    let z = logits();
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let wrong = SamplingParams {
        temperature: 1.1,
        ..p.clone()
    };
    let expected = reference(&z, &wrong);
    let n = 60_000;
    let mut s = Sampler::new(p, 9);
    let mut counts = vec![0usize; z.len()];
    for _ in 0..n {
        counts[s.sample(&z).0 as usize] += 1;
    }
    let chi2: f64 = expected
        .iter()
        .filter(|x| x.1 * n as f64 >= 5.0)
        .map(|&(t, prob)| {
            let e = prob * n as f64;
            (counts[t] as f64 - e).powi(2) / e
        })
        .sum();
    assert!(
        chi2 > chi2_critical(expected.len() as f64),
        "χ² {chi2} did not reject"
    );
}
