"""Images as the engine takes them: decoded to RGB pixels with Pillow, checked, and named by a
hash of what they show.

The hash covers the decoded pixels and the size, not the bytes that carried them: the same
picture sent as a PNG, a lossless WebP or under another ``data:`` URL has one hash, so its
prompt blocks and its encoder output are found again. Decoding refuses what is not a PNG,
JPEG, WebP or GIF (the first frame of an animation is taken), and an image of more than
``max_pixels`` pixels before its pixels are decoded (a small file may declare a huge image: a
decompression bomb).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from prefixserve.model.arch.vision_config import DEFAULT_MAX_IMAGE_PIXELS

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""The formats images may come in (Pillow's names)."""

MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
"""The media types a ``data:`` URL or an Anthropic image source may name."""

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,",
                       re.ASCII)


class ImageError(ValueError):
    """An image that cannot be used; the message names the problem. ``code`` is the API
    error code: ``invalid_image`` (not an image, or not one of the formats),
    ``image_too_large`` (over the pixel limit)."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """An image's RGB pixels (``[height, width, 3]`` uint8) and the SHA-256 (hex) of its size
    and pixels, its name in the prefix cache and the encoder cache."""

    pixels: np.ndarray
    content_hash: str

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


def pixel_hash(pixels: np.ndarray) -> str:
    """The SHA-256 (hex) of an RGB uint8 array's size and pixels."""
    height, width = pixels.shape[:2]
    digest = hashlib.sha256(f"rgb8:{width}x{height}:".encode())
    digest.update(np.ascontiguousarray(pixels).data)
    return digest.hexdigest()


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB; transparent parts are laid over white (as transformers' processors
    convert)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def from_pil(image: Image.Image, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """A Pillow image (its pixels loaded now) as a :class:`DecodedImage`; an
    :class:`ImageError` over ``max_pixels``."""
    check_size(image.width, image.height, max_pixels)
    pixels = np.asarray(to_rgb(image), dtype=np.uint8)
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ImageError(f"the image has pixels of shape {pixels.shape}, not RGB")
    pixels.setflags(write=False)
    return DecodedImage(pixels, pixel_hash(pixels))


def check_size(width: int, height: int, max_pixels: int) -> None:
    """An :class:`ImageError` for an empty image or one over ``max_pixels``."""
    if width < 1 or height < 1:
        raise ImageError(f"the image is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height:,} pixels, more "
                         f"than the limit of {max_pixels:,} (--max-image-pixels)",
                         code="image_too_large")


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """The image in ``data`` (a PNG, JPEG, WebP or GIF file); an :class:`ImageError` for bytes
    that are none of these, a broken file, or an image over ``max_pixels`` (checked on the
    header, before the pixels are decoded)."""
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            check_size(image.width, image.height, max_pixels)
            image.load()
            return from_pil(image, max_pixels)
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own limit, met when opening
        raise ImageError(f"the image is over the limit of {max_pixels:,} pixels "
                         f"(--max-image-pixels): {exc}", code="image_too_large") from None
    except UnidentifiedImageError:
        raise ImageError(f"the data is not an image in a supported format "
                         f"({', '.join(IMAGE_FORMATS)})") from None
    except Exception as exc:  # a broken file: Pillow's decoders raise many kinds
        raise ImageError(f"the image cannot be decoded: {type(exc).__name__}: {exc}") from None


def decode_base64_image(data: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """:func:`decode_image` of base64 text; an :class:`ImageError` for text that is not
    base64."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None
    return decode_image(raw, max_pixels)


def decode_data_url(url: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> DecodedImage:
    """The image of a ``data:image/...;base64,...`` URL; an :class:`ImageError` for another
    kind of URL, a media type other than :data:`MEDIA_TYPES`, or what :func:`decode_image`
    refuses."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("an image data URL must look like data:image/png;base64,<data>")
    media_type = (match.group("type") or "").lower()
    if media_type not in MEDIA_TYPES:
        raise ImageError(f"unsupported image media type {media_type or 'none'!r}; supported: "
                         f"{', '.join(MEDIA_TYPES)}")
    return decode_base64_image(url[match.end():], max_pixels)
