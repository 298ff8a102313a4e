"""Images in requests: where the server takes them from, and what it refuses.

An image comes as a ``data:`` URL (OpenAI ``image_url`` parts) or base64 data (Anthropic
``image`` blocks with a ``base64`` source): it is decoded here, in the worker thread that
renders the prompt. An ``http(s)`` URL is fetched only from a host that
``--allowed-media-domains`` names (exactly, redirects included), within the request body's size
limit and ``FETCH_TIMEOUT``; any other host is a 400, since servers often run offline and an
open fetcher lets a client make the server call any address it can reach. Every refusal is an
``ApiError`` 400 that names the part at fault: bytes that are not an image, an image over
``--max-image-pixels``, more images than ``--limit-mm-per-prompt``, or an image sent to a
model that takes none.
"""

from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prefixserve.model.arch.vision_config import (
    DEFAULT_LIMIT_IMAGES_PER_PROMPT,
    DEFAULT_MAX_IMAGE_PIXELS,
)
from prefixserve.model.vision.image import (
    MEDIA_TYPES,
    DecodedImage,
    ImageError,
    decode_base64_image,
    decode_data_url,
    decode_image,
)
from prefixserve.server.errors import ApiError, quote

FETCH_TIMEOUT = 10.0
"""Seconds an image fetch from an allowed host may take."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (see the module docstring)."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 32 << 20
    limit: int = DEFAULT_LIMIT_IMAGES_PER_PROMPT


@dataclass
class ImageCollector:
    """Turns a prompt's image parts, in prompt order, into ``image_token`` (the text the
    chat template renders where an image goes) and keeps the decoded images (``images``).
    ``image_token`` None: the model takes no images, and any image part is a 400."""

    policy: MediaPolicy
    image_token: str | None
    images: list[DecodedImage] = field(default_factory=list)

    def url(self, where: str, url: str) -> str:
        """The placeholder of the image at ``url`` (a ``data:`` or allowed ``http(s)`` URL)."""
        self._admit(where)
        return self._keep(where, lambda: load_image_url(url, self.policy))

    def base64(self, where: str, media_type: str, data: str) -> str:
        """The placeholder of a base64 image of ``media_type``."""
        self._admit(where)
        if media_type.lower() not in MEDIA_TYPES:
            raise ApiError(400, f"{where}: unsupported image media type {quote(media_type)}; "
                           f"supported: {', '.join(MEDIA_TYPES)}", param="messages",
                           code="invalid_image")
        return self._keep(where, lambda: decode_base64_image(data, self.policy.max_pixels))

    def _admit(self, where: str) -> None:
        """A 400 unless the model takes images and the prompt has room for one more."""
        if self.image_token is None:
            raise ApiError(400, f"{where}: this model takes no images (it is a text-only "
                           "model); send text only", param="messages",
                           code="image_not_supported")
        if len(self.images) >= self.policy.limit:
            raise ApiError(400, f"{where}: more than {self.policy.limit} images in one prompt "
                           "(--limit-mm-per-prompt)", param="messages", code="too_many_images")

    def _keep(self, where: str, load: Any) -> str:
        try:
            self.images.append(load())
        except ImageError as exc:
            raise ApiError(400, f"{where}: {exc}", param="messages", code=exc.code) from None
        assert self.image_token is not None
        return self.image_token


def load_image_url(url: str, policy: MediaPolicy) -> DecodedImage:
    """The image of a ``data:`` URL, or of an ``http(s)`` URL on an allowed host; an
    ``ImageError`` otherwise (code ``image_url_not_allowed`` for a host or scheme that is
    not allowed)."""
    if url.startswith("data:"):
        return decode_data_url(url, policy.max_pixels)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ImageError(f"the image URL is not valid: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ImageError(f"unsupported image URL scheme {quote(parts.scheme)}; send a "
                         "data:image/...;base64 URL", code="image_url_not_allowed")
    _check_host(parts.hostname, policy)
    return decode_image(_download(url, policy), policy.max_pixels)


def _check_host(host: str | None, policy: MediaPolicy) -> None:
    allowed = {d.lower() for d in policy.allowed_domains}
    if (host or "").lower() not in allowed:
        raise ImageError(f"image URLs are fetched only from the hosts --allowed-media-domains "
                         f"names, and {quote(host)} is not one; send the image as a "
                         "data:image/...;base64 URL", code="image_url_not_allowed")


class _AllowedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:
        _check_host(urlsplit(newurl).hostname, self.policy)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _download(url: str, policy: MediaPolicy) -> bytes:
    """The body of ``url`` (at most ``max_bytes``); an ``ImageError`` when it fails."""
    opener = urllib.request.build_opener(_AllowedRedirects(policy))
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT) as response:
            data: bytes = response.read(policy.max_bytes + 1)
    except ImageError:
        raise
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        raise ImageError(f"the image at {quote(url)} cannot be fetched: {exc}") from None
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image at {quote(url)} is larger than {policy.max_bytes} bytes",
                         code="image_too_large")
    return data
