//! The PyO3 layer: a thin binding of the runtime, one file per domain, that converts arguments
//! and results and calls the model layer (`candlewick::model`, `candlewick::engine`).
//!
//! # Which file may import which
//!
//! The files form layers, listed bottom up; a file imports (`use super::…`) only files listed
//! before it, so the import graph between binding files has no circle:
//!
//! 1. `errors`: the exception classes and the mapping of the runtime's errors onto them
//!    (`engine_err` included).
//! 2. `gil`: locks waited for with the GIL released.
//! 3. `hub`: Hub names handed to the Python package's `candlewick.hub`.
//! 4. `convert` (`errors`): the conversions every file shares (token ids, counts,
//!    numbers, prompts, JSON, `Given`, `py_repr`).
//! 5. `build_info` (`errors`): `build_info()`, `supported_architectures()`.
//! 6. `observation` (`errors`, `convert`): `ObservationRequest`, `ObservationSet`.
//! 7. `intervention` (`errors`, `convert`): `Intervention`, `save_control_vector()`.
//! 8. `text` (`errors`, `convert`): `Tokenizer`, chat data and tool calls.
//! 9. `sampling` (`errors`, `convert`): the sampling keywords, `generation_defaults()`.
//! 10. `result` (`convert`): `GenerationResult`, log-probabilities.
//! 11. `runtime` (`errors`, `gil`, `hub`, `convert`, `intervention`, `text`): the `ModelRuntime`
//!     class and its lock; `load`, `close`, `model_info`, `tokenizer`, `prefill`, `decode`;
//!     `StepOutput`, `Submission`.
//! 12. `session` (`errors`, `convert`, `runtime`): `backend`, `session`, `capabilities`, `fork`;
//!     `Backend`, `Session`, `SessionCapabilities`, `SessionSnapshot`.
//! 13. `inspection` (`errors`, `convert`, `observation`, `intervention`, `runtime`):
//!     `inspect_prefill`, `inspect_decode`, `trace`, `trace_batch`, `observe_output`, `unembed`;
//!     `InspectedOutput`.
//! 14. `steering` (`errors`, `convert`, `intervention`, `runtime`): `interventions`, `intervene`,
//!     `load_control_vector`; `InterventionScope`.
//! 15. `generation` (`errors`, `gil`, `convert`, `text`, `sampling`, `result`, `runtime`):
//!     `generate`, `stream`, `chat`, `generate_batch`; `GenerationStream`.
//! 16. `engine` (`errors`, `gil`, `convert`, `intervention`, `sampling`, `result`, `runtime`):
//!     `Engine`, `EngineRequest`.
//! 17. `sae` (`errors`, `convert`, `observation`, `intervention`, `runtime`): `attach_sae`,
//!     `detach_sae`, `saes`, `top_features`, `collect_batch`, `last_layer_needed`; the feature
//!     edits `Intervention.sae_steer/sae_clamp/sae_splice`.
//! 18. `vision` (`errors`, `runtime`): `process`, the ids and pixel values of a call with images
//!     (the calls take `images=` / `pixel_values=` through `runtime`'s helpers).
//! 19. `adapters` (`errors`, `convert`, `runtime`): `load_adapter`, `unload_adapter`,
//!     `loaded_adapters`, `adapters`, `active_adapters`, `set_adapters` (LoRA).
//! 20. `embedding` (`errors`, `convert`, `runtime`): `embed`, `rerank`, `embedding_info`.
//!
//! `ModelRuntime` is defined in `runtime` and its methods are spread over 11-18, one
//! `#[pymethods]` block per domain (pyo3's `multiple-pymethods` feature), so that a domain's
//! methods sit beside its classes and import the class, never the other way round.

/// The sampling keywords of `generate`, `stream`, `chat`, `generate_batch` and `Engine.submit`
/// as their text signatures show them; `None` keeps the model's default (`generation_defaults()`).
macro_rules! sampling_signature {
    () => {
        concat!(
            "max_tokens=",
            candlewick::default_max_tokens!(),
            ", temperature=None, top_k=None, top_p=None, min_p=None, repetition_penalty=None, ",
            "presence_penalty=None, frequency_penalty=None, logit_bias=None, stop=None, seed=None, ",
            "ignore_eos=False, logprobs=None, skip_special_tokens=True, response_format=None, grammar=None, grammar_format=None, ",
            "regex=None, choice=None, prompt_lookup_num_tokens=None, num_draft_tokens=None, adapters=None"
        )
    };
}

/// The `Args:` entries of the sampling keywords, for the docstrings of the methods that take them.
macro_rules! sampling_args_doc {
    () => {
        concat!(
            "    max_tokens (int | None): the most tokens to generate (default ",
            candlewick::default_max_tokens!(),
            "); None: until the context is full.\n",
            "    temperature (float | None): softmax temperature; 0 picks the most likely token.\n",
            "    top_k (int | None): keep the k most likely tokens (0: all).\n",
            "    top_p (float | None): keep the smallest set of tokens whose probability reaches p.\n",
            "    min_p (float | None): drop tokens below this fraction of the best one's probability.\n",
            "    repetition_penalty (float | None): llama.cpp's repeat penalty (1: off).\n",
            "    presence_penalty (float | None): OpenAI's presence penalty (0: off).\n",
            "    frequency_penalty (float | None): OpenAI's frequency penalty (0: off).\n",
            "    logit_bias (dict[int, float] | None): added to the logits of these token ids.\n",
            "    stop (str | list[str] | None): text that ends generation (not returned).\n",
            "    seed (int | None): the sampling seed; None or -1: random.\n",
            "    ignore_eos (bool): keep generating past end-of-sequence tokens.\n",
            "    logprobs (int | None): N: report each token's log-probability and the N most likely\n",
            "        alternatives. The sampling defaults (None) are ``generation_defaults()``.\n",
            "    skip_special_tokens (bool): leave control tokens (special tokens, and markup such as\n",
            "        Gemma's ``<start_of_image>``) out of the text; their ids and logprobs stay.\n",
            "    response_format (dict | None): OpenAI's ``{\"type\": \"json_object\"}`` or\n",
            "        ``{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", \"strict\"}}``: the\n",
            "        output is JSON (valid against the schema).\n",
            "    grammar (str | None): a grammar the output follows: Lark (llguidance's dialect) or\n",
            "        llama.cpp's GBNF (converted by ``candlewick.grammar.to_lark``).\n",
            "    grammar_format (str | None): ``\"lark\"`` or ``\"gbnf\"``; None: detected (GBNF has\n",
            "        ``name ::= ...`` rules).\n",
            "    regex (str | None): a regular expression the whole output matches.\n",
            "    choice (list[str] | None): the output is exactly one of these strings.\n",
            "        One constraint at most; an unsatisfiable or unsupported one raises\n",
            "        ``GenerationOptionError`` naming it, before any step.\n",
            "    prompt_lookup_num_tokens (int | None): speculative decoding by prompt lookup: up to\n",
            "        this many tokens that followed the context's last n-gram earlier in it are checked\n",
            "        with each token in one step; output and sampling distribution are unchanged\n",
            "        (``generate``, ``stream`` and ``chat``; 0 or None: off).\n",
            "    num_draft_tokens (int | None): with a draft model (``load(..., draft_model=)``): the\n",
            "        most tokens it proposes a step (None: 16; 0: off); it stops early where it is\n",
            "        unsure. Greedy output is unchanged, sampled output keeps its distribution (the\n",
            "        standard acceptance rule). Used when prompt lookup has no guess.\n",
            "    adapters (str | list | dict | None): LoRA adapters for this call, by loaded name:\n",
            "        ``\"name\"``, ``[\"a\", (\"b\", 0.5)]`` or ``{\"a\": 1.0, \"b\": 0.5}`` (summed); ``{}``:\n",
            "        the base model; None: the runtime's (``set_adapters``)."
        )
    };
}

mod adapters;
mod build_info;
mod convert;
mod embedding;
mod engine;
mod errors;
mod generation;
mod gil;
mod hub;
mod inspection;
mod intervention;
mod observation;
mod result;
mod runtime;
mod sae;
mod sampling;
mod session;
mod steering;
mod text;
mod vision;

use pyo3::prelude::*;

/// The native module behind the `candlewick` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<runtime::PyModelRuntime>()?;
    m.add_class::<session::PyBackend>()?;
    m.add_class::<session::PySession>()?;
    m.add_class::<session::PySessionCapabilities>()?;
    m.add_class::<runtime::PyStepOutput>()?;
    m.add_class::<runtime::PySubmission>()?;
    m.add_class::<inspection::PyInspectedOutput>()?;
    m.add_class::<observation::PyObservationRequest>()?;
    m.add_class::<observation::PyObservationSet>()?;
    m.add_class::<text::PyTokenizer>()?;
    m.add_class::<result::PyGenerationResult>()?;
    m.add_class::<generation::PyGenerationStream>()?;
    m.add_class::<intervention::PyIntervention>()?;
    m.add_class::<steering::PyInterventionScope>()?;
    m.add_class::<session::PySessionSnapshot>()?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PyEngineRequest>()?;
    // Registered here, not in `errors::register`, to keep the module's `__all__` order.
    m.add("QueueFullError", m.py().get_type::<errors::QueueFullError>())?;
    m.add_function(wrap_pyfunction!(intervention::save_control_vector, m)?)?;
    m.add_function(wrap_pyfunction!(sampling::generation_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(build_info::build_info, m)?)?;
    m.add_function(wrap_pyfunction!(build_info::supported_architectures, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
