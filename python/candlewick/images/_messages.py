"""Chat messages with image parts, in the shape chat templates read them."""

from __future__ import annotations

from typing import Any

from ._load import ImageError


def _image_of(part: dict, index: int) -> Any:
    """The image source of one content part, or None when the part is not an image."""
    kind = part.get("type")
    if kind == "image_url":  # OpenAI: {"type": "image_url", "image_url": {"url": ..., "detail": ...}}
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise ImageError(index, "an image_url part needs image_url.url (a data: URL, or http(s) where allowed)")
        return url
    if kind == "image":  # transformers: {"type": "image", "image" | "url" | "path" | "base64": ...}
        for key in ("image", "url", "path"):
            if part.get(key) is not None:
                return part[key]
        if part.get("base64") is not None:
            return "data:image/*;base64," + part["base64"] if isinstance(part["base64"], str) else part["base64"]
        raise ImageError(index, "an image part needs one of image, url, path or base64")
    return None


def messages_with_images(messages: list) -> tuple:
    """Splits the images out of chat messages: each OpenAI ``{"type": "image_url", "image_url":
    {"url": ...}}`` and transformers ``{"type": "image", "image" | "url" | "path": ...}`` content
    part becomes the ``{"type": "image"}`` part chat templates expect (the template writes the
    model's image placeholder there), and its source (a URL string, path, bytes, PIL image or
    array, not yet loaded) joins the returned list, in order. Returns ``(messages, images)``;
    the messages given are not changed, and messages without images come back equal."""
    out: list = []
    images: list = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            src = _image_of(part, len(images)) if isinstance(part, dict) else None
            if src is None:
                parts.append(part)
            else:
                images.append(src)
                parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images
