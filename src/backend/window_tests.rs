//! Sliding-window layers keep only their window (a ring): the results equal a cache holding every
//! position, and snapshots, forks, truncates and the prefix cache stay exact.
//!
//! The rings are made as small as they go (`set_ring_slack(0)`: window + the step in flight), so
//! they wrap within a few tokens; prompts run in steps whose boundaries fall inside and across
//! windows and past the 64-key blocks of the tiled kernel, and decoding goes far past the window.
//! Models without a window of their own get one through their configuration (a test-only path).

use std::path::PathBuf;

use super::*;
use crate::core::{BackendSession, DecodeInput, ModelLoadingBackend, ModelRuntime, PrefillInput, SnapshotSession};
use session::PrefixCache;

type Rt = ModelRuntime<CandleBackend>;

fn fixtures() -> PathBuf {
    std::env::var_os("CANDLEWICK_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"))
}

fn rel_l2(a: &[f32], r: &[f32]) -> f64 {
    assert_eq!(a.len(), r.len());
    let num: f64 = a.iter().zip(r).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = r.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// A tiny fixture, its windowed layers' window forced to `window` where given (every other
/// layer for a model without windows), with `kv` as its cache type.
fn load(case: &str, window: Option<usize>, kv: Option<KvType>) -> Rt {
    let backend = CandleBackend::new("cpu").unwrap();
    let dir = fixtures().join("tiny").join(case);
    let options = LoadOptions { kv_cache_type: kv, max_context: Some(4096), ..LoadOptions::default() };
    let mut config = backend.load_config(&dir, &options).unwrap();
    if let Some(w) = window {
        let had = config.arch.layers.iter().any(|l| l.sliding_window.is_some());
        for (i, l) in config.arch.layers.iter_mut().enumerate() {
            if l.sliding_window.is_some() || (!had && i % 2 == 0) {
                l.sliding_window = Some(w);
            }
        }
    }
    ModelRuntime::prepare(backend, config).unwrap()
}

/// A windowed runtime whose rings are as small as they go, and the same model on a full cache.
fn pair(case: &str, window: Option<usize>, kv: Option<KvType>) -> (Rt, Rt) {
    let mut ring = load(case, window, kv);
    ring.session_mut().set_ring_slack(0);
    let mut full = load(case, window, kv);
    full.session_mut().use_full_cache();
    (ring, full)
}

/// `n` token ids spread over the vocabulary (the same every run).
fn tokens(rt: &Rt, n: usize, seed: u32) -> Vec<u32> {
    let vocab = rt.session().vocab_size() as u32;
    (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97 + 1)) % vocab).collect()
}

fn prefill(rt: &mut Rt, ids: &[u32]) -> Vec<f32> {
    rt.prefill(PrefillInput::new(ids.to_vec()).all_logits(true)).unwrap().wait().unwrap().logits_f32().unwrap().1
}

fn decode(rt: &mut Rt, ids: &[u32]) -> Vec<f32> {
    rt.decode(DecodeInput::new(ids.to_vec())).unwrap().wait().unwrap().logits_f32().unwrap().1
}

/// The cases: native windows (Gemma 2, Gemma 3, gpt-oss with its sinks on the materialised
/// path) and windows forced on Mistral and Qwen3.
const CASES: [(&str, Option<usize>); 5] =
    [("gemma2", None), ("gemma3", None), ("gpt_oss", None), ("mistral", Some(5)), ("qwen3", Some(7))];

#[test]
fn a_windowed_cache_equals_the_full_cache_across_steps_and_far_past_the_window() {
    for (case, window) in CASES {
        let (mut ring, mut full) = pair(case, window, None);
        let ids = tokens(&ring, 260, 1);
        // Steps of 5, 3, 70, 1, 40 and the rest: boundaries inside a window, across several,
        // and a step longer than the tiled kernel's key blocks.
        let mut at = 0;
        for step in [5, 3, 70, 1, 40, 61] {
            let chunk = &ids[at..at + step];
            let (a, b) = (prefill(&mut ring, chunk), prefill(&mut full, chunk));
            let err = rel_l2(&a, &b);
            assert!(err <= 1e-5, "{case}: prompt step at {at} of {step} tokens: rel L2 {err:.3e}");
            at += step;
        }
        // Decoding one token at a time far past the window, then a draft of 4 checked at once.
        for (i, &t) in ids[at..at + 60].iter().enumerate() {
            let err = rel_l2(&decode(&mut ring, &[t]), &decode(&mut full, &[t]));
            assert!(err <= 1e-5, "{case}: decode step {i}: rel L2 {err:.3e}");
        }
        let draft = &ids[at + 60..at + 64];
        let err = rel_l2(&decode(&mut ring, draft), &decode(&mut full, draft));
        assert!(err <= 1e-5, "{case}: a draft of 4: rel L2 {err:.3e}");
        // The ring holds far less than the full cache.
        assert!(ring.session().cache_bytes() < full.session().cache_bytes(), "{case}: the ring is smaller");
    }
}

#[test]
fn a_long_prompt_in_plain_chunks_equals_the_full_cache() {
    // 1,100 tokens: the session's own 512-token chunks; the ring keeps its default slack.
    let mut ring = load("gemma3", None, None);
    let mut full = load("gemma3", None, None);
    full.session_mut().use_full_cache();
    let ids = tokens(&ring, 1100, 2);
    let err = rel_l2(&prefill(&mut ring, &ids), &prefill(&mut full, &ids));
    assert!(err <= 1e-5, "rel L2 {err:.3e}");
    for &t in &ids[..20] {
        let err = rel_l2(&decode(&mut ring, &[t]), &decode(&mut full, &[t]));
        assert!(err <= 1e-5, "rel L2 {err:.3e}");
    }
    // Gemma 3's tiny config: 3 of 4 layers slide (window 6) and hold 517 positions (window - 1 +
    // the 512-token slack) where a full layer holds the 1,120 tokens (its buffer a little more).
    let (r, f) = (ring.session().cache_bytes(), full.session().cache_bytes());
    assert!(r * 5 < f * 3, "ring {r} bytes, full {f}");
}

#[test]
fn snapshots_forks_and_truncates_of_a_windowed_cache_are_exact() {
    let (mut ring, mut full) = pair("gemma3", None, None);
    let ids = tokens(&ring, 120, 3);
    for chunk in ids[..40].chunks(5) {
        prefill(&mut ring, chunk);
        prefill(&mut full, chunk);
    }
    let snap = ring.session().snapshot().unwrap();
    let fork = ring.fork().unwrap();
    let path = std::env::temp_dir().join(format!("candlewick-window-{}.snap", std::process::id()));
    snap.save(&path).unwrap();
    let from_file = session::SessionSnapshot::load(&path, &candle_core::Device::Cpu).unwrap();
    std::fs::remove_file(&path).ok();
    // A snapshot of a ring holds the window only, not the 40 positions.
    assert!(snap.layers.iter().flatten().any(|h| h.first > 0));

    let continuation = &ids[40..70];
    let want: Vec<Vec<f32>> = continuation.iter().map(|&t| decode(&mut full, &[t])).collect();
    let run = |rt: &mut Rt| -> Vec<Vec<f32>> { continuation.iter().map(|&t| decode(rt, &[t])).collect() };
    let mut restored = load("gemma3", None, None);
    restored.session_mut().set_ring_slack(0);
    restored.session_mut().restore(&from_file).unwrap();
    let mut in_memory = load("gemma3", None, None);
    in_memory.session_mut().restore(&snap).unwrap();
    for (label, got) in [
        ("the original", run(&mut ring)),
        ("a fork", run(&mut fork.fork().unwrap())),
        ("a snapshot through a file", run(&mut restored)),
        ("a snapshot in memory, default slack", run(&mut in_memory)),
    ] {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Keys are read in position order whatever the slots: bit for bit.
            assert_eq!(g, w, "{label}, step {i}");
        }
    }

    // A rewind within what the ring kept is exact; further back it is a typed error that
    // changes nothing; to 0 it starts over.
    let pos = ring.session().position();
    assert_eq!(pos, 70);
    let earliest = ring.session().earliest_truncate();
    assert!(earliest > 0 && earliest < pos, "earliest {earliest}");
    let before = ring.session().tokens().to_vec();
    let err = ring.session_mut().truncate(earliest - 1).unwrap_err();
    assert!(matches!(err, CandleError::WindowRewind { requested, .. } if requested == earliest - 1), "{err}");
    assert!(!ring.session().can_truncate(earliest - 1) && ring.session().can_truncate(0));
    assert_eq!(ring.session().tokens(), before.as_slice());
    let draft = &ids[70..74];
    let a = decode(&mut ring, draft);
    ring.session_mut().truncate(pos).unwrap();
    let b = decode(&mut ring, draft);
    assert_eq!(a, b, "a draft rejected and fed again");
    ring.session_mut().truncate(pos).unwrap();
    full.session_mut().truncate(pos).unwrap();
    assert_eq!(decode(&mut ring, &ids[80..81]), decode(&mut full, &ids[80..81]));
    ring.session_mut().truncate(0).unwrap();
    full.session_mut().truncate(0).unwrap();
    assert_eq!(prefill(&mut ring, &ids[..9]), prefill(&mut full, &ids[..9]));

    // A windowed snapshot cannot fill a cache that holds every position.
    let mut whole = load("gemma3", None, None);
    whole.session_mut().use_full_cache();
    assert!(whole.session_mut().restore(&snap).is_err());
    assert_eq!(whole.session().position(), 0);
}

#[test]
fn the_prefix_cache_restores_a_windowed_prefix_exactly_or_not_at_all() {
    let (mut ring, mut full) = pair("gemma3", None, None);
    let ids = tokens(&ring, 90, 4);
    // The first session prefills 40 tokens in steps of 5: its rings keep the last positions only.
    for chunk in ids[..40].chunks(5) {
        prefill(&mut ring, chunk);
    }
    let mut cache = PrefixCache::new(4, 1 << 30);
    cache.store_from(ring.session()).unwrap();

    // The same 40 tokens then more: the whole 40 come back, and the rest equals a full run.
    let prompt = &ids[..60];
    let mut fresh = ring.fork_empty().unwrap();
    let n = cache.restore_into(fresh.session_mut(), prompt).unwrap();
    assert_eq!(n, 40);
    prefill(&mut full, &ids[..40]);
    let err = rel_l2(&prefill(&mut fresh, &prompt[40..]), &prefill(&mut full, &prompt[40..]));
    assert!(err <= 1e-5, "rel L2 {err:.3e}");

    // A prompt leaving the stored one at token 30: the blocks before lack the windows' keys
    // (the ring had overwritten them), so nothing shorter is restored than what can continue.
    let mut other = ids[..30].to_vec();
    other.extend(tokens(&ring, 20, 9));
    let mut fresh = ring.fork_empty().unwrap();
    let n = cache.restore_into(fresh.session_mut(), &other).unwrap();
    assert_eq!(n, 0, "no block boundary before 30 has the windows' keys");
    full.session_mut().reset();
    let err = rel_l2(&prefill(&mut fresh, &other), &prefill(&mut full, &other));
    assert!(err <= 1e-5, "rel L2 {err:.3e}");

    // Once a session that holds those positions stores them, the shorter prefix is served too.
    let mut whole = load("gemma3", None, None);
    prefill(&mut whole, &ids[..40]);
    cache.store_from(whole.session()).unwrap();
    let mut fresh = ring.fork_empty().unwrap();
    let n = cache.restore_into(fresh.session_mut(), &other).unwrap();
    assert_eq!(n, 28);
    full.session_mut().truncate(28).unwrap();
    let err = rel_l2(&prefill(&mut fresh, &other[28..]), &prefill(&mut full, &other[28..]));
    assert!(err <= 1e-5, "rel L2 {err:.3e}");
}

#[test]
fn a_q8_0_cache_reads_as_its_rings_and_snapshots_say() {
    // q8_0 on a windowed model: the ring equals q8_0 on a full cache, snapshots keep the type.
    let (mut ring, mut full) = pair("gemma3", None, Some(KvType::Q8_0));
    let ids = tokens(&ring, 100, 5);
    for chunk in ids[..50].chunks(7) {
        let err = rel_l2(&prefill(&mut ring, chunk), &prefill(&mut full, chunk));
        assert!(err <= 1e-5, "rel L2 {err:.3e}");
    }
    for &t in &ids[50..80] {
        let err = rel_l2(&decode(&mut ring, &[t]), &decode(&mut full, &[t]));
        assert!(err <= 1e-5, "rel L2 {err:.3e}");
    }
    let snap = ring.session().snapshot().unwrap();
    assert_eq!(snap.kv_cache_type, KvType::Q8_0);
    let mut dense = load("gemma3", None, None);
    assert!(dense.session_mut().restore(&snap).is_err(), "a q8_0 snapshot on a float32 cache");
    // A head width q8_0 blocks do not tile is refused at load, naming the type.
    let backend = CandleBackend::new("cpu").unwrap();
    let dir = fixtures().join("tiny").join("llama");
    let options = LoadOptions { kv_cache_type: Some(KvType::Q8_0), ..LoadOptions::default() };
    let err = ModelRuntime::load(backend, &dir, &options).unwrap_err().to_string();
    assert!(err.contains("q8_0") && err.contains("16"), "{err}");
    assert!(parse_kv_cache_type("q4_0").unwrap_err().to_string().contains("f16"));
}
