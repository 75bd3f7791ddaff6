"""What llama.cpp computes for the nomic-bert and ModernBERT encoders of tests/encoder_fixtures.py,
from the GGUF files its own converter writes of them: the references tests/test_encoders.py
compares the HF directories and the GGUF files with, beside sentence-transformers'.

    PYTHONPATH=/work/bench/venv-llama/lib/python3.11/site-packages \\
        /work/bench/venv-ref/bin/python tests/encoder_llama_reference.py   (not run by CI)

The converter is llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python 0.3.36 sdist
(tests/llama_convert.py: its departures are there), float32; the embeddings are llama-cpp-python's
`Llama.embed` of each text (the file's pooling, mean), normalised as the directories' Normalize
module does. The token ids llama.cpp made of each text are stored too: the same as the
directories' tokenizers give. Writes tests/data/encoders/llama_cpp.safetensors and
llama_cpp.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import encoder_fixtures as fx  # noqa: E402
import llama_convert  # noqa: E402

DATA = TESTS / "data" / "encoders"
# nomic-bert's file loads as the converter writes it; ModernBERT's needs the layer-norm key.
FAMILIES = {"nomic-embed": False, "modernbert-embed": True}


def main() -> None:
    import llama_cpp
    from safetensors.numpy import save_file

    root = Path(tempfile.mkdtemp(prefix="cw-encoder-llama-"))
    paths = fx.materialise(root)
    out: dict[str, np.ndarray] = {}
    ids: dict[str, list] = {}
    for key, loadable in FAMILIES.items():
        gguf = llama_convert.convert(paths[key], root / f"{key}.gguf", loadable=loadable)
        llm = llama_cpp.Llama(model_path=str(gguf), embedding=True, verbose=False, n_ctx=512, n_batch=512,
                              n_ubatch=512)
        texts = {"default": fx.TEXTS, "query": [fx.NOMIC_PROMPTS["query"] + t for t in fx.TEXTS]}
        for case, batch in texts.items():
            ids[f"{key}/{case}"] = [llm.tokenize(t.encode()) for t in batch]
            vecs = np.array([llm.embed(t) for t in batch], dtype=np.float64)
            out[f"{key}/{case}"] = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
        del llm
    DATA.mkdir(parents=True, exist_ok=True)
    save_file(out, str(DATA / "llama_cpp.safetensors"))
    meta = {
        "input_ids": ids,
        "llama_cpp_python": llama_cpp.__version__,
        "converter": "convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendor/llama.cpp, --outtype f32",
    }
    (DATA / "llama_cpp.json").write_text(json.dumps(meta, indent=1) + "\n")
    print("wrote", len(out), "arrays to", DATA)


if __name__ == "__main__":
    main()
