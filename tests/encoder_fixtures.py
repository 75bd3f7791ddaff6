"""Seeded random BERT-family encoders and cross-encoders, written with numpy (no torch) in the
layout their real counterparts ship (DESIGN §17):

- `bert-embed/`: all-MiniLM-L6-v2's: a bare `BertModel` (`embeddings.*`, `encoder.layer.*`,
  `pooler.*`), a WordPiece tokenizer (lower-casing, `[CLS] … [SEP]`), sentence-transformers files
  with mean pooling and Normalize, `query` / `passage` prompts and a short `max_seq_length`.
- `xlmr-embed/`: bge-m3's: a bare `XLMRobertaModel` (positions after the padding index, one
  token type), `<s> … </s>`, CLS pooling and Normalize.
- `bert-rerank/`: a `BertForSequenceClassification` cross-encoder (`bert.` names, pooler,
  `classifier`, one label): `[CLS] q [SEP] d [SEP]` with token types 0 then 1.
- `xlmr-rerank/`: bge-reranker-base's: `XLMRobertaForSequenceClassification` (`roberta.` names,
  `classifier.dense` / `classifier.out_proj`, no pooler, one label): `<s> q </s></s> d </s>`.

- `modernbert-embed/`: modernbert-embed-base's / gte-modernbert's: a bare `ModernBertModel`
  (`embeddings.tok_embeddings`, `layers.*.attn.Wqkv`, `mlp.Wi`, `final_norm`; no biases; layers
  0 and 3 global, 1 and 2 in a window of 8 tokens, each kind with its rotary base), a byte-level
  BPE tokenizer with `[CLS] … [SEP]` as ModernBERT's, mean pooling, Normalize and
  `search_query: ` / `search_document: ` prompts.
- `modernbert-rerank/`: gte-reranker-modernbert's: `ModernBertForSequenceClassification`
  (`model.` names, `head.dense` + GELU + `head.norm` on the mean, `classifier`, one label).
- `nomic-embed/`: nomic-embed-text-v1.5's: a bare `NomicBertModel` (remote code in the real
  one: `embeddings.*`, `emb_ln`, `encoder.layers.*.attn.Wqkv`, `mlp.fc11/fc12/fc2`, `norm1/2`;
  no biases, rotary base 1000), BERT's WordPiece tokenizer, mean pooling and Normalize.

`materialise(root)` writes them (deterministic: numpy's PCG64 with fixed seeds; the tokenizer is
built with the `tokenizers` library). The references in tests/data/encoders/ were computed from
these directories by sentence-transformers: `/work/bench/venv-ref/bin/python
tests/encoder_reference.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

import embedding_fixtures as efx

# The decoder fixtures' texts, and one with capitals, punctuation and a word the vocabulary
# lacks (lower-cased, split at punctuation, `[UNK]`).
TEXTS = efx.TEXTS + ["Hello, World! the zyzzyva sleeps"]
QUERY = efx.QUERY
DOCUMENTS = efx.DOCUMENTS
PROMPTS = {"query": "query: ", "passage": "passage: "}
# A text longer than the encoders' 64 positions: pairs with it are cut longest-first.
LONG = " ".join(["the capital of france is paris"] * 12)
LONG_PAIRS = [(QUERY, LONG), (LONG, "a dog runs"), (LONG, LONG)]
MAX_SEQ_LENGTH = 16
# Words the vocabulary holds only as pieces, so WordPiece splits them (`capital` → `cap ##ital`).
SPLIT = {"capital": ("cap", "##ital"), "bananas": ("banana", "##s"), "largest": ("large", "##st")}
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


def _pieces() -> list[str]:
    corpus = " ".join(TEXTS + [QUERY] + DOCUMENTS + list(PROMPTS.values())).lower()
    words = sorted(set(re.findall(r"\w+|[^\w\s]", corpus)) - {"zyzzyva"})
    out = []
    for w in words:
        out.extend(SPLIT.get(w, (w,)))
    return sorted(set(out))


def tokenizer_json(kind: str) -> str:
    """The tokenizer.json of `kind` (`bert` or `xlmr`), built with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    specials = BERT_SPECIALS if kind == "bert" else XLMR_SPECIALS
    vocab = {s: i for i, s in enumerate(specials)}
    for p in _pieces():
        vocab[p] = len(vocab)
    unk = "[UNK]" if kind == "bert" else "<unk>"
    tok = Tokenizer(WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    if kind == "bert":
        cls, sep = "[CLS]", "[SEP]"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A:0 {sep}:0",
            pair=f"{cls} $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
        )
    else:
        # RoBERTa's layout; every token type 0 (XLM-RoBERTa has one type).
        bos, eos = "<s>", "</s>"
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0 {eos}:0",
            pair=f"{bos} $A:0 {eos}:0 {eos}:0 $B:0 {eos}:0",
            special_tokens=[(bos, vocab[bos]), (eos, vocab[eos])],
        )
    tok.add_special_tokens(specials)
    return tok.to_str(pretty=True)


def vocab_size(kind: str) -> int:
    return len(BERT_SPECIALS if kind == "bert" else XLMR_SPECIALS) + len(_pieces())


def _config(kind: str, classify: bool) -> dict:
    common = {
        "attention_probs_dropout_prob": 0.0,
        "hidden_dropout_prob": 0.0,
        "classifier_dropout": None,
        "hidden_act": "gelu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "position_embedding_type": "absolute",
        "vocab_size": vocab_size(kind),
        "dtype": "float32",
        "use_cache": False,
    }
    if classify:
        common |= {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    if kind == "bert":
        return common | {
            "architectures": ["BertForSequenceClassification" if classify else "BertModel"],
            "model_type": "bert",
            "layer_norm_eps": 1e-12,
            "max_position_embeddings": 64,
            "type_vocab_size": 2,
            "pad_token_id": 0,
        }
    return common | {
        "architectures": ["XLMRobertaForSequenceClassification" if classify else "XLMRobertaModel"],
        "model_type": "xlm-roberta",
        "layer_norm_eps": 1e-05,
        # 64 positions after the padding index (1) and the one before it.
        "max_position_embeddings": 66,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
    }


def _weights(cfg: dict, seed: int, prefix: str, head: str | None) -> dict:
    """`head`: None (a bare model with BERT's pooler), `bert` (pooler + classifier) or `roberta`
    (`classifier.dense` + `classifier.out_proj`, no pooler)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]

    def w(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ln(stem: str, t: dict) -> None:
        t[f"{stem}.weight"] = (1.0 + rng.standard_normal(h) * 0.1).astype(np.float32)
        t[f"{stem}.bias"] = w(h, scale=0.1)

    def linear(stem: str, out: int, inp: int, t: dict) -> None:
        t[f"{stem}.weight"] = w(out, inp)
        t[f"{stem}.bias"] = w(out, scale=0.05)

    t: dict = {}
    e = f"{prefix}embeddings"
    t[f"{e}.word_embeddings.weight"] = w(cfg["vocab_size"], h, scale=0.5)
    t[f"{e}.position_embeddings.weight"] = w(cfg["max_position_embeddings"], h, scale=0.3)
    t[f"{e}.token_type_embeddings.weight"] = w(cfg["type_vocab_size"], h, scale=0.3)
    ln(f"{e}.LayerNorm", t)
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}encoder.layer.{i}"
        for part in ("query", "key", "value"):
            linear(f"{p}.attention.self.{part}", h, h, t)
        linear(f"{p}.attention.output.dense", h, h, t)
        ln(f"{p}.attention.output.LayerNorm", t)
        linear(f"{p}.intermediate.dense", inter, h, t)
        linear(f"{p}.output.dense", h, inter, t)
        ln(f"{p}.output.LayerNorm", t)
    if head in (None, "bert"):
        linear(f"{prefix}pooler.dense", h, h, t)
    if head == "bert":
        t["classifier.weight"] = w(1, h, scale=0.5)
        t["classifier.bias"] = w(1, scale=0.1)
    elif head == "roberta":
        linear("classifier.dense", h, h, t)
        t["classifier.out_proj.weight"] = w(1, h, scale=0.5)
        t["classifier.out_proj.bias"] = w(1, scale=0.1)
    return t


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _tokenizer_files(dest: Path, kind: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(tokenizer_json(kind) + "\n")
    if kind == "bert":
        # BERT's tokenizer returns token types (sentence A 0, B 1), which a cross-encoder reads.
        cfg = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
               "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}
    else:
        # XLM-RoBERTa's tokenizer returns no token types.
        cfg = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "pad_token": "<pad>",
               "unk_token": "<unk>", "model_input_names": ["input_ids", "attention_mask"]}
    _write_json(dest / "tokenizer_config.json",
                cfg | {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "do_lower_case": True})


def _sentence_transformers(dest: Path, pooling: str, prompts: dict | None, max_seq_length: int, width: int = 32) -> None:
    _write_json(
        dest / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write_json(dest / "1_Pooling" / "config.json", efx._pooling(pooling, width))
    (dest / "2_Normalize").mkdir(exist_ok=True)
    st = {"similarity_fn_name": "cosine", "default_prompt_name": None}
    if prompts:
        st["prompts"] = prompts
    _write_json(dest / "config_sentence_transformers.json", st)
    _write_json(dest / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})


def materialise(root: Path) -> dict[str, Path]:
    """Writes the four checkpoints under `root` (skipping what is there); returns their paths."""
    from safetensors.numpy import save_file

    root = Path(root)
    specs = {
        # name: (kind, seed, weight prefix, head, sentence-transformers pooling)
        "bert-embed": ("bert", 4301, "", None, "mean"),
        "xlmr-embed": ("xlmr", 4302, "", None, "cls"),
        "bert-rerank": ("bert", 4303, "bert.", "bert", None),
        "xlmr-rerank": ("xlmr", 4304, "roberta.", "roberta", None),
    }
    out = {}
    for name, (kind, seed, prefix, head, pooling) in specs.items():
        dest = root / name
        out[name] = dest
        if (dest / "model.safetensors").is_file():
            continue
        cfg = _config(kind, head is not None)
        _write_json(dest / "config.json", cfg)
        save_file(_weights(cfg, seed, prefix, head), str(dest / "model.safetensors"))
        _tokenizer_files(dest, kind)
        if pooling == "mean":
            _sentence_transformers(dest, pooling, PROMPTS, MAX_SEQ_LENGTH)
        elif pooling:
            _sentence_transformers(dest, pooling, None, 64)
    for name, write in (("modernbert-embed", _modernbert_embed), ("modernbert-rerank", _modernbert_rerank),
                        ("nomic-embed", _nomic_embed)):
        dest = root / name
        out[name] = dest
        if not (dest / "model.safetensors").is_file():
            write(dest)
    return out


# ModernBERT, nomic-bert ---------------------------------------------------------------------

# What modernbert-embed and nomic-embed-text declare.
NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}
# Longer than ModernBERT's window (8 tokens: 4 either side), so its sliding layers mask.
MODERNBERT_LOCAL = 8
MODERNBERT_SPECIALS = ["|||IP_ADDRESS|||", "<|padding|>", "[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# Words the BPE vocabulary leaves in pieces (merged only up to these prefixes), and one it lacks
# entirely beyond single bytes.
BPE_PARTIAL = {"capital": "cap", "largest": "large", "bananas": "banan"}
BPE_ABSENT = {"zyzzyva"}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what the ByteLevel pre-tokenizer writes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def modernbert_tokenizer_json() -> str:
    """A byte-level BPE tokenizer in ModernBERT's layout (OLMo's pre-tokenizer, `[CLS] $A [SEP]`,
    pairs `[CLS] A [SEP] B [SEP]`, no token types), its vocabulary and merges built by hand so no
    trainer's tie-breaking decides them: every byte, then each corpus word merged left to right
    (some only partly, one not at all)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    b2u = _bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(MODERNBERT_SPECIALS)}
    for b in range(256):
        vocab.setdefault(b2u[b], len(vocab))
    merges: list[tuple[str, str]] = []
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    corpus = TEXTS + [QUERY, LONG] + DOCUMENTS + list(NOMIC_PROMPTS.values())
    words = sorted({w for text in corpus for w, _ in pre.pre_tokenize_str(text)})
    for word in words:
        bare = word.lstrip("Ġ")
        if bare in BPE_ABSENT:
            continue
        stop = len(word) - len(bare) + len(BPE_PARTIAL[bare]) if bare in BPE_PARTIAL else len(word)
        piece = word[0]
        for ch in word[1:stop]:
            merged = piece + ch
            if merged not in vocab:
                merges.append((piece, ch))
                vocab[merged] = len(vocab)
            piece = merged
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    cls, sep = "[CLS]", "[SEP]"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:0 {sep}:0",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    tok.add_special_tokens(MODERNBERT_SPECIALS)
    return tok.to_str(pretty=True)


def _modernbert_config(vocab: int, classify: bool) -> dict:
    ids = {s: i for i, s in enumerate(MODERNBERT_SPECIALS)}
    cfg = {
        "architectures": ["ModernBertForSequenceClassification" if classify else "ModernBertModel"],
        "model_type": "modernbert",
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_activation": "gelu",
        "max_position_embeddings": 128,
        "norm_eps": 1e-05,
        "norm_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        # The Hub's keys (transformers 5 reads them into layer_types and rope_parameters); the
        # bases are not the released ones (160k / 10k) so that a swap of the two shows.
        "global_attn_every_n_layers": 3,
        "local_attention": MODERNBERT_LOCAL,
        "global_rope_theta": 10000.0,
        "local_rope_theta": 500.0,
        "classifier_pooling": "mean",
        "classifier_activation": "gelu",
        "classifier_bias": False,
        "classifier_dropout": 0.0,
        "attention_dropout": 0.0,
        "embedding_dropout": 0.0,
        "mlp_dropout": 0.0,
        "initializer_range": 0.02,
        "pad_token_id": ids["[PAD]"],
        "bos_token_id": ids["[CLS]"],
        "eos_token_id": ids["[SEP]"],
        "cls_token_id": ids["[CLS]"],
        "sep_token_id": ids["[SEP]"],
        "dtype": "float32",
    }
    if classify:
        cfg |= {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return cfg


def _modernbert_weights(cfg: dict, seed: int, prefix: str, classify: bool) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]

    def w(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ln(stem: str, t: dict) -> None:
        t[f"{stem}.weight"] = (1.0 + rng.standard_normal(h) * 0.1).astype(np.float32)

    t: dict = {}
    t[f"{prefix}embeddings.tok_embeddings.weight"] = w(cfg["vocab_size"], h, scale=0.5)
    ln(f"{prefix}embeddings.norm", t)
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}"
        if i > 0:
            ln(f"{p}.attn_norm", t)
        t[f"{p}.attn.Wqkv.weight"] = w(3 * h, h, scale=0.3)
        t[f"{p}.attn.Wo.weight"] = w(h, h)
        ln(f"{p}.mlp_norm", t)
        t[f"{p}.mlp.Wi.weight"] = w(2 * inter, h, scale=0.25)
        t[f"{p}.mlp.Wo.weight"] = w(h, inter)
    ln(f"{prefix}final_norm", t)
    if classify:
        t["head.dense.weight"] = w(h, h, scale=0.3)
        ln("head.norm", t)
        t["classifier.weight"] = w(1, h, scale=0.5)
        t["classifier.bias"] = w(1, scale=0.1)
    return t


def _modernbert_tokenizer_files(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(modernbert_tokenizer_json() + "\n")
    _write_json(dest / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 128,
        "clean_up_tokenization_spaces": True, "model_input_names": ["input_ids", "attention_mask"],
    })


def _modernbert_vocab() -> int:
    # The embedding table has a few rows past the tokenizer's, as the released ones do (50368).
    return len(json.loads(modernbert_tokenizer_json())["model"]["vocab"]) + 3


def _modernbert_embed(dest: Path) -> None:
    from safetensors.numpy import save_file

    cfg = _modernbert_config(_modernbert_vocab(), classify=False)
    _write_json(dest / "config.json", cfg)
    save_file(_modernbert_weights(cfg, 4305, "", classify=False), str(dest / "model.safetensors"))
    _modernbert_tokenizer_files(dest)
    _sentence_transformers(dest, "mean", NOMIC_PROMPTS, 128)


def _modernbert_rerank(dest: Path) -> None:
    from safetensors.numpy import save_file

    cfg = _modernbert_config(_modernbert_vocab(), classify=True)
    _write_json(dest / "config.json", cfg)
    save_file(_modernbert_weights(cfg, 4306, "model.", classify=True), str(dest / "model.safetensors"))
    _modernbert_tokenizer_files(dest)


def _nomic_config() -> dict:
    # nomic-embed-text-v1.5's config.json, shrunk; n_positions / max_trained_positions as the
    # released one's (llama.cpp's converter accepts only the released pairs).
    return {
        "architectures": ["NomicBertModel"],
        "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                     "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
        "model_type": "nomic_bert",
        "activation_function": "swiglu",
        "bos_token_id": None,
        "eos_token_id": None,
        "causal": False,
        "dense_seq_output": True,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "summary_first_dropout": 0.0,
        "fused_bias_fc": True,
        "fused_dropout_add_ln": True,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-12,
        "max_trained_positions": 2048,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
        "n_embd": 32,
        "n_head": 4,
        "n_inner": 48,
        "n_layer": 2,
        "n_positions": 8192,
        "pad_vocab_size_multiple": 1,
        "parallel_block": False,
        "parallel_block_tied_norm": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "reorder_and_upcast_attn": False,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "rotary_scaling_factor": None,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "type_vocab_size": 2,
        "use_flash_attn": False,
        "use_rms_norm": False,
        "use_xentropy": True,
        "vocab_size": vocab_size("bert"),
        # transformers ≥ 5.2's own `nomic_bert` reads these (BERT's names; it renames the released
        # tensors, `Wqkv` split, as it loads) and not the GPT-2-style keys above, whose defaults
        # are the released model's sizes: the tiny directory has both, so that sentence-transformers
        # and llama.cpp's converter read the same model from it.
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 48,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "layer_norm_eps": 1e-12,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "pad_token_id": 0,
    }


def _nomic_weights(cfg: dict, seed: int) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter = cfg["n_embd"], cfg["n_inner"]

    def w(*shape, scale=0.15):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def ln(stem: str, t: dict) -> None:
        t[f"{stem}.weight"] = (1.0 + rng.standard_normal(h) * 0.1).astype(np.float32)
        t[f"{stem}.bias"] = w(h, scale=0.1)

    t: dict = {}
    t["embeddings.word_embeddings.weight"] = w(cfg["vocab_size"], h, scale=0.5)
    t["embeddings.token_type_embeddings.weight"] = w(cfg["type_vocab_size"], h, scale=0.3)
    ln("emb_ln", t)
    for i in range(cfg["n_layer"]):
        p = f"encoder.layers.{i}"
        t[f"{p}.attn.Wqkv.weight"] = w(3 * h, h, scale=0.3)
        t[f"{p}.attn.out_proj.weight"] = w(h, h)
        ln(f"{p}.norm1", t)
        t[f"{p}.mlp.fc11.weight"] = w(inter, h, scale=0.25)
        t[f"{p}.mlp.fc12.weight"] = w(inter, h, scale=0.25)
        t[f"{p}.mlp.fc2.weight"] = w(h, inter)
        ln(f"{p}.norm2", t)
    return t


def _nomic_embed(dest: Path) -> None:
    from safetensors.numpy import save_file

    cfg = _nomic_config()
    _write_json(dest / "config.json", cfg)
    save_file(_nomic_weights(cfg, 4307), str(dest / "model.safetensors"))
    _tokenizer_files(dest, "bert")
    _sentence_transformers(dest, "mean", NOMIC_PROMPTS, 64)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for k, v in materialise(Path(sys.argv[1])).items():
        print(k, v)
