"""The image processors of the vision-language families, equal to transformers' defaults.

Each reads the keys of a merged ``preprocessor_config.json`` / ``processor_config.json``
(docs/images.md lists them per family) and returns what transformers' processor returns:
``pixel_values`` as float32 numpy, the number of image tokens per image, and the family's other
tensors (``image_grid_thw``, ``pixel_attention_mask``, ...). ``expand`` writes each image's
placeholder out as transformers' *processor* (not only its image processor) does.

The reference is transformers' default backend when torchvision is installed (the "fast",
torchvision processors): resizing is torch's antialiased uint8 kernel, reproduced bit for bit in
``_resize``; rescaling and normalisation are fused as torchvision's backend fuses them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from PIL import Image

from .._native import UnsupportedError
from ._load import ImageError, load_image
from ._resize import resize_uint8

IMAGENET_STANDARD_MEAN = [0.5, 0.5, 0.5]
IMAGENET_STANDARD_STD = [0.5, 0.5, 0.5]
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Pillow's resampling codes, as processor configs write `resample`, to torch's filters.
_RESAMPLE = {1: "lanczos", 2: "bilinear", 3: "bicubic"}


@dataclass
class ProcessedImages:
    """What a processor made of a list of images.

    ``pixel_values``: float32, laid out as transformers' processor returns them (per family:
    docs/images.md). ``tokens_per_image``: how many image (soft) tokens each image fills in the
    prompt, i.e. the rows of the projector's output for it. ``extra``: the family's other arrays
    (``image_grid_thw``, ``pixel_attention_mask``, ``num_crops``, ``rows``, ``cols``)."""

    pixel_values: np.ndarray
    tokens_per_image: list
    extra: dict = field(default_factory=dict)


def _rgb(img: Image.Image) -> np.ndarray:
    """H x W x 3 uint8, as transformers' `convert_to_rgb` makes it: any transparency (an alpha
    band or a palette's transparent index) composited over white, the rest `convert("RGB")`."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.array(img.convert("RGB"))


def _size_dict(size: Any, default_to_square: bool) -> dict:
    """transformers' `get_size_dict`: an int is a square or a shortest edge, a dict is itself."""
    if size is None:
        return {}
    if isinstance(size, int):
        return {"height": size, "width": size} if default_to_square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    return dict(size)


class ImageProcessor:
    """One family's image processor: ``preprocess`` turns images into the encoder's input,
    ``expand`` writes each image's placeholder (``image_token``) out as the model reads it."""

    #: The placeholder a prompt (or a chat template) writes for one image.
    image_token: str = "<image>"
    #: Defaults of transformers' image processor class, overridden by the config's keys.
    defaults: dict = {}

    def __init__(self, model_type: str, processor_config: dict, model_config: dict):
        self.model_type = model_type
        cfg = {k: v for k, v in (processor_config or {}).items() if v is not None}
        self.config = {**self.defaults, **cfg}
        self.model_config = model_config or {}
        c = self.config
        self.do_resize = bool(c.get("do_resize", True))
        self.do_rescale = bool(c.get("do_rescale", True))
        self.rescale_factor = float(c.get("rescale_factor", 1 / 255))
        self.do_normalize = bool(c.get("do_normalize", True))
        self.image_mean = [float(x) for x in _triple(c.get("image_mean", IMAGENET_STANDARD_MEAN))]
        self.image_std = [float(x) for x in _triple(c.get("image_std", IMAGENET_STANDARD_STD))]
        self.do_convert_rgb = bool(c.get("do_convert_rgb", True))
        resample = c.get("resample", 2)
        if resample not in _RESAMPLE:
            raise UnsupportedError(f"{model_type}: the image processor's resample={resample!r} is not supported "
                                   f"(supported: {sorted(_RESAMPLE)}: lanczos, bilinear, bicubic)")
        self.resample = _RESAMPLE[resample]
        if "image_token" in cfg and isinstance(cfg["image_token"], str):
            self.image_token = cfg["image_token"]

    # -- shared steps --------------------------------------------------------------------

    def _load(self, images: list) -> list:
        """Each image loaded and converted to H x W x 3 uint8; every image is checked before
        any is processed."""
        if not isinstance(images, (list, tuple)):
            raise ImageError(None, f"images must be a list, not {type(images).__name__}")
        loaded = [load_image(im, index=i) for i, im in enumerate(images)]
        out = []
        for i, img in enumerate(loaded):
            if self.do_convert_rgb:
                a = _rgb(img)
            else:
                a = np.array(img)
                if a.ndim == 2:
                    a = np.repeat(a[:, :, None], 3, axis=2)
                if a.dtype != np.uint8 or a.shape[2] != 3:
                    raise ImageError(i, f"mode {img.mode} needs do_convert_rgb, which this processor's config turns off")
            out.append(a)
        return out

    def _resize(self, a: np.ndarray, height: int, width: int) -> np.ndarray:
        return resize_uint8(a, height, width, self.resample)

    def _normalize(self, a: np.ndarray) -> np.ndarray:
        """H x W x 3 uint8 -> 3 x H x W float32, as torchvision's backend fuses rescale and
        normalise: (x - mean / factor) / (std / factor) in float32."""
        x = np.ascontiguousarray(a.transpose(2, 0, 1)).astype(np.float32)
        if self.do_rescale and self.do_normalize:
            f = np.float32(1.0 / self.rescale_factor)
            mean = np.asarray(self.image_mean, dtype=np.float32) * f
            std = np.asarray(self.image_std, dtype=np.float32) * f
            return (x - mean[:, None, None]) / std[:, None, None]
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            return (x - mean[:, None, None]) / std[:, None, None]
        if self.do_rescale:
            return x * np.float32(self.rescale_factor)
        return x

    # -- the interface -------------------------------------------------------------------

    def preprocess(self, images: list) -> ProcessedImages:
        """The images (paths, bytes, data: URLs, PIL images, uint8 arrays) as the model's
        encoder reads them; bad ones raise ImageError naming their index, before any work."""
        raise NotImplementedError

    def replacement(self, index: int, processed: ProcessedImages) -> str:
        """The text that replaces image `index`'s placeholder."""
        raise NotImplementedError

    def expand(self, text: str, processed: ProcessedImages) -> str:
        """`text` with its i-th ``image_token`` replaced by image i's tokens, as transformers'
        processor lays them out; the placeholders must be as many as the images."""
        n = len(processed.tokens_per_image)
        found = [m.start() for m in re.finditer(re.escape(self.image_token), text)]
        if len(found) != n:
            index = min(len(found), n - 1) if n else None
            raise ImageError(index, f"the text has {len(found)} {self.image_token!r} placeholder"
                                    f"{'s' if len(found) != 1 else ''} for {n} image{'s' if n != 1 else ''}")
        out, last = [], 0
        for i, start in enumerate(found):
            out.append(text[last:start])
            out.append(self.replacement(i, processed))
            last = start + len(self.image_token)
        out.append(text[last:])
        return "".join(out)


def _triple(v: Any) -> list:
    return [v, v, v] if isinstance(v, (int, float)) else list(v)


class Gemma3ImageProcessor(ImageProcessor):
    """Gemma 3: each image resized to ``size`` (896 x 896, bilinear), scaled to [-1, 1];
    ``image_seq_length`` (256) soft tokens between ``<start_of_image>`` and ``<end_of_image>``.
    Pan and scan (``do_pan_and_scan``, off by default as in transformers) adds crops of long
    images after each whole image."""

    image_token = "<start_of_image>"
    defaults = {"size": {"height": 224, "width": 224}, "resample": 2, "image_mean": IMAGENET_STANDARD_MEAN,
                "image_std": IMAGENET_STANDARD_STD,
                # Gemma3Processor's own defaults for the pan-and-scan options.
                "do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}

    def __init__(self, model_type, processor_config, model_config):
        super().__init__(model_type, processor_config, model_config)
        size = _size_dict(self.config["size"], True)
        self.height, self.width = int(size["height"]), int(size["width"])
        self.seq_len = int(self.config.get("image_seq_length", self.model_config.get("mm_tokens_per_image", 256)))
        self.boi, self.eoi, self.soft = "<start_of_image>", "<end_of_image>", "<image_soft_token>"

    def _crops(self, a: np.ndarray) -> list:
        """transformers' `pan_and_scan`: crops of an image whose aspect ratio is past the
        threshold, or none."""
        c = self.config
        min_crop, max_crops, ratio = (int(c["pan_and_scan_min_crop_size"]), int(c["pan_and_scan_max_num_crops"]),
                                      float(c["pan_and_scan_min_ratio_to_activate"]))
        height, width = a.shape[:2]
        if width >= height:
            if width / height < ratio:
                return []
            n_w = int(math.floor(width / height + 0.5))
            n_w = min(int(math.floor(width / min_crop)), n_w)
            n_w = min(max_crops, max(2, n_w))
            n_h = 1
        else:
            if height / width < ratio:
                return []
            n_h = int(math.floor(height / width + 0.5))
            n_h = min(int(math.floor(height / min_crop)), n_h)
            n_h = min(max_crops, max(2, n_h))
            n_w = 1
        cw, ch = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
        if min(cw, ch) < min_crop:
            return []
        return [a[ch * i:ch * i + ch, cw * j:cw * j + cw] for i in range(n_h) for j in range(n_w)]

    def preprocess(self, images: list) -> ProcessedImages:
        arrays = self._load(images)
        frames, num_crops = [], []
        for a in arrays:
            crops = self._crops(a) if self.config.get("do_pan_and_scan") else []
            num_crops.append(len(crops))
            for f in [a] + crops:
                if self.do_resize:
                    f = self._resize(f, self.height, self.width)
                frames.append(self._normalize(f))
        pixel_values = np.stack(frames) if frames else np.zeros((0, 3, self.height, self.width), np.float32)
        return ProcessedImages(pixel_values=pixel_values,
                               tokens_per_image=[self.seq_len * (1 + n) for n in num_crops],
                               extra={"num_crops": np.asarray(num_crops, dtype=np.int64)})

    def replacement(self, index, processed):
        full = f"\n\n{self.boi}{self.soft * self.seq_len}{self.eoi}\n\n"
        n = int(processed.extra["num_crops"][index])
        if not n:
            return full
        return (f"Here is the original image {full} and here are some crops to help you see better "
                + " ".join([full] * n))


class ClipImageProcessor(ImageProcessor):
    """LLaVA-1.5 (CLIPImageProcessor): the shortest edge resized to ``size.shortest_edge``
    (bicubic), a centre crop of ``crop_size``, CLIP's mean and std; ``<image>`` repeated once
    per patch (+ ``num_additional_image_tokens``, - 1 for the "default" feature strategy).
    With ``image_processor_type: LlavaImageProcessor`` and ``do_pad``, each image is first
    padded to a square with the mean colour, as that processor does."""

    defaults = {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}, "resample": 3,
                "do_center_crop": True, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD}

    def __init__(self, model_type, processor_config, model_config):
        super().__init__(model_type, processor_config, model_config)
        self.size = _size_dict(self.config["size"], False)
        self.crop = _size_dict(self.config.get("crop_size"), True)
        self.do_center_crop = bool(self.config.get("do_center_crop", True))
        vision = self.model_config.get("vision_config") or {}
        self.patch_size = int(self.config.get("patch_size") or vision.get("patch_size", 14))
        self.strategy = self.config.get("vision_feature_select_strategy") or self.model_config.get(
            "vision_feature_select_strategy", "default")
        # CLIP's encoder adds one class token; LLaVA's processors write this count down.
        self.additional = int(self.config.get("num_additional_image_tokens", 1))
        # Only LlavaImageProcessor pads to a square (CLIPImageProcessor's `do_pad` would pad a
        # batch to its largest image instead, which a centre crop makes moot).
        self.pad_square = (str(self.config.get("image_processor_type", "")).startswith("LlavaImageProcessor")
                           and bool(self.config.get("do_pad", False)))

    def _pad_square(self, a: np.ndarray) -> np.ndarray:
        """LlavaImageProcessor's `pad_to_square`: centred, the rest filled with the mean colour."""
        h, w = a.shape[:2]
        if h == w:
            return a
        side = max(h, w)
        top, left = (side - h) // 2, (side - w) // 2
        out = np.empty((side, side, 3), dtype=np.uint8)
        out[:] = np.asarray([int(x * 255) for x in self.image_mean], dtype=np.uint8)
        out[top:top + h, left:left + w] = a
        return out

    def _out_size(self, h: int, w: int) -> tuple:
        if "shortest_edge" in self.size:
            s = int(self.size["shortest_edge"])
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = s, int(s * long / short)
            return (new_long, new_short) if w <= h else (new_short, new_long)
        return int(self.size["height"]), int(self.size["width"])

    def _center_crop(self, a: np.ndarray) -> np.ndarray:
        """torchvision's backend `center_crop`: zero padding where the crop is larger."""
        ch, cw = int(self.crop["height"]), int(self.crop["width"])
        h, w = a.shape[:2]
        if cw > w or ch > h:
            left, top = ((cw - w) // 2 if cw > w else 0), ((ch - h) // 2 if ch > h else 0)
            right, bottom = ((cw - w + 1) // 2 if cw > w else 0), ((ch - h + 1) // 2 if ch > h else 0)
            a = np.pad(a, ((top, bottom), (left, right), (0, 0)))
            h, w = a.shape[:2]
            if (h, w) == (ch, cw):
                return a
        top, left = int((h - ch) / 2.0), int((w - cw) / 2.0)
        return a[top:top + ch, left:left + cw]

    def preprocess(self, images: list) -> ProcessedImages:
        frames, tokens = [], []
        for a in self._load(images):
            if self.pad_square:
                a = self._pad_square(a)
            if self.do_resize:
                a = self._resize(a, *self._out_size(*a.shape[:2]))
            if self.do_center_crop:
                a = self._center_crop(a)
            frames.append(self._normalize(a))
            h, w = a.shape[:2]
            n = (h // self.patch_size) * (w // self.patch_size) + self.additional
            tokens.append(n - 1 if self.strategy == "default" else n)
        if frames and len({f.shape for f in frames}) > 1:
            raise ImageError(None, "without a centre crop the images have different sizes and cannot be stacked")
        return ProcessedImages(pixel_values=np.stack(frames) if frames else np.zeros((0, 3, 0, 0), np.float32),
                               tokens_per_image=tokens, extra={})

    def replacement(self, index, processed):
        return self.image_token * processed.tokens_per_image[index]


class Idefics3ImageProcessor(ImageProcessor):
    """Idefics3 and SmolVLM: the longest edge resized to ``size.longest_edge`` (lanczos), then to
    multiples of ``max_image_size.longest_edge`` and split into that many square crops plus the
    whole image at that size (``do_image_splitting``); ``image_seq_len`` ``<image>`` tokens per
    crop, laid out with ``<fake_token_around_image>``, ``<row_r_col_c>`` and ``<global-img>``."""

    defaults = {"size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364}, "resample": 1,
                "do_image_splitting": True, "do_pad": True, "image_mean": IMAGENET_STANDARD_MEAN,
                "image_std": IMAGENET_STANDARD_STD}
    MAX_IMAGE_SIZE = 4096

    def __init__(self, model_type, processor_config, model_config):
        super().__init__(model_type, processor_config, model_config)
        self.longest = int(_size_dict(self.config["size"], False)["longest_edge"])
        self.tile = int(_size_dict(self.config["max_image_size"], False)["longest_edge"])
        self.split = bool(self.config.get("do_image_splitting", True))
        seq = self.config.get("image_seq_len")
        if seq is None:
            vision = self.model_config.get("vision_config") or {}
            scale = int(self.model_config.get("scale_factor", 2))
            seq = int(((int(vision.get("image_size", self.tile)) // int(vision.get("patch_size", 14))) ** 2)
                      / (scale ** 2))
        self.seq_len = int(seq)
        self.fake, self.global_tag = "<fake_token_around_image>", "<global-img>"

    def _longest_edge_size(self, h: int, w: int) -> tuple:
        aspect = w / h
        if w >= h:
            w = self.longest
            h = int(w / aspect)
            if h % 2 != 0:
                h += 1
        else:
            h = self.longest
            w = int(h * aspect)
            if w % 2 != 0:
                w += 1
        h, w = max(h, 1), max(w, 1)
        # ... then scaled below the absolute bound.
        aspect = w / h
        if w >= h and w > self.MAX_IMAGE_SIZE:
            w = self.MAX_IMAGE_SIZE
            h = int(w / aspect)
        elif h > w and h > self.MAX_IMAGE_SIZE:
            h = self.MAX_IMAGE_SIZE
            w = int(h * aspect)
        return max(h, 1), max(w, 1)

    def _tile_multiple_size(self, h: int, w: int) -> tuple:
        t = self.tile
        aspect = w / h
        if w >= h:
            w = math.ceil(w / t) * t
            h = int(w / aspect)
            h = math.ceil(h / t) * t
        else:
            h = math.ceil(h / t) * t
            w = int(h * aspect)
            w = math.ceil(w / t) * t
        return h, w

    def preprocess(self, images: list) -> ProcessedImages:
        frames, rows, cols = [], [], []
        for a in self._load(images):
            if self.do_resize:
                a = self._resize(a, *self._longest_edge_size(*a.shape[:2]))
            if self.split:
                a = self._resize(a, *self._tile_multiple_size(*a.shape[:2]))
                h, w = a.shape[:2]
                t = self.tile
                if h > t or w > t:
                    r, c = math.ceil(h / t), math.ceil(w / t)
                    # torch's `unfold` keeps whole tiles only; the size is a multiple of the tile.
                    crops = [a[i * t:(i + 1) * t, j * t:(j + 1) * t] for i in range(h // t) for j in range(w // t)]
                    crops.append(self._resize(a, t, t))
                else:
                    r, c, crops = 0, 0, [a]
            else:
                r, c, crops = 0, 0, [self._resize(a, self.tile, self.tile)]
            rows.append(r)
            cols.append(c)
            frames.append([self._normalize(f) for f in crops])
        flat = [f for fs in frames for f in fs]
        # All frames of the call are one sample (as the processor nests one prompt's images):
        # [1, frames, 3, H, W], padded at the bottom and right to the largest frame.
        height = max((f.shape[1] for f in flat), default=self.tile)
        width = max((f.shape[2] for f in flat), default=self.tile)
        pixel_values = np.zeros((1, len(flat), 3, height, width), dtype=np.float32)
        mask = np.zeros((1, len(flat), height, width), dtype=np.int64)
        for k, f in enumerate(flat):
            pixel_values[0, k, :, :f.shape[1], :f.shape[2]] = f
            mask[0, k, :f.shape[1], :f.shape[2]] = 1
        tokens = [self.seq_len * len(fs) for fs in frames]
        return ProcessedImages(pixel_values=pixel_values, tokens_per_image=tokens,
                               extra={"pixel_attention_mask": mask, "rows": rows, "cols": cols})

    def replacement(self, index, processed):
        r, c = processed.extra["rows"][index], processed.extra["cols"][index]
        image = self.image_token * self.seq_len
        whole = f"{self.fake}{self.global_tag}{image}{self.fake}"
        if r == 0 and c == 0:
            return whole
        text = ""
        for i in range(r):
            for j in range(c):
                text += f"{self.fake}<row_{i + 1}_col_{j + 1}>{image}"
            text += "\n"
        return text + "\n" + whole


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, index: int = 0) -> tuple:
    """Qwen2-VL's size: both sides multiples of `factor`, the area within the pixel bounds, the
    aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(index, f"the aspect ratio {max(height, width) / min(height, width):.1f} is over 200, "
                                "which Qwen2-VL's processor refuses")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2-VL and Qwen2.5-VL: `smart_resize` to multiples of ``patch_size * merge_size`` within
    ``min_pixels`` .. ``max_pixels`` (bicubic), CLIP's mean and std, each image flattened into
    patches of ``3 * temporal_patch_size * patch_size**2`` values (the frame repeated over time),
    grouped by ``merge_size`` squares; ``<|image_pad|>`` once per merged patch."""

    image_token = "<|image_pad|>"
    defaults = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, "resample": 3,
                "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD, "patch_size": 14,
                "temporal_patch_size": 2, "merge_size": 2}

    def __init__(self, model_type, processor_config, model_config):
        super().__init__(model_type, processor_config, model_config)
        c = self.config
        size = dict(c["size"])
        if c.get("min_pixels") is not None:
            size["shortest_edge"] = c["min_pixels"]
        if c.get("max_pixels") is not None:
            size["longest_edge"] = c["max_pixels"]
        self.min_pixels, self.max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
        self.patch, self.temporal, self.merge = int(c["patch_size"]), int(c["temporal_patch_size"]), int(c["merge_size"])

    def preprocess(self, images: list) -> ProcessedImages:
        arrays = self._load(images)
        p, t, m = self.patch, self.temporal, self.merge
        sizes = [smart_resize(a.shape[0], a.shape[1], p * m, self.min_pixels, self.max_pixels, index=i)
                 if self.do_resize else a.shape[:2] for i, a in enumerate(arrays)]
        patches, grids = [], []
        for a, (h, w) in zip(arrays, sizes):
            if self.do_resize:
                a = self._resize(a, h, w)
            x = self._normalize(a)  # 3 x H x W
            gh, gw = h // p, w // p
            x = x.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
            x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t, p, p))
            patches.append(x.reshape(gh * gw, 3 * t * p * p))
            grids.append([1, gh, gw])
        pixel_values = (np.concatenate(patches) if patches else np.zeros((0, 3 * t * p * p), np.float32))
        grid = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
        return ProcessedImages(pixel_values=np.ascontiguousarray(pixel_values),
                               tokens_per_image=[int(g.prod()) // (m * m) for g in grid],
                               extra={"image_grid_thw": grid})

    def replacement(self, index, processed):
        return self.image_token * processed.tokens_per_image[index]


# model_type (config.json) -> processor.
PROCESSORS = {
    "gemma3": Gemma3ImageProcessor,
    "llava": ClipImageProcessor,
    "idefics3": Idefics3ImageProcessor,
    "smolvlm": Idefics3ImageProcessor,
    "qwen2_vl": Qwen2VLImageProcessor,
    "qwen2_5_vl": Qwen2VLImageProcessor,
}


def processor_for(model_type: str, processor_config: Optional[dict], model_config: Optional[dict]) -> ImageProcessor:
    """The image processor of a model: `model_type` from its config.json, `processor_config` the
    merged preprocessor_config.json / processor_config.json (or an mmproj's metadata mapped to
    the same keys), `model_config` its config.json (for values only it holds)."""
    cls = PROCESSORS.get(model_type)
    if cls is None:
        raise UnsupportedError(f"no image processor for model type {model_type!r} "
                               f"(candlewick has: {', '.join(sorted(PROCESSORS))})")
    return cls(model_type, processor_config or {}, model_config or {})
