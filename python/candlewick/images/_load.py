"""Reading one image from what a user hands over, refusing bad input with a typed error.

Every check that needs no pixels (the type, the path, the header's size) runs before any
decoding, so a decompression bomb or a wrong argument costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from typing import Any, Optional

import numpy as np
from PIL import Image, ImageOps

from .._native import InvalidOptionError

# The most pixels an image may have: Pillow's own warning threshold (about 89.5 million, a
# 9459 x 9459 image, 268 MB as RGBA). Larger ones are refused from their header, before decoding.
MAX_IMAGE_PIXELS = 89_478_485

# Modes Pillow converts to RGB (what every processor feeds its encoder). 16-bit ("I;16") and
# 32-bit ("I", "F") grey are clipped to 0..255 by that conversion, as transformers gets them.
SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "I", "I;16",
                             "I;16B", "I;16L", "I;16N", "F"})


class ImageError(InvalidOptionError):
    """An image that cannot be read (undecodable, truncated, too large, empty, of an unsupported
    type, shape or mode, a missing file): ``index`` is the image's place among those given,
    ``reason`` says why. Raised before any step, so no session changes."""

    def __init__(self, index: Optional[int], reason: str):
        self.index = index
        self.reason = reason
        where = "image" if index is None else f"image {index}"
        super().__init__(f"{where}: {reason}")


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return repr(obj if len(obj) <= 60 else obj[:57] + "...")
    return type(obj).__name__


def _check_size(width: int, height: int, index: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(index, f"the image is empty ({width} x {height} pixels)")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(index, f"the image is {width} x {height} pixels, over the limit of {MAX_IMAGE_PIXELS} "
                                "pixels (a decompression bomb?); it was not decoded")


def _open_bytes(data: bytes, index: int, what: str) -> Image.Image:
    """Decodes encoded image bytes, checking the header's size before the pixels."""
    if not data:
        raise ImageError(index, f"{what} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns between 1x and 2x its limit and raises above: both
            # are refusals here, with the size from the header.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(index, f"{what} is too large to decode ({e})") from None
    except Exception as e:  # Pillow raises many types for bad headers: UnidentifiedImageError, SyntaxError, ...
        raise ImageError(index, f"{what} is not an image Pillow can decode ({type(e).__name__}: {e})") from None
    return _finish(img, index, what)


def _finish(img: Image.Image, index: int, what: str) -> Image.Image:
    """Checks size and mode, decodes the pixels, applies the EXIF orientation."""
    _check_size(img.width, img.height, index)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
            # transformers' `load_image` turns every image it loads upright by its EXIF
            # orientation tag (`PIL.ImageOps.exif_transpose`), so this does too.
            img = ImageOps.exif_transpose(img)
    except ImageError:
        raise
    except Exception as e:  # truncated data, corrupt chunks, bad EXIF: all the image's fault
        raise ImageError(index, f"{what} could not be decoded ({type(e).__name__}: {e})") from None
    _check_size(img.width, img.height, index)
    if img.mode not in SUPPORTED_MODES:
        raise ImageError(index, f"unsupported image mode {img.mode!r} (supported: {', '.join(sorted(SUPPORTED_MODES))})")
    return img


def _from_array(a: np.ndarray, index: int) -> Image.Image:
    if a.dtype != np.uint8:
        raise ImageError(index, f"an image array must be uint8, not {a.dtype}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise ImageError(index, f"an image array must be H x W or H x W x C with C in 1, 3, 4 (channels last), "
                                f"not of shape {tuple(a.shape)}")
    _check_size(a.shape[1], a.shape[0], index)
    # H x W -> L, H x W x 3 -> RGB, H x W x 4 -> RGBA.
    return Image.fromarray(np.ascontiguousarray(a))


def decode_data_url(url: str, index: int) -> bytes:
    """The bytes of a ``data:[<type>][;base64],<data>`` URL (base64 only: images are binary)."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError(index, "a data: URL needs a comma before its data")
    if not head.endswith(";base64"):
        raise ImageError(index, "a data: URL for an image must be base64 (data:image/png;base64,...)")
    mime = head[len("data:"):-len(";base64")]
    if mime and not mime.startswith("image/"):
        raise ImageError(index, f"a data: URL of type {mime!r} is not an image")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(index, f"the data: URL's base64 is malformed ({e})") from None


def load_image(obj: Any, *, index: int = 0) -> Image.Image:
    """Reads one image: a path (``str`` or ``os.PathLike``), encoded bytes (PNG, JPEG, GIF, WebP,
    BMP, ... whatever Pillow decodes), a ``data:image/...;base64,`` URL, a PIL image, or a uint8
    numpy array H x W (grey) or H x W x C (C = 1, 3 or 4, channels last).

    Returns a decoded PIL image in its own mode (RGB, RGBA, L, P, I;16, ...), turned upright by
    its EXIF orientation as transformers' ``load_image`` does; the processors convert it to RGB
    as transformers' do (transparency over white). Bad input raises :class:`ImageError` naming
    ``index``: undecodable or truncated data, a header over :data:`MAX_IMAGE_PIXELS` (refused
    before decoding), an empty image, an unsupported type, array shape, dtype or mode, a missing
    file. An ``http(s)://`` URL is refused: fetching is the caller's choice (``serve``'s
    ``--allow-image-urls``)."""
    if isinstance(obj, Image.Image):
        return _finish(obj, index, "the PIL image")
    if isinstance(obj, np.ndarray):
        return _from_array(obj, index)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(obj), index, "the image data")
    if isinstance(obj, str) and obj[:5].lower() == "data:":
        return _open_bytes(decode_data_url(obj, index), index, "the data: URL's image")
    if isinstance(obj, str) and obj[:8].lower().startswith(("http://", "https://")):
        raise ImageError(index, f"{_describe(obj)} is a URL; candlewick reads no URL by itself "
                                "(fetch it, or start `serve` with --allow-image-urls)")
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if not os.path.isfile(path):
            raise ImageError(index, f"no image file at {_describe(path)}")
        # Reading the bytes first keeps no file handle open in the returned image.
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise ImageError(index, f"cannot read {_describe(path)}: {e}") from None
        if len(data) > MAX_FILE_BYTES:
            raise ImageError(index, f"{_describe(path)} is over {MAX_FILE_BYTES} bytes")
        return _open_bytes(data, index, f"the file {_describe(path)}")
    raise ImageError(index, f"an image must be a path, bytes, a data: URL, a PIL image or a uint8 array, "
                            f"not {_describe(obj)}")


# The largest encoded image file read: far above any photo, far below what would exhaust memory.
MAX_FILE_BYTES = 256 << 20
