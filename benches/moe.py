"""candlewick beside llama.cpp on a mixture of experts of realistic shape (issue 24, item 4).

    python benches/moe.py --peer-python /work/bench-venv/bin/python --runs 5 --threads 2

1. Writes, outside the repository (`--dir`, default /work/bench/moe), a Qwen3-MoE-shaped GGUF
   (`qwen3moe`) with random float16 weights through the `gguf` package's writer: hidden 1024,
   12 layers, 32 experts of width 768 with 4 selected per token (softmax, top-4, renormalised,
   as llama.cpp's Qwen3-MoE graph routes), 16 query heads and 4 key/value heads of width 64 with
   Qwen3's per-head q/k norms, the output projection tied to the embedding. The vocabulary
   (151,936 tokens) and its metadata are copied from a real GGUF (`--tokenizer-from`, the
   Qwen2.5-Coder 0.5B file by default) so that both runtimes load a real tokenizer; the workers
   feed token ids. The router is random, so tokens spread over the experts about evenly.
2. Quantizes it with llama.cpp's own quantizer (`llama_model_quantize`, `--quant`, Q4_K_M by
   default: experts and attention in Q4_K with some Q6_K, the router left in F32) in the
   interpreter that has llama-cpp-python (`--peer-python`).
3. Measures both runtimes with compare.py's workers: each run a fresh process, the runtimes
   alternating run by run, prefill of 128 and 512 prompt tokens and 128 greedy decode tokens,
   medians reported with the ratio candlewick / llama.cpp. With `CANDLEWICK_BENCH_CLOCK=cpu` both
   are timed by their process's CPU time: with `--threads 1` the figure that survives a shared,
   overloaded machine (no thread waits at a barrier for a descheduled sibling).

Both steps 1 and 2 are skipped when their file exists. Nothing is written into the repository.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import compare  # noqa: E402

SHAPE = {
    "hidden": 1024,
    "layers": 12,
    "experts": 32,
    "experts_used": 4,
    "expert_ffn": 768,
    "heads": 16,
    "kv_heads": 4,
    "head_dim": 64,
    # Qwen3-MoE checkpoints give their dense width too; no layer here uses it.
    "dense_ffn": 3072,
    "context": 4096,
}
# llama_ftype (llama.h) of the quantizations this script makes.
FTYPES = {"Q4_K_M": 15, "Q3_K_M": 12, "Q5_K_M": 17, "Q4_0": 2, "Q8_0": 7}


def make_f16(path, tokenizer_from, seed=0):
    """Step 1: the random-weight float16 GGUF, tensors written one at a time (about 2.2 GB)."""
    import gguf
    import numpy as np

    s = SHAPE
    src = gguf.GGUFReader(tokenizer_from)
    tokens = src.fields["tokenizer.ggml.tokens"]
    vocab = len(tokens.data)
    h, d = s["hidden"], s["head_dim"]
    tensors = [("token_embd.weight", (vocab, h), np.float16), ("output_norm.weight", (h,), np.float32)]
    for i in range(s["layers"]):
        b = f"blk.{i}"
        tensors += [
            (f"{b}.attn_norm.weight", (h,), np.float32),
            (f"{b}.attn_q.weight", (s["heads"] * d, h), np.float16),
            (f"{b}.attn_k.weight", (s["kv_heads"] * d, h), np.float16),
            (f"{b}.attn_v.weight", (s["kv_heads"] * d, h), np.float16),
            (f"{b}.attn_output.weight", (h, s["heads"] * d), np.float16),
            (f"{b}.attn_q_norm.weight", (d,), np.float32),
            (f"{b}.attn_k_norm.weight", (d,), np.float32),
            (f"{b}.ffn_norm.weight", (h,), np.float32),
            (f"{b}.ffn_gate_inp.weight", (s["experts"], h), np.float32),
            (f"{b}.ffn_gate_exps.weight", (s["experts"], s["expert_ffn"], h), np.float16),
            (f"{b}.ffn_up_exps.weight", (s["experts"], s["expert_ffn"], h), np.float16),
            (f"{b}.ffn_down_exps.weight", (s["experts"], h, s["expert_ffn"]), np.float16),
        ]
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("random-qwen3moe-1024x12-32e4")
    w.add_context_length(s["context"])
    w.add_embedding_length(h)
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["dense_ffn"])
    w.add_expert_feed_forward_length(s["expert_ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["experts_used"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for field in src.fields.values():
        if field.name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub)
    for name, shape, dtype in tensors:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, dtype in tensors:
        if "norm" in name:
            t = np.ones(shape, dtype=dtype)
        else:
            # Rows of unit-variance outputs for unit-variance inputs (the router sharper, so that
            # selection is decided rather than a near tie everywhere).
            fan_in = shape[-1]
            scale = (4.0 if "gate_inp" in name else 1.0) / np.sqrt(fan_in)
            if name == "token_embd.weight":
                scale = 1.0
            t = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)
        w.write_tensor_data(t)
    w.close()
    return vocab


def quantize(src, dest, quant, threads):
    """Step 2 (under llama-cpp-python): llama.cpp's quantizer, as llama-quantize runs it."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype, p.nthread = FTYPES[quant], threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(p))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def make(args):
    """Steps 1 and 2, in the peer's interpreter (it has gguf and llama-cpp-python)."""
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    f16, q = out / "moe-f16.gguf", out / f"moe-{args.quant}.gguf"
    if not f16.exists():
        t = time.perf_counter()
        tmp = f16.with_suffix(".tmp")
        make_f16(tmp, args.tokenizer_from)
        tmp.rename(f16)
        print(f"wrote {f16} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    if not q.exists():
        t = time.perf_counter()
        tmp = q.with_suffix(".tmp")
        quantize(f16, tmp, args.quant, args.threads)
        tmp.rename(q)
        print(f"wrote {q} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(q)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/work/bench/moe", help="where the model files go (outside the repo)")
    ap.add_argument("--tokenizer-from", default="/work/bench/qwen2.5-coder-0.5b.gguf")
    ap.add_argument("--quant", default="Q4_K_M", choices=sorted(FTYPES))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--lens", default="128,512")
    ap.add_argument("--runtimes", default="candlewick,llama.cpp")
    ap.add_argument("--peer-python", default=os.environ.get("BENCH_PYTHON", sys.executable))
    ap.add_argument("--make-only", action="store_true", help="write the files and stop")
    ap.add_argument("--_make", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "moe.json"))
    args = ap.parse_args()
    if args._make:
        return make(args)
    cmd = [args.peer_python, __file__, "--_make", "--dir", args.dir, "--tokenizer-from", args.tokenizer_from,
           "--quant", args.quant, "--threads", str(args.threads)]
    model = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if args.make_only:
        print(model)
        return
    lens = [int(x) for x in args.lens.split(",")]
    runtimes = [r for r in args.runtimes.split(",") if r]
    results = {r: [] for r in runtimes}
    for i in range(args.runs):
        # Alternating run by run, so a change in the shared host's load hits every runtime.
        for r in runtimes:
            python = sys.executable if r.startswith("candlewick") else args.peer_python
            results[r].append(compare.run(r, python, model, args.threads, lens, args.decode_tokens))
            print(f"run {i + 1}/{args.runs} {r}: done", file=sys.stderr)
    summary = compare.summarize(results, lens)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": model,
        "shape": SHAPE,
        "quant": args.quant,
        "threads": args.threads,
        "runs": args.runs,
        "decode_tokens": args.decode_tokens,
        "cpu": compare.cpu_name(),
        "clock": os.environ.get("CANDLEWICK_BENCH_CLOCK", "wall"),
        "load_avg": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "raw": results}, indent=2))
    print(f"CPU: {meta['cpu']}, {args.threads} threads, medians of {args.runs} runs, {args.quant}, "
          f"{meta['clock']} clock, load average {meta['load_avg'][0]:.1f} at the end")
    compare.print_model(Path(model).name, summary, lens)
    print("\n### candlewick / llama.cpp\n")
    print(compare.ratio_table({Path(model).name: summary}, lens))


if __name__ == "__main__":
    main()
