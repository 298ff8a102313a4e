"""Images in the engine: where a prompt's images go, their embeddings, the encoder cache.

A chat with images is rendered with one placeholder token (the model's image token) where each
image is; :meth:`ImageInputs.place` expands each placeholder to the image's
``tokens_per_image`` tokens and names each run by the image's content hash
(``MultiModalInput``): the prefix cache then gives every block the run overlaps that hash as
an extra key, so the same image at the same place hits and another image misses from its
first block on.

When a step computes placeholder positions, :meth:`ImageInputs.step_embeds` hands the runner
the projected image features for them. The features come from the **encoder cache**
(recent images by content hash, LRU, bounded in rows) or from the vision encoder, run once
per step over all the images the step needs that the cache lacks. A prompt whose image blocks
are all cached computes no placeholder position, so it asks for no features at all.

:func:`flatten_content` renders the image parts of ``LLM.chat`` messages as the image token
(the server has its own, ``server/media.py``, for the API's shapes and policies).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from prefixserve.core import MultiModalInput
from prefixserve.engine.errors import RequestError
from prefixserve.model.vision.image import (
    DecodedImage,
    check_size,
    decode_data_url,
    decode_image,
    from_pil,
)
from prefixserve.model.vision.loader import VisionModel


@dataclass(frozen=True)
class PlacedImages:
    """A prompt's images in order, and where each sits in its token ids: ``inputs[i]``
    (offset, length, content hash) is ``images[i]``'s run of placeholder tokens."""

    images: tuple[DecodedImage, ...]
    inputs: tuple[MultiModalInput, ...]


class EncoderCache:
    """Image embeddings (``[rows, hidden]``) by content hash, the least recently used dropped
    first once they hold more than ``capacity`` rows (0: keeps none)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: str) -> torch.Tensor | None:
        """The embeddings of an image, now the most recently used; None if not kept."""
        entry = self._entries.get(content_hash)
        if entry is not None:
            self._entries.move_to_end(content_hash)
        return entry

    def put(self, content_hash: str, embeds: torch.Tensor) -> None:
        """Keeps ``embeds`` (not if it alone is over the capacity), dropping the least
        recently used entries it needs room from."""
        if embeds.shape[0] > self.capacity or content_hash in self._entries:
            return
        while self.rows + embeds.shape[0] > self.capacity:
            _, dropped = self._entries.popitem(last=False)
            self.rows -= dropped.shape[0]
        self._entries[content_hash] = embeds
        self.rows += embeds.shape[0]


class ImageInputs:
    """The engine's images: placement and checks for every model, the encoder and its cache
    for a model that takes images (``vision`` is None for one that does not).

    ``limit`` is the most images one prompt may hold; ``encoder_runs`` counts the images run
    through the encoder, ``encoder_cache_hits`` the times a step found an image's embeddings
    in the encoder cache."""

    def __init__(self, vision: VisionModel | None, limit: int, cache_rows: int,
                 device: torch.device | str = "cpu") -> None:
        self.vision = vision
        self.limit = limit
        self.cache = EncoderCache(cache_rows)
        self.device = torch.device(device)
        self.encoder_runs = 0
        self.encoder_cache_hits = 0

    @property
    def image_token_id(self) -> int | None:
        """The placeholder token of an image (None: the model takes no images)."""
        return None if self.vision is None else self.vision.config.image_token_id

    @property
    def tokens_per_image(self) -> int:
        return 0 if self.vision is None else self.vision.config.tokens_per_image

    def place(self, token_ids: Sequence[int], images: Sequence[DecodedImage]
              ) -> tuple[list[int], PlacedImages]:
        """``token_ids`` with each image placeholder expanded to the image's tokens, and where
        each image went. A ``RequestError`` for images given to a model that takes none, more
        images than ``limit``, or placeholders that do not match the images one to one."""
        if self.vision is None:
            raise RequestError("this model takes no images (it is a text-only model); send "
                               "text only", code="image_not_supported")
        if len(images) > self.limit:
            raise RequestError(f"the prompt has {len(images)} images; at most {self.limit} "
                               "are allowed (--limit-mm-per-prompt)", code="too_many_images")
        placeholder, length = self.vision.config.image_token_id, self.tokens_per_image
        found = sum(1 for t in token_ids if t == placeholder)
        if found != len(images):
            raise RequestError(f"the prompt has {found} image placeholder tokens for "
                               f"{len(images)} images (the text may not contain the image "
                               "token itself)", code="invalid_image")
        out: list[int] = []
        inputs: list[MultiModalInput] = []
        for token in token_ids:
            if token == placeholder:
                image = images[len(inputs)]
                inputs.append(MultiModalInput(len(out), length, image.content_hash))
                out.extend([placeholder] * length)
            else:
                out.append(token)
        return out, PlacedImages(tuple(images), tuple(inputs))

    def check(self, token_ids: Sequence[int], placed: PlacedImages | None) -> None:
        """A ``RequestError`` unless ``token_ids``' image tokens are exactly ``placed``'s runs
        (no images: none at all)."""
        placeholder = self.image_token_id
        if placeholder is None:
            if placed is not None and placed.images:
                self.place(token_ids, placed.images)  # raises: no images here
            return
        runs = placed.inputs if placed is not None else ()
        covered = sum(run.length for run in runs)
        bad = any(run.length != self.tokens_per_image or
                  any(t != placeholder for t in token_ids[run.offset:run.offset + run.length])
                  for run in runs)
        if bad or covered != sum(1 for t in token_ids if t == placeholder):
            raise RequestError("the prompt's image placeholder tokens do not match its "
                               "images (place them with place_images)", code="invalid_image")

    def step_embeds(self, spans: Sequence[tuple[Sequence[MultiModalInput],
                                                 Sequence[DecodedImage], int, int]]
                    ) -> list[tuple[tuple[int, torch.Tensor], ...]]:
        """For each ``(inputs, images, start, count)`` (a request's images and the positions
        ``[start, start + count)`` a step computes), the ``embeds`` of its runner input:
        ``(first new token, rows)`` of every image run the positions overlap. The encoder runs
        once, over the images the encoder cache lacks."""
        wanted: dict[str, DecodedImage] = {}
        for inputs, images, start, count in spans:
            for run, image in zip(inputs, images, strict=True):
                if run.offset < start + count and run.offset + run.length > start:
                    wanted[run.content_hash] = image
        found = self._embeddings(list(wanted.values()))
        out = []
        for inputs, _, start, count in spans:
            embeds = []
            for run in inputs:
                lo, hi = max(run.offset, start), min(run.offset + run.length, start + count)
                if lo < hi:
                    rows = found[run.content_hash][lo - run.offset:hi - run.offset]
                    embeds.append((lo - start, rows))
            out.append(tuple(embeds))
        return out

    def _embeddings(self, images: list[DecodedImage]) -> dict[str, torch.Tensor]:
        """Each image's embeddings, from the cache or from one run of the encoder."""
        found: dict[str, torch.Tensor] = {}
        missing = []
        for image in images:
            cached = self.cache.get(image.content_hash)
            if cached is None:
                missing.append(image)
            else:
                found[image.content_hash] = cached
                self.encoder_cache_hits += 1
        if missing:
            for image, embeds in zip(missing, self.encode(missing), strict=True):
                found[image.content_hash] = embeds
                self.cache.put(image.content_hash, embeds)
        return found

    @torch.inference_mode()
    def encode(self, images: Sequence[DecodedImage]) -> list[torch.Tensor]:
        """The images' decoder embeddings (``[tokens_per_image, hidden]`` each), through the
        processor and one batch of the encoder."""
        assert self.vision is not None
        pixels = np.stack([self.vision.processor(image) for image in images])
        batch = torch.from_numpy(pixels).to(self.device)
        self.encoder_runs += len(images)
        return list(self.vision.encoder(batch))


def load_image(part: dict[str, Any], max_pixels: int) -> DecodedImage:
    """The image of a chat content part: ``{"type": "image_url", "image_url": {"url":
    "data:..."}}`` (or the URL as a plain string), or ``{"type": "image", "image": ...}``
    holding a Pillow image, the bytes of an image file or a ``DecodedImage``. An
    ``ImageError`` for what cannot be decoded, a ``RequestError`` for another kind of URL."""
    if part.get("type") == "image":
        image = part.get("image")
        if isinstance(image, DecodedImage):
            check_size(image.width, image.height, max_pixels)
            return image
        if isinstance(image, Image.Image):
            return from_pil(image, max_pixels)
        if isinstance(image, bytes | bytearray):
            return decode_image(bytes(image), max_pixels)
        raise RequestError(f"an image part holds a {type(image).__name__}, not a Pillow "
                           "image, image bytes or a DecodedImage", code="invalid_image")
    source = part.get("image_url")
    url = source.get("url") if isinstance(source, dict) else source
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("an image_url part needs a data: URL here (no image is fetched "
                           "from the network)", code="invalid_image")
    return decode_data_url(url, max_pixels)


def flatten_content(messages: Sequence[dict[str, Any]], image_token: str | None,
                    max_pixels: int) -> tuple[list[dict[str, Any]], list[DecodedImage]]:
    """The messages with each list content that holds an image as one string, for a chat
    template that reads strings: its text parts, and ``image_token`` for each image part,
    joined by newlines; and the images in order (decoded by :func:`load_image`). Other
    messages stay as they are."""
    out: list[dict[str, Any]] = []
    images: list[DecodedImage] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(
                part.get("type") in ("image", "image_url") for part in content):
            out.append(dict(message))
            continue
        pieces = []
        for part in content:
            if part.get("type") == "text":
                pieces.append(str(part.get("text", "")))
            elif part.get("type") in ("image", "image_url"):
                images.append(load_image(part, max_pixels))
                pieces.append(image_token or "")
            else:
                raise RequestError(f"unknown content part type {part.get('type')!r}; "
                                   "expected text, image or image_url")
        out.append({**message, "content": "\n".join(pieces)})
    return out, images
