"""Activation datasets (docs/interventions.md, "Collecting activations"): a corpus run through the
model in batches, each forward pass stopped after the last layer the points need, written as
safetensors shards with an index that a later call resumes from.

    cw.collect(rt, texts, points=["model.layers.12.output"], out="acts/", dtype="float16")

Each shard ``shard-NNNNN.safetensors`` holds one row per token: every point flattened
(``[rows, ...]`` in `dtype`), ``token_ids`` (int32), ``document`` (int64, the document's index in
the corpus) and ``position`` (int32, the token's position in its document); an SAE's features
(`sae_features`) as compressed rows: ``sae.{name}.indptr`` (int64 ``[rows + 1]``),
``sae.{name}.indices`` (int32) and ``sae.{name}.values`` (`dtype`). ``index.json`` lists the shards
and how many documents they cover; it is rewritten (atomically) after each shard, so an
interrupted run resumes after the last shard written.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

__all__ = ["collect"]

_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": None}


def _runtime(model_or_engine):
    from ._native import ModelRuntime

    if isinstance(model_or_engine, ModelRuntime):
        return model_or_engine
    runtime = getattr(model_or_engine, "runtime", None)
    if isinstance(runtime, ModelRuntime):
        return runtime
    return ModelRuntime.load(model_or_engine)


def _save(path: Path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


class _Shard:
    """Rows gathered for the next shard."""

    def __init__(self, points, saes):
        self.dense = {p: [] for p in points}
        self.sparse = {s: ([], [], []) for s in saes}  # per document: counts, indices, values
        self.tokens, self.docs, self.positions = [], [], []
        self.rows = 0

    def add(self, doc_index: int, ids: Sequence[int], obs, points, saes) -> None:
        t = len(ids)
        for p in points:
            a = np.asarray(obs[p])
            self.dense[p].append(a.reshape(t, -1))
        for s in saes:
            f = obs[f"sae.{s}.features"]
            counts, idx, vals = self.sparse[s]
            counts.append(np.diff(f.indptr))
            idx.append(f.flat_indices.astype(np.int32))
            vals.append(f.flat_values)
        self.tokens.append(np.asarray(ids, dtype=np.int32))
        self.docs.append(np.full(t, doc_index, dtype=np.int64))
        self.positions.append(np.arange(t, dtype=np.int32))
        self.rows += t

    def tensors(self, dtype) -> dict:
        out = {p: np.concatenate(v).astype(dtype) for p, v in self.dense.items()}
        for s, (counts, idx, vals) in self.sparse.items():
            out[f"sae.{s}.indptr"] = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
            out[f"sae.{s}.indices"] = np.concatenate(idx).astype(np.int32)
            out[f"sae.{s}.values"] = np.concatenate(vals).astype(dtype)
        out["token_ids"] = np.concatenate(self.tokens)
        out["document"] = np.concatenate(self.docs)
        out["position"] = np.concatenate(self.positions)
        return out


def collect(
    model_or_engine: Any,
    texts_or_token_batches: Iterable,
    points: Sequence[str] = (),
    out: str | os.PathLike = "activations",
    dtype: str = "float16",
    shard_size: int = 65536,
    sae_features: Sequence[str] = (),
    batch_tokens: int = 4096,
    max_tokens: Optional[int] = None,
    progress: bool = True,
) -> dict:
    """Runs a corpus through the model and writes the activations of `points` (and the features
    of the attached SAEs named in `sae_features`) to safetensors shards under `out`.

    `texts_or_token_batches`: texts (encoded as ``generate`` encodes a prompt) or token-id lists,
    one per document. `model_or_engine`: a ``ModelRuntime``, an ``Engine`` (its runtime) or what
    ``ModelRuntime.load`` takes. Documents run in batches of about `batch_tokens` tokens, one
    batched step each, stopped after the last layer the points need (no later layer, no logits);
    the runtime's kept interventions apply. `max_tokens` truncates each document (default: the
    model's context). A shard is written once it holds `shard_size` rows or more (documents are
    not split); rerunning with the same arguments resumes after the last shard written.

    Returns the index (also ``out/index.json``).
    """
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', not {dtype!r}")
    points, saes = list(points), list(sae_features)
    if not points and not saes:
        raise ValueError("collect needs at least one point or SAE to record")
    if any(p.endswith("attention.pattern") for p in points):
        raise ValueError("collect records per-token rows; attention.pattern is [heads, T, T] per document")
    from ._native import ObservationRequest

    rt = _runtime(model_or_engine)
    request = ObservationRequest.exact(points + [f"sae.{s}.features" for s in saes])
    limit = int(max_tokens or rt.session.max_context)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index_path = out / "index.json"
    config = dict(points=points, sae_features=saes, dtype=dtype, shard_size=int(shard_size), max_tokens=limit)
    index = dict(config=config, documents=0, rows=0, shards=[], last_layer=rt.last_layer_needed(request))
    if index_path.exists():
        old = json.loads(index_path.read_text())
        if old.get("config") != config:
            raise ValueError(f"{index_path} was written with {old.get('config')}, not {config}: use another `out`")
        index = old
    done = index["documents"]
    np_dtype = _DTYPES[dtype]
    tokenizer = None
    shard = _Shard(points, saes)
    shard_first = done
    start, tokens_run = time.perf_counter(), 0

    def flush(next_document: int) -> None:
        nonlocal shard, shard_first
        if shard.rows == 0:
            return
        name = f"shard-{len(index['shards']):05d}.safetensors"
        _save(out / name, shard.tensors(np_dtype))
        index["shards"].append(dict(file=name, rows=shard.rows, documents=[shard_first, next_document]))
        index["rows"] += shard.rows
        index["documents"] = next_document
        tmp = index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        os.replace(tmp, index_path)
        shard, shard_first = _Shard(points, saes), next_document

    def run(batch: list) -> None:
        nonlocal tokens_run
        sets = rt.collect_batch([ids for _, ids in batch], request)
        for (d, ids), obs in zip(batch, sets):
            shard.add(d, ids, obs, points, saes)
        tokens_run += sum(len(ids) for _, ids in batch)
        if shard.rows >= shard_size:
            flush(batch[-1][0] + 1)
        if progress:
            rate = tokens_run / max(time.perf_counter() - start, 1e-9)
            print(f"\rcollect: {batch[-1][0] + 1} documents, {index['rows'] + shard.rows:,} rows, "
                  f"{rate:,.0f} tokens/s", end="", file=sys.stderr, flush=True)

    batch: list = []
    batch_len = 0
    d = -1
    for d, doc in enumerate(texts_or_token_batches):
        if d < done:
            continue
        if isinstance(doc, str):
            tokenizer = tokenizer or rt.tokenizer
            ids = tokenizer.encode(doc)
        else:
            ids = [int(t) for t in doc]
        ids = ids[:limit]
        if not ids:
            ids = []
        if batch and batch_len + len(ids) > batch_tokens:
            run(batch)
            batch, batch_len = [], 0
        if ids:
            batch.append((d, ids))
            batch_len += len(ids)
    if batch:
        run(batch)
    flush(max(d + 1, done))
    if progress:
        print(file=sys.stderr)
    return index


def _documents(path: str):
    """One document per line of a text file, or per record of a JSON-lines file (its ``text``
    field, or a list of token ids); ``-`` reads standard input."""
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    try:
        for line in stream:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith((".jsonl", ".json")):
                record = json.loads(line)
                yield record if isinstance(record, list) else record["text"]
            else:
                yield line
    finally:
        if stream is not sys.stdin:
            stream.close()


def add_command(sub, common, fmt, load) -> None:
    """``candlewick collect``: the CLI of `collect` (`load` turns the common options into a runtime)."""

    def run(args) -> int:
        rt = load(args)
        for spec in args.sae or []:
            name, _, rest = spec.partition("=")
            path, _, point = rest.partition("@")
            if not name or not path:
                raise SystemExit(f"--sae wants NAME=PATH[@POINT], got {spec!r}")
            rt.attach_sae(path, point=point or None, name=name)
        index = collect(rt, _documents(args.input), points=args.point or [], out=args.out, dtype=args.out_dtype,
                        shard_size=args.shard_size, sae_features=[s.partition("=")[0] for s in args.sae or []],
                        batch_tokens=args.batch_tokens, max_tokens=args.max_doc_tokens, progress=not args.quiet)
        print(f"{index['rows']} rows of {index['documents']} documents in {len(index['shards'])} shards under {args.out}")
        return 0

    c = sub.add_parser("collect", parents=[common], formatter_class=fmt,
                       help="write a corpus's activations (and SAE features) to safetensors shards")
    c.add_argument("input", help="a text file (a document per line), a .jsonl file (text or token ids), or -")
    c.add_argument("--point", action="append", help="a point to record, e.g. model.layers.12.output (repeatable)")
    c.add_argument("--sae", action="append", metavar="NAME=PATH[@POINT]",
                   help="attach an SAE and record its features (repeatable)")
    c.add_argument("--out", required=True, help="the dataset's directory (rerun to resume)")
    c.add_argument("--out-dtype", default="float16", choices=["float16", "float32"], help="dtype of the stored activations")
    c.add_argument("--shard-size", type=int, default=65536, help="rows per shard (documents are not split)")
    c.add_argument("--batch-tokens", type=int, default=4096, help="tokens run together in one step")
    c.add_argument("--max-doc-tokens", type=int, default=None, help="truncate each document (default: the context)")
    c.set_defaults(func=run)
