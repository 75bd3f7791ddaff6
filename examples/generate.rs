//! Loads a model (a GGUF file or a Hugging Face directory), generates text and reads one
//! observation point, from Rust alone.
//!
//!     cargo run --release --example generate -- PATH "The capital of France is"

use std::path::PathBuf;

use candlewick::core::{ObservationRequest, ObservationSelector, ObservationValue, PrefillInput};
use candlewick::generation::{GenerateOptions, SamplingParams};
use candlewick::model::{Model, ModelOptions, Prompt};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: generate PATH [PROMPT]")?);
    let prompt = args.next().unwrap_or_else(|| "The capital of France is".into());

    let mut model = Model::load(&path, &ModelOptions { device: "cpu".into(), ..ModelOptions::default() })?;
    let info = model.info();
    println!(
        "{} with {} layers, {} parameters ({:?})",
        info.architecture,
        info.num_layers,
        info.parameters,
        info.weight_shares()
    );

    let options = GenerateOptions { max_tokens: 32, sampling: SamplingParams::greedy(), ..model.defaults().clone() };
    let result = model.generate(&Prompt::Text(prompt.clone()), options)?;
    println!("{prompt}{}", result.text);
    println!(
        "[{} tokens, {:.1} tok/s decode]",
        result.usage.completion_tokens,
        result.usage.decode_tokens_per_second()
    );

    // The residual stream leaving the middle layer, on a fresh context (the session is untouched).
    let ids = model.prompt_ids(&Prompt::Text(prompt))?;
    let point = format!("model.layers.{}.output", model.info().num_layers / 2);
    let request = ObservationRequest::select([ObservationSelector::exact(point.clone())])?;
    let traced = model.runtime().trace(PrefillInput::new(ids), &request)?;
    if let Some(ObservationValue::Tensor { shape, data }) = traced.observations.get(&point) {
        let norm = data.iter().map(|x| x * x).sum::<f32>().sqrt();
        println!("{point}: shape {shape:?}, norm {norm:.2}");
    }
    Ok(())
}
