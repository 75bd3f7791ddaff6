"""Tiny mixtures of experts with a shared expert (Qwen2-MoE, Granite MoE Shared) and transformers'
reference outputs for them, in the contract of ../shared/fixtures/generate_tiny_more.py.

The checkpoints are not stored (weights stay out of git): every float32 weight is drawn from
numpy's PCG64 generator with a fixed seed, in the order of the names the checkpoint holds, so a
test rebuilds the directory without torch (`materialise`). What is stored, in
tests/data/shared_experts/<case>/: `config.json` as transformers saved it, `weights.json` (the
tensor names and shapes in draw order, the seed, and the SHA-256 of the weights so that a
different draw is an error, not a silently different model) and `reference.safetensors` /
`reference.json`, computed by transformers from the rebuilt weights.

    python tests/shared_expert_fixtures.py [case ...]   (needs torch and transformers 5.x)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from fixture_writers import write_spec, write_weights

DATA = Path(__file__).resolve().parent / "data" / "shared_experts"
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CASES = {
    # name: (config class, model class, kwargs replacing BASE, seed)
    # Every layer a mixture with a gated shared expert (llama.cpp's qwen2moe has no dense layers).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False), 41),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=96, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=2.0, tie_word_embeddings=False), 42),
}


def _is_norm(name):
    return name.endswith(("norm.weight", "layernorm.weight"))


def materialise(case, dest):
    """Writes the checkpoint directory of `case` (config.json, model.safetensors) at `dest`."""
    dest = write_weights(DATA / case, _is_norm, dest)
    shutil.copy(DATA / case / "config.json", dest / "config.json")
    return dest


def reference(case):
    """transformers' outputs for `case`."""
    from safetensors.numpy import load_file

    return load_file(str(DATA / case / "reference.safetensors"))


def _build(case):
    import tempfile

    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
    from generate_tiny_more import N_GREEDY, T_PROMPT, capture

    cfg_name, model_name, extra, seed = CASES[case]
    config = getattr(transformers, cfg_name)(**{**BASE, **extra})
    config._attn_implementation = "eager"
    dest = DATA / case
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # The names and shapes the checkpoint holds on disk (transformers 5 fuses experts in memory).
        getattr(transformers, model_name)(config).save_pretrained(tmp, safe_serialization=True)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        shutil.copy(Path(tmp) / "config.json", dest / "config.json")
    write_spec(dest, seed, saved, _is_norm)
    with tempfile.TemporaryDirectory() as tmp:
        model = getattr(transformers, model_name).from_pretrained(materialise(case, tmp), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    model.eval()
    ids = np.random.default_rng(7).integers(3, config.vocab_size, size=T_PROMPT).astype(np.int64)
    input_ids = torch.tensor(ids)[None]
    # Granite MoE Shared adds its shared MLP outside `block_sparse_moe` (the module the capture
    # hooks for `mlp.output`): the point is the sum of the two.
    shared_out, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if getattr(layer, "shared_mlp", None) is not None:
            hooks.append(layer.shared_mlp.register_forward_hook(
                lambda _m, _a, out, i=i: shared_out.__setitem__(i, out[0].detach().float().numpy().copy())))
    obs = capture(model, input_ids)
    for h in hooks:
        h.remove()
    for i, s in shared_out.items():
        obs[f"model.layers.{i}.mlp.output"] = obs[f"model.layers.{i}.mlp.output"] + s
    with torch.no_grad():
        gen = model.generate(input_ids, max_new_tokens=N_GREEDY, min_new_tokens=N_GREEDY,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        full = model(gen, use_cache=False).logits[0].float().numpy()
    tensors = {"input_ids": ids, "greedy_ids": gen[0, T_PROMPT:].numpy().astype(np.int64),
               "sequence_logits": full.copy(), **obs}
    save_file(tensors, str(dest / "reference.safetensors"))
    meta = {
        "case": case,
        "architecture": model_name,
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, eager attention, float32",
        "prompt_tokens": T_PROMPT,
        "greedy_tokens": N_GREEDY,
        "observations": sorted(obs),
        "notes": "As ../shared/fixtures/generate_tiny_more.py; mlp.output includes the shared expert.",
    }
    (dest / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(case, "->", dest, len(obs), "points")


if __name__ == "__main__":
    for name in sys.argv[1:] or CASES:
        _build(name)
