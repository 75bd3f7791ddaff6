"""Seeded random LoRA adapters for the tiny checkpoints, written as PEFT directories, and PEFT's
outputs with them (DESIGN §16).

The adapters are not stored (weights stay out of git): `materialise(root)` draws every factor from
numpy's PCG64 generator with the seed in `ADAPTERS` and writes PEFT directories
(adapter_config.json + adapter_model.safetensors) under `root`. What is stored, in
tests/data/adapters/: `reference.safetensors` and `reference.json`, what peft + transformers
compute with each adapter on the fixture's prompt (logits, the residual stream after each layer,
the final norm, a greedy continuation), and `qwen2_r4.gguf`, the `qwen2_r4` adapter as llama.cpp's
`convert_lora_to_gguf.py` writes it (a converter's output, kept so CI needs no torch).

    /work/bench/venv-ref/bin/python tests/adapter_fixtures.py   (needs torch, transformers, peft)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "adapters"
TINY = Path(__file__).resolve().parent.parent.parent / "shared" / "fixtures" / "tiny"

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# name: (architecture, r, lora_alpha, target_modules, use_rslora, rank_pattern, alpha_pattern, seed)
ADAPTERS = {
    "qwen2_r4": ("qwen2", 4, 8, ATTN + MLP, False, {}, {}, 201),
    "qwen2_rslora_head": ("qwen2", 8, 16, ["q_proj", "v_proj", "down_proj", "lm_head"], True, {}, {}, 202),
    "phi3_fused": ("phi3", 2, 4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False, {"o_proj": 6}, {"down_proj": 1}, 203),
    "llama_r8": ("llama", 8, 4, ["q_proj", "v_proj", "up_proj"], False, {}, {}, 204),
    "qwen2_embed": ("qwen2", 4, 8, ["embed_tokens", "q_proj"], False, {}, {}, 205),
}
STD = 0.1


def module_shapes(config: dict, target: str) -> tuple[int, int]:
    """`(out, in)` of a target module of a tiny checkpoint."""
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // nh
    return {
        "q_proj": (nh * d, h),
        "k_proj": (nkv * d, h),
        "v_proj": (nkv * d, h),
        "qkv_proj": ((nh + 2 * nkv) * d, h),
        "o_proj": (h, nh * d),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "gate_up_proj": (2 * inter, h),
        "down_proj": (h, inter),
        "lm_head": (v, h),
        "embed_tokens": (h, v),
    }[target]


def module_name(layer: int | None, target: str) -> str:
    if target == "lm_head":
        return "lm_head"
    if target == "embed_tokens":
        return "model.embed_tokens"
    part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{part}.{target}"


def write_adapter(root: Path, name: str) -> Path:
    from safetensors.numpy import save_file

    arch, r, alpha, targets, rslora, rank_pattern, alpha_pattern, seed = ADAPTERS[name]
    config = json.loads((TINY / arch / "config.json").read_text())
    rng = np.random.Generator(np.random.PCG64(seed))
    tensors = {}
    for target in targets:
        layers = [None] if target in ("lm_head", "embed_tokens") else range(config["num_hidden_layers"])
        for layer in layers:
            out, inp = module_shapes(config, target)
            rank = rank_pattern.get(target, r)
            module = module_name(layer, target)
            # PEFT names an embedding's factors lora_embedding_A [r, vocab] and _B [hidden, r].
            a, b = ("lora_embedding_A", "lora_embedding_B") if target == "embed_tokens" else ("lora_A.weight", "lora_B.weight")
            tensors[f"base_model.model.{module}.{a}"] = rng.normal(0, STD, (rank, inp)).astype(np.float32)
            tensors[f"base_model.model.{module}.{b}"] = rng.normal(0, STD, (out, rank)).astype(np.float32)
    out_dir = root / name
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(TINY / arch),
                "r": r,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "target_modules": targets,
                "use_rslora": rslora,
                "use_dora": False,
                "rank_pattern": rank_pattern,
                "alpha_pattern": alpha_pattern,
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "inference_mode": True,
            },
            indent=2,
        )
    )
    return out_dir


def materialise(root: Path) -> dict[str, Path]:
    """Every adapter of `ADAPTERS` as a PEFT directory under `root`."""
    return {name: write_adapter(root, name) for name in ADAPTERS}


GGUF_SLOTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def write_gguf_lora(path: Path, factors: dict[str, np.ndarray], architecture: str, alpha: float,
                    heads: tuple[int, int] | None = None) -> Path:
    """PEFT factors (`...layers.L.self_attn.q_proj.lora_A.weight` and the like) as llama.cpp's GGUF
    LoRA, laid out as `convert_lora_to_gguf.py` writes it: `blk.L.attn_q.weight.lora_a` [r, in] and
    `.lora_b` [out, r] in float32, `adapter.lora.alpha`. `heads` = (query heads, key/value heads)
    for the Llama family, whose converter permutes q's and k's `lora_B` rows as the base's
    (`LlamaModel.permute`)."""
    import gguf

    from gguf_convert import _permute

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    for name, t in sorted(factors.items()):
        layer, module = name.split(".layers.")[1].split(".", 1)
        module, factor = module.rsplit(".lora_", 1)
        slot = GGUF_SLOTS[module]
        if heads and factor.startswith("B") and slot in ("attn_q", "attn_k"):
            t = _permute(t, heads[0], heads[0] if slot == "attn_q" else heads[1])
        w.add_tensor(f"blk.{layer}.{slot}.weight.lora_{factor[0].lower()}", np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    import tempfile

    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    import peft
    import transformers

    DATA.mkdir(parents=True, exist_ok=True)
    out, meta = {}, {
        "reference": f"peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, eager attention, float32",
        "adapters": {},
        "notes": "per adapter: logits [T, V] of the fixture's prompt, layers.{i}.output [T, H] (i < L-1), norm [T, H] (final norm), greedy_ids (8 tokens)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        dirs = materialise(Path(tmp))
        for name, path in dirs.items():
            arch = ADAPTERS[name][0]
            ids = load_file(str(TINY / arch / "reference.safetensors"))["input_ids"].astype(np.int64)
            base = AutoModelForCausalLM.from_pretrained(TINY / arch, dtype=torch.float32, attn_implementation="eager")
            model = PeftModel.from_pretrained(base, path).eval()
            with torch.no_grad():
                x = torch.tensor(ids)[None]
                o = model(input_ids=x, output_hidden_states=True)
                gen = model.generate(input_ids=x, max_new_tokens=8, do_sample=False, pad_token_id=0)
            hs = o.hidden_states
            out[f"{name}/logits"] = o.logits[0].float().numpy()
            for i in range(len(hs) - 2):
                out[f"{name}/layers.{i}.output"] = hs[i + 1][0].float().numpy()
            out[f"{name}/norm"] = hs[-1][0].float().numpy()
            meta["adapters"][name] = {"architecture": arch, "greedy_ids": gen[0, ids.shape[0]:].tolist()}
            print(name, "done", file=sys.stderr)
        save_file(out, str(DATA / "reference.safetensors"))
        (DATA / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
        convert = Path("/tmp/lora-convert/convert_lora_to_gguf.py")
        if convert.exists():
            import subprocess

            for name in ("qwen2_r4",):
                subprocess.run(
                    [sys.executable, str(convert), str(dirs[name]), "--base", str(TINY / ADAPTERS[name][0]),
                     "--outtype", "f32", "--outfile", str(DATA / f"{name}.gguf")],
                    check=True,
                )


if __name__ == "__main__":
    main()
