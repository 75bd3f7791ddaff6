//! Several generations over one model at once: each step decodes every unfinished sequence
//! in one batched step (the weights are read once for all of them).

use std::sync::Arc;
use std::time::Instant;

use super::generator::{Advance, GenerateOptions, Generation, GenerationError, GenerationResult};
use crate::core::{BackendProvider, BackendSession, BatchSession, ModelRuntime, RuntimeError};
use crate::text::Tokenizer;

/// Generates from each prompt on its own runtime (`runtimes[i]` runs `prompts[i]` with
/// `options[i]`), stepping the unfinished ones together. Each result is what that prompt's
/// `generate` would give alone, up to the order of float additions.
pub fn generate_batch<B>(
    runtimes: &mut [ModelRuntime<B>],
    tokenizer: Arc<Tokenizer>,
    prompts: &[Vec<u32>],
    options: Vec<GenerateOptions>,
) -> Result<Vec<GenerationResult>, GenerationError<B::Error>>
where
    B: BackendProvider,
    B::Session: BatchSession<B>,
{
    if options.iter().any(|o| o.prompt_lookup > 0 || o.draft_tokens.is_some_and(|n| n > 0)) {
        // Batched steps carry one token per sequence; a draft would need rows of its own.
        return Err(GenerationError::InvalidOptions(
            "speculative decoding (prompt_lookup_num_tokens, num_draft_tokens) is not supported by batched generation (generate_batch); use generate or stream"
                .into(),
        ));
    }
    if runtimes.len() != prompts.len() || prompts.len() != options.len() {
        return Err(GenerationError::InvalidOptions("one runtime and one set of options per prompt".into()));
    }
    let mut gens = Vec::with_capacity(prompts.len());
    for ((rt, prompt), opts) in runtimes.iter_mut().zip(prompts).zip(options) {
        // Prefill is compute-bound: batching it gains little, so each prompt prefills alone.
        gens.push(Generation::start(rt, Arc::clone(&tokenizer), prompt, opts)?);
    }
    loop {
        let mut active: Vec<(&mut Generation, &mut ModelRuntime<B>)> =
            gens.iter_mut().zip(runtimes.iter_mut()).filter(|(g, _)| g.finish_reason().is_none()).collect();
        if active.is_empty() {
            break;
        }
        step_together(&mut active)?;
    }
    Ok(gens.iter().map(Generation::result).collect())
}

/// One step of several generations, each on its own runtime of the same model: every one that
/// continues samples its next token, and those tokens are decoded together in one batched step.
/// Returns the text each generation made final in this step (empty for none).
pub fn step_together<B>(
    active: &mut [(&mut Generation, &mut ModelRuntime<B>)],
) -> Result<Vec<String>, GenerationError<B::Error>>
where
    B: BackendProvider,
    B::Session: BatchSession<B>,
{
    let mut texts = vec![String::new(); active.len()];
    let mut fed = Vec::new();
    for (i, (g, rt)) in active.iter_mut().enumerate() {
        let s = rt.session();
        match g.advance::<B::Error>(s.position(), s.max_context())? {
            Advance::Feed(token) => fed.push((i, token)),
            Advance::Done(text) => texts[i] = text,
        }
    }
    if fed.is_empty() {
        return Ok(texts);
    }
    let started = Instant::now();
    let inputs = fed.iter().map(|&(_, t)| vec![t].into()).collect();
    let outs = {
        let mut chosen: Vec<&mut ModelRuntime<B>> = active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| fed.iter().any(|(j, _)| j == i))
            .map(|(_, (_, rt))| &mut **rt)
            .collect();
        ModelRuntime::decode_batch(&mut chosen, inputs)?
    };
    let seconds = started.elapsed().as_secs_f64();
    for ((i, _), sub) in fed.into_iter().zip(outs) {
        let (g, rt) = &mut active[i];
        let out = sub.wait().map_err(RuntimeError::Backend)?;
        let host = rt.session().logits_to_host(&out).map_err(RuntimeError::Backend)?;
        texts[i] = g.accept_logits::<B::Error>(host.last_row().to_vec(), rt.session().position(), seconds)?;
        g.note_epoch(rt.epoch());
    }
    Ok(texts)
}
