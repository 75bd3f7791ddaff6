//! The candle backend against transformers' reference outputs for the tiny checkpoints.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

use super::*;
use crate::core::{DecodeInput, ModelRuntime, ObservationRequest, ObservationValue, PrefillInput};

const CASES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];

fn fixtures() -> PathBuf {
    std::env::var_os("CANDLEWICK_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"))
}

fn reference(case: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixtures().join("tiny").join(case).join("reference.safetensors"), &Device::Cpu)
        .unwrap()
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect()
}

fn rel_l2(a: &[f32], r: &[f32]) -> f64 {
    assert_eq!(a.len(), r.len());
    let num: f64 = a.iter().zip(r).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = r.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn load(case: &str, options: LoadOptions) -> ModelRuntime<CandleBackend> {
    let dir = fixtures().join("tiny").join(case);
    ModelRuntime::load(CandleBackend::new("cpu").unwrap(), &dir, &options).unwrap()
}

#[test]
fn prompt_logits_and_every_observation_match_transformers() {
    for case in CASES {
        let mut r = reference(case);
        // The points interventions added are in the interventions reference, of the same prompt.
        let edits = fixtures().join("tiny").join(case).join("interventions.safetensors");
        let extra = candle_core::safetensors::load(edits, &Device::Cpu).unwrap();
        r.extend(extra.into_iter().filter(|(k, _)| k.ends_with("attention.heads") || k.ends_with("mlp.hidden")));
        let mut rt = load(case, LoadOptions::default());
        let prompt = ids(&r["input_ids"]);
        let out = rt.inspect_prefill(PrefillInput::new(prompt).all_logits(true), &ObservationRequest::all()).unwrap();
        for (path, value) in out.observations.iter() {
            let ObservationValue::Tensor { shape, data } = value else { panic!("{path} not a tensor") };
            let want = &r[path];
            assert_eq!(shape.as_slice(), want.dims(), "{case} {path} shape");
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let err = rel_l2(data, &want);
            assert!(err <= 1e-4, "{case} {path}: relative L2 {err:.3e}");
        }
        let reference_points = r.keys().filter(|k| k.starts_with("model.")).count();
        assert_eq!(out.observations.len(), reference_points, "{case}: every point observed");
    }
}

#[test]
fn prefill_then_decode_reproduces_the_greedy_sequence() {
    for case in CASES {
        let r = reference(case);
        let mut rt = load(case, LoadOptions::default());
        let prompt = ids(&r["input_ids"]);
        let greedy = ids(&r["greedy_ids"]);
        let seq = r["sequence_logits"].clone();
        let t = prompt.len();
        let out = rt.prefill(PrefillInput::new(prompt)).unwrap().wait().unwrap();
        let mut logits = vec![out.logits_f32().unwrap().1];
        for &g in &greedy[..greedy.len() - 1] {
            let out = rt.decode(DecodeInput::new(vec![g])).unwrap().wait().unwrap();
            logits.push(out.logits_f32().unwrap().1);
        }
        for (k, row) in logits.iter().enumerate() {
            let want = seq.get(t - 1 + k).unwrap().to_vec1::<f32>().unwrap();
            let err = rel_l2(row, &want);
            assert!(err <= 1e-4, "{case} row {}: relative L2 {err:.3e}", t - 1 + k);
            let argmax = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
            assert_eq!(argmax, greedy[k], "{case}: greedy token {k}");
        }
    }
}

#[test]
fn a_batched_step_equals_each_session_stepped_alone() {
    use crate::core::{BackendSession, EditOp, Intervention};
    for case in CASES {
        let r = reference(case);
        let prompt = ids(&r["input_ids"]);
        let mut base = load(case, LoadOptions::default());
        base.prefill(PrefillInput::new(prompt.clone())).unwrap();
        // Three sessions at different positions, one of them with an edit of its own.
        let mut batch: Vec<ModelRuntime<CandleBackend>> = (0..3).map(|_| base.fork().unwrap()).collect();
        for (k, rt) in batch.iter_mut().enumerate() {
            rt.session_mut().truncate(prompt.len() - 4 * k).unwrap();
        }
        let mut alone: Vec<ModelRuntime<CandleBackend>> = batch.iter().map(|rt| rt.fork().unwrap()).collect();
        let edit = vec![Intervention {
            point: "model.layers.0.output".into(),
            op: EditOp::Add { vector: vec![0.5; 64], scale: 1.0 },
            positions: None,
        }];
        let input = |k: usize| {
            let i = DecodeInput::new(vec![prompt[k + 1], prompt[k + 2]]);
            if k == 1 {
                i.with_interventions(edit.clone())
            } else {
                i
            }
        };
        let mut refs: Vec<&mut ModelRuntime<CandleBackend>> = batch.iter_mut().collect();
        let outs = ModelRuntime::decode_batch(&mut refs, (0..3).map(input).collect()).unwrap();
        for (k, out) in outs.into_iter().enumerate() {
            let got = out.wait().unwrap().logits_f32().unwrap();
            let want = alone[k].decode(input(k)).unwrap().wait().unwrap().logits_f32().unwrap();
            assert_eq!(got.0, want.0, "{case} session {k} shape");
            let err = rel_l2(&got.1, &want.1);
            assert!(err <= 1e-5, "{case} session {k}: relative L2 {err:.3e}");
            assert_eq!(batch[k].session().tokens(), alone[k].session().tokens());
        }
    }
}
