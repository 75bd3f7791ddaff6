"""The host's limits and how near a run comes to them (issue 27): decode as a fraction of the
measured memory read bandwidth, prefill as a fraction of the measured int8 multiply-accumulate
peak. Used by compare.py (`--roofline`), or alone:

    python benches/roofline.py --threads 2 [--model PATH --decode-tps X --prefill-tps Y --context N]

The probes (`roofline/probe.c`) are compiled here with the host's C compiler and run with the
benchmark's thread count; a machine shared with other work lowers them, so measure on a quiet one.
"""

import argparse
import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def probe_binary() -> str:
    out = Path(tempfile.gettempdir()) / f"candlewick-roofline-probe-{os.getuid()}"
    src = HERE / "roofline" / "probe.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O2", "-march=native", "-pthread", str(src), "-o", str(out)], check=True)
    return str(out)


def probe(mode: str, threads: int, *extra: str, runs: int = 3) -> float:
    """The best of `runs` probe results (GB/s for `read`, GMAC/s for `int8`/`bf16`)."""
    vals = [float(subprocess.run([probe_binary(), mode, str(threads), *extra], capture_output=True, text=True,
                                 check=True).stdout.split()[-1]) for _ in range(runs)]
    return max(vals)


def host_limits(threads: int) -> dict:
    """Read bandwidth over a 512 MiB buffer (well past the caches) and the int8 and bf16 peaks."""
    return {
        "read_gbs": probe("read", threads, "512"),
        "int8_gmacs": probe("int8", threads),
        "bf16_gmacs": probe("bf16", threads),
        "threads": threads,
    }


def gguf_bytes(model: str) -> dict:
    """What one decoded token reads of a GGUF's weights, and the multiply-accumulates one prompt
    token costs in its matrix products (attention over the context aside; the output projection
    left out, since a prompt computes logits for its last token only). The token embedding is
    read one row a token, unless the output projection shares it."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(model)
    total = 0
    embed = output = 0
    macs = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        total += n
        if t.name == "token_embd.weight":
            embed = n
        elif t.name == "output.weight":
            output = n
        if len(t.shape) >= 2 and t.name not in ("token_embd.weight", "output.weight"):
            macs += int(np.prod([int(x) for x in t.shape]))
    # A tied output projection is the embedding, read whole by every decoded token.
    tied = output == 0
    per_token = total if tied else total - embed
    return {"weight_bytes_per_token": per_token, "matmul_macs_per_token": macs, "tied_embeddings": tied}


def kv_bytes_per_token(model: str, context: int, bytes_per_value: int = 2) -> int:
    """The KV cache one decoded token reads at `context` (float16 cache, every layer's window)."""
    from gguf import GGUFReader

    r = GGUFReader(model)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key, default=None):
        f = r.fields.get(f"{arch}.{key}")
        if f is None:
            return default
        return [int(x) for x in f.parts[f.data[0]]] if len(f.data) == 1 else [int(f.parts[i][0]) for i in f.data]

    layers = field("block_count")[0]
    kv = field("attention.head_count_kv") or field("attention.head_count")
    kv = kv if len(kv) == layers else kv * layers
    key_len = (field("attention.key_length") or [field("embedding_length")[0] // field("attention.head_count")[0]])[0]
    window = (field("attention.sliding_window") or [0])[0]
    total = 0
    for i, h in enumerate(kv):
        span = context
        if window and arch.startswith("gemma3") and (i + 1) % 6 != 0:
            span = min(context, window)  # Gemma 3: five local layers, then one global
        total += 2 * h * key_len * span * bytes_per_value
    return total


def fractions(model: str, limits: dict, decode_tps: float, prefill_tps: float, context: int) -> dict:
    w = gguf_bytes(model)
    kv = kv_bytes_per_token(model, context)
    read = (w["weight_bytes_per_token"] + kv) * decode_tps / 1e9
    macs = w["matmul_macs_per_token"] * prefill_tps / 1e9
    return {
        "decode_gbs": read,
        "decode_of_bandwidth": read / limits["read_gbs"],
        "prefill_gmacs": macs,
        "prefill_of_int8_peak": macs / limits["int8_gmacs"] if limits["int8_gmacs"] else float("nan"),
        "bytes_per_token": w["weight_bytes_per_token"] + kv,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model")
    ap.add_argument("--decode-tps", type=float)
    ap.add_argument("--prefill-tps", type=float)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    limits = host_limits(args.threads)
    out = {"limits": limits}
    if args.model and args.decode_tps and args.prefill_tps:
        out["model"] = fractions(args.model, limits, args.decode_tps, args.prefill_tps, args.context)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
