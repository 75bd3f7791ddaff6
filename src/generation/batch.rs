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
    if runtimes.len() != prompts.len() || prompts.len() != options.len() {
        return Err(GenerationError::InvalidOptions("one runtime and one set of options per prompt".into()));
    }
    let mut gens = Vec::with_capacity(prompts.len());
    for ((rt, prompt), opts) in runtimes.iter_mut().zip(prompts).zip(options) {
        // Prefill is compute-bound: batching it gains little, so each prompt prefills alone.
        gens.push(Generation::start(rt, Arc::clone(&tokenizer), prompt, opts)?);
    }
    loop {
        let mut fed = Vec::new();
        for (i, (g, rt)) in gens.iter_mut().zip(runtimes.iter()).enumerate() {
            if g.finish_reason().is_some() {
                continue;
            }
            let s = rt.session();
            if let Advance::Feed(token) = g.advance::<B::Error>(s.position(), s.max_context())? {
                fed.push((i, token));
            }
        }
        if fed.is_empty() {
            break;
        }
        let started = Instant::now();
        let inputs = fed.iter().map(|&(_, t)| vec![t].into()).collect();
        let mut chosen: Vec<&mut ModelRuntime<B>> = Vec::with_capacity(fed.len());
        let mut rest: &mut [ModelRuntime<B>] = runtimes;
        let mut taken = 0;
        for &(i, _) in &fed {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - taken);
            let (one, tail) = tail.split_first_mut().expect("index in range");
            chosen.push(one);
            rest = tail;
            taken = i + 1;
        }
        let outs = ModelRuntime::decode_batch(&mut chosen, inputs)?;
        let seconds = started.elapsed().as_secs_f64();
        for ((i, _), sub) in fed.into_iter().zip(outs) {
            let rt = &runtimes[i];
            let out = sub.wait().map_err(RuntimeError::Backend)?;
            let host = rt.session().logits_to_host(&out).map_err(RuntimeError::Backend)?;
            gens[i].accept_logits::<B::Error>(host.last_row().to_vec(), rt.session().position(), seconds)?;
        }
    }
    Ok(gens.iter().map(Generation::result).collect())
}
