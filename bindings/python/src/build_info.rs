//! What this build is and which kernels it picks on this machine.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::invalid_option;
use candlewick::backend::config::encoder::EncoderFamily;
use candlewick::backend::config::Architecture;
use candlewick::backend::device;
use candlewick::backend::kernels::{self, int8_gemm};

/// How this build was made and what it runs on this machine, as a dict: a wheel built for
/// another CPU, or without CUDA, otherwise shows only as a slower or refused run.
///
/// Returns:
///     dict: ``version``; ``features`` (``"cuda"``, ``"metal"``: the devices compiled in; every
///     macOS build has ``"metal"``);
///     ``cpu_target_features`` (the SIMD features the compiler could assume, e.g. no
///     ``avx512f`` in the portable x86-64-v3 wheel); ``int8_kernel`` (the inner product our
///     quantized GEMM chose on this CPU at run time: ``"avx512vnni"``, ``"avx2"``, ``"neon-i8mm"``,
///     ``"neon-dotprod"``, ``"neon"`` or ``"portable"``); ``interleaved_tiles`` (whether this CPU
///     repacks block weights at load into 16-row tiles of their own size: AVX-512 VNNI or AVX2 on
///     x86, ``sdot`` on Arm); ``tiled_types`` (the ggml types it repacks, by llama.cpp's name:
///     every block type on AVX-512 VNNI and on AVX2 (the grid i-quants and ternary types IQ1_S …
///     IQ3_S, TQ1_0, TQ2_0 included), all but IQ4_NL/IQ4_XS/MXFP4 on Arm; elsewhere weights stay
///     in ggml's layout, and the types candle lacks are re-encoded as Q8_0); ``devices``
///     (``"cpu:0"``, ``"cuda:0"`` ...: what this build sees here).
///
/// Example:
///     >>> candlewick.build_info()["devices"]
///     ['cpu:0']
#[pyfunction]
pub fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    let features: Vec<&str> = [(device::CUDA_BUILT, "cuda"), (device::METAL_BUILT, "metal")]
        .into_iter()
        .filter(|f| f.0)
        .map(|f| f.1)
        .collect();
    d.set_item("features", features)?;
    d.set_item("cpu_target_features", kernels::compiled_cpu_features())?;
    d.set_item("int8_kernel", int8_gemm::best_path().name())?;
    d.set_item("interleaved_tiles", kernels::interleaved::available())?;
    let tiled: Vec<&str> =
        kernels::interleaved::Format::ALL.into_iter().filter(|f| f.runs_fast()).map(|f| f.name()).collect();
    d.set_item("tiled_types", tiled)?;
    let devices: Vec<String> =
        device::available_devices().into_iter().map(|(d, _)| format!("{}:{}", d.kind, d.ordinal)).collect();
    d.set_item("devices", devices)?;
    Ok(d)
}

/// The architectures this build loads, by the name ``model_info["architecture"]`` gives them.
///
/// Args:
///     format (str | None): ``"hf"`` for Hugging Face directories (every architecture),
///         ``"gguf"`` for the subset whose GGUF files (llama.cpp's ``general.architecture``) load;
///         ``None`` (the default) for all of them. Decoders first, then the BERT-family
///         encoders (``"bert"``, ``"roberta"``, ``"xlm-roberta"``: ``embed``, and ``rerank`` with
///         a classification head; of them ``"bert"`` loads from GGUF too, to embed).
///
///     images (bool): only the vision-language families that take images (``images=`` on
///         ``generate``, ``chat`` and the step API; docs/vision.md), by their config.json
///         ``model_type``: ``"gemma3"`` (``Gemma3ForConditionalGeneration``) and ``"llava"``
///         (``LlavaForConditionalGeneration``, whose language model is listed by its own name);
///         with ``"gguf"``, those that load as a GGUF plus an mmproj file.
///
/// Returns:
///     list[str]: names such as ``"llama"``, ``"gemma2"``, ``"gpt_neox"``, in the order they were added.
///
/// Raises:
///     InvalidOptionError: ``format`` is neither ``"hf"``, ``"gguf"`` nor ``None``.
///
/// Example:
///     >>> "gemma3" in candlewick.supported_architectures("gguf")
///     True
#[pyfunction]
#[pyo3(signature = (format = None, images = false))]
pub fn supported_architectures(py: Python<'_>, format: Option<&str>, images: bool) -> PyResult<Vec<&'static str>> {
    let gguf_only = match format {
        None | Some("hf") => false,
        Some("gguf") => true,
        Some(other) => {
            return Err(invalid_option(py, format!("format must be \"hf\", \"gguf\" or None, not {other:?}")))
        }
    };
    if images {
        use candlewick::backend::config::vision::VisionFamily;
        // Every family loads from a GGUF language model plus its mmproj file too
        // (`config::vision::from_mmproj`). A family lists every `model_type` it loads.
        return Ok(VisionFamily::ALL.into_iter().flat_map(|f| f.model_types().iter().copied()).collect());
    }
    let decoders =
        Architecture::ALL.into_iter().filter(|a| !gguf_only || a.gguf_name().is_some()).map(Architecture::name);
    // BERT-family encoders (embeddings, cross-encoder reranking); of their GGUF files, those
    // llama.cpp's converter writes under an architecture of their own (bert, modern-bert,
    // nomic-bert), listed by their config.json names.
    let encoders =
        EncoderFamily::ALL.into_iter().filter(|f| !gguf_only || f.gguf_name().is_some()).map(EncoderFamily::name);
    Ok(decoders.chain(encoders).collect())
}
