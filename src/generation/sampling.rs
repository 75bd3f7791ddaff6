//! Choosing the next token from logits: penalties, bias, temperature, top-k, top-p, min-p.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling controls, with the neutral value of each meaning "off".
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 means no limit.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p; 1 means no limit.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 means off.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen; 1 means off.
    pub repetition_penalty: f32,
    /// Subtract from the logit of every token generated at least once; 0 means off.
    pub presence_penalty: f32,
    /// Subtract, per occurrence, from the logits of generated tokens; 0 means off.
    pub frequency_penalty: f32,
    /// Added to the logits of the given tokens before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampler's random generator; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Whether these settings always pick the arg-max.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Checks that every control is in its range.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |what: &str| Err(what.to_owned());
        if !(self.temperature >= 0.0) || !self.temperature.is_finite() {
            return bad("temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0) || !self.repetition_penalty.is_finite() {
            return bad("repetition_penalty must be a finite number > 0");
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty must be a finite number");
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty must be a finite number");
        }
        if let Some((id, _)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(format!("logit_bias for token {id} must be a finite number"));
        }
        Ok(())
    }
}

/// Applies the controls to logits and draws tokens, with its own seeded generator.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// How often each token was generated (for presence/frequency penalties).
    counts: std::collections::HashMap<u32, u32>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Self { params, rng, counts: Default::default() }
    }

    /// The controls in use.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token for the presence and frequency penalties.
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
    }

    /// Applies bias and penalties in place; `context` is every token seen (prompt and generated).
    pub fn adjust(&self, logits: &mut [f32], context: &[u32]) {
        let p = &self.params;
        for &(t, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in context {
                if seen.insert(t) {
                    if let Some(l) = logits.get_mut(t as usize) {
                        *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &n) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
    }

    /// The probabilities that remain after temperature, top-k, top-p and min-p, as `(token, p)` summing to 1.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        let t = p.temperature.max(1e-6);
        let mut cand: Vec<(u32, f32)> =
            logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (i as u32, l / t)).collect();
        if cand.is_empty() {
            return cand;
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let mut total = 0.0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            total += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let keep = cand
                .iter()
                .position(|c| {
                    acc += c.1;
                    acc >= p.top_p
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 * p.min_p;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f32 = cand.iter().map(|c| c.1).sum();
        for c in cand.iter_mut() {
            c.1 /= total;
        }
        cand
    }

    /// A uniform draw in [0, 1) from this sampler's generator (for speculative acceptance, so that
    /// a seeded run stays repeatable).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random()
    }

    /// Picks the next token from adjusted logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        if dist.is_empty() {
            return argmax(logits);
        }
        let u: f32 = self.rng.random();
        draw(&dist, u).unwrap_or_else(|| argmax(logits))
    }
}

/// The token at cumulative mass `u` of `dist` (`(token, probability)` pairs), skipping tokens
/// without mass: the last one with mass when rounding runs past the end, `None` when none has.
pub fn draw(dist: &[(u32, f32)], mut u: f32) -> Option<u32> {
    let mut last = None;
    for &(t, p) in dist {
        if p <= 0.0 {
            continue;
        }
        if u < p {
            return Some(t);
        }
        u -= p;
        last = Some(t);
    }
    last
}

/// The softmax probability (temperature 1) of `token` under raw `logits`.
pub fn softmax_prob(logits: &[f32], token: u32) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    (f64::from(logits[token as usize] - max).exp() / total) as f32
}

/// The index of the largest logit (the first one among ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 6] = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0];

    /// Expected probabilities computed independently of `distribution`.
    fn expected(temp: f32, keep: &[usize]) -> Vec<f64> {
        let w: Vec<f64> = LOGITS.iter().map(|&l| ((l / temp) as f64).exp()).collect();
        let z: f64 = keep.iter().map(|&i| w[i]).sum();
        (0..LOGITS.len()).map(|i| if keep.contains(&i) { w[i] / z } else { 0.0 }).collect()
    }

    /// Pearson's chi-square over the kept categories; tokens outside `keep` must never appear.
    fn chi_square(params: SamplingParams, keep: &[usize], temp: f32) -> f64 {
        let n = 40_000;
        let mut s = Sampler::new(SamplingParams { seed: Some(7), ..params });
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample(&LOGITS) as usize] += 1;
        }
        let exp = expected(temp, keep);
        for i in 0..6 {
            if !keep.contains(&i) {
                assert_eq!(counts[i], 0, "token {i} should have been filtered");
            }
        }
        keep.iter().map(|&i| (counts[i] as f64 - n as f64 * exp[i]).powi(2) / (n as f64 * exp[i])).sum()
    }

    // Critical values of chi-square at p = 0.001, fixed before looking at any draw.
    const CRIT_DF5: f64 = 20.52;
    const CRIT_DF2: f64 = 13.82;
    const CRIT_DF1: f64 = 10.83;

    #[test]
    fn temperature_sampling_matches_softmax() {
        let x = chi_square(SamplingParams { temperature: 0.7, ..Default::default() }, &[0, 1, 2, 3, 4, 5], 0.7);
        assert!(x < CRIT_DF5, "chi-square {x}");
    }

    #[test]
    fn top_k_keeps_k_tokens_in_proportion() {
        let x = chi_square(SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() }, &[0, 1, 2], 1.0);
        assert!(x < CRIT_DF2, "chi-square {x}");
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // softmax(LOGITS): 0.420, 0.255, 0.154, ... cumulative 0.420, 0.674, 0.829: p = 0.7 keeps three.
        let x = chi_square(SamplingParams { temperature: 1.0, top_p: 0.7, ..Default::default() }, &[0, 1, 2], 1.0);
        assert!(x < CRIT_DF2, "chi-square {x}");
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // p_i / p_max = exp(l_i - 2): 1, 0.61, 0.37, 0.22 ...; min_p = 0.5 keeps two.
        let x = chi_square(SamplingParams { temperature: 1.0, min_p: 0.5, ..Default::default() }, &[0, 1], 1.0);
        assert!(x < CRIT_DF1, "chi-square {x}");
    }

    #[test]
    fn greedy_and_top_k_one_pick_the_argmax() {
        assert_eq!(Sampler::new(SamplingParams::greedy()).sample(&LOGITS), 0);
        let mut s = Sampler::new(SamplingParams { temperature: 1.5, top_k: 1, seed: Some(1), ..Default::default() });
        assert!((0..100).all(|_| s.sample(&LOGITS) == 0));
    }

    #[test]
    fn same_seed_same_draws() {
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams { seed: Some(seed), ..Default::default() });
            (0..50).map(|_| s.sample(&LOGITS)).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn penalties_and_bias_adjust_logits() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(5, 10.0)],
            ..Default::default()
        });
        s.observe(1);
        s.observe(1);
        let mut l = LOGITS.to_vec();
        s.adjust(&mut l, &[0, 1, 4]);
        assert_eq!(l[0], 1.0); // 2.0 / 2
        assert_eq!(l[1], 1.5 / 2.0 - 0.5 - 0.5); // repetition, presence, 2 x frequency
        assert_eq!(l[4], 0.0); // 0 * 2
        assert_eq!(l[5], 9.0); // bias
        assert_eq!(l[2], 1.0); // untouched
    }
}
