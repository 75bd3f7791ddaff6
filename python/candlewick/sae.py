"""Sparse autoencoder features as observed (docs/interventions.md, "Sparse autoencoders").

``rt.attach_sae(path)`` adds the point ``sae.{name}.features``; its value is a ``SparseFeatures``:
for each position the indices of the features that fired and their values, so a wide SAE over a
long prompt is never a dense array unless ``toarray()`` asks for one.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SparseFeatures"]


class SparseFeatures:
    """Rows ``[positions, d_sae]`` in compressed-row form (``indptr``, ``flat_indices``, ``flat_values``).

    ``feats.indices[i]`` and ``feats.values[i]`` are position ``i``'s features and values (ascending
    feature order); ``feats[i]`` is that pair; ``feats.toarray()`` the dense float32 array.
    """

    __slots__ = ("indptr", "flat_indices", "flat_values", "shape")

    def __init__(self, indptr, indices, values, shape) -> None:
        self.indptr = np.asarray(indptr, dtype=np.int64)
        self.flat_indices = np.asarray(indices, dtype=np.uint32)
        self.flat_values = np.asarray(values, dtype=np.float32)
        self.shape = (int(shape[0]), int(shape[1]))
        for a in (self.indptr, self.flat_indices, self.flat_values):
            a.flags.writeable = False

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} is out of range for {len(self)} positions")
        position %= len(self)
        a, b = self.indptr[position], self.indptr[position + 1]
        return self.flat_indices[a:b], self.flat_values[a:b]

    @property
    def indices(self) -> list[np.ndarray]:
        """Each position's active features."""
        return [self[i][0] for i in range(len(self))]

    @property
    def values(self) -> list[np.ndarray]:
        """Each position's feature values, in the order of ``indices``."""
        return [self[i][1] for i in range(len(self))]

    @property
    def nnz(self) -> int:
        """How many values are stored."""
        return int(self.flat_values.size)

    def toarray(self) -> np.ndarray:
        """The dense float32 ``[positions, d_sae]`` array."""
        out = np.zeros(self.shape, dtype=np.float32)
        rows = np.repeat(np.arange(self.shape[0]), np.diff(self.indptr))
        out[rows, self.flat_indices.astype(np.int64)] = self.flat_values
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(feats)`` is the dense array (what the server's ``observe`` sends)."""
        a = self.toarray()
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"SparseFeatures(shape={self.shape}, nnz={self.nnz})"
