//! Text generation for Python: `ModelRuntime.generate`, `stream`, `chat` and `generate_batch`,
//! and `GenerationStream`, with the GIL released and Ctrl-C honoured.

use std::sync::Mutex;

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};

use super::convert::{prompt_of, Given};
use super::errors::{
    catch_panic, generation_err, invalid_option, model_err, text_err, GenerationOptionError, InternalError,
};
use super::gil::lock_released;
use super::result::{logprobs_to_py, to_result, PyGenerationResult};
use super::runtime::{ImageCall, PyModelRuntime};
use super::sampling::SamplingArgs;
use super::text::{conversation, template_value, tool_calls_to_py, tool_choice_of, tools_of};
use candlewick::generation::{GenerateOptions, Generation};
use candlewick::text::ToolChoice;

#[pymethods]
impl PyModelRuntime {
    #[doc = concat!("generate($self, prompt, *, stream=False, images=None, pixel_values=None, ", sampling_signature!(), ")\n--\n")]
    /// Generates text from a prompt; a new prompt that shares a prefix with what the session
    /// holds prefills only the rest. Ctrl-C stops it within one step.
    ///
    /// Args:
    ///     prompt (str | Sequence[int]): text (encoded with the model's special tokens) or ids.
    ///     images (list | None): a vision-language model's images (paths, bytes, data: URLs, PIL
    ///         images, HxWxC uint8 arrays), each in place of a placeholder of the prompt (one in
    ///         front per image when it has none), processed as transformers' processor does.
    ///     pixel_values (numpy.ndarray | None): processed images; the prompt holds their tokens.
    ///     stream (bool): return a ``GenerationStream`` of text pieces instead of the result.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationResult: ``text``, ``token_ids``, ``finish_reason``, ``usage`` and
    ///     ``logprobs`` (or a ``GenerationStream`` with ``stream=True``).
    ///
    /// Example:
    ///     >>> r = rt.generate("The capital of France is", max_tokens=16, temperature=0.7, seed=1)
    ///     >>> r.finish_reason, r.usage["completion_tokens"]
    ///     ('length', 16)
    #[pyo3(text_signature = None, signature = (prompt, *, stream=false, images=None, pixel_values=None, max_tokens=Given::Omitted, temperature=None,
        top_k=None, top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, grammar_format=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        slf: &Bound<'py, Self>,
        prompt: &Bound<'py, PyAny>,
        stream: bool,
        images: Option<Bound<'py, PyAny>>,
        pixel_values: Option<Bound<'py, PyAny>>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        grammar_format: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
        adapters: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            grammar_format,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
            adapters,
        };
        let py = slf.py();
        let opts = args.options(slf.get().lock(py)?.defaults())?;
        let call = slf.get().image_call(py, prompt, images.as_ref(), pixel_values.as_ref())?;
        let ids = match &call {
            Some(c) => c.ids.clone(),
            None => slf.get().prompt_ids(py, prompt)?,
        };
        if stream {
            let s = PyGenerationStream::start(py, slf, ids, opts, call.as_ref())?;
            return Ok(Bound::new(py, s)?.into_any());
        }
        Ok(Bound::new(py, with_images(py, slf.get(), &call, || run_to_end(py, slf.get(), ids, opts))?)?.into_any())
    }

    #[doc = concat!("stream($self, prompt, *, images=None, pixel_values=None, ", sampling_signature!(), ")\n--\n")]
    /// Generates from a prompt, yielding text pieces as they become final.
    ///
    /// Args:
    ///     prompt (str | Sequence[int]): text (encoded with the model's special tokens) or ids.
    ///     images (list | None): a vision-language model's images (paths, bytes, data: URLs, PIL
    ///         images, HxWxC uint8 arrays), each in place of a placeholder of the prompt (one in
    ///         front per image when it has none), processed as transformers' processor does.
    ///     pixel_values (numpy.ndarray | None): processed images; the prompt holds their tokens.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationStream: an iterator of ``str`` pieces; ``.logprobs`` holds the last piece's
    ///     log-probabilities, ``.result`` the whole generation once it ends or is closed.
    ///
    /// Example:
    ///     >>> for piece in rt.stream("def fibonacci(n):", max_tokens=64, stop=["\n\n"]):
    ///     ...     print(piece, end="", flush=True)
    #[pyo3(text_signature = None, signature = (prompt, *, images=None, pixel_values=None, max_tokens=Given::Omitted, temperature=None, top_k=None,
        top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, grammar_format=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None))]
    #[allow(clippy::too_many_arguments)]
    fn stream<'py>(
        slf: &Bound<'py, Self>,
        prompt: &Bound<'py, PyAny>,
        images: Option<Bound<'py, PyAny>>,
        pixel_values: Option<Bound<'py, PyAny>>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        grammar_format: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
        adapters: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PyGenerationStream> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            grammar_format,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
            adapters,
        };
        let py = slf.py();
        let opts = args.options(slf.get().lock(py)?.defaults())?;
        let call = slf.get().image_call(py, prompt, images.as_ref(), pixel_values.as_ref())?;
        let ids = match &call {
            Some(c) => c.ids.clone(),
            None => slf.get().prompt_ids(py, prompt)?,
        };
        PyGenerationStream::start(py, slf, ids, opts, call.as_ref())
    }

    #[doc = concat!(
        "chat($self, messages, *, stream=False, chat_template=None, tools=None, tool_choice=None, ",
        "parallel_tool_calls=True, tool_call_format=None, ",
        sampling_signature!(),
        ")\n--\n"
    )]
    /// Answers a conversation through the model's chat template (base models such as the
    /// default Gemma 3 270M ship none: pass ``chat_template``, or use an instruction-tuned model).
    ///
    /// Args:
    ///     messages (Sequence[dict]): ``{"role", "content"}`` dicts; a content may be a string
    ///         or a list of ``{"type": "text", "text": ...}`` parts, as OpenAI clients send it,
    ///         with image parts (``{"type": "image_url", "image_url": {"url": "data:..."}}`` or
    ///         ``{"type": "image", "image": ...}``) for a vision-language model.
    ///     stream (bool): return a ``GenerationStream`` of text pieces instead of the result.
    ///     chat_template (str | None): a Jinja template to use instead of the model's.
    ///     tools (list[dict] | None): OpenAI tool objects, rendered by the template; the answer's
    ///         calls come back parsed in ``result.tool_calls`` (``finish_reason`` ``"tool_calls"``).
    ///     tool_choice (str | dict | None): ``"auto"`` (the default), ``"none"``, ``"required"`` or
    ///         ``{"type": "function", "function": {"name": ...}}``; the last two constrain the output
    ///         to a call whose arguments validate against the function's parameter schema.
    ///     parallel_tool_calls (bool): allow several calls in one answer.
    ///     tool_call_format (str | None): ``"hermes"``, ``"mistral"`` or ``"llama3"``; None detects
    ///         it from the chat template. ``tool_choice``, ``tool_call_format`` and
    ///         ``parallel_tool_calls=False`` without ``tools`` raise ``InvalidOptionError``.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     GenerationResult: the assistant's answer (or a ``GenerationStream`` with ``stream=True``,
    ///     whose ``result.tool_calls`` holds the calls once it ends).
    ///
    /// Example:
    ///     >>> rt.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text
    #[pyo3(text_signature = None, signature = (messages, *, stream=false, chat_template=None, tools=None,
        tool_choice=None, parallel_tool_calls=true, tool_call_format=None, max_tokens=Given::Omitted, temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None,
        presence_penalty=None, frequency_penalty=None, logit_bias=None, stop=None, seed=None, ignore_eos=false,
        logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, grammar_format=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None))]
    #[allow(clippy::too_many_arguments)]
    fn chat<'py>(
        slf: &Bound<'py, Self>,
        messages: &Bound<'py, PyAny>,
        stream: bool,
        chat_template: Option<&str>,
        tools: Option<Bound<'py, PyAny>>,
        tool_choice: Option<Bound<'py, PyAny>>,
        parallel_tool_calls: bool,
        tool_call_format: Option<&str>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        grammar_format: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
        adapters: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            grammar_format,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
            adapters,
        };
        let py = slf.py();
        let mut opts = args.options(slf.get().lock(py)?.defaults())?;
        let tools = tools.filter(|t| !t.is_none());
        let Some(tools) = tools else {
            // Without tools these would change nothing: refused, naming them, rather than ignored.
            let stray: Vec<&str> = [
                ("tool_choice", tool_choice.is_some()),
                ("tool_call_format", tool_call_format.is_some()),
                ("parallel_tool_calls", !parallel_tool_calls),
            ]
            .into_iter()
            .filter_map(|(name, given)| given.then_some(name))
            .collect();
            if !stray.is_empty() {
                return Err(invalid_option(py, format!("{}: only with tools, and none were given", stray.join(", "))));
            }
            // Image content parts: rendered by the template, expanded and encoded (docs/vision.md).
            let call = slf.get().chat_image_call(py, messages, chat_template, None)?;
            let ids = match &call {
                Some(c) => c.ids.clone(),
                None => slf.get().chat_ids(py, messages, chat_template)?,
            };
            if stream {
                let s = PyGenerationStream::start(py, slf, ids, opts, call.as_ref())?;
                return Ok(Bound::new(py, s)?.into_any());
            }
            let r = with_images(py, slf.get(), &call, || run_to_end(py, slf.get(), ids, opts))?;
            return Ok(Bound::new(py, r)?.into_any());
        };
        let tool_values = tools_of(&tools)?;
        let choice = tool_choice_of(tool_choice.as_ref())?;
        let rt = slf.get();
        let (format, ids) = {
            let messages = conversation("messages", messages)?;
            let tools_value = template_value("tools", &tools)?;
            py.detach(|| {
                catch_panic(|| {
                    let model = rt.lock_detached()?;
                    let tokenizer = model.tokenizer().map_err(model_err)?;
                    let format = tokenizer.tool_call_format(tool_call_format, chat_template).map_err(text_err)?;
                    let grammar = tokenizer
                        .tool_call_grammar(format, &tool_values, &choice, parallel_tool_calls)
                        .map_err(text_err)?;
                    if let Some(g) = grammar {
                        if opts.constraint.is_some() {
                            return Err(GenerationOptionError::new_err(
                                "tool_choice \"required\" or a named function constrains the output already: give no other constraint",
                            ));
                        }
                        opts.constraint = Some(candlewick::generation::ConstraintSpec::Lark(g));
                    }
                    let ids = model.chat_ids_with(&messages, chat_template, Some(("tools", tools_value))).map_err(model_err)?;
                    Ok((format, ids))
                })
            })?
        };
        if stream {
            let s = PyGenerationStream::start(py, slf, ids, opts, None)?;
            let s = if choice == ToolChoice::None { s } else { s.with_tool_calls(format) };
            return Ok(Bound::new(py, s)?.into_any());
        }
        let result = run_to_end(py, rt, ids, opts)?;
        if choice == ToolChoice::None {
            return Ok(Bound::new(py, result)?.into_any());
        }
        let (text, calls) = {
            let model = rt.lock(py)?;
            model.tokenizer().map_err(model_err)?.parse_tool_calls(format, result.ids()).map_err(text_err)?
        };
        let calls = tool_calls_to_py(py, &calls)?;
        Ok(Bound::new(py, result.with_tool_calls(text, calls))?.into_any())
    }

    #[doc = concat!("generate_batch($self, prompts, *, ", sampling_signature!(), ")\n--\n")]
    /// Generates from every prompt at once, the unfinished ones decoding together in one
    /// batched step. Each gets what ``generate`` would give it alone; the session is left as it
    /// was.
    ///
    /// Args:
    ///     prompts (Sequence[str | Sequence[int]]): texts or token lists.
    #[doc = sampling_args_doc!()]
    ///
    /// Returns:
    ///     list[GenerationResult]: one per prompt.
    ///
    /// Example:
    ///     >>> [r.text for r in rt.generate_batch(["Hello", "Bonjour"], max_tokens=4, temperature=0)]
    #[pyo3(text_signature = None, signature = (prompts, *, max_tokens=Given::Omitted, temperature=None, top_k=None,
        top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        logit_bias=None, stop=None, seed=None, ignore_eos=false, logprobs=None, skip_special_tokens=true, response_format=None, grammar=None, grammar_format=None, regex=None,
        choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch<'py>(
        &self,
        py: Python<'py>,
        prompts: Vec<Bound<'py, PyAny>>,
        max_tokens: Given<'py>,
        temperature: Option<Bound<'py, PyAny>>,
        top_k: Option<Bound<'py, PyAny>>,
        top_p: Option<Bound<'py, PyAny>>,
        min_p: Option<Bound<'py, PyAny>>,
        repetition_penalty: Option<Bound<'py, PyAny>>,
        presence_penalty: Option<Bound<'py, PyAny>>,
        frequency_penalty: Option<Bound<'py, PyAny>>,
        logit_bias: Option<Bound<'py, PyAny>>,
        stop: Option<Bound<'py, PyAny>>,
        seed: Option<Bound<'py, PyAny>>,
        ignore_eos: bool,
        logprobs: Option<Bound<'py, PyAny>>,
        skip_special_tokens: bool,
        response_format: Option<Bound<'py, PyAny>>,
        grammar: Option<String>,
        grammar_format: Option<String>,
        regex: Option<String>,
        choice: Option<Vec<String>>,
        prompt_lookup_num_tokens: Option<Bound<'py, PyAny>>,
        num_draft_tokens: Option<Bound<'py, PyAny>>,
        adapters: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<PyGenerationResult>> {
        let args = SamplingArgs {
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            stop,
            seed,
            ignore_eos,
            logprobs,
            skip_special_tokens,
            response_format,
            grammar,
            grammar_format,
            regex,
            choice,
            prompt_lookup_num_tokens,
            num_draft_tokens,
            adapters,
        };
        let opts = args.options(self.lock(py)?.defaults())?;
        let prompts = prompts.iter().map(|p| prompt_of("prompts[i]", p)).collect::<PyResult<Vec<_>>>()?;
        let results =
            py.detach(|| catch_panic(|| self.lock_detached()?.generate_batch(&prompts, opts).map_err(model_err)))?;
        results.into_iter().map(|r| to_result(py, r)).collect()
    }
}

/// Runs a whole generation in Rust; Ctrl-C raises KeyboardInterrupt within one step.
pub fn run_to_end(
    py: Python<'_>,
    rt: &PyModelRuntime,
    prompt: Vec<u32>,
    opts: GenerateOptions,
) -> PyResult<PyGenerationResult> {
    let mut pending: Option<PyErr> = None;
    let result = py.detach(|| {
        catch_panic(|| {
            let mut model = rt.lock_detached()?;
            let generation = model.start_generation(&prompt, opts).map_err(model_err)?;
            let (result, _) = model
                .run_generation(
                    generation,
                    |_| {},
                    || {
                        // Signals are only delivered with the GIL held: take it briefly between steps.
                        match Python::attach(|py| py.check_signals()) {
                            Ok(()) => false,
                            Err(e) => {
                                pending = Some(e);
                                true
                            }
                        }
                    },
                )
                .map_err(generation_err)?;
            Ok(result)
        })
    })?;
    if let Some(e) = pending {
        return Err(e);
    }
    to_result(py, result)
}

/// An iterator of text pieces, each final (never a broken character or a stop string's start).
///
/// ``result`` holds the whole generation (text, finish reason, usage) once the stream ends, or
/// once ``close()`` stops it early; ``logprobs`` holds the log-probabilities of the tokens
/// behind the piece last yielded when ``logprobs=N`` was asked for. A stream is a context
/// manager that closes itself.
///
/// Example:
///     >>> with rt.stream("The capital of France is", max_tokens=8, logprobs=2) as s:
///     ...     for piece in s:
///     ...         print(piece, s.logprobs)
///     >>> s.result.finish_reason
///     'length'
#[pyclass(name = "GenerationStream", module = "candlewick._native", frozen)]
pub struct PyGenerationStream {
    runtime: Py<PyModelRuntime>,
    state: Mutex<Option<Generation>>,
    result: Mutex<Option<Py<PyGenerationResult>>>,
    logprobs: Mutex<Option<Vec<Py<PyDict>>>>,
    /// With `chat(..., tools=...)`: the format whose calls `result` parses out of the text.
    tool_format: Option<candlewick::text::ToolCallFormat>,
}

fn poisoned<T>(_: T) -> PyErr {
    InternalError::new_err("generation stream poisoned")
}

impl PyGenerationStream {
    /// Starts a generation (prefilling the prompt, with `images` staged for it) whose tokens
    /// are produced on iteration.
    pub fn start(
        py: Python<'_>,
        runtime: &Bound<'_, PyModelRuntime>,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        images: Option<&ImageCall>,
    ) -> PyResult<Self> {
        let rt = runtime.get();
        let generation = py.detach(|| {
            catch_panic(|| {
                let mut model = rt.lock_detached()?;
                let Some(c) = images else {
                    return model.start_generation(&prompt, opts).map_err(model_err);
                };
                model.stage_images(&c.ids, 0, &c.pixels, None, &[]).map_err(model_err)?;
                let started = model.start_generation(&prompt, opts).map_err(model_err);
                model.clear_images();
                let mut generation = started?;
                // The prompt (and its images) is prefilled; unstaging the images after it changes
                // nothing the stream's steps read, so they go on from here.
                generation.note_epoch(model.runtime().epoch());
                Ok(generation)
            })
        })?;
        Ok(Self {
            runtime: runtime.clone().unbind(),
            state: Mutex::new(Some(generation)),
            result: Mutex::new(None),
            logprobs: Mutex::new(None),
            tool_format: None,
        })
    }

    /// This stream with the model's tool calls parsed into `result.tool_calls` when it ends (the
    /// pieces stream as the model writes them).
    pub fn with_tool_calls(mut self, format: candlewick::text::ToolCallFormat) -> Self {
        self.tool_format = Some(format);
        self
    }

    /// Keeps the finished generation's result and drops its state.
    fn finish(&self, py: Python<'_>, state: &mut Option<Generation>) -> PyResult<()> {
        if let Some(generation) = state.take() {
            let mut result = to_result(py, generation.result())?;
            if let Some(format) = self.tool_format {
                let (text, calls) = {
                    let model = self.runtime.get().lock(py)?;
                    model.tokenizer().map_err(model_err)?.parse_tool_calls(format, result.ids()).map_err(text_err)?
                };
                result = result.with_tool_calls(text, tool_calls_to_py(py, &calls)?);
            }
            *self.result.lock().map_err(poisoned)? = Some(Py::new(py, result)?);
        }
        Ok(())
    }

    /// Records the log-probabilities behind the piece about to be yielded.
    fn keep_logprobs(&self, py: Python<'_>, generation: &mut Generation) -> PyResult<()> {
        let taken = generation.take_logprobs().map(|l| logprobs_to_py(py, l)).transpose()?;
        *self.logprobs.lock().map_err(poisoned)? = taken;
        Ok(())
    }
}

#[pymethods]
impl PyGenerationStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<String> {
        let mut state = lock_released(py, &self.state).map_err(poisoned)?;
        let Some(generation) = state.as_mut() else {
            return Err(PyStopIteration::new_err(()));
        };
        let rt = self.runtime.get();
        loop {
            if generation.finish_reason().is_some() {
                self.finish(py, &mut state)?;
                return Err(PyStopIteration::new_err(()));
            }
            let piece =
                py.detach(|| catch_panic(|| rt.lock_detached()?.step_generation(generation).map_err(generation_err)))?;
            if !piece.is_empty() {
                self.keep_logprobs(py, generation)?;
                return Ok(piece);
            }
            py.check_signals()?;
        }
    }

    /// Stops the generation where it stands; ``result`` then holds what was generated, its usage
    /// and the finish reason ``"cancelled"`` (a stream that already ended keeps its own).
    /// ``result.text`` also has the text not yet yielded (a possible stop string's start, held
    /// back). Closing twice does nothing.
    ///
    /// Example:
    ///     >>> s = rt.stream("Once upon a time", max_tokens=100)
    ///     >>> first = next(s)
    ///     >>> s.close()
    ///     >>> s.result.finish_reason, s.result.usage["completion_tokens"]
    ///     ('cancelled', 1)
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = lock_released(py, &self.state).map_err(poisoned)?;
        if let Some(generation) = state.as_mut() {
            generation.cancel().map_err(text_err)?;
        }
        self.finish(py, &mut state)
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<&Bound<'_, PyAny>>,
        _value: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// The finished generation (None until the stream ends or is closed).
    #[getter]
    fn result(&self, py: Python<'_>) -> PyResult<Option<Py<PyGenerationResult>>> {
        Ok(self.result.lock().map_err(poisoned)?.as_ref().map(|r| r.clone_ref(py)))
    }

    /// With ``logprobs=N``: the log-probabilities of the tokens behind the piece last yielded
    /// (entries as in ``GenerationResult.logprobs``); None otherwise. Tokens whose text is
    /// still held back come with a later piece; ``result.logprobs`` has every token's.
    #[getter]
    fn logprobs(&self, py: Python<'_>) -> PyResult<Option<Vec<Py<PyDict>>>> {
        Ok(self.logprobs.lock().map_err(poisoned)?.as_ref().map(|l| l.iter().map(|d| d.clone_ref(py)).collect()))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let running = lock_released(py, &self.state).map_err(poisoned)?.is_some();
        Ok(format!("GenerationStream({})", if running { "running" } else { "ended" }))
    }
}

/// Runs `f` (which runs a generation from position 0 to its end) with the call's images staged,
/// and unstages them after, whatever `f` returned. (A stream, whose steps come after, unstages
/// its images itself: `PyGenerationStream::start`.)
fn with_images<T>(
    py: Python<'_>,
    rt: &PyModelRuntime,
    call: &Option<ImageCall>,
    f: impl FnOnce() -> PyResult<T>,
) -> PyResult<T> {
    if let Some(c) = call {
        rt.stage(py, c, Some(0), None, &[])?;
    }
    let out = f();
    if call.is_some() {
        rt.unstage(py);
    }
    out
}
