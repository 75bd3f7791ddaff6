"""Seeded checkpoints that are rebuilt, not stored: the writers the fixture scripts share
(tests/shared_expert_fixtures.py, tests/vision_fixtures.py).

A case's directory holds `weights.json`: the tensor names and shapes in draw order, the seed, and
the SHA-256 of the draw, so that a numpy that draws other numbers is an error, not a silently
different model. Every float32 weight is drawn from numpy's PCG64 generator with that seed, in
that order: norms 1 + 0.1·N(0, 1), the rest 0.1·N(0, 1) (generate_tiny_more.py's `randomise`,
with numpy's generator instead of torch's)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def draw(case_dir: Path, is_norm) -> tuple[dict, str]:
    """The tensors `case_dir/weights.json` describes, and the SHA-256 it records for them;
    `is_norm(name)` says which are norm weights (drawn around 1)."""
    spec = json.loads((Path(case_dir) / "weights.json").read_text())
    rng = np.random.default_rng(spec["seed"])
    out = {}
    for name, shape in spec["tensors"]:
        t = np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32)
        out[name] = t + np.float32(1.0) if is_norm(name) else t
    return out, spec["sha256"]


def digest(tensors: dict) -> str:
    """SHA-256 over the tensors' names and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors[name]).tobytes())
    return h.hexdigest()


def write_weights(case_dir: Path, is_norm, dest: Path) -> Path:
    """Draws the case of `case_dir` and writes it as `dest/model.safetensors` (making `dest`),
    refusing a draw whose digest differs from the recorded one; returns `dest`."""
    from safetensors.numpy import save_file

    tensors, sha = draw(case_dir, is_norm)
    if digest(tensors) != sha:
        raise RuntimeError(f"{Path(case_dir).name}: numpy drew other weights than the reference was computed from")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def write_spec(case_dir: Path, seed: int, saved: dict, is_norm) -> None:
    """Writes `case_dir/weights.json` for a checkpoint holding the tensors `saved` (name → array,
    as transformers saved them): their names and shapes in name order, `seed`, and the digest of
    the draw they give (reference building; needs no torch)."""
    path = Path(case_dir) / "weights.json"
    spec = {"seed": seed, "tensors": [[n, list(saved[n].shape)] for n in sorted(saved)], "sha256": ""}
    path.write_text(json.dumps(spec) + "\n")
    spec["sha256"] = digest(draw(case_dir, is_norm)[0])
    path.write_text(json.dumps(spec) + "\n")
