"""Writes a real-size Hugging Face directory from a GGUF file, for benches/compare_hf.py.

Runs in the benchmark environment (torch + transformers + gguf), never in CI:

    /work/bench-venv-hf/bin/python benches/make_hf_dir.py GGUF OUT_DIR [--dtype bf16]

transformers de-quantizes the GGUF (``from_pretrained(dir, gguf_file=...)``); the quantization
config it records is dropped so that the saved directory is a plain dense checkpoint.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    a = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[a.dtype]
    model = AutoModelForCausalLM.from_pretrained(a.gguf.parent, gguf_file=a.gguf.name, dtype=torch.float32)
    # The weights are already plain float tensors; only the bookkeeping says "gguf".
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    for holder in (model.config, getattr(model.config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.to(dtype).save_pretrained(a.out, safe_serialization=True)
    AutoTokenizer.from_pretrained(a.gguf.parent, gguf_file=a.gguf.name).save_pretrained(a.out)
    print(f"wrote {a.out} ({a.dtype})")


if __name__ == "__main__":
    main()
