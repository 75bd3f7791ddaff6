"""Seeded random embedding and reranking checkpoints, written with numpy (no torch), in the
layout their real counterparts ship (DESIGN §17):

- `qwen3-embed/`: Qwen3-Embedding's: a bare Qwen3 model (`embed_tokens.weight`, no `model.`
  prefix, no `lm_head`), sentence-transformers files with last-token pooling and Normalize,
  `query` / `document` prompts, a tokenizer that appends `<|endoftext|>`.
- `gemma-embed/`: EmbeddingGemma's: a bare Gemma 3 text model with
  `use_bidirectional_attention` and sliding layers, mean pooling, two Dense layers (Identity
  without bias, then Tanh with bias), Normalize, EmbeddingGemma's prompts, `<bos> … <eos>`.
- `embeddinggemma/`: `gemma-embed/` with EmbeddingGemma's own Dense layers (64 → 96 → 64,
  Identity, no bias), the shape llama.cpp's `gemma-embedding` GGUF takes (its `dense_2` /
  `dense_3`: weights only, back to the hidden width), every layer sliding and the embedding
  table cut to the tokenizer's size (as the converter and llama.cpp take them).
- `qwen3-rerank/`: Qwen3-Reranker's: a Qwen3 causal LM (with `model.` names and an untied
  `lm_head`) whose vocabulary has `yes` and `no`.

`materialise(root)` writes them (deterministic: numpy's PCG64 with fixed seeds). The references
in tests/data/embeddings/ were computed from these directories by sentence-transformers and
transformers: `/work/bench/venv-ref/bin/python tests/embedding_reference.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Texts the tests embed: short and long, so batches mix lengths and the sliding window (5 keys
# each way once halved) cuts.
TEXTS = [
    "the cat sat on the mat",
    "a dog runs",
    "paris is the capital of france and the largest city of the country by far",
    "bananas are yellow",
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat in the sun",
    "water",
]
QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital of france",
    "bananas are yellow",
    "the capital of germany is berlin",
    "a dog runs in the park",
]
QWEN_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
    "document": "",
}
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
VOCAB = 160
MAX_SEQ_LENGTH = 24


def _words() -> list[str]:
    """Every piece the Whitespace pre-tokenizer makes of the texts, prompts and templates."""
    import re

    corpus = " ".join(
        TEXTS
        + [QUERY, RERANK_PREFIX, RERANK_SUFFIX, RERANK_INSTRUCTION, "<Instruct>: <Query>: <Document>: yes no"]
        + DOCUMENTS
        + list(QWEN_PROMPTS.values())
        + list(GEMMA_PROMPTS.values())
    )
    for s in SPECIALS:
        corpus = corpus.replace(s, " ")
    return sorted(set(re.findall(r"\w+|[^\w\s]+", corpus)))


def tokenizer_json(post: str | None) -> dict:
    """A WordLevel tokenizer over `_words()`; `post`: `"eos"` appends `<|endoftext|>`, `"gemma"`
    wraps in `<bos> … <eos>`, None adds nothing."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for w in _words():
        vocab[w] = len(vocab)
    assert len(vocab) <= VOCAB, len(vocab)
    added = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, s in enumerate(SPECIALS)
    ]
    processor = None
    if post == "eos":
        processor = {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [vocab["<|endoftext|>"]], "tokens": ["<|endoftext|>"]}},
        }
    elif post == "gemma":
        processor = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<bos>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<eos>", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}}],
            "special_tokens": {
                "<bos>": {"id": "<bos>", "ids": [vocab["<bos>"]], "tokens": ["<bos>"]},
                "<eos>": {"id": "<eos>", "ids": [vocab["<eos>"]], "tokens": ["<eos>"]},
            },
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": processor,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def _config(kind: str) -> dict:
    common = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
        "head_dim": 16,
        "hidden_size": 64,
        "initializer_range": 0.1,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-06,
        "vocab_size": VOCAB,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "use_cache": False,
    }
    if kind == "gemma":
        return common | {
            "architectures": ["Gemma3TextModel"],
            "model_type": "gemma3_text",
            "eos_token_id": 3,
            "hidden_activation": "gelu_pytorch_tanh",
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
            },
            "sliding_window": 8,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
            "use_bidirectional_attention": True,
        }
    return common | {
        "architectures": ["Qwen3Model" if kind == "embed" else "Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "eos_token_id": 4,
        "hidden_act": "silu",
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "layer_types": ["full_attention", "full_attention"],
        "max_window_layers": 28,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": None,
        "use_sliding_window": False,
        # Qwen3-Embedding-0.6B ties them (and ships no lm_head); the reranker gets its own.
        "tie_word_embeddings": kind == "embed",
    }


def _weights(cfg: dict, seed: int, prefix: str, lm_head: bool) -> dict:
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gemma = cfg["model_type"] == "gemma3_text"

    def w(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        # Gemma multiplies by (1 + w): weights near 0; the others by w: near 1.
        return (rng.standard_normal(n) * 0.1 + (0.0 if gemma else 1.0)).astype(np.float32)

    t = {f"{prefix}embed_tokens.weight": w(cfg["vocab_size"], h, scale=0.5)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = w(nh * d, h)
        t[p + "self_attn.k_proj.weight"] = w(nkv * d, h)
        t[p + "self_attn.v_proj.weight"] = w(nkv * d, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * d)
        t[p + "self_attn.q_norm.weight"] = norm(d)
        t[p + "self_attn.k_norm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        if gemma:
            t[p + "pre_feedforward_layernorm.weight"] = norm(h)
            t[p + "post_feedforward_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
    t[f"{prefix}norm.weight"] = norm(h)
    if lm_head:
        t["lm_head.weight"] = w(cfg["vocab_size"], h, scale=0.5)
    return t


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _pooling(mode: str, width: int) -> dict:
    modes = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "lasttoken": "lasttoken"}
    out = {"word_embedding_dimension": width}
    for k in ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken"]:
        out[f"pooling_mode_{k}"] = k == modes[mode]
    out["include_prompt"] = True
    return out


def _tokenizer_files(dest: Path, post: str | None, eos: str) -> None:
    _write_json(dest / "tokenizer.json", tokenizer_json(post))
    _write_json(
        dest / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "eos_token": eos,
            "padding_side": "right",
            "model_max_length": 512,
        },
    )


def materialise(root: Path) -> dict[str, Path]:
    """Writes the four checkpoints under `root` (skipping what is there); returns their paths."""
    from safetensors.numpy import save_file

    root = Path(root)
    out = {}
    # qwen3-embed
    dest = root / "qwen3-embed"
    out["qwen3"] = dest
    if not (dest / "model.safetensors").is_file():
        cfg = _config("embed")
        _write_json(dest / "config.json", cfg)
        dest.mkdir(parents=True, exist_ok=True)
        save_file(_weights(cfg, 4201, "", lm_head=False), str(dest / "model.safetensors"))
        _tokenizer_files(dest, "eos", "<|endoftext|>")
        _write_json(
            dest / "modules.json",
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ],
        )
        _write_json(dest / "1_Pooling" / "config.json", _pooling("lasttoken", 64))
        (dest / "2_Normalize").mkdir(exist_ok=True)
        _write_json(
            dest / "config_sentence_transformers.json",
            {"prompts": QWEN_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"},
        )
        _write_json(dest / "sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    # gemma-embed
    dest = root / "gemma-embed"
    out["gemma"] = dest
    if not (dest / "model.safetensors").is_file():
        cfg = _config("gemma")
        _write_json(dest / "config.json", cfg)
        dest.mkdir(parents=True, exist_ok=True)
        save_file(_weights(cfg, 4202, "", lm_head=False), str(dest / "model.safetensors"))
        _tokenizer_files(dest, "gemma", "<eos>")
        _write_json(
            dest / "modules.json",
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
                {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
                {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
            ],
        )
        _write_json(dest / "1_Pooling" / "config.json", _pooling("mean", 64))
        rng = np.random.Generator(np.random.PCG64(4203))
        _write_json(
            dest / "2_Dense" / "config.json",
            {"in_features": 64, "out_features": 96, "bias": False, "activation_function": "torch.nn.modules.linear.Identity"},
        )
        save_file(
            {"linear.weight": (rng.standard_normal((96, 64)) * 0.2).astype(np.float32)},
            str(dest / "2_Dense" / "model.safetensors"),
        )
        _write_json(
            dest / "3_Dense" / "config.json",
            {"in_features": 96, "out_features": 48, "bias": True, "activation_function": "torch.nn.modules.activation.Tanh"},
        )
        save_file(
            {
                "linear.weight": (rng.standard_normal((48, 96)) * 0.2).astype(np.float32),
                "linear.bias": (rng.standard_normal(48) * 0.1).astype(np.float32),
            },
            str(dest / "3_Dense" / "model.safetensors"),
        )
        (dest / "4_Normalize").mkdir(exist_ok=True)
        _write_json(
            dest / "config_sentence_transformers.json",
            {"prompts": GEMMA_PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"},
        )
        _write_json(dest / "sentence_bert_config.json", {"max_seq_length": 512, "do_lower_case": False})
    # embeddinggemma: gemma-embed with the released model's Dense shape
    dest = root / "embeddinggemma"
    out["embeddinggemma"] = dest
    if not (dest / "model.safetensors").is_file():
        import shutil

        from safetensors.numpy import load_file

        shutil.copytree(root / "gemma-embed", dest, dirs_exist_ok=True)
        # As many embedding rows as the converter keeps (it cuts the table to the tokenizer.json's
        # vocabulary + added tokens and pads the token list to config.json's vocab_size; llama.cpp
        # wants the two equal).
        tok = json.loads((dest / "tokenizer.json").read_text())
        n_vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
        # Every layer slides: llama.cpp takes a `gemma-embedding` file's layers as five sliding
        # then one global (EmbeddingGemma's own pattern, which the converter does not write), so
        # three layers all slide there.
        cfg = json.loads((dest / "config.json").read_text()) | {
            "vocab_size": n_vocab,
            "layer_types": ["sliding_attention"] * 3,
        }
        _write_json(dest / "config.json", cfg)
        weights = load_file(str(dest / "model.safetensors"))
        weights["embed_tokens.weight"] = np.ascontiguousarray(weights["embed_tokens.weight"][:n_vocab])
        save_file(weights, str(dest / "model.safetensors"))
        rng = np.random.Generator(np.random.PCG64(4205))
        for folder, (n_in, n_out) in (("2_Dense", (64, 96)), ("3_Dense", (96, 64))):
            _write_json(
                dest / folder / "config.json",
                {"in_features": n_in, "out_features": n_out, "bias": False,
                 "activation_function": "torch.nn.modules.linear.Identity"},
            )
            save_file({"linear.weight": (rng.standard_normal((n_out, n_in)) * 0.2).astype(np.float32)},
                      str(dest / folder / "model.safetensors"))
    # qwen3-rerank
    dest = root / "qwen3-rerank"
    out["rerank"] = dest
    if not (dest / "model.safetensors").is_file():
        cfg = _config("rerank")
        _write_json(dest / "config.json", cfg)
        dest.mkdir(parents=True, exist_ok=True)
        save_file(_weights(cfg, 4204, "model.", lm_head=True), str(dest / "model.safetensors"))
        _tokenizer_files(dest, None, "<|im_end|>")
    return out


if __name__ == "__main__":
    import sys

    for k, v in materialise(Path(sys.argv[1])).items():
        print(k, v)
