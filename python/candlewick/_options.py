"""Helpers the command line and the server share, so that the command line imports the server
and the server never imports the command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union


def parse_control_vector(spec: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` as llama.cpp's ``--control-vector-scaled FILE SCALE`` (scale 1 when absent)."""
    file, sep, scale = spec.rpartition(":")
    if sep and file:
        try:
            return file, float(scale)
        except ValueError:
            pass
    return spec, 1.0


def parse_lora(spec: str) -> tuple[str, float]:
    """``PATH[:SCALE]`` (or ``PATH=SCALE``) for ``--lora``, as llama.cpp's ``--lora-scaled FILE
    SCALE`` (scale 1 when absent)."""
    for sep in (":", "="):
        path, found, scale = spec.rpartition(sep)
        if found and path:
            try:
                return path, float(scale)
            except ValueError:
                pass
    return spec, 1.0


def served_name(given: Union[str, "os.PathLike[str]"], local: str) -> str:
    """The name a server gives its model: the Hub name as given (``org/name:Q4_K_M``, as vLLM
    names a model by its repository), else the local file or directory's name."""
    text = os.fspath(given)
    return text if local != text else Path(local).name
