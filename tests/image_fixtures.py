"""Images drawn with numpy and Pillow, and what transformers' image processors and processors make
of them, for tests/test_images.py.

The images are not stored (except one EXIF-rotated JPEG, whose bytes depend on the encoder):
`draw_images()` draws them from numpy's PCG64 generator with fixed seeds and encodes them as PNG,
so a test rebuilds them without torch. What is stored, in tests/data/images/: `cases.json` (each
case's family, configs, images, the token counts, the expanded text or its SHA-256, and for the
real default configs the shapes, sums and seeded sample values) and `<case>.npz` with the full
`pixel_values` (and the family's other arrays) for the small-size cases.

The reference is transformers' default processor class for each family, which is the torchvision
("fast") one when torchvision is installed (docs/images.md says why); `backend` in cases.json
records it.

    python tests/image_fixtures.py     (needs torch, torchvision and transformers 5.x)
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

DATA = Path(__file__).resolve().parent / "data" / "images"


def _smooth(rng, h, w, c):
    """A smooth field plus noise: edges and gradients that make resampling filters differ."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    base = np.stack([127 + 120 * np.sin(x / max(w, 1) * (3 + k) + y / max(h, 1) * (2 + k) + k) for k in range(c)], -1)
    return np.clip(base + rng.normal(0, 25, (h, w, c)), 0, 255).astype(np.uint8)


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def draw_images() -> dict:
    """name -> encoded image bytes (PNG, and the stored JPEG), deterministic."""
    rng = np.random.default_rng(20260)
    out = {}
    out["rgb_small"] = _png(Image.fromarray(_smooth(rng, 37, 53, 3)))
    out["rgb_wide"] = _png(Image.fromarray(_smooth(rng, 40, 150, 3)))
    out["rgb_tall"] = _png(Image.fromarray(_smooth(rng, 300, 64, 3)))
    rgba = _smooth(rng, 50, 50, 4)
    rgba[:10, :, 3] = 0  # fully transparent rows, half-transparent elsewhere
    out["rgba"] = _png(Image.fromarray(rgba))
    out["grey"] = _png(Image.fromarray(_smooth(rng, 45, 70, 1)[:, :, 0]))
    pal = Image.fromarray(_smooth(rng, 60, 40, 3)).quantize(colors=16, method=Image.Quantize.MEDIANCUT, dither=0)
    out["palette"] = _png(pal, transparency=3)
    grey16 = (rng.integers(0, 1024, (33, 47)) * np.linspace(1, 60, 47)).astype(np.uint16)
    out["grey16"] = _png(Image.fromarray(grey16))
    out["exif_png"] = _png(Image.fromarray(_smooth(rng, 30, 50, 3)), exif=_exif(6))
    out["exif_jpeg"] = (DATA / "exif_rotated.jpg").read_bytes()
    out["tiny"] = _png(Image.fromarray(_smooth(rng, 1, 1, 3)))
    out["tiny_2x3"] = _png(Image.fromarray(_smooth(rng, 2, 3, 3)))
    out["large"] = _png(Image.fromarray(_smooth(rng, 900, 1200, 3)))
    return out


def write_exif_jpeg() -> None:
    """The EXIF-rotated JPEG (orientation 8: stored sideways), written once and kept."""
    rng = np.random.default_rng(77)
    buf = io.BytesIO()
    Image.fromarray(_smooth(rng, 24, 40, 3)).save(buf, format="JPEG", quality=90, exif=_exif(8))
    (DATA / "exif_rotated.jpg").write_bytes(buf.getvalue())


SMALL = ["rgb_small", "rgb_wide", "rgb_tall", "rgba", "grey", "palette", "grey16", "exif_png", "exif_jpeg", "tiny",
         "tiny_2x3"]
REAL = ["rgb_wide", "large", "tiny_2x3", "exif_jpeg"]

# case -> (model_type, image processor config, processor config, model config, images, full arrays?)
CASES = {
    "gemma3_small": ("gemma3", {"size": {"height": 32, "width": 32}}, {"image_seq_length": 4}, {}, SMALL, True),
    "gemma3_pan_and_scan": ("gemma3", {"size": {"height": 24, "width": 24}, "do_pan_and_scan": True,
                                       "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 4,
                                       "pan_and_scan_min_ratio_to_activate": 1.2},
                            {"image_seq_length": 3}, {}, ["rgb_wide", "rgb_tall", "rgb_small", "grey"], True),
    "llava_small": ("llava", {"size": {"shortest_edge": 24}, "crop_size": {"height": 24, "width": 24}},
                    {"patch_size": 4, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1},
                    {}, SMALL, True),
    "llava_crop_pads": ("llava", {"size": {"shortest_edge": 16}, "crop_size": {"height": 20, "width": 28}},
                        {"patch_size": 4, "vision_feature_select_strategy": "full", "num_additional_image_tokens": 1},
                        {}, ["rgb_wide", "rgb_tall", "grey"], True),
    "llava_pad_to_square": ("llava", {"image_processor_type": "LlavaImageProcessor", "do_pad": True,
                                      "size": {"shortest_edge": 20}, "crop_size": {"height": 20, "width": 20}},
                            {"patch_size": 5, "vision_feature_select_strategy": "default",
                             "num_additional_image_tokens": 1}, {}, ["rgb_wide", "rgb_tall", "rgba", "tiny_2x3"], True),
    "idefics3_small": ("idefics3", {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 16}},
                       {"image_seq_len": 4}, {}, SMALL, True),
    "idefics3_no_split": ("idefics3", {"size": {"longest_edge": 48}, "max_image_size": {"longest_edge": 16},
                                       "do_image_splitting": False}, {"image_seq_len": 2}, {},
                          ["rgb_wide", "rgb_tall", "rgba"], True),
    "qwen2_5_vl_small": ("qwen2_5_vl", {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                                        "size": {"shortest_edge": 64, "longest_edge": 48 * 48}}, {}, {}, SMALL, True),
    # The real default configs (as the Hub's checkpoints write them), compared on summaries.
    "gemma3_4b": ("gemma3", {"size": {"height": 896, "width": 896}, "resample": 2, "image_mean": [0.5, 0.5, 0.5],
                             "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": None},
                  {"image_seq_length": 256}, {}, REAL, False),
    "llava_1_5": ("llava", {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                            "resample": 3}, {"patch_size": 14, "vision_feature_select_strategy": "default",
                                             "num_additional_image_tokens": 1}, {}, REAL, False),
    "smolvlm": ("smolvlm", {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512},
                            "resample": 1}, {"image_seq_len": 64}, {}, REAL, False),
    "qwen2_5_vl": ("qwen2_5_vl", {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                                  "temporal_patch_size": 2, "merge_size": 2}, {}, {}, REAL, False),
}

PLACEHOLDER = {"gemma3": "<start_of_image>", "llava": "<image>", "idefics3": "<image>", "smolvlm": "<image>",
               "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}


def prompt(model_type: str, n: int) -> str:
    """The text a case expands: one placeholder per image between words."""
    return "User: look" + "".join(f" at {PLACEHOLDER[model_type]} and" for _ in range(n)) + " say.\n"


def sample_positions(shape, n=64, seed=5):
    """Seeded flat positions into an array of `shape`, the same here and in the test."""
    size = int(np.prod(shape))
    return np.random.default_rng(seed).integers(0, size, n) if size else np.zeros(0, np.int64)


def summary(a: np.ndarray) -> dict:
    a = np.asarray(a, dtype=np.float64)
    pos = sample_positions(a.shape)
    return {"shape": list(a.shape), "sum": float(a.sum()), "abs_sum": float(np.abs(a).sum()),
            "samples": [float(v) for v in a.reshape(-1)[pos]]}


def _tokenizer(gemma: bool):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<image>", "<fake_token_around_image>",
             "<global-img>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    words += [f"<row_{i}_col_{j}>" for i in range(1, 9) for j in range(1, 9)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    if not gemma:  # the other processors take a tokenizer's `image_token` over their own default
        return PreTrainedTokenizerFast(tokenizer_object=tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})


def _processor(model_type, ip_cfg, proc_cfg):
    import transformers as tf

    tok = _tokenizer(model_type == "gemma3")
    ip_cfg = {k: v for k, v in ip_cfg.items() if v is not None}
    if model_type == "gemma3":
        ip = tf.Gemma3ImageProcessor(**ip_cfg)
        return ip, tf.Gemma3Processor(image_processor=ip, tokenizer=tok, **proc_cfg)
    if model_type == "llava":
        kind = ip_cfg.pop("image_processor_type", "CLIPImageProcessor")
        ip = getattr(tf, kind)(**ip_cfg)
        return ip, tf.LlavaProcessor(image_processor=ip, tokenizer=tok, **proc_cfg)
    if model_type in ("idefics3", "smolvlm"):
        ip = (tf.Idefics3ImageProcessor if model_type == "idefics3" else tf.SmolVLMImageProcessor)(**ip_cfg)
        return ip, tf.Idefics3Processor(image_processor=ip, tokenizer=tok, **proc_cfg)
    ip = tf.Qwen2VLImageProcessor(**ip_cfg)
    return ip, tf.Qwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, video_processor=tf.Qwen2VLVideoProcessor(),
                                     **proc_cfg)


def reference_input(data: bytes) -> Image.Image:
    """The image as transformers reads it before its processor: decoded, upright by EXIF."""
    from PIL import ImageOps

    img = Image.open(io.BytesIO(data))
    img.load()
    return ImageOps.exif_transpose(img)


def generate() -> None:
    import torch
    import transformers

    DATA.mkdir(parents=True, exist_ok=True)
    if not (DATA / "exif_rotated.jpg").exists():
        write_exif_jpeg()
    images = draw_images()
    index = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": {}}
    for name, (model_type, ip_cfg, proc_cfg, model_cfg, names, full) in CASES.items():
        ip, proc = _processor(model_type, dict(ip_cfg), proc_cfg)
        imgs = [reference_input(images[n]) for n in names]
        kw = {"return_row_col_info": True} if model_type in ("idefics3", "smolvlm") else {}
        out = ip(imgs, return_tensors="pt", **kw)
        text = prompt(model_type, len(imgs))
        inputs, repl = proc._process_images(imgs, **kw)
        expanded = proc.get_text_with_replacements([text], images_replacements=repl)[0][0]
        arrays = {k: (v.numpy() if hasattr(v, "numpy") else np.asarray(v)) for k, v in out.items()}
        arrays["pixel_values"] = arrays["pixel_values"].astype(np.float32)
        image_token = getattr(proc, "image_token")
        soft = {"gemma3": "<image_soft_token>"}.get(model_type, image_token)
        case = {"model_type": model_type, "image_processor_config": ip_cfg, "processor_config": proc_cfg,
                "model_config": model_cfg, "images": names, "backend": ip.backend,
                "image_processor": type(ip).__name__, "processor": type(proc).__name__, "text": text,
                "image_token": image_token,
                "tokens_per_image": [r.count(soft) for r in repl],
                "keys": sorted(arrays), "shapes": {k: list(v.shape) for k, v in arrays.items()}}
        if full:
            case["expanded"] = expanded
            np.savez_compressed(DATA / f"{name}.npz", **arrays)
        else:
            case["expanded_sha256"] = hashlib.sha256(expanded.encode()).hexdigest()
            case["expanded_len"] = len(expanded)
            case["summaries"] = {k: summary(v) for k, v in arrays.items()}
        index["cases"][name] = case
        print(name, case["backend"], case["shapes"], case["tokens_per_image"])
    (DATA / "cases.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(generate())
