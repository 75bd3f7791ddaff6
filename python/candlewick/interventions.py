"""Edits of named activations (docs/interventions.md): steer, patch, ablate, project out.

Each function returns an ``Intervention``; pass a list to ``prefill``/``decode``/``inspect_*``/
``trace`` (``interventions=[...]``) for one call, set ``rt.interventions = [...]`` to keep them
on (generation included), or use ``with rt.intervene([...]):`` for a block. Positions are
absolute sequence positions; ``None`` means every position, decoded ones included.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from ._native import Intervention

__all__ = [
    "Intervention",
    "add",
    "set",
    "scale",
    "project_out",
    "sae_steer",
    "sae_clamp",
    "sae_ablate",
    "sae_splice",
]


def _values(name: str, array) -> list:
    a = np.asarray(array, dtype=np.float32)
    if a.ndim == 0:
        raise ValueError(f"{name} must be an array, not a scalar")
    return a.ravel().tolist()


def _positions(positions: Optional[Iterable[int]]) -> Optional[list]:
    return None if positions is None else [int(p) for p in positions]


def add(point: str, vector, scale: float = 1.0, positions: Optional[Iterable[int]] = None) -> Intervention:
    """Steering: ``x + scale * vector`` (the point's last dimension, or its whole per-position shape)."""
    return Intervention.add(point, _values("vector", vector), float(scale), _positions(positions))


def set(point: str, values, positions: Iterable[int]) -> Intervention:  # noqa: A001 - the issue's name
    """Activation patching: ``x[positions] = values`` (one row of the point's per-position shape per position)."""
    # None stays None, so the native call names the missing positions.
    return Intervention.set(point, _values("values", values), _positions(positions))  # type: ignore[arg-type]


def scale(point: str, index, factor: float, positions: Optional[Iterable[int]] = None) -> Intervention:
    """Multiplies units (heads of ``attention.heads``, neurons of ``mlp.hidden``, channels) by ``factor``; 0 ablates."""
    idx = [int(i) for i in np.atleast_1d(np.asarray(index)).ravel()]
    return Intervention.scale(point, idx, float(factor), _positions(positions))


def project_out(point: str, direction, positions: Optional[Iterable[int]] = None) -> Intervention:
    """Directional ablation: ``x - (x . d) d`` with ``d`` the normalised direction."""
    return Intervention.project_out(point, _values("direction", direction), _positions(positions))


# Feature edits of an attached sparse autoencoder (``rt.attach_sae``), applied at its point.


def sae_steer(name: str, feature: int, scale: float, positions: Optional[Iterable[int]] = None) -> Intervention:
    """``x + scale * W_dec[feature]`` at the point of the SAE called ``name``."""
    return Intervention.sae_steer(name, int(feature), float(scale), _positions(positions))


def sae_clamp(name: str, features, value: float, positions: Optional[Iterable[int]] = None) -> Intervention:
    """The listed features set to ``value``: ``x + (f' - f) W_dec``, the SAE's error kept."""
    idx = [int(i) for i in np.atleast_1d(np.asarray(features)).ravel()]
    return Intervention.sae_clamp(name, idx, float(value), _positions(positions))


def sae_ablate(name: str, features, positions: Optional[Iterable[int]] = None) -> Intervention:
    """The listed features clamped to 0."""
    return sae_clamp(name, features, 0.0, positions)


def sae_splice(name: str, keep_error: bool = True, positions: Optional[Iterable[int]] = None) -> Intervention:
    """The point replaced by the SAE's reconstruction, plus its error where ``keep_error``."""
    return Intervention.sae_splice(name, bool(keep_error), _positions(positions))
