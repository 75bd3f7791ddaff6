"""Antialiased uint8 resizing, bit for bit as torch resizes a uint8 image on the CPU.

transformers' default ("torchvision") image processors resize uint8 tensors with
``torchvision.transforms.v2.functional.resize(..., antialias=True)``, which on the CPU runs
torch's separable uint8 kernel (``upsample_avx_bilinear_bicubic_uint8`` and its generic twin):
float64 filter weights per output pixel, rescaled to int16 with the most precision bits that
fit, integer sums rounded half up and shifted, clamped to 0..255, width first, then height.
That arithmetic is exact, so it is reproduced here in numpy without torch (docs/images.md says
why this, and not Pillow's resize, is the reference).
"""

from __future__ import annotations

import math

import numpy as np

# torch's `interp_size` of each filter: the support of the filter at scale 1 is half of it.
_INTERP_SIZE = {"bilinear": 2, "bicubic": 4, "lanczos": 6}


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _bicubic(x: float) -> float:
    # torch's antialiased bicubic uses Pillow's a = -0.5 (its plain bicubic, -0.75).
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    if -3.0 <= x < 3.0:
        return _sinc(x) * _sinc(x / 3.0)
    return 0.0


_FILTERS = {"bilinear": _bilinear, "bicubic": _bicubic, "lanczos": _lanczos}


def _weights(in_size: int, out_size: int, kind: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(first input index per output [out], int16 weights [out, k], precision bits)."""
    fn = _FILTERS[kind]
    interp = _INTERP_SIZE[kind]
    scale = in_size / out_size
    support = (interp * 0.5) * scale if scale >= 1.0 else interp * 0.5
    max_size = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    starts = np.zeros(out_size, dtype=np.int64)
    wts = np.zeros((out_size, max_size), dtype=np.float64)
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(int(center + support + 0.5), in_size) - xmin
        xsize = min(max(xsize, 0), max_size)
        row = [fn((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for w in row:
            total += w
        if total != 0.0:
            row = [w / total for w in row]
        starts[i] = xmin
        if row:
            wts[i, :xsize] = row
            wt_max = max(wt_max, max(row))
    precision = 0
    while precision < 22:
        if int(0.5 + wt_max * (1 << (precision + 1))) >= (1 << 15):
            break
        precision += 1
    v = wts * (1 << precision)
    ints = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v)).astype(np.int64)
    return starts, ints, precision


def _pass(img: np.ndarray, out_size: int, kind: str) -> np.ndarray:
    """One separable pass along axis 0 of a uint8 array (N x ... ): gathering whole rows keeps
    the memory reads contiguous, so the width pass runs on the transposed image."""
    in_size = img.shape[0]
    starts, ints, precision = _weights(in_size, out_size, kind)
    shape = (out_size,) + img.shape[1:]
    # int32 holds every sum: |weights| < 2**15 and their sum stays near 2**precision <= 2**22.
    acc = np.full(shape, 1 << (precision - 1) if precision > 0 else 0, dtype=np.int32)
    term = np.empty_like(acc)
    for k in range(ints.shape[1]):
        w = ints[:, k].astype(np.int32)
        if not w.any():
            continue
        rows = img[np.minimum(starts + k, in_size - 1)]
        np.multiply(rows, w.reshape((-1,) + (1,) * (img.ndim - 1)), out=term, dtype=np.int32)
        acc += term
    # An arithmetic shift floors, as torch's `>>` on int32 does.
    np.right_shift(acc, precision, out=acc)
    return np.clip(acc, 0, 255).astype(np.uint8)


def resize_uint8(img: np.ndarray, height: int, width: int, kind: str) -> np.ndarray:
    """Resizes an HxWxC uint8 array to `height` x `width` with the antialiased `kind` filter
    ("bilinear", "bicubic" or "lanczos") as torch does on the CPU; an unchanged size returns the
    image as it is."""
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    if w != width:
        img = _pass(np.ascontiguousarray(img.transpose(1, 0, 2)), width, kind).transpose(1, 0, 2)
    if h != height:
        img = _pass(np.ascontiguousarray(img), height, kind)
    return np.ascontiguousarray(img)
