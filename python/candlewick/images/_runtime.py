"""The glue between the runtime and the processors: the native ``ModelRuntime`` calls these with
the model's processor configuration when a call is given ``images=`` (docs/vision.md).

A text prompt gets its placeholders expanded as transformers' processor expands them (one
placeholder per image; a prompt with none gets one per image in front). Token ids get each
placeholder token replaced by the ids of its expansion. Chat messages have their image parts
rendered by the chat template, then expanded.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ._load import ImageError
from ._messages import messages_with_images
from ._processors import ImageProcessor, processor_for


def _processor(files: tuple) -> ImageProcessor:
    model_type, processor_json, config_json = files
    return processor_for(model_type, json.loads(processor_json), json.loads(config_json))


def _pixels(processed: Any) -> np.ndarray:
    return np.ascontiguousarray(processed.pixel_values, dtype=np.float32)


def prepare(files: tuple, tokenizer: Any, prompt: Any, images: Any) -> tuple:
    """``(prompt, pixel_values)``: the text with its placeholders expanded (a ``str``), or the
    token ids with theirs (a ``list[int]``), and float32 pixel values ``[n, 3, S, S]``."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ImageError(None, "images= is empty; leave it out for a prompt without images")
    p = _processor(files)
    processed = p.preprocess(list(images))
    if isinstance(prompt, str):
        if p.image_token not in prompt:
            prompt = p.image_token * len(images) + prompt
        return p.expand(prompt, processed), _pixels(processed)
    ids = [int(t) for t in prompt]
    placeholder = tokenizer.encode(p.image_token, False)
    if len(placeholder) != 1:
        raise ImageError(None, f"the placeholder {p.image_token!r} is not one token of this tokenizer")
    where = [i for i, t in enumerate(ids) if t == placeholder[0]]
    if not where:
        ids = placeholder * len(images) + ids
        where = list(range(len(images)))
    n = len(processed.tokens_per_image)
    if len(where) != n:
        raise ImageError(min(len(where), n - 1), f"the token ids hold {len(where)} {p.image_token!r} placeholders "
                                                 f"for {n} images")
    out, last = [], 0
    for i, at in enumerate(where):
        out.extend(ids[last:at])
        out.extend(tokenizer.encode(p.replacement(i, processed), False))
        last = at + 1
    out.extend(ids[last:])
    return out, _pixels(processed)


def has_images(messages: Any) -> bool:
    """Whether chat messages hold any image content part."""
    try:
        return bool(messages_with_images(list(messages))[1])
    except (TypeError, ValueError, AttributeError):
        return False


def prepare_chat(files: tuple, tokenizer: Any, messages: Any, chat_template: Any, images: Any = None) -> tuple:
    """``(ids, pixel_values)`` of chat messages with image parts: rendered by the chat template
    (which writes the placeholder where each image part is), expanded, encoded. With `images`,
    the messages' image parts are bare ``{"type": "image"}`` ones (as ``messages_with_images``
    leaves them) and `images` their sources, in order."""
    if images is not None:
        plain, sources = list(messages), list(images)
    else:
        plain, sources = messages_with_images(list(messages))
    text = tokenizer.apply_chat_template(plain, chat_template=chat_template, add_generation_prompt=True, tokenize=False)
    p = _processor(files)
    processed = p.preprocess(sources)
    return tokenizer.encode(p.expand(text, processed), False), _pixels(processed)
