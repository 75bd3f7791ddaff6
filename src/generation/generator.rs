//! The token loop: prefill what the session does not already hold, then sample and decode.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::sampling::{Sampler, SamplingParams};
use super::stopping::{StopScan, StopStrings};
use crate::backend::{CandleBackend, CandleError, DecodeInput, PrefillInput, StepOutput};
use crate::core::{ModelRuntime, RuntimeError};
use crate::text::{IncrementalDecoder, TextError, Tokenizer};

/// Why generation failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerationError {
    /// The runtime refused or failed a step.
    #[error(transparent)]
    Runtime(#[from] RuntimeError<CandleError>),
    /// Detokenization failed.
    #[error(transparent)]
    Text(#[from] TextError),
    /// A generation option is out of range.
    #[error("invalid generation option: {0}")]
    InvalidOptions(String),
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string was produced (and cut).
    Stop,
    /// `max_tokens` was reached, or the context filled up.
    Length,
    /// The model produced an end-of-sequence token.
    Eos,
}

impl FinishReason {
    /// The OpenAI-style name: `stop`, `length`, `eos`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Eos => "eos",
        }
    }
}

/// How to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// The most tokens to generate.
    pub max_tokens: usize,
    /// Text at which generation stops (the stop string itself is not returned).
    pub stop: Vec<String>,
    /// Sampling controls.
    pub sampling: SamplingParams,
    /// Extra end-of-sequence ids (besides the tokenizer's and the model's).
    pub eos_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            stop: Vec::new(),
            sampling: SamplingParams::default(),
            eos_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// Token counts and timings of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens the session already held and did not prefill again.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Seconds from the start to the first generated token.
    pub time_to_first_token: f64,
    /// Seconds spent prefilling.
    pub prefill_seconds: f64,
    /// Seconds spent decoding.
    pub decode_seconds: f64,
}

impl Usage {
    /// Prefilled tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        rate(self.prompt_tokens - self.cached_tokens, self.prefill_seconds)
    }

    /// Decoded tokens per second.
    pub fn decode_tokens_per_second(&self) -> f64 {
        rate(self.completion_tokens.saturating_sub(1), self.decode_seconds)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// What a finished generation produced.
#[derive(Debug, Clone)]
pub struct GenerationResult {
    /// The generated text, cut before any stop string.
    pub text: String,
    /// The generated token ids (without an end-of-sequence token).
    pub token_ids: Vec<u32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Counts and timings.
    pub usage: Usage,
}

/// One generation in progress; each `step` samples one token and feeds it back.
pub struct Generation {
    sampler: Sampler,
    stops: StopStrings,
    detok: IncrementalDecoder,
    eos: HashSet<u32>,
    max_tokens: usize,
    context: Vec<u32>,
    generated: Vec<u32>,
    logits: Vec<f32>,
    text: String,
    emitted: usize,
    scanned: usize,
    finish: Option<FinishReason>,
    usage: Usage,
    started: Instant,
}

fn last_row(out: &StepOutput) -> Result<Vec<f32>, GenerationError> {
    let (shape, data) = out.logits_f32().map_err(RuntimeError::Backend)?;
    let vocab = shape.last().copied().unwrap_or(0);
    Ok(data[data.len() - vocab..].to_vec())
}

impl Generation {
    /// Prefills the part of `prompt` the session does not already hold and readies the first token.
    pub fn start(
        rt: &mut ModelRuntime<CandleBackend>,
        tokenizer: Arc<Tokenizer>,
        prompt: &[u32],
        options: GenerateOptions,
    ) -> Result<Self, GenerationError> {
        options.sampling.validate().map_err(GenerationError::InvalidOptions)?;
        if prompt.is_empty() {
            return Err(GenerationError::InvalidOptions("the prompt has no tokens".into()));
        }
        let started = Instant::now();
        // Reuse the longest prefix the session holds; at least one token is run to get logits.
        let held = rt.session().tokens();
        let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
        rt.session_mut().truncate(common).map_err(RuntimeError::Backend)?;
        let out = rt.prefill(PrefillInput::new(prompt[common..].to_vec()))?.wait().map_err(RuntimeError::Backend)?;
        let logits = last_row(&out)?;
        let mut eos: HashSet<u32> = tokenizer.eos_ids().iter().copied().collect();
        eos.extend(rt.session().decoder().config().eos_token_ids.iter().copied());
        eos.extend(options.eos_ids.iter().copied());
        if options.ignore_eos {
            eos.clear();
        }
        let usage = Usage {
            prompt_tokens: prompt.len(),
            cached_tokens: common,
            prefill_seconds: started.elapsed().as_secs_f64(),
            ..Usage::default()
        };
        Ok(Self {
            sampler: Sampler::new(options.sampling),
            stops: StopStrings::new(options.stop),
            detok: IncrementalDecoder::new(tokenizer, true),
            eos,
            max_tokens: options.max_tokens,
            context: prompt.to_vec(),
            generated: Vec::new(),
            logits,
            text: String::new(),
            emitted: 0,
            scanned: 0,
            finish: if options.max_tokens == 0 { Some(FinishReason::Length) } else { None },
            usage,
            started,
        })
    }

    /// Why generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Samples one token, feeds it to the session unless generation ends, and returns the
    /// newly final text (possibly empty).
    pub fn step(&mut self, rt: &mut ModelRuntime<CandleBackend>) -> Result<String, GenerationError> {
        if self.finish.is_some() {
            return Ok(String::new());
        }
        let mut logits = std::mem::take(&mut self.logits);
        self.sampler.adjust(&mut logits, &self.context);
        let token = self.sampler.sample(&logits);
        if self.generated.is_empty() {
            self.usage.time_to_first_token = self.started.elapsed().as_secs_f64();
        }
        if self.eos.contains(&token) {
            return self.end(FinishReason::Eos);
        }
        self.generated.push(token);
        self.context.push(token);
        self.sampler.observe(token);
        if let Some(piece) = self.detok.push(token)? {
            self.text.push_str(&piece);
        }
        match self.stops.scan(&self.text, self.scanned) {
            StopScan::Stopped(at) => {
                self.text.truncate(at);
                return self.end(FinishReason::Stop);
            }
            StopScan::SafeUpTo(_) => self.scanned = self.text.len(),
        }
        let session = rt.session();
        if self.generated.len() >= self.max_tokens || session.position() >= session.max_context() {
            return self.end(FinishReason::Length);
        }
        let t = Instant::now();
        let out = rt.decode(DecodeInput { tokens: vec![token] })?.wait().map_err(RuntimeError::Backend)?;
        self.logits = last_row(&out)?;
        self.usage.decode_seconds += t.elapsed().as_secs_f64();
        Ok(self.take_safe())
    }

    fn take_safe(&mut self) -> String {
        let safe = match self.stops.scan(&self.text, self.text.len()) {
            StopScan::SafeUpTo(s) | StopScan::Stopped(s) => s,
        };
        if safe <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..safe].to_owned();
        self.emitted = safe;
        out
    }

    fn end(&mut self, reason: FinishReason) -> Result<String, GenerationError> {
        self.finish = Some(reason);
        if reason != FinishReason::Stop {
            if let Some(rest) = self.detok.flush()? {
                self.text.push_str(&rest);
                if let StopScan::Stopped(at) = self.stops.scan(&self.text, self.scanned) {
                    self.text.truncate(at);
                    self.finish = Some(FinishReason::Stop);
                }
            }
        }
        let out = self.text[self.emitted.min(self.text.len())..].to_owned();
        self.emitted = self.text.len();
        Ok(out)
    }

    /// The result so far (final once `finish_reason` is set).
    pub fn result(&self) -> GenerationResult {
        GenerationResult {
            text: self.text.clone(),
            token_ids: self.generated.clone(),
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            usage: Usage { completion_tokens: self.generated.len(), ..self.usage },
        }
    }

    /// Runs to the end, passing each piece of final text to `on_text`; `interrupted` is asked
    /// between steps and stops the loop (leaving the session consistent) when it answers true.
    pub fn run(
        mut self,
        rt: &mut ModelRuntime<CandleBackend>,
        mut on_text: impl FnMut(&str),
        mut interrupted: impl FnMut() -> bool,
    ) -> Result<(GenerationResult, bool), GenerationError> {
        while self.finish.is_none() {
            if interrupted() {
                return Ok((self.result(), true));
            }
            let piece = self.step(rt)?;
            if !piece.is_empty() {
                on_text(&piece);
            }
        }
        Ok((self.result(), false))
    }
}
