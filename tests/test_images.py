"""candlewick.images: reading images (typed errors for bad input) and the families' processors
against transformers' (tests/data/images, made by tests/image_fixtures.py)."""

import base64
import hashlib
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import candlewick
from candlewick.images import (
    MAX_IMAGE_PIXELS,
    ImageError,
    ProcessedImages,
    load_image,
    messages_with_images,
    processor_for,
)
from image_fixtures import CASES, DATA, draw_images, sample_positions

INDEX = json.loads((DATA / "cases.json").read_text())["cases"]
IMAGES = draw_images()


def png_header(width, height, mode=2):
    """A PNG whose IHDR claims width x height (RGB) followed by a tiny IDAT: a bomb's header."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, mode, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


# -- load_image ------------------------------------------------------------------------------


def test_image_error_is_the_packages_input_error():
    assert issubclass(ImageError, candlewick.InvalidOptionError)
    assert issubclass(ImageError, candlewick.CandlewickError) and issubclass(ImageError, ValueError)


def test_sources_all_give_the_same_image(tmp_path):
    data = IMAGES["rgb_small"]
    path = tmp_path / "a.png"
    path.write_bytes(data)
    ref = np.array(Image.open(io.BytesIO(data)))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for src in [data, bytearray(data), str(path), path, url, Image.open(io.BytesIO(data)), ref, ref[:, :, :]]:
        assert np.array_equal(np.array(load_image(src)), ref)


def test_modes_are_kept_for_the_processor():
    assert load_image(IMAGES["rgba"]).mode == "RGBA"
    assert load_image(IMAGES["grey"]).mode == "L"
    assert load_image(IMAGES["palette"]).mode == "P"
    assert load_image(IMAGES["grey16"]).mode.startswith("I;16")
    assert load_image(np.zeros((4, 5), np.uint8)).mode == "L"
    assert load_image(np.zeros((4, 5, 1), np.uint8)).mode == "L"
    assert load_image(np.zeros((4, 5, 4), np.uint8)).mode == "RGBA"


def test_exif_orientation_is_applied_as_transformers_load_image_does():
    stored = Image.open(io.BytesIO(IMAGES["exif_png"]))
    assert stored.size == (50, 30)
    upright = load_image(IMAGES["exif_png"])
    assert upright.size == (30, 50)  # orientation 6: turned 90 degrees
    assert np.array_equal(np.array(upright), np.rot90(np.array(stored), -1))
    assert load_image(IMAGES["exif_jpeg"]).size == (24, 40)


@pytest.mark.parametrize("src, why", [
    (b"", "empty"),
    (b"not an image at all", "not an image"),
    (IMAGES["rgb_small"][:60], "could not be decoded|not an image"),  # truncated
    (IMAGES["rgb_small"][: len(IMAGES["rgb_small"]) // 2], "could not be decoded"),
    (png_header(100_000, 100_000), "too large|over the limit"),
    (png_header(0, 10), "not an image|empty"),
    (np.zeros((0, 5, 3), np.uint8), "empty"),
    (np.zeros((4, 5, 3), np.float32), "uint8"),
    (np.zeros((4, 5, 2), np.uint8), "shape"),
    (np.zeros((3, 4, 5, 3), np.uint8), "shape"),
    ("/no/such/image.png", "no image file"),
    ("https://example.com/a.png", "URL"),
    ("data:text/plain;base64,aGk=", "not an image"),
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png,rawbytes", "base64"),
    (12, "not int"),
    (Image.new("RGB", (0, 0)), "empty"),
])
def test_bad_input_is_a_typed_error_naming_the_image(src, why):
    with pytest.raises(ImageError) as e:
        load_image(src, index=3)
    assert e.value.index == 3 and str(e.value).startswith("image 3: ")
    assert any(w in str(e.value) for w in why.split("|")), str(e.value)


def test_a_bomb_is_refused_from_its_header_before_decoding(monkeypatch):
    # Were it decoded, 100,000 x 100,000 RGB would need 30 GB: refused in milliseconds.
    decoded = []
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(1))
    with pytest.raises(ImageError, match="pixels"):
        load_image(png_header(100_000, 100_000))
    with pytest.raises(ImageError, match="90000000 pixels"):
        load_image(png_header(10_000, 9_000))  # under twice Pillow's limit (its hard error), over ours
    assert not decoded
    assert 9_000 * 9_000 < MAX_IMAGE_PIXELS < 10_000 * 9_000


# -- the processors against transformers ------------------------------------------------------


def run_case(name):
    case = INDEX[name]
    proc_cfg = {**case["image_processor_config"], **case["processor_config"]}
    p = processor_for(case["model_type"], proc_cfg, case["model_config"])
    # The images as a user hands them over: encoded bytes.
    return case, p, p.preprocess([IMAGES[n] for n in case["images"]])


def check_common(case, p, out):
    assert isinstance(out, ProcessedImages)
    assert out.pixel_values.dtype == np.float32
    assert list(out.pixel_values.shape) == case["shapes"]["pixel_values"]
    assert out.tokens_per_image == case["tokens_per_image"]
    assert p.image_token == case["image_token"]


FULL = [n for n, c in CASES.items() if c[5]]
REAL = [n for n, c in CASES.items() if not c[5]]


@pytest.mark.parametrize("name", FULL)
def test_small_configs_equal_transformers_on_every_value(name):
    case, p, out = run_case(name)
    check_common(case, p, out)
    ref = np.load(DATA / f"{name}.npz")
    assert case["backend"] == "torchvision"
    diff = np.abs(out.pixel_values - ref["pixel_values"]).max()
    assert diff <= 1e-5, f"{name}: max |diff| {diff}"
    for key in ref.files:
        if key in ("pixel_values",):
            continue
        assert np.array_equal(np.asarray(out.extra[key]).reshape(ref[key].shape), ref[key]), key
    assert p.expand(case["text"], out) == case["expanded"]


@pytest.mark.parametrize("name", REAL)
def test_real_default_configs_equal_transformers_on_shapes_tokens_and_samples(name):
    case, p, out = run_case(name)
    check_common(case, p, out)
    arrays = {"pixel_values": out.pixel_values, **out.extra}
    for key, ref in case["summaries"].items():
        a = np.asarray(arrays[key], dtype=np.float64)
        if key in ("rows", "cols"):  # a list per image here, per prompt and image in transformers
            a = a.reshape(ref["shape"])
        assert list(a.shape) == ref["shape"], key
        got = a.reshape(-1)[sample_positions(a.shape)]
        assert np.abs(got - np.asarray(ref["samples"])).max() <= 1e-5, key
        assert abs(a.sum() - ref["sum"]) <= 1e-6 * max(1.0, ref["abs_sum"]), key
        assert abs(np.abs(a).sum() - ref["abs_sum"]) <= 1e-6 * max(1.0, ref["abs_sum"]), key
    expanded = p.expand(case["text"], out)
    assert len(expanded) == case["expanded_len"]
    assert hashlib.sha256(expanded.encode()).hexdigest() == case["expanded_sha256"]


def test_expand_needs_one_placeholder_per_image():
    p = processor_for("llava", {"patch_size": 14}, {})
    out = p.preprocess([np.zeros((8, 8, 3), np.uint8)] * 2)
    with pytest.raises(ImageError, match="1 '<image>' placeholder for 2 images"):
        p.expand("a <image> b", out)
    assert p.expand("<image><image>", out).count("<image>") == 2 * 256  # CLIP's default 224 crop: 16 x 16 patches


def test_a_bad_image_among_good_ones_is_named_before_any_work():
    p = processor_for("gemma3", {}, {})
    with pytest.raises(ImageError, match="^image 2: "):
        p.preprocess([IMAGES["rgb_small"], IMAGES["grey"], b"garbage"])


def test_unknown_family_and_filter_are_refused():
    with pytest.raises(candlewick.UnsupportedError, match="no image processor"):
        processor_for("mllama", {}, {})
    with pytest.raises(candlewick.UnsupportedError, match="resample"):
        processor_for("gemma3", {"resample": 4}, {})


def test_qwen_refuses_an_extreme_aspect_ratio_as_transformers_does():
    p = processor_for("qwen2_5_vl", {}, {})
    with pytest.raises(ImageError, match="image 1: the aspect ratio"):
        p.preprocess([np.zeros((30, 30, 3), np.uint8), np.zeros((1, 300, 3), np.uint8)])


# -- chat messages ----------------------------------------------------------------------------


def test_messages_with_images_turns_both_part_shapes_into_template_parts():
    url = "data:image/png;base64," + base64.b64encode(IMAGES["tiny"]).decode()
    pil = Image.new("RGB", (3, 3))
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "image", "image": pil},
            {"type": "image", "path": "/tmp/x.png"},
        ]},
    ]
    before = json.dumps(messages[1]["content"][:2])
    out, images = messages_with_images(messages)
    assert out[0] is messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"},
                                 {"type": "image"}]
    assert images[0] == url and images[1] is pil and images[2] == "/tmp/x.png"
    assert json.dumps(messages[1]["content"][:2]) == before  # the caller's messages are untouched
    assert messages_with_images([{"role": "user", "content": "hi"}]) == ([{"role": "user", "content": "hi"}], [])


def test_a_malformed_image_part_names_its_image():
    with pytest.raises(ImageError, match="^image 1: an image_url part"):
        messages_with_images([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            {"type": "image_url", "image_url": {}}]}])
