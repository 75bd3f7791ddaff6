"""Images in chat requests: content parts read into PIL images, URLs fetched only when allowed.

A client names an image by a ``data:`` URL (always taken) or an ``http(s)://`` URL (fetched only
when the server was started with ``--allow-image-urls``, then with a size cap and a timeout).
A path, or any other string, is refused: a client must not make the server read its own files.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Optional

from ..images import ImageError, load_image, messages_with_images


@dataclass
class ImagePolicy:
    """What the server may do to get a request's images: fetch http(s) URLs or not, and then
    how many bytes per image and how many seconds per fetch."""

    allow_urls: bool = False
    max_bytes: int = 20 << 20
    timeout: Optional[float] = 10.0  # None: no limit


def fetch(url: str, index: int, policy: ImagePolicy) -> bytes:
    """The bytes at `url`, at most `policy.max_bytes` of them, within `policy.timeout` seconds
    per read; any failure is an ImageError naming the image."""
    request = urllib.request.Request(url, headers={"User-Agent": "candlewick-serve"})
    try:
        with urllib.request.urlopen(request, timeout=policy.timeout) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise ImageError(index, f"{url} is {length} bytes, over the server's limit of {policy.max_bytes}")
            data = r.read(policy.max_bytes + 1)
    except ImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(index, f"could not fetch {url}: {getattr(e, 'reason', e)}") from None
    if len(data) > policy.max_bytes:
        raise ImageError(index, f"{url} is over the server's limit of {policy.max_bytes} bytes")
    return data


def source_bytes(src: Any, index: int, policy: ImagePolicy):
    """What `load_image` may read of a client's image source: a data: URL as it is, an allowed
    http(s) URL's bytes; anything else is refused."""
    if not isinstance(src, str):
        raise ImageError(index, "an image must be given by a data: URL or an http(s) URL")
    low = src[:8].lower()
    if low.startswith("data:"):
        return src
    if low.startswith(("http://", "https://")):
        if not policy.allow_urls:
            raise ImageError(index, "this server fetches no image URL (start it with --allow-image-urls); "
                                    "send the image as a data: URL")
        return fetch(src, index, policy)
    raise ImageError(index, "an image must be given by a data: URL or an http(s) URL")


async def request_images(messages: list, policy: ImagePolicy) -> tuple:
    """A chat request's messages with their image parts turned into template parts, and the
    images read (fetched in worker threads, so the server's loop keeps serving)."""
    messages, sources = messages_with_images(messages)
    images = []
    for i, src in enumerate(sources):
        data = await asyncio.to_thread(source_bytes, src, i, policy)
        images.append(await asyncio.to_thread(load_image, data, index=i))
    return messages, images
