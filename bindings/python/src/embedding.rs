//! Embeddings and reranking for Python: `embed`, `rerank`, `embedding_info` (DESIGN §17).

use numpy::ndarray::{ArrayD, IxDyn};
use numpy::PyArray;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyList};

use super::convert::prompt_of;
use super::errors::{catch_panic, invalid_option, model_err, InternalError};
use super::runtime::PyModelRuntime;
use candlewick::model::embedding::{EmbedOptions, Pooling};
use candlewick::model::Prompt;

/// The inputs of `embed`, and whether they were one input (a string or one list of token ids).
fn inputs_of(texts: &Bound<'_, PyAny>) -> PyResult<(Vec<Prompt>, bool)> {
    if texts.extract::<String>().is_ok() {
        return Ok((vec![prompt_of("texts", texts)?], true));
    }
    let items: Vec<Bound<'_, PyAny>> = texts.try_iter().and_then(|it| it.collect::<PyResult<_>>()).map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err("texts must be a string, a list of strings, or token ids")
    })?;
    if !items.is_empty() && items.iter().all(|i| i.extract::<i64>().is_ok()) {
        return Ok((vec![prompt_of("texts", texts)?], true));
    }
    let prompts = items.iter().map(|i| prompt_of("texts", i)).collect::<PyResult<Vec<_>>>()?;
    Ok((prompts, false))
}

#[pymethods]
impl PyModelRuntime {
    /// Embeds texts as sentence-transformers does with the same directory: the final hidden
    /// states (after the last norm) pooled as ``1_Pooling/config.json`` says (mean, CLS, last
    /// token), then its Dense layers and Normalize module. Runs on fresh contexts: the session
    /// is left as it was. Decoder embedding models (Qwen3-Embedding, EmbeddingGemma with its
    /// bidirectional attention) and BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa: their last
    /// layer's states) are supported.
    ///
    /// Args:
    ///     texts (str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]): one text or
    ///         token-id list (a 1-D result), or several (2-D).
    ///     pooling (str | None): ``"mean"``, ``"cls"``, ``"lasttoken"`` or ``"max"``; None: the model's.
    ///     normalize (bool | None): scale to unit length; None: as the model declares.
    ///     dimensions (int | None): keep the first this many dimensions (Matryoshka), then normalise.
    ///     prompt_name (str | None): one of the model's prompts (``embedding_info()["prompts"]``,
    ///         e.g. ``"query"``) put in front of each text; None: the model's default, if any.
    ///     prompt (str | None): a prompt of one's own (overrides ``prompt_name``).
    ///
    /// Returns:
    ///     numpy.ndarray: float32 ``[dimension]`` for one input, ``[inputs, dimension]`` for a list.
    ///
    /// Example:
    ///     >>> v = rt.embed(["a cat", "a dog"], prompt_name="query")
    ///     >>> v.shape
    ///     (2, 1024)
    #[pyo3(signature = (texts, pooling=None, normalize=None, dimensions=None, prompt_name=None, prompt=None))]
    #[allow(clippy::too_many_arguments)]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        pooling: Option<String>,
        normalize: Option<bool>,
        dimensions: Option<usize>,
        prompt_name: Option<String>,
        prompt: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (inputs, single) = inputs_of(texts)?;
        let pooling = match pooling {
            None => None,
            Some(p) => Some(Pooling::parse(&p).ok_or_else(|| {
                invalid_option(py, format!("pooling: {p:?} is not one of mean, cls, lasttoken, max"))
            })?),
        };
        let options = EmbedOptions { pooling, normalize, dimensions, prompt_name, prompt };
        let out = py.detach(|| catch_panic(|| self.lock_detached()?.embed(&inputs, &options).map_err(model_err)))?;
        let (embed_dims, rows) = (out.vectors.first().map_or(0, Vec::len), out.vectors.len());
        let width = if rows == 0 { self.embedding_width(py, dimensions)? } else { embed_dims };
        let data: Vec<f32> = out.vectors.into_iter().flatten().collect();
        let shape = if single { vec![width] } else { vec![rows, width] };
        let arr = ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| InternalError::new_err(e.to_string()))?;
        Ok(PyArray::from_owned_array(py, arr).into_any())
    }

    /// Scores documents' relevance to a query: with a cross-encoder (``BertForSequenceClassification``,
    /// ``XLMRobertaForSequenceClassification`` with one label, as bge-reranker), its score of the
    /// tokenizer's (query, document) pair as sentence-transformers' ``CrossEncoder.predict`` gives
    /// it (a sigmoid of the logit unless config.json names another activation); with a yes/no
    /// reranker (Qwen3-Reranker), the probability of "yes" against "no" after its prompt, as its
    /// model card computes it. Runs on fresh contexts: the session is left as it was.
    ///
    /// Args:
    ///     query (str): the query.
    ///     documents (Sequence[str]): the documents.
    ///     top_n (int | None): return only the best this many.
    ///     instruction (str | None): a yes/no reranker's task instruction; None: the model card's
    ///         default ("Given a web search query, retrieve relevant passages that answer the
    ///         query"). A cross-encoder refuses one.
    ///
    /// Returns:
    ///     list[dict]: ``{"index", "relevance_score"}`` per document, best first.
    ///
    /// Example:
    ///     >>> rt.rerank("capital of France", ["Paris is the capital.", "Bananas are yellow."])[0]["index"]
    ///     0
    #[pyo3(signature = (query, documents, top_n=None, instruction=None))]
    fn rerank<'py>(
        &self,
        py: Python<'py>,
        query: String,
        documents: Vec<String>,
        top_n: Option<usize>,
        instruction: Option<String>,
    ) -> PyResult<Bound<'py, PyList>> {
        let results = py.detach(|| {
            catch_panic(|| {
                self.lock_detached()?.rerank(&query, &documents, top_n, instruction.as_deref()).map_err(model_err)
            })
        })?;
        let list = PyList::empty(py);
        for r in results {
            let d = PyDict::new(py);
            d.set_item("index", r.index)?;
            d.set_item("relevance_score", r.relevance_score)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// How this model makes embeddings, as read from its sentence-transformers files.
    ///
    /// Returns:
    ///     dict: ``pooling``, ``normalize``, ``dimension`` (before truncation), ``prompts``
    ///     (name to text), ``default_prompt_name``, ``max_seq_length``, ``sentence_transformers``
    ///     (whether the directory has such files; without them: last-token pooling, normalised).
    ///
    /// Example:
    ///     >>> rt.embedding_info()["pooling"]
    ///     'lasttoken'
    fn embedding_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| catch_panic(|| self.lock_detached()?.embedding_setup().map_err(model_err)))?;
        let d = PyDict::new(py);
        d.set_item("pooling", s.pooling.name())?;
        d.set_item("normalize", s.normalize)?;
        d.set_item("dimension", s.dimension())?;
        d.set_item("prompts", s.prompts.clone())?;
        d.set_item("default_prompt_name", s.default_prompt_name.clone())?;
        d.set_item("max_seq_length", s.max_seq_length)?;
        d.set_item("sentence_transformers", s.sentence_transformers)?;
        Ok(d)
    }
}

impl PyModelRuntime {
    /// The width of an empty batch's rows.
    fn embedding_width(&self, py: Python<'_>, dimensions: Option<usize>) -> PyResult<usize> {
        let s = py.detach(|| catch_panic(|| self.lock_detached()?.embedding_setup().map_err(model_err)))?;
        Ok(dimensions.unwrap_or(s.dimension()))
    }
}
