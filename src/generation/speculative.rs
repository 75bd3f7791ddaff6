//! Prompt-lookup drafting (n-gram speculation): guesses of the next tokens copied from earlier
//! in the context, checked by the model in one step.
//!
//! When the output repeats its input (editing code, quoting, extracting), the tokens that
//! followed the last occurrence of the context's final n-gram are likely to come next. The
//! generation feeds them with the sampled token in one step and keeps those that each sampled
//! token confirms (`Generation::step`). Each token is still sampled from the model's own
//! distribution at its position, so greedy output is the plain run's, and sampled output has
//! the plain run's distribution (for a draft that is one token for sure, accepting it exactly
//! when the sample equals it is the standard speculative acceptance rule).

/// The longest n-gram looked up; shorter ones are tried when it has no earlier occurrence.
pub const MAX_NGRAM: usize = 3;

/// The most draft tokens a step may check (`GenerateOptions::prompt_lookup`).
pub const MAX_DRAFT: usize = 64;

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
}
