//! Speculative decoding: guesses of the next tokens, checked by the model in one step.
//!
//! Two drafters: prompt lookup (n-gram speculation), which copies the tokens that followed the
//! last occurrence of the context's final n-gram (right when the output repeats its input:
//! editing code, quoting, extracting), and a draft model, a smaller model sharing the
//! tokenizer that proposes tokens from its own distribution. The generation feeds the guesses
//! with the sampled token in one step and keeps those the model accepts (`Generation::step`).
//!
//! Acceptance keeps the model's own distribution at every position, so greedy output is the
//! plain run's and sampled output is distributed as the plain run's:
//! - a guess that is one token for sure (prompt lookup, a greedy draft, or any draft under an
//!   output constraint) is kept exactly when the model's own sample equals it;
//! - a token `x` drawn from the draft's distribution `q` is kept with probability
//!   `min(1, p(x)/q(x))` and otherwise replaced by a draw from `max(0, p - q)` normalised
//!   (Leviathan et al. 2023, Chen et al. 2023), which accepts more of a sampled draft.

use super::sampling::draw;

/// The longest n-gram looked up; shorter ones are tried when it has no earlier occurrence.
pub const MAX_NGRAM: usize = 3;

/// The most draft tokens a step may check (`GenerateOptions::prompt_lookup`, `draft_tokens`).
pub const MAX_DRAFT: usize = 64;

/// Tokens a draft model proposes per step when the caller sets no number (llama.cpp's
/// `--draft-max` default).
pub const DEFAULT_DRAFT_TOKENS: usize = 16;

/// A draft model stops proposing once the probability of its own pick falls below this
/// (llama.cpp's `--draft-p-min` default): an unsure guess is mostly refused and costs a row.
pub const DRAFT_P_MIN: f32 = 0.75;

/// One guessed token and, when it was drawn from a draft model's distribution, that
/// distribution (`(token, probability)` pairs); `None` for a guess that was certain.
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// The guessed token.
    pub token: u32,
    /// The distribution it was drawn from, for the acceptance rule.
    pub q: Option<Vec<(u32, f32)>>,
}

impl Proposal {
    /// A guess that was certain (prompt lookup, a greedy draft).
    pub fn certain(token: u32) -> Self {
        Self { token, q: None }
    }
}

/// The standard acceptance rule for a draft token `x ~ q` against the model's distribution `p`
/// (both as `(token, probability)` pairs; `u` and `v` uniform in [0, 1)): `x` when
/// `u < p(x)/q(x)`, else the token at `v` of `max(0, p - q)` normalised. `None` when `p` is empty.
pub fn accept_or_resample(p: &[(u32, f32)], q: &[(u32, f32)], x: u32, u: f32, v: f32) -> Option<u32> {
    let prob = |d: &[(u32, f32)], t: u32| d.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1);
    let (px, qx) = (prob(p, x), prob(q, x));
    if qx > 0.0 && u < px / qx {
        return Some(x);
    }
    let residual: Vec<(u32, f32)> = p.iter().map(|&(t, pt)| (t, (pt - prob(q, t)).max(0.0))).collect();
    let total: f32 = residual.iter().map(|e| e.1).sum();
    if !(total > 0.0) {
        // p <= q everywhere only when they are equal (up to rounding): then p itself is the residual.
        return draw(p, v);
    }
    draw(&residual, v * total)
}

/// The at most `k` tokens that followed the latest earlier occurrence of `context`'s last
/// n-gram (n from `MAX_NGRAM` down to 1); empty when there is none.
pub fn prompt_lookup(context: &[u32], k: usize) -> &[u32] {
    if k == 0 {
        return &[];
    }
    for n in (1..=MAX_NGRAM.min(context.len().saturating_sub(1))).rev() {
        let tail = &context[context.len() - n..];
        // Latest first: the nearest copy is the likeliest to continue the same way.
        for start in (0..context.len() - n).rev() {
            if &context[start..start + n] == tail {
                let from = start + n;
                return &context[from..(from + k).min(context.len())];
            }
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_what_followed_the_latest_occurrence_of_the_longest_ngram() {
        // "1 2 3 4 5 ... 1 2 3" → "4 5 ..." (the trigram), at most k.
        let c = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3];
        assert_eq!(prompt_lookup(&c, 2), &[4, 5]);
        // Two occurrences: the later one wins.
        let c = [7, 8, 1, 7, 8, 2, 7, 8];
        assert_eq!(prompt_lookup(&c, 4), &[2, 7, 8]);
        // Only a unigram matches.
        let c = [5, 6, 9, 5];
        assert_eq!(prompt_lookup(&c, 3), &[6, 9, 5]);
        // Nothing earlier, or nothing asked for.
        assert!(prompt_lookup(&[1, 2, 3], 4).is_empty());
        assert!(prompt_lookup(&[1, 1], 0).is_empty());
        assert!(prompt_lookup(&[], 4).is_empty());
    }

    #[test]
    fn acceptance_rule_keeps_p() {
        // Exact: sum over x ~ q of P(accept x) p-mass plus the residual draws equals p.
        let p = [(0u32, 0.5f32), (1, 0.3), (2, 0.2)];
        let q = [(0u32, 0.2f32), (1, 0.6), (2, 0.2)];
        let n = 400;
        let mut got = [0.0f64; 3];
        for (x, qx) in q {
            for i in 0..n {
                for j in 0..n {
                    let (u, v) = ((i as f32 + 0.5) / n as f32, (j as f32 + 0.5) / n as f32);
                    let t = accept_or_resample(&p, &q, x, u, v).unwrap();
                    got[t as usize] += f64::from(qx) / (n * n) as f64;
                }
            }
        }
        for (t, pt) in p {
            assert!((got[t as usize] - f64::from(pt)).abs() < 1e-2, "{t}: {got:?}");
        }
        // A token the model gives more than the draft is always kept; one it rules out never.
        assert_eq!(accept_or_resample(&p, &q, 0, 0.99, 0.0), Some(0));
        assert_ne!(accept_or_resample(&[(0, 1.0)], &[(0, 0.5), (1, 0.5)], 1, 0.0, 0.5), Some(1));
    }
}
