"""The image family: seeded mutations of PNG, JPEG and GIF bytes read by `candlewick.images`.

Each input is written to a file; the worker reads it with `load_image` and, if it decodes, runs a
small Gemma 3 processor over it. Every outcome must be an image or an `ImageError` (typed), never
another exception, a crash or a hang. Inputs invalid by construction (a header claiming
100,000 x 100,000 pixels, zero sizes, a file cut inside its header) are `must_reject`.
"""

import io
import struct
import zlib

import numpy as np
from PIL import Image

try:
    from .cases import Case
except ImportError:  # imported as a top-level module by runner.py
    from cases import Case


def _seeds():
    """name -> bytes of small valid images of each format and a few modes."""
    rng = np.random.default_rng(9)
    rgb = Image.fromarray(rng.integers(0, 256, (19, 23, 3), dtype=np.uint8))
    out = {}
    for name, img, fmt, kw in [
        ("png-rgb", rgb, "PNG", {}),
        ("png-rgba", rgb.convert("RGBA"), "PNG", {}),
        ("png-palette", rgb.quantize(8), "PNG", {"transparency": 2}),
        ("jpeg", rgb, "JPEG", {"quality": 80}),
        ("gif", rgb.quantize(16), "GIF", {"save_all": True, "append_images": [rgb.quantize(16).rotate(90)]}),
    ]:
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        out[name] = buf.getvalue()
    return out


def _png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with_size(width, height):
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + _png_chunk(b"IEND", b""))


def _mutate(rng, data):
    """One seeded mutation: byte flips, a cut, a spliced run, or a size field rewritten."""
    b = bytearray(data)
    kind = rng.choice(["flip", "flips", "cut", "splice", "size", "zero"])
    if kind == "flip":
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "flips":
        for _ in range(rng.randint(2, 24)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == "cut":
        b = b[: rng.randrange(1, len(b))]
    elif kind == "splice":
        at, n = rng.randrange(len(b)), rng.randint(1, 64)
        b[at:at] = bytes(rng.randrange(256) for _ in range(n))
    elif kind == "size":
        # The width/height fields of PNG's IHDR (16..24), GIF's screen (6..10), or a JPEG SOF's.
        at = {b"\x89P": 16, b"GI": 6}.get(bytes(b[:2]))
        if at is None:
            sof = b.find(b"\xff\xc0")
            at = sof + 5 if sof >= 0 else rng.randrange(len(b) - 4)
        value = rng.choice([0, 1, 65535, 100_000, 2**31 - 1, rng.randrange(1 << 16)])
        fmt = "<H" if b[:2] == b"GI" else (">I" if b[:2] == b"\x89P" else ">H")
        b[at:at + struct.calcsize(fmt)] = struct.pack(fmt, min(value, (1 << 8 * struct.calcsize(fmt)) - 1))
    else:
        at = rng.randrange(len(b))
        b[at:at + 16] = bytes(16)
    return kind, bytes(b)


def image_cases(rng, scratch, n_random):
    """Fixed hostile images, then `n_random` seeded mutations of each seed image."""
    d = scratch / "images"
    d.mkdir(exist_ok=True)

    count = iter(range(1 << 30))

    def case(label, data, must_reject=False):
        p = d / f"{next(count)}.img"
        p.write_bytes(data)
        return Case("image", label, {"kind": "image", "path": str(p)}, must_reject)

    seeds = _seeds()
    yield case("png header 100000 x 100000", _png_with_size(100_000, 100_000), True)
    yield case("png header 0 x 10", _png_with_size(0, 10), True)
    yield case("png header 2^31-1 x 1", _png_with_size(2**31 - 1, 1), True)
    yield case("empty file", b"", True)
    for name, data in seeds.items():
        yield case(f"{name} as is", data)
        yield case(f"{name} cut inside its header", data[:10], True)
    for name, data in seeds.items():
        for i in range(n_random):
            kind, mutated = _mutate(rng, data)
            yield case(f"{name} mutation {i} ({kind})", mutated)
