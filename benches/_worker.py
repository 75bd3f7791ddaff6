"""Measures one runtime in a fresh process and prints one JSON line (used by compare.py).

Usage: python _worker.py RUNTIME MODEL THREADS PROMPT_LENS DECODE_TOKENS
RUNTIME is candlewick, candlewick-py (decode driven from Python), llama.cpp or transformers.
"""

import json
import os
import sys
import time


def status_mb(field):
    """A size field of /proc/self/status (VmHWM: peak resident, VmRSS: resident now) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb():
    return status_mb("VmHWM")


def prompt_ids(n, vocab):
    # The same deterministic ids for every runtime: ordinary tokens, no specials.
    import numpy as np

    rng = np.random.default_rng(1234)
    return [2] + rng.integers(1000, min(vocab, 50000), size=n - 1).tolist()


# CANDLEWICK_BENCH_CLOCK=cpu: this process's CPU time instead of wall time (candlewick and
# llama.cpp). On an overloaded shared machine wall time mostly measures the neighbours, while CPU
# time with one thread (no worker spinning at a barrier) still compares two runtimes or builds.
clock = time.process_time if os.environ.get("CANDLEWICK_BENCH_CLOCK") == "cpu" else time.perf_counter


def run_candlewick(model, threads, lens, n_decode, python_loop):
    import numpy as np

    import candlewick as cw

    t = clock()
    # benches/device_check.sh measures the same thing on a GPU.
    # The context is the model's unless the longest prompt needs more (as the peer's is sized).
    need = max(lens) + n_decode + 8
    # CANDLEWICK_BENCH_KV_CACHE_TYPE=q8_0 measures another cache type (builds before it had none).
    kv = {"kv_cache_type": os.environ["CANDLEWICK_BENCH_KV_CACHE_TYPE"]} if os.environ.get("CANDLEWICK_BENCH_KV_CACHE_TYPE") else {}
    rt = cw.ModelRuntime.load(model, device=os.environ.get("CANDLEWICK_BENCH_DEVICE", "cpu"), threads=threads, **kv)
    if rt.model_info["max_context"] < need:
        rt = cw.ModelRuntime.load(model, device=os.environ.get("CANDLEWICK_BENCH_DEVICE", "cpu"), threads=threads,
                                  max_context=need, **kv)
    load = clock() - t
    # CANDLEWICK_BENCH_LORA=FILE: decode with that LoRA (a GGUF LoRA, so the peer reads the same).
    if os.environ.get("CANDLEWICK_BENCH_LORA"):
        rt.load_adapter(os.environ["CANDLEWICK_BENCH_LORA"], name="bench")
        rt.set_adapters("bench")
    vocab = rt.model_info["vocab_size"]
    out = {"load_s": load, "runs": {}}
    for n in lens:
        ids = prompt_ids(n, vocab)
        rt.session.reset()
        t = clock()
        logits = rt.prefill(ids).wait().logits[-1]
        first = int(np.argmax(logits))
        ttft = clock() - t
        if python_loop:
            tok = first
            t = clock()
            for _ in range(n_decode):
                tok = int(np.argmax(rt.decode([tok]).wait().logits[-1]))
            decode = clock() - t
        else:
            # The Rust loop: the session already holds the prompt, so only the last token is re-run.
            t = clock()
            r = rt.generate(ids, max_tokens=n_decode + 1, temperature=0.0, ignore_eos=True)
            decode = r.usage["decode_seconds"] if clock is time.perf_counter else clock() - t
        out["runs"][str(n)] = {"prefill_tps": n / ttft, "ttft_s": ttft, "decode_tps": n_decode / decode,
                               "cache_mb": rt.session.cache_bytes / 1e6}
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def run_llama(model, threads, lens, n_decode):
    import numpy as np
    from llama_cpp import Llama

    t = clock()
    # The context is sized to the longest prompt and its decoded tokens (llama.cpp allocates it
    # whole at load), and no smaller than the 2,048 of earlier runs so short rows stay comparable.
    n_ctx = max(2048, max(lens) + n_decode + 8)
    lora = {"lora_path": os.environ["CANDLEWICK_BENCH_LORA"]} if os.environ.get("CANDLEWICK_BENCH_LORA") else {}
    llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, logits_all=False, **lora)
    load = clock() - t
    vocab = llm.n_vocab()

    def last_logits():
        # Without logits_all, llama-cpp-python keeps no copy: read the context's last row.
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

    out = {"load_s": load, "runs": {}}
    for n in lens:
        ids = prompt_ids(n, vocab)
        llm.reset()
        t = clock()
        llm.eval(ids)
        first = int(np.argmax(last_logits()))
        ttft = clock() - t
        tok = first
        t = clock()
        for _ in range(n_decode):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        decode = clock() - t
        out["runs"][str(n)] = {"prefill_tps": n / ttft, "ttft_s": ttft, "decode_tps": n_decode / decode}
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def run_transformers(model, threads, lens, n_decode):
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp())
    shutil.copy(model, tmp / "model.gguf")
    t = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(tmp, gguf_file="model.gguf", dtype=torch.float32).eval()
    load = time.perf_counter() - t
    vocab = m.config.vocab_size
    out = {"load_s": load, "runs": {}}
    with torch.no_grad():
        for n in lens:
            ids = torch.tensor([prompt_ids(n, vocab)])
            t = time.perf_counter()
            r = m(ids, use_cache=True)
            tok = r.logits[0, -1].argmax().view(1, 1)
            ttft = time.perf_counter() - t
            past = r.past_key_values
            t = time.perf_counter()
            for _ in range(n_decode):
                r = m(tok, past_key_values=past, use_cache=True)
                past = r.past_key_values
                tok = r.logits[0, -1].argmax().view(1, 1)
            decode = time.perf_counter() - t
            out["runs"][str(n)] = {"prefill_tps": n / ttft, "ttft_s": ttft, "decode_tps": n_decode / decode}
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def main():
    runtime, model, threads, lens, n_decode = sys.argv[1:6]
    threads, n_decode = int(threads), int(n_decode)
    lens = [int(x) for x in lens.split(",")]
    if runtime == "candlewick":
        out = run_candlewick(model, threads, lens, n_decode, python_loop=False)
    elif runtime == "candlewick-py":
        out = run_candlewick(model, threads, lens, n_decode, python_loop=True)
    elif runtime == "llama.cpp":
        out = run_llama(model, threads, lens, n_decode)
    elif runtime == "transformers":
        out = run_transformers(model, threads, lens, n_decode)
    else:
        raise SystemExit(f"unknown runtime {runtime}")
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
