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


def _sentence_transformers(dest: Path, pooling: str, prompts: dict | None, max_seq_length: int) -> None:
    _write_json(
        dest / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write_json(dest / "1_Pooling" / "config.json", efx._pooling(pooling, 32))
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
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for k, v in materialise(Path(sys.argv[1])).items():
        print(k, v)
