"""Real-size benchmark models with random weights (issue 43): GGUF files with the exact tensor
shapes of Qwen2.5-3B and Llama-3.1-8B, quantized by llama.cpp's own code.

    /work/bench/venv-llama/bin/python benches/make_synthetic.py --shape qwen2.5-3b \\
        --types Q4_K_M,Q8_0,IQ4_XS,IQ3_XXS,IQ2_XXS --out /var/tmp/synthetic

Runs in a venv with llama-cpp-python (built from source, benches/README.md), numpy and gguf.

- The float16 source (`<shape>-F16.gguf`): weights N(0, 0.02) (norms 1, biases 0), written one
  tensor at a time (never the whole model in memory). The tokenizer: a byte-level BPE vocabulary
  (the 256 byte symbols of GPT-2's table and two control tokens, as the tests' tiny models have)
  padded with control tokens to the shape's vocabulary size, so the embedding and LM head are
  the real model's size; token ids a benchmark feeds are any below the vocabulary size.
- Q4_K_M, Q8_0, IQ4_XS, IQ3_XXS: `llama_model_quantize` on that source (llama.cpp's tensor-type
  mixture for each file type, as `llama-quantize` writes it; no importance matrix).
- IQ2_XXS: llama.cpp refuses it without an importance matrix, and `llama_model_quantize_params
  .imatrix` is a C++ map no ctypes caller can build, so the file is written here, tensor by
  tensor, through ggml's own `ggml_quantize_chunk` with a random importance matrix (uniform in
  [0.5, 1.5) per column: its values only steer the search, the speed is the type's): every 2-D
  weight IQ2_XXS except `token_embd` / `output` (Q4_K, as llama.cpp keeps embeddings and heads
  at 4+ bits in its IQ2 mixtures). `--reuse-layers` writes layer 0's blocks for every layer.

The shapes not written: OLMoE-1B-7B and gpt-oss-20b (3-D expert tensors; time did not allow,
issue 43 item 5).
"""

import argparse
import ctypes
import glob
import os
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import gguf

T = gguf.GGMLQuantizationType

SHAPES = {
    # Qwen2.5-3B: config.json of Qwen/Qwen2.5-3B (tied embeddings, q/k/v biases).
    "qwen2.5-3b": dict(arch="qwen2", hidden=2048, layers=36, heads=16, kv_heads=2, ff=11008, vocab=151936,
                       tied=True, qkv_bias=True, rope_theta=1e6, eps=1e-6, context=32768),
    # Llama-3.1-8B: config.json of meta-llama/Llama-3.1-8B (llama3 rope scaling not written: the
    # speed is the same).
    "llama-3.1-8b": dict(arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, ff=14336, vocab=128256,
                         tied=False, qkv_bias=False, rope_theta=5e5, eps=1e-5, context=131072),
}

FTYPES = {"Q4_K_M": 15, "Q8_0": 7, "IQ4_XS": 30, "IQ3_XXS": 23}


def byte_symbols():
    """GPT-2's byte-to-symbol table (`bytes_to_unicode`)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tensors(s):
    """(name, shape [rows, cols] or [n], kind) of every tensor, in llama.cpp's order."""
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    out = [("token_embd.weight", (s["vocab"], h), "w")]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h,), "one"))
        for n, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            out.append((b + n + ".weight", (rows, h), "w"))
            if s["qkv_bias"]:
                out.append((b + n + ".bias", (rows,), "zero"))
        out.append((b + "attn_output.weight", (h, h), "w"))
        out.append((b + "ffn_norm.weight", (h,), "one"))
        out.append((b + "ffn_gate.weight", (s["ff"], h), "w"))
        out.append((b + "ffn_up.weight", (s["ff"], h), "w"))
        out.append((b + "ffn_down.weight", (h, s["ff"]), "w"))
    out.append(("output_norm.weight", (h,), "one"))
    if not s["tied"]:
        out.append(("output.weight", (s["vocab"], h), "w"))
    return out


def values(name, shape, kind, seed):
    if kind == "one":
        return np.ones(shape, np.float32)
    if kind == "zero":
        return np.zeros(shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


def writer_for(path, s):
    w = gguf.GGUFWriter(str(path), s["arch"])
    a = s["arch"]
    w.add_string("general.name", f"synthetic {path.stem}")
    w.add_uint32(f"{a}.context_length", s["context"])
    w.add_uint32(f"{a}.embedding_length", s["hidden"])
    w.add_uint32(f"{a}.block_count", s["layers"])
    w.add_uint32(f"{a}.feed_forward_length", s["ff"])
    w.add_uint32(f"{a}.attention.head_count", s["heads"])
    w.add_uint32(f"{a}.attention.head_count_kv", s["kv_heads"])
    w.add_float32(f"{a}.rope.freq_base", s["rope_theta"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s["eps"])
    w.add_uint32(f"{a}.vocab_size", s["vocab"])
    # The one merge's result is a token too: a tokenizer whose merge makes a token outside the
    # vocabulary is refused by candlewick (and by Hugging Face tokenizers) when it is built.
    tokens = ["<|bos|>", "<|eos|>", *byte_symbols(), "\u0120t"]
    types = [3, 3] + [1] * 257
    tokens += [f"<|pad_{i}|>" for i in range(s["vocab"] - len(tokens))]
    types += [3] * (s["vocab"] - len(types))
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_array("tokenizer.ggml.merges", ["\u0120 t"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 1)
    return w


def ggml():
    import llama_cpp

    libs = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so*"))
    lib = ctypes.CDLL(sorted(libs)[0])
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def quantize(lib, qtype, x, threads, imatrix=None):
    """`x [rows, cols]` float32 as `qtype` blocks by ggml's `ggml_quantize_chunk`, rows split over threads."""
    rows, cols = x.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty((rows, cols // block * size), np.uint8)
    lib.ggml_quantize_init(int(qtype))
    im = imatrix.ctypes.data if imatrix is not None else None
    parts = np.array_split(np.arange(rows), threads)

    def work(r):
        if len(r) == 0:
            return
        start = int(r[0])
        lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data,
                                start * cols, len(r), cols, im)

    ts = [threading.Thread(target=work, args=(p,)) for p in parts]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return out


def write(path, s, seed, kind_of, threads, reuse=False):
    """Writes the model, each tensor as `kind_of(name, shape, kind)` returns: None for float16
    (1-D: float32), else a ggml type quantized through ggml."""
    lib = None
    w = writer_for(path, s)
    plan = []
    for name, shape, kind in tensors(s):
        qtype = kind_of(name, shape, kind)
        if qtype is None:
            dt = np.float32 if len(shape) == 1 else np.float16
            w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
        plan.append((name, shape, kind, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # The quantized blocks of layer 0's tensors, reused for every layer (see `--reuse-layers`).
    first = {}
    for name, shape, kind, qtype in plan:
        role = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if qtype is not None and reuse and role in first:
            w.write_tensor_data(first[role])
            continue
        x = values(name, shape, kind, seed)
        if qtype is None:
            w.write_tensor_data(x if len(shape) == 1 else x.astype(np.float16))
        else:
            lib = lib or ggml()
            imatrix = None
            if qtype not in (T.Q4_K, T.Q6_K, T.Q8_0):
                imatrix = np.random.default_rng(seed).uniform(0.5, 1.5, size=shape[1]).astype(np.float32)
            blocks = quantize(lib, qtype, np.ascontiguousarray(x), threads, imatrix)
            if reuse:
                first[role] = blocks
            w.write_tensor_data(blocks)
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-3b")
    ap.add_argument("--types", default="Q4_K_M,Q8_0,IQ4_XS,IQ3_XXS,IQ2_XXS")
    ap.add_argument("--out", default="/var/tmp/synthetic")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--reuse-layers", action="store_true",
                    help="IQ2_XXS: quantize layer 0's tensors once and write their blocks for every layer "
                         "(ggml's IQ2_XXS search takes about 90 s a Qwen2.5-3B layer on 2 loaded cores; "
                         "the bytes a step reads, and so the speed, are the same)")
    args = ap.parse_args()
    s = SHAPES[args.shape]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    types = [t for t in args.types.split(",") if t]
    src = out / f"{args.shape}-F16.gguf"
    if any(t in FTYPES for t in types) and not src.exists():
        t0 = time.time()
        write(src, s, args.seed, lambda n, sh, k: None, args.threads)
        print(f"{src}: {src.stat().st_size / 1e9:.2f} GB in {time.time() - t0:.0f} s", flush=True)
    for t in types:
        dst = out / f"{args.shape}-{t}.gguf"
        if dst.exists():
            print(f"{dst}: exists", flush=True)
            continue
        t0 = time.time()
        if t in FTYPES:
            import llama_cpp

            p = llama_cpp.llama_model_quantize_default_params()
            p.nthread = args.threads
            p.ftype = FTYPES[t]
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
            if rc != 0:
                sys.exit(f"llama_model_quantize {t} failed: {rc}")
        elif t == "IQ2_XXS":
            def kind_of(name, shape, kind):
                if len(shape) == 1:
                    return None
                return T.Q4_K if name in ("token_embd.weight", "output.weight") else T.IQ2_XXS

            write(dst, s, args.seed, kind_of, args.threads, args.reuse_layers)
        else:
            sys.exit(f"unknown type {t}")
        print(f"{dst}: {dst.stat().st_size / 1e9:.2f} GB in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
