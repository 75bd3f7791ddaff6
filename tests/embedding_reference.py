"""What sentence-transformers and transformers compute for the checkpoints of
tests/embedding_fixtures.py: the references tests/test_embeddings.py compares with.

    /work/bench/venv-ref/bin/python tests/embedding_reference.py   (torch, transformers 5.x,
    sentence-transformers; not run by CI)

Writes tests/data/embeddings/reference.safetensors (one float32 array per case) and
reference.json (each case's arguments, the tokenizer's input ids, the library versions).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import embedding_fixtures as fx  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "embeddings"


def st_model(path: Path, pooling: str | None = None, normalize: bool = True):
    """The directory as sentence-transformers loads it, or its Transformer with another pooling."""
    from sentence_transformers import SentenceTransformer, models

    if pooling is None:
        return SentenceTransformer(str(path), device="cpu")
    word = models.Transformer(str(path))
    mods = [word, models.Pooling(word.get_word_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        mods.append(models.Normalize())
    return SentenceTransformer(modules=mods, device="cpu")


def main() -> None:
    import sentence_transformers
    import transformers

    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="cw-embed-ref-"))
    paths = fx.materialise(root)
    out: dict[str, np.ndarray] = {}
    cases: dict[str, dict] = {}

    def case(name: str, model, args: dict, **encode):
        batch = model.encode(fx.TEXTS, convert_to_numpy=True, batch_size=len(fx.TEXTS), **encode)
        # Padding must not change anything: each text alone gives the same vector.
        for i, t in enumerate(fx.TEXTS):
            alone = model.encode([t], convert_to_numpy=True, **encode)[0]
            assert np.allclose(alone, batch[i], atol=1e-5), (name, i, np.abs(alone - batch[i]).max())
        out[name] = batch.astype(np.float32)
        cases[name] = args

    ids = {}
    for key in ("qwen3", "gemma"):
        m = st_model(paths[key])
        ids[key] = [m.tokenizer(t)["input_ids"] for t in fx.TEXTS]
        case(f"{key}/default", m, {})
        case(f"{key}/query", m, {"prompt_name": "query"}, prompt_name="query")
        case(f"{key}/document", m, {"prompt_name": "document"}, prompt_name="document")
        dim = 32 if key == "qwen3" else 24
        case(f"{key}/dim{dim}", m, {"dimensions": dim}, truncate_dim=dim, normalize_embeddings=True)
    q = paths["qwen3"]
    case("qwen3/mean_raw", st_model(q, "mean", normalize=False), {"pooling": "mean", "normalize": False})
    case("qwen3/cls", st_model(q, "cls"), {"pooling": "cls"})
    case("qwen3/max", st_model(q, "max"), {"pooling": "max"})
    # EmbeddingGemma's Dense shape (tests/test_encoders.py reads its GGUF file).
    m = st_model(paths["embeddinggemma"])
    ids["embeddinggemma"] = [m.tokenizer(t)["input_ids"] for t in fx.TEXTS]
    case("embeddinggemma/default", m, {})
    case("embeddinggemma/query", m, {"prompt_name": "query"}, prompt_name="query")
    # A prompt of one's own on the Gemma model.
    m = st_model(paths["gemma"])
    case("gemma/own_prompt", m, {"prompt": "task: clustering | query: "}, prompt="task: clustering | query: ")

    # The reranker, as Qwen3-Reranker's model card scores a pair.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rp = paths["rerank"]
    tok = AutoTokenizer.from_pretrained(str(rp))
    lm = AutoModelForCausalLM.from_pretrained(str(rp), dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    prefix = tok.encode(fx.RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(fx.RERANK_SUFFIX, add_special_tokens=False)
    for name, instruction in (("rerank/default", None), ("rerank/instruction", "Find the city")):
        inst = instruction or fx.RERANK_INSTRUCTION
        scores = []
        for d in fx.DOCUMENTS:
            pair = f"<Instruct>: {inst}\n<Query>: {fx.QUERY}\n<Document>: {d}"
            x = prefix + tok(pair)["input_ids"] + suffix
            with torch.no_grad():
                logits = lm(torch.tensor([x])).logits[0, -1]
            two = torch.stack([logits[no], logits[yes]]).log_softmax(0).exp()
            scores.append(float(two[1]))
        out[name] = np.array(scores, dtype=np.float32)
        cases[name] = {"instruction": instruction}

    DATA.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    save_file(out, str(DATA / "reference.safetensors"))
    meta = {
        "cases": cases,
        "input_ids": ids,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
        },
    }
    (DATA / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", len(out), "cases to", DATA)


if __name__ == "__main__":
    main()
