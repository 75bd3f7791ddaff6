"""``candlewick embed`` and ``candlewick rerank``: `ModelRuntime.embed` and `ModelRuntime.rerank`
from the command line (docs/embeddings.md)."""

from __future__ import annotations

import json
import sys

import numpy as np


def _texts(args) -> list:
    texts = list(args.text or [])
    if args.file:
        f = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        with f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise SystemExit("no text: give TEXT arguments or --file FILE (a text per line; - reads standard input)")
    return texts


def add_command(sub, common, fmt, load) -> None:
    """Adds ``embed`` and ``rerank`` (`load` turns the common options into a runtime)."""

    def run_embed(args) -> int:
        rt = load(args)
        texts = _texts(args)
        vectors = rt.embed(texts, pooling=args.pooling, normalize=False if args.no_normalize else None,
                           dimensions=args.dimensions, prompt_name=args.prompt_name, prompt=args.prompt)
        if args.output:
            np.save(args.output, vectors)
            if not args.quiet:
                print(f"{vectors.shape[0]} embeddings of {vectors.shape[1]} dimensions in {args.output}", file=sys.stderr)
            return 0
        for i, (t, v) in enumerate(zip(texts, vectors)):
            print(json.dumps({"index": i, "text": t, "embedding": [round(float(x), 7) for x in v]}))
        return 0

    def run_rerank(args) -> int:
        rt = load(args)
        docs = _texts(args)
        for r in rt.rerank(args.query, docs, top_n=args.top_n, instruction=args.instruction):
            print(json.dumps({"index": r["index"], "relevance_score": round(r["relevance_score"], 6),
                              "document": docs[r["index"]]}))
        return 0

    e = sub.add_parser("embed", parents=[common], formatter_class=fmt,
                       help="embed texts (sentence-transformers pooling, prompts, Matryoshka dimensions)")
    e.add_argument("text", nargs="*", help="texts to embed")
    e.add_argument("--file", "-f", default=None, help="a file with a text per line (- reads standard input)")
    e.add_argument("--prompt-name", default=None, help="one of the model's prompts, e.g. query or document")
    e.add_argument("--prompt", default=None, help="a prompt of one's own put in front of each text")
    e.add_argument("--dimensions", type=int, default=None, help="keep the first N dimensions (then normalise)")
    e.add_argument("--pooling", default=None, choices=["mean", "cls", "lasttoken", "max"],
                   help="override the model's pooling")
    e.add_argument("--no-normalize", action="store_true", help="do not scale the vectors to unit length")
    e.add_argument("--output", "-o", default=None, help="write a float32 .npy array instead of JSON lines")
    e.set_defaults(func=run_embed)
    r = sub.add_parser("rerank", parents=[common], formatter_class=fmt,
                       help="score documents against a query with a cross-encoder (bge-reranker) "
                            "or a yes/no reranker (Qwen3-Reranker)")
    r.add_argument("query")
    r.add_argument("text", nargs="*", help="documents")
    r.add_argument("--file", "-f", default=None, help="a file with a document per line (- reads standard input)")
    r.add_argument("--top-n", type=int, default=None)
    r.add_argument("--instruction", default=None,
                   help="the task instruction of a yes/no reranker's prompt (a cross-encoder takes none)")
    r.set_defaults(func=run_rerank)
