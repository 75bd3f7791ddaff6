"""llama.cpp's own `convert_hf_to_gguf.py` on a tiny directory, where its source is here (the
llama-cpp-python sdist's `vendor/llama.cpp/`: `pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36` and unpack; or `CANDLEWICK_LLAMA_CPP_SRC` naming that folder).

One departure, in one place: the converter names a BPE or WordPiece vocabulary's pre-tokenizer by
hashing what the tokenizer makes of a test text, and stops on a hash it does not know, which every
tiny fixture's hand-built vocabulary gives. The name is then what the released model's vocabulary
hashes to (`modern-bert` for ModernBERT's byte-level BPE) or `default` (BERT's and nomic-bert's
WordPiece, whose pre-tokenizer llama.cpp's WPM tokenizer does not read). Everything else (keys,
tensor names, types, transforms) is the converter's.

`loadable=True` adds a second departure, for llama.cpp's own cross-check only: this converter
writes ModernBERT's `norm_eps` as `modern-bert.attention.layer_norm_rms_epsilon` (its LayerNorm
name list lacks `norm_eps`), and the llama.cpp beside it requires
`modern-bert.attention.layer_norm_epsilon` ("key not found in model"), so it loads no ModernBERT
this converter writes; the LayerNorm key is written too, with the same value. candlewick reads
the file without it.

    python tests/llama_convert.py SRC_DIR OUT.gguf [--outtype f32]   (torch, transformers)
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

SDIST_GLOBS = ["/tmp/sdist/*/vendor/llama.cpp", "/tmp/sdist/vendor/llama.cpp", "/tmp/sdist-*/llama.cpp",
               "/tmp/sdist-*/*/vendor/llama.cpp"]


def source() -> Path | None:
    """The llama.cpp source folder holding convert_hf_to_gguf.py, or None."""
    named = os.environ.get("CANDLEWICK_LLAMA_CPP_SRC")
    if named:
        return Path(named) if (Path(named) / "convert_hf_to_gguf.py").is_file() else None
    import glob

    for pattern in SDIST_GLOBS:
        for hit in sorted(glob.glob(pattern)):
            if (Path(hit) / "convert_hf_to_gguf.py").is_file():
                return Path(hit)
    return None


def convert(src: Path, out: Path, python: str = sys.executable, outtype: str = "f32", loadable: bool = False,
            extra: tuple[str, ...] = ()) -> Path:
    """Writes `out` from the directory `src` with llama.cpp's converter run by `python` (which
    needs torch and transformers), `extra` added to its arguments."""
    llama = source()
    if llama is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py (set CANDLEWICK_LLAMA_CPP_SRC)")
    env = {**os.environ, "CANDLEWICK_LLAMA_LOADABLE": "1" if loadable else ""}
    r = subprocess.run([python, __file__, str(llama), str(src), "--outfile", str(out), "--outtype", outtype, *extra],
                       capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-3000:]}")
    return out


def _run(llama: Path, argv: list[str]) -> None:
    sys.path.insert(0, str(llama))
    sys.path.insert(1, str(llama / "gguf-py"))
    from conversion import base, bert

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            # Departure: see the module's doc.
            return "modern-bert" if isinstance(self, bert.ModernBertModel) else "default"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    if os.environ.get("CANDLEWICK_LLAMA_LOADABLE"):
        parameters = bert.ModernBertModel.set_gguf_parameters

        def with_layer_norm_eps(self) -> None:
            parameters(self)
            # Departure (loadable): see the module's doc.
            self.gguf_writer.add_layer_norm_eps(self.hparams["norm_eps"])

        bert.ModernBertModel.set_gguf_parameters = with_layer_norm_eps
    sys.argv = [str(llama / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(str(llama / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    _run(Path(sys.argv[1]), sys.argv[2:])
