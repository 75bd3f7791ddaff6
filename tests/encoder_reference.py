"""What sentence-transformers computes for the encoders of tests/encoder_fixtures.py: the
references tests/test_encoders.py compares with.

    /work/bench/venv-ref/bin/python tests/encoder_reference.py   (torch, transformers 5.x,
    sentence-transformers; not run by CI)

Checks first that transformers loads every checkpoint with no missing or unexpected tensor (so
the layout is the real one), then writes tests/data/encoders/reference.safetensors (one float32
array per case) and reference.json (each case's arguments, the tokenizers' ids and token types,
the library versions).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import encoder_fixtures as fx  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "encoders"


def main() -> None:
    import sentence_transformers
    import transformers
    from sentence_transformers import CrossEncoder, SentenceTransformer, models
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="cw-encoder-ref-"))
    paths = fx.materialise(root)
    for name, path in paths.items():
        cls = AutoModelForSequenceClassification if "rerank" in name else AutoModel
        _, info = cls.from_pretrained(str(path), output_loading_info=True)
        bad = {k: v for k, v in info.items() if v}
        assert not bad, (name, bad)

    out: dict[str, np.ndarray] = {}
    cases: dict[str, dict] = {}
    ids: dict[str, list] = {}

    texts_of: dict[str, list] = {}

    def case(name: str, model, args: dict, texts=None, **encode):
        texts = texts or fx.TEXTS
        if texts is not fx.TEXTS:
            texts_of[name] = texts
        batch = model.encode(texts, convert_to_numpy=True, batch_size=len(texts), **encode)
        # Padding must not change anything: each text alone gives the same vector.
        for i, t in enumerate(texts):
            alone = model.encode([t], convert_to_numpy=True, **encode)[0]
            assert np.allclose(alone, batch[i], atol=1e-5), (name, i, np.abs(alone - batch[i]).max())
        out[name] = batch.astype(np.float32)
        cases[name] = args

    for key in ("bert-embed", "xlmr-embed"):
        m = SentenceTransformer(str(paths[key]), device="cpu")
        ids[key] = [m.tokenizer(t)["input_ids"] for t in fx.TEXTS]
        case(f"{key}/default", m, {})
    m = SentenceTransformer(str(paths["bert-embed"]), device="cpu")
    case("bert-embed/query", m, {"prompt_name": "query"}, prompt_name="query")
    case("bert-embed/passage", m, {"prompt_name": "passage"}, prompt_name="passage")
    case("bert-embed/dim12", m, {"dimensions": 12}, truncate_dim=12, normalize_embeddings=True)
    word = models.Transformer(str(paths["bert-embed"]), max_seq_length=fx.MAX_SEQ_LENGTH)
    raw = SentenceTransformer(modules=[word, models.Pooling(32, pooling_mode="cls")], device="cpu")
    case("bert-embed/cls_raw", raw, {"pooling": "cls", "normalize": False})

    # ModernBERT: every text but two is longer than the window (8), and the long one is cut at
    # max_seq_length (128) past which the rotary positions would go on.
    key = "modernbert-embed"
    m = SentenceTransformer(str(paths[key]), device="cpu")
    ids[key] = [m.tokenizer(t)["input_ids"] for t in fx.TEXTS]
    case(f"{key}/default", m, {})
    case(f"{key}/query", m, {"prompt_name": "query"}, prompt_name="query")
    case(f"{key}/long", m, {}, texts=[fx.LONG, fx.LONG[:150], fx.TEXTS[2]])
    case(f"{key}/dim16", m, {"dimensions": 16}, truncate_dim=16, normalize_embeddings=True)

    # nomic-bert: transformers ≥ 5.2's own NomicBertModel, reading the released layout (remote
    # code's tensor names, renamed as it loads) from the fixture's config (see its BERT-named keys).
    key = "nomic-embed"
    m = SentenceTransformer(str(paths[key]), device="cpu")
    ids[key] = [m.tokenizer(t)["input_ids"] for t in fx.TEXTS]
    case(f"{key}/default", m, {})
    case(f"{key}/query", m, {"prompt_name": "query"}, prompt_name="query")
    case(f"{key}/long", m, {}, texts=[fx.LONG, fx.TEXTS[2]])

    pairs = [(fx.QUERY, d) for d in fx.DOCUMENTS]
    # ModernBERT's head on the mean (gte-reranker-modernbert) and, in a copy, on the first token.
    cls_dir = root / "modernbert-rerank-cls"
    shutil.copytree(paths["modernbert-rerank"], cls_dir)
    cfg = json.loads((cls_dir / "config.json").read_text())
    (cls_dir / "config.json").write_text(json.dumps(cfg | {"classifier_pooling": "cls"}))
    out["modernbert-rerank/cls"] = np.asarray(
        CrossEncoder(str(cls_dir), device="cpu").predict(pairs, convert_to_numpy=True), dtype=np.float32
    )
    cases["modernbert-rerank/cls"] = {}
    for key in ("bert-rerank", "xlmr-rerank", "modernbert-rerank"):
        ce = CrossEncoder(str(paths[key]), device="cpu")
        assert ce.num_labels == 1
        tok = AutoTokenizer.from_pretrained(str(paths[key]))
        enc = [tok(q, d) for q, d in pairs]
        ids[key] = [e["input_ids"] for e in enc]
        ids[f"{key}/types"] = [e.get("token_type_ids", [0] * len(e["input_ids"])) for e in enc]
        scores = ce.predict(pairs, convert_to_numpy=True)
        alone = np.array([ce.predict([p], convert_to_numpy=True)[0] for p in pairs])
        assert np.allclose(alone, scores, atol=1e-6)
        out[f"{key}/default"] = np.asarray(scores, dtype=np.float32)
        cases[f"{key}/default"] = {}
        logits = ce.predict(pairs, convert_to_numpy=True, activation_fn=torch.nn.Identity())
        out[f"{key}/logits"] = np.asarray(logits, dtype=np.float32)
        # Pairs past the 64 positions, cut longest-first to them (the tokenizer's own limit, 512,
        # would index past the position table).
        ce64 = CrossEncoder(str(paths[key]), device="cpu", max_length=128 if "modernbert" in key else 64)
        out[f"{key}/long"] = np.asarray(ce64.predict(fx.LONG_PAIRS, convert_to_numpy=True), dtype=np.float32)

    DATA.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(out, str(DATA / "reference.safetensors"))
    meta = {
        "cases": cases,
        "texts": texts_of,
        "input_ids": ids,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
        },
    }
    (DATA / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", len(out), "arrays to", DATA)


if __name__ == "__main__":
    main()
