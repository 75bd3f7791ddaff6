"""A tiny Hugging Face checkpoint to a GGUF file, written as llama.cpp's `convert_hf_to_gguf.py`
writes it (the `conversion/` modules of ggml-org/llama.cpp: `base.py`, `llama.py`, `gemma.py`,
`gpt2.py`, `gptneox.py`, `olmo.py`, `granite.py`, `phi.py`, `qwen.py`, `gpt_oss.py`, `bert.py`:
BERT, nomic-bert and ModernBERT; the last two checked key for key and tensor for tensor against
the converter's own output by tests/test_encoders_llama_cpp.py).

What is reproduced: the architecture name, the metadata keys the converter's
`set_gguf_parameters` writes, tensor names through the `gguf` package's `TensorNameMap`, every
tensor transform (`LlamaModel.permute` of q/k rows for the Llama family, Gemma's norm + 1, GPT-2's
`Conv1D` transposed, GPT-NeoX's per-head qkv regrouped as q, k, v, experts stacked into 3-D
`ffn_*_exps`, gpt-oss's interleaved gate/up split, Granite MoE's fused input split) and the
converter's type rule (1-D tensors, `*_norm.weight`, biases, `ffn_gate_inp` and `position_embd`
stay F32; every other weight takes the output type, F16 where its rows do not fit the blocks).

Where the converter would fail on these fixtures or cannot say what they hold, this module
departs from it, each time in one place marked "Departure":

- the fixtures have no tokenizer, on which the converter stops; a minimal SentencePiece-style
  vocabulary of `vocab_size` tokens (`<t{i}>`) is written so that llama.cpp can load the file;
- configs written by transformers 5 keep `partial_rotary_factor` in `rope_parameters` and have no
  `n_ctx` / `rotary_pct`, keys the GPT-2 and GPT-NeoX converters read;
- GPT-2's converter writes `feed_forward_length = 4 · n_embd`, true of every released GPT-2 but
  not of the tiny one (`n_inner` = 128): the real width is written;
- Gemma 3's converter writes no layer pattern (llama.cpp assumes five sliding layers, then one
  global); where `layer_types` says otherwise, llama.cpp's per-layer key
  `{arch}.attention.sliding_window_pattern` (booleans) is written. Real Gemma 3 checkpoints
  follow the assumed pattern and get no such key. llama.cpp reads it: on the tiny Gemma 3 (global
  layer 3 of 4) its logits are within 3e-4 of the reference with the key, 0.54 away without;
- BERT's converter hashes its tokenizer's output on a test text to name `tokenizer.ggml.pre` and
  stops on a vocabulary it does not know (the tiny fixture's): `default` is written (llama.cpp's
  WPM tokenizer does not read it);
- gpt-oss's converter writes no `swiglu_limit` (llama.cpp clamps its experts at a constant 7.0,
  the released models' value; the tiny fixture's is 1.0): it is written as
  `gpt-oss.swiglu_clamp_exp`, one entry per layer, the key llama.cpp's converter writes for
  DeepSeek's clamp of the same name (`swiglu_limit`). candlewick reads it; llama.cpp's gpt-oss
  graph does not.

Left as the converter writes them, though llama.cpp cannot then reproduce the fixture: gpt-oss
(llama.cpp clamps at 7.0 whatever the file says, and rounds YaRN's ramp bounds to whole
dimensions, which the fixture's `truncate: false` does not) and OLMoE's k norm, which llama.cpp
expects as wide as the residual (the tiny OLMoE has fewer key/value heads than heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

F32 = "f32"
Q8_0 = "q8_0"

# config.json `model_type` → llama.cpp's `general.architecture`.
ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt2": "gpt2",
    "gpt_neox": "gptneox",
    "gemma2": "gemma2",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "granitemoe": "granitemoe",
    # Granite MoE Shared is written as Granite MoE with `ffn_*_shexp` tensors.
    "granitemoeshared": "granitemoe",
    "gpt_oss": "gpt-oss",
    "qwen2_moe": "qwen2moe",
    "bert": "bert",
    "nomic_bert": "nomic-bert",
    "modernbert": "modern-bert",
}

# The converters that derive from `LlamaModel` and so permute q/k rows (`undo_permute = True`).
LLAMA_FAMILY = {"llama", "mistral", "mixtral", "smollm3", "granite", "granitemoe", "granitemoeshared"}


def _arch_enum(name):
    import gguf

    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


def _permute(w, n_head, n_head_kv):
    """`LlamaModel.permute`: each head's rows from halves (HF) to interleaved pairs (GGUF)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_params(cfg):
    """`TextModel.rope_parameters`: `rope_parameters` or `rope_scaling`, with `rope_theta` mirrored in."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" not in rp and "sliding_attention" not in rp:
        if "rope_theta" not in rp:
            for k in ("rope_theta", "global_rope_theta", "rotary_emb_base"):
                if cfg.get(k) is not None:
                    rp["rope_theta"] = cfg[k]
                    break
        if "rope_type" not in rp and rp.get("type") is not None:
            rp["rope_type"] = rp["type"]
    return rp


def _find(cfg, *keys):
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def _text_model_parameters(w, cfg, n_layers):
    """`TextModel.set_gguf_parameters`."""
    import gguf

    w.add_block_count(n_layers)
    if (n_ctx := _find(cfg, "max_position_embeddings", "n_ctx", "n_positions")) is not None:
        w.add_context_length(n_ctx)
    if (n_embd := _find(cfg, "hidden_size", "n_embd")) is not None:
        w.add_embedding_length(n_embd)
    if (n_ff := _find(cfg, "intermediate_size", "n_inner")) is not None:
        w.add_feed_forward_length(n_ff)
    if (n_head := _find(cfg, "num_attention_heads", "n_head")) is not None:
        w.add_head_count(n_head)
    if (n_head_kv := _find(cfg, "num_key_value_heads", "n_kv_heads")) is not None:
        w.add_head_count_kv(n_head_kv)
    rp = _rope_params(cfg)
    rp = rp.get("full_attention", rp)
    rope_type = rp.get("rope_type")
    if rope_type == "linear" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif rope_type == "yarn" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        if (v := rp.get("extrapolation_factor")) is not None:
            w.add_rope_scaling_yarn_ext_factor(v)
        if (v := rp.get("attention_factor", rp.get("attn_factor"))) is not None:
            w.add_rope_scaling_yarn_attn_factor(v)
        if (v := rp.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(v)
        if (v := rp.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(v)
    if (theta := rp.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (eps := _find(cfg, "rms_norm_eps", "norm_eps")) is not None:
        w.add_layer_norm_rms_eps(eps)
    if (eps := _find(cfg, "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")) is not None:
        w.add_layer_norm_eps(eps)
    if (n := cfg.get("num_local_experts")) is not None:
        w.add_expert_count(n)
    if (n := cfg.get("num_experts_per_tok")) is not None:
        w.add_expert_used_count(n)
    if (head_dim := cfg.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)


def _parameters(w, cfg, model_type, n_layers):
    """Each converter class's `set_gguf_parameters`."""
    hidden = _find(cfg, "hidden_size", "n_embd")
    heads = _find(cfg, "num_attention_heads", "n_head")
    if model_type == "gpt2":
        w.add_block_count(n_layers)
        # Departure: `n_ctx` is absent from transformers 5 configs; `n_positions` is the same length.
        w.add_context_length(_find(cfg, "n_ctx", "n_positions"))
        w.add_embedding_length(hidden)
        # Departure: the converter writes 4 · n_embd, wrong for a checkpoint with another n_inner.
        w.add_feed_forward_length(cfg.get("n_inner") or 4 * hidden)
        w.add_head_count(heads)
        w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
        return
    if model_type == "gpt_neox":
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_block_count(n_layers)
        w.add_feed_forward_length(cfg["intermediate_size"])
        # Departure: transformers 5 moved `rotary_pct` into `rope_parameters.partial_rotary_factor`.
        pct = _find(cfg, "rotary_pct", "partial_rotary_factor")
        if pct is None:
            pct = _rope_params(cfg).get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(pct * (hidden // heads)))
        w.add_head_count(heads)
        w.add_parallel_residual(cfg.get("use_parallel_residual", True))
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        return
    if model_type == "gemma2":
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_block_count(n_layers)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    if model_type == "phi3":
        rot_pct = cfg.get("partial_rotary_factor", _rope_params(cfg).get("partial_rotary_factor", 1.0))
        w.add_context_length(_find(cfg, "n_positions", "max_position_embeddings"))
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_block_count(n_layers)
        w.add_head_count(heads)
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_rope_dimension_count(int(rot_pct * hidden) // heads)
        rp = _rope_params(cfg)
        w.add_rope_freq_base(rp.get("full_attention", rp)["rope_theta"])
        # "use zero value of sliding_window to distinguish Phi-4 from other PHI3 models"
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        return
    granite = model_type in ("granite", "granitemoe", "granitemoeshared")
    if granite:
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}  # "Ignoring head_dim ... for Granite"
    _text_model_parameters(w, cfg, n_layers)
    if model_type in LLAMA_FAMILY:
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    if granite:
        if v := cfg.get("attention_multiplier"):
            w.add_attention_scale(v)
        if v := cfg.get("embedding_multiplier"):
            w.add_embedding_scale(v)
        if v := cfg.get("residual_multiplier"):
            w.add_residual_scale(v)
        if v := cfg.get("logits_scaling"):
            w.add_logit_scale(v)
        if v := cfg.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(v)
    if model_type == "gemma3":
        w.add_context_length(cfg.get("max_position_embeddings", 131072))
        w.add_head_count(cfg.get("num_attention_heads", 8))
        w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
        w.add_key_length(cfg.get("head_dim", 256))
        w.add_value_length(cfg.get("head_dim", 256))
        rp = _rope_params(cfg)
        w.add_rope_freq_base(rp.get("full_attention", rp).get("rope_theta", 1_000_000.0))
        if v := cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(v)
        if cfg.get("sliding_window_pattern") != 1:
            w.add_sliding_window(cfg["sliding_window"])
        w.add_head_count_kv(cfg.get("num_key_value_heads", 4))
        # Departure (see the module's doc): the pattern only where llama.cpp's assumption is wrong.
        types = cfg.get("layer_types")
        assumed = [(i + 1) % 6 != 0 for i in range(n_layers)]
        if types is not None and [t == "sliding_attention" for t in types] != assumed:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    if model_type == "olmo2" and "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
        types = cfg.get("layer_types")
        pattern = [t == "sliding_attention" for t in types] if types else [(i + 1) % 4 != 0 for i in range(n_layers)]
        w.add_sliding_window_pattern(pattern)
    if model_type == "olmoe":
        w.add_layer_norm_rms_eps(1e-5)
        if (n := cfg.get("num_experts")) is not None:
            w.add_expert_count(n)
    if model_type == "qwen2_moe" and (n := cfg.get("num_experts")) is not None:
        w.add_expert_count(n)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        if (n := cfg.get("moe_intermediate_size")) is not None:
            w.add_expert_feed_forward_length(n)
        if (n := cfg.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(n)
    if model_type == "gpt_oss":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        # Departure (see the module's doc): the clamp, in the key DeepSeek's converter writes.
        if (limit := cfg.get("swiglu_limit")) is not None:
            w.add_array(f"{w.arch}.swiglu_clamp_exp", [float(limit)] * n_layers)


def _tensors(cfg, model_type, weights, n_layers, arch):
    """Each converter class's `modify_tensors`: (HF-style name to map, array) pairs, or
    (GGUF name, array) where the converter names the tensor itself (prefixed by `=`)."""
    heads = _find(cfg, "num_attention_heads", "n_head")
    kv_heads = cfg.get("num_key_value_heads")
    hidden = _find(cfg, "hidden_size", "n_embd")
    out = []
    experts: dict[int, dict[str, np.ndarray]] = {}
    for name, t in weights.items():
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if model_type == "bert":
            # `BertModel.filter_tensors`: the base model's prefix off; the pooler and the
            # pre-training heads dropped (llama.cpp uses BERT for embeddings).
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.predictions", "cls.seq_relationship")) or name.endswith("position_ids"):
                continue
        if model_type == "modernbert":
            # `ModernBertModel.filter_tensors`: the task model's prefix off; `modify_tensors`: a
            # classifier's map named as RoBERTa's (`cls.output`).
            name = name.removeprefix("model.")
            if _class_labels(cfg) and name in ("classifier.weight", "classifier.bias"):
                name = name.replace("classifier", "classifier.out_proj")
        if model_type == "gpt2" and name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if model_type == "gemma2" and name == "lm_head.weight":
            continue
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if model_type in LLAMA_FAMILY:
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = _permute(t, heads, heads)
            if name.endswith(("k_proj.weight", "k_proj.bias")):
                t = _permute(t, heads, kv_heads)
        if model_type in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + np.float32(1.0)
        if model_type == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            t = t.T
        if model_type == "gpt_neox" and ".attention.query_key_value." in name:
            d = hidden // heads
            shape = (heads, 3, d, hidden) if name.endswith(".weight") else (heads, 3, d)
            parts = t.reshape(shape)
            t = np.concatenate([parts[:, k].reshape((-1, *t.shape[1:])) for k in range(3)], axis=0)
        if model_type == "mixtral" and ".block_sparse_moe.experts." in name:
            experts.setdefault(bid, {})[name] = t
            n = cfg["num_local_experts"]
            if len(experts[bid]) == 3 * n:
                for wid in ("w1", "w2", "w3"):
                    stack = [experts[bid][f"model.layers.{bid}.block_sparse_moe.experts.{x}.{wid}.weight"] for x in range(n)]
                    out.append((f"layers.{bid}.feed_forward.experts.{wid}.weight", np.stack(stack)))
            continue
        if model_type in ("qwen3_moe", "qwen2_moe", "olmoe") and ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            n = cfg.get("num_local_experts") or cfg["num_experts"]
            if len(experts[bid]) == 3 * n:
                for wn in ("down_proj", "gate_proj", "up_proj"):
                    stack = [experts[bid][f"model.layers.{bid}.mlp.experts.{x}.{wn}.weight"] for x in range(n)]
                    out.append((f"model.layers.{bid}.mlp.experts.{wn}.weight", np.stack(stack)))
            continue
        if model_type in ("granitemoe", "granitemoeshared") and name.endswith("block_sparse_moe.input_linear.weight"):
            ffn = cfg["intermediate_size"]
            out.append((f"=blk.{bid}.ffn_gate_exps.weight", t[:, :ffn]))
            out.append((f"=blk.{bid}.ffn_up_exps.weight", t[:, ffn:]))
            continue
        if model_type == "granitemoeshared" and name.endswith("shared_mlp.input_linear.weight"):
            ffn = cfg["shared_intermediate_size"]
            out.append((f"=blk.{bid}.ffn_gate_shexp.weight", t[:ffn]))
            out.append((f"=blk.{bid}.ffn_up_shexp.weight", t[ffn:]))
            continue
        if model_type == "gpt_oss":
            if "sinks" in name:
                name += ".weight"
            if name.endswith("down_proj_bias"):
                name = name.replace("down_proj_bias", "down_proj.bias")
            elif name.endswith("down_proj"):
                name, t = name + ".weight", np.swapaxes(t, -1, -2)
            elif name.endswith("gate_up_proj_bias"):
                out.append((name.replace("gate_up_proj_bias", "gate_proj.bias"), t[..., ::2]))
                out.append((name.replace("gate_up_proj_bias", "up_proj.bias"), t[..., 1::2]))
                continue
            elif name.endswith("gate_up_proj"):
                t = np.swapaxes(t, -1, -2)
                out.append((name.replace("gate_up_proj", "gate_proj.weight"), t[:, ::2, :]))
                out.append((name.replace("gate_up_proj", "up_proj.weight"), t[:, 1::2, :]))
                continue
        out.append((name, t))
    return out


def _try_set_pooling_type(w, src):
    """`TextModel._try_set_pooling_type`: the sentence-transformers Pooling module's mode as
    `{arch}.pooling_type` (mean 1, cls 2, last 3), where the directory has one."""
    import gguf

    modules = Path(src) / "modules.json"
    if not modules.is_file():
        return
    path = next((m["path"] for m in json.loads(modules.read_text()) if m["type"].endswith("Pooling")), None)
    if path is None:
        return
    pooling = json.loads((Path(src) / path / "config.json").read_text())
    modes = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}
    if pooling.get("pooling_mode_mean_tokens"):
        w.add_pooling_type(gguf.PoolingType.MEAN)
    elif pooling.get("pooling_mode_cls_token"):
        w.add_pooling_type(gguf.PoolingType.CLS)
    elif pooling.get("pooling_mode_lasttoken"):
        w.add_pooling_type(gguf.PoolingType.LAST)
    elif pooling.get("pooling_mode") in modes:
        w.add_pooling_type(modes[pooling["pooling_mode"]])
    else:
        raise NotImplementedError("Only MEAN, CLS, and LAST pooling types supported")


def _minimal_vocab(w, cfg):
    """Departure: the fixtures have no tokenizer. A SentencePiece-style (`llama`) vocabulary of
    `vocab_size` distinct tokens, so that llama.cpp (which needs one) loads the file too."""
    n = cfg["vocab_size"]
    tokens = [f"<t{i}>" for i in range(n)]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types([1] * n)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = cfg.get(key)
        v = v[0] if isinstance(v, list) else v
        if v is not None:
            add(v)


def _bert_parameters(w, src, cfg, n_layers):
    """`BertModel.set_gguf_parameters`: `TextModel`'s keys, no causal mask, and the pooling of the
    directory's sentence-transformers Pooling module (`_try_set_pooling_type`)."""
    import gguf

    _text_model_parameters(w, cfg, n_layers)
    w.add_causal_attention(False)
    modules = src / "modules.json"
    if modules.is_file():
        path = next(m["path"] for m in json.loads(modules.read_text()) if m["type"].endswith("Pooling"))
        pooling = json.loads((src / path / "config.json").read_text())
        for key, kind in (("pooling_mode_mean_tokens", gguf.PoolingType.MEAN), ("pooling_mode_cls_token", gguf.PoolingType.CLS),
                          ("pooling_mode_lasttoken", gguf.PoolingType.LAST)):
            if pooling.get(key):
                w.add_pooling_type(kind)
                break


def _bert_vocab(w, src, cfg):
    """`BertModel.set_vocab`: the WordPiece vocabulary in "phantom space" (a word-initial piece
    `▁word`, a `##piece` bare, control tokens as they are), the token type count, and the special
    tokens as the `gguf` package's `SpecialVocab` reads them ([CLS] as BOS, [SEP] as EOS, both
    added). Departure: `tokenizer.ggml.pre` is `default`; the converter hashes the tokenizer's
    output on a test text and stops on a vocabulary it does not know, as the fixture's is."""
    import gguf

    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [None] * len(vocab)
    for piece, i in vocab.items():
        tokens[i] = piece
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    phantom = [t if ty == gguf.TokenType.CONTROL else (t[2:] if t.startswith("##") else "\u2581" + t)
               for t, ty in zip(tokens, types)]
    w.add_token_type_count(cfg.get("type_vocab_size", 1))
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(phantom)
    w.add_token_types(types)
    gguf.SpecialVocab(src, n_vocab=len(tokens)).add_to_gguf(w)


def _nomic_bert_parameters(w, src, cfg, n_layers):
    """`NomicBertModel.set_gguf_parameters`: BERT's (`TextModel`'s keys as transformers' config
    gives them, the head size included, no causal mask, the Pooling module's pooling)."""
    heads = _find(cfg, "num_attention_heads", "n_head")
    _bert_parameters(w, src, cfg, n_layers)
    w.add_key_length(_find(cfg, "hidden_size", "n_embd") // heads)
    w.add_value_length(_find(cfg, "hidden_size", "n_embd") // heads)


def _class_labels(cfg):
    """`BertModel.__init__`'s `cls_out_labels`: `id2label`, unless it is the two dummy labels
    AutoConfig adds."""
    labels = cfg.get("id2label")
    if labels and len(labels) == 2 and labels.get("0") == "LABEL_0":
        return None
    return labels


def _modern_bert_parameters(w, src, cfg, n_layers):
    """`ModernBertModel.set_gguf_parameters`: `TextModel`'s keys (the global rotary base, the
    sliding layers' as `rope.freq_base_swa`, `norm_eps` under the RMS norm's key), no causal
    mask, the pooling and the classifier's pooling, the window (`local_attention` tokens) and
    pattern (`global_attn_every_n_layers`), no rope scaling, the vocabulary size, the MLP
    activation."""
    import gguf

    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg.get("global_rope_theta", 160000.0))
    w.add_rope_freq_base_swa(cfg.get("local_rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.get("norm_eps", 1e-5))
    w.add_causal_attention(False)
    _try_set_pooling_type(w, src)
    if labels := _class_labels(cfg):
        w.add_array(f"{w.arch}.classifier.output_labels", [v for _, v in sorted(labels.items())])
    if (pooling := cfg.get("classifier_pooling")) is not None:
        kind = {"cls": gguf.PoolingType.CLS, "mean": gguf.PoolingType.MEAN}[pooling]
        # The writer method is newer than some `gguf` releases; the key and type are its.
        w.add_uint32("modern-bert.classifier.pooling_type", kind)
    w.add_sliding_window(cfg["local_attention"])
    if (pattern := cfg.get("global_attn_every_n_layers")) is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_vocab_size(cfg["vocab_size"])
    if (act := cfg.get("hidden_activation")) is not None:
        w.add_string("modern-bert.hidden_activation", act)  # `add_hidden_act`, newer than some `gguf`s


def _gpt2_vocab(w, src, cfg, pre="modern-bert", modernbert=True):
    """`_set_vocab_gpt2` (ModernBERT's `set_vocab` adds BOS, EOS and SEP first; `SpecialVocab`
    then says which are added): the tokenizer.json vocabulary padded to the config's
    `vocab_size` with `[PAD{i}]` (unused), special tokens as control tokens, the merges, and the
    special tokens as `SpecialVocab` reads them. Departure: `tokenizer.ggml.pre` is `pre`, the name
    the released vocabulary hashes to (`modern-bert`), or `default` (EmbeddingGemma's fixture's
    WordLevel vocabulary); the converter stops on the fixture's unknown hash."""
    import gguf

    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    reverse = {i: piece for piece, i in vocab.items()}
    tokens, types = [], []
    for i in range(cfg["vocab_size"]):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.CONTROL if reverse[i] in special else gguf.TokenType.NORMAL)
    if modernbert:
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(src, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)
    if not modernbert:
        # The converter's (newer) `SpecialVocab` reads BOS / EOS as added from the post-processor's
        # single template, `<bos> $A <eos>`, where some `gguf` releases do not.
        single = (tok.get("post_processor") or {}).get("single") or []
        if single:
            w.add_add_bos_token("SpecialToken" in single[0])
            w.add_add_eos_token("SpecialToken" in single[-1])


def _embedding_gemma_dense(src):
    """`EmbeddingGemma` with `--sentence-transformers-dense-modules`: the `2_Dense` / `3_Dense`
    modules' weights (bias and activation not written) as `dense_2` / `dense_3`, with their widths."""
    from safetensors.numpy import load_file

    modules = json.loads((src / "modules.json").read_text())
    out = []
    for m in modules:
        if m["type"].endswith("Dense") and (src / m["path"] / "model.safetensors").is_file():
            prefix = "dense_2" if m["path"] == "2_Dense" else "dense_3"
            conf = json.loads((src / m["path"] / "config.json").read_text())
            weight = load_file(str(src / m["path"] / "model.safetensors"))["linear.weight"]
            out.append((prefix, weight, conf["in_features"], conf["out_features"]))
    return out


def convert(src, dest, outtype=F32, vocab=True, config=None, experts=None, split_max_tensors=0,
            small_first_shard=False, dense_modules=False):
    """Writes `dest`, the GGUF file llama.cpp's converter makes of the checkpoint directory `src`
    with `--outtype` `outtype` (`"f32"` or `"q8_0"`); returns `dest`.

    `config` overrides keys of the checkpoint's config.json (the same weights, another model);
    `experts="mxfp4"` stores the 3-D expert tensors in MXFP4 where their rows are whole blocks,
    as gpt-oss's converter keeps the checkpoint's MXFP4 experts.

    `split_max_tensors` > 0 writes a split file instead, as the converter's `--split-max-tensors`
    does (the `gguf` package's split writer, whose parts llama.cpp's gguf-split also writes):
    `{stem}-00001-of-0000N.gguf` and so on beside `dest`, at most that many tensors in each, the
    metadata in the first; `small_first_shard` (`--no-tensor-first-split`) leaves the first with
    none. `dest` itself is then not written; the parts are returned, in order."""
    import gguf
    from safetensors.numpy import load_file

    src, dest = Path(src), Path(dest)
    cfg = json.loads((src / "config.json").read_text())
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    cfg.update(config or {})
    model_type = cfg["model_type"]
    model_type = "gemma3" if model_type == "gemma3_text" else model_type
    # `EmbeddingGemma` (registered for `Gemma3TextModel`): Gemma 3 as `gemma-embedding`.
    embedding_gemma = model_type == "gemma3" and "Gemma3TextModel" in (cfg.get("architectures") or [])
    arch = "gemma-embedding" if embedding_gemma else ARCH[model_type]
    n_layers = _find(cfg, "n_layers", "num_hidden_layers", "n_layer", "num_layers")
    names = gguf.get_tensor_name_map(_arch_enum(arch), n_layers)
    weights = load_file(str(src / "model.safetensors"))
    qtype = {F32: gguf.GGMLQuantizationType.F32, Q8_0: gguf.GGMLQuantizationType.Q8_0}[outtype]
    ftype = {F32: gguf.LlamaFileType.ALL_F32, Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]

    w = gguf.GGUFWriter(str(dest), arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    tensors = _tensors(cfg, model_type, weights, n_layers, arch)
    dense = _embedding_gemma_dense(src) if embedding_gemma and dense_modules else []
    if embedding_gemma:
        # `Gemma3Model.modify_tensors`: the table cut to the tokenizer's tokens (vocabulary +
        # added tokens, as it counts them); the dense layers after the model's own tensors.
        tok = json.loads((src / "tokenizer.json").read_text())
        n_real = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
        tensors = [(n, t[:n_real] if n.endswith("embed_tokens.weight") else t) for n, t in tensors]
        tensors += [(f"={prefix}.weight", weight) for prefix, weight, _, _ in dense]
    for hf_name, t in tensors:
        if hf_name.startswith("="):
            new_name = hf_name[1:]
        else:
            new_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ValueError(f"{src.name}: cannot map tensor {hf_name!r}")
        data = np.ascontiguousarray(t, dtype=np.float32)
        always_f32 = (
            data.ndim <= 1
            or new_name.endswith("_norm.weight")
            or not new_name.endswith(".weight")
            or new_name.split(".")[-2] in ("ffn_gate_inp", "position_embd")
        )
        dtype = gguf.GGMLQuantizationType.F32 if always_f32 else qtype
        if experts == "mxfp4" and new_name.endswith("_exps.weight"):
            dtype = gguf.GGMLQuantizationType.MXFP4
        try:
            raw = gguf.quants.quantize(data, dtype)
        except gguf.QuantError:
            dtype = gguf.GGMLQuantizationType.F16
            raw = gguf.quants.quantize(data, dtype)
        w.add_tensor(new_name, raw, raw_dtype=dtype)

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(src.name)
    if model_type == "bert":
        _bert_parameters(w, src, cfg, n_layers)
    elif model_type == "nomic_bert":
        _nomic_bert_parameters(w, src, cfg, n_layers)
    elif model_type == "modernbert":
        _modern_bert_parameters(w, src, cfg, n_layers)
    else:
        _parameters(w, cfg, model_type, n_layers)
        if embedding_gemma:
            # `EmbeddingGemma.set_gguf_parameters` after Gemma 3's: the sliding layers' base
            # (`TextModel`'s), the dense widths, the pooling.
            w.add_rope_freq_base_swa(_rope_params(cfg)["sliding_attention"]["rope_theta"])
            for prefix, _, n_in, n_out in dense:
                w.add_dense_features_dims(prefix, n_in, n_out)
            _try_set_pooling_type(w, src)
        if model_type in ("qwen2", "qwen3"):
            # `Qwen2Model.set_gguf_parameters` (Qwen3's too) ends with `_try_set_pooling_type`.
            _try_set_pooling_type(w, src)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if model_type in ("bert", "nomic_bert"):
        _bert_vocab(w, src, cfg)
    elif model_type == "modernbert":
        _gpt2_vocab(w, src, cfg)
    elif embedding_gemma:
        _gpt2_vocab(w, src, cfg, pre="default", modernbert=False)
    elif vocab:
        _minimal_vocab(w, cfg)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return w.format_shard_names(dest)
    return dest
