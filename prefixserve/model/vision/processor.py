"""An image's pixels as the vision tower takes them, following the model's own processor
(``preprocessor_config.json``, as transformers' CLIP, SigLIP and LLaVA image processors with
Pillow do it).

In order, each step where the config turns it on: pad to a square of the mean colour
(``do_pad``, LLaVA), resize with Pillow (``size``: ``shortest_edge``, keeping the aspect
ratio, or ``height`` and ``width``; ``resample`` is Pillow's filter number), crop the centre
(``crop_size``, padding with zeros where the image is smaller), rescale (``rescale_factor``,
in float64, then float32) and normalise per channel (``image_mean``, ``image_std``). A model
directory without the file gets the tower's defaults: CLIP resizes the shortest edge to the
tower's image size and crops the centre with OpenAI's CLIP statistics; SigLIP resizes to the
square with mean and std 0.5.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from prefixserve.model.arch.vision_config import VisionTowerConfig
from prefixserve.model.vision.image import DecodedImage

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing of one model (see the module docstring). ``size`` is
    ``("shortest_edge", n)`` or ``("exact", (height, width))``; ``crop``, ``rescale`` and
    ``mean``/``std`` are None where the step is off."""

    size: tuple[str, Any] | None
    resample: int = _BICUBIC
    crop: tuple[int, int] | None = None
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    pad_to_square: bool = False

    @classmethod
    def for_tower(cls, tower: VisionTowerConfig) -> ImageProcessor:
        """The defaults of ``tower``'s kind (a directory with no processor config)."""
        side = tower.image_size
        if tower.kind == "siglip":
            return cls(("exact", (side, side)), mean=(0.5,) * 3, std=(0.5,) * 3)
        return cls(("shortest_edge", side), crop=(side, side), mean=CLIP_MEAN, std=CLIP_STD)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], tower: VisionTowerConfig) -> ImageProcessor:
        """The processor a ``preprocessor_config.json`` dict describes."""
        default = cls.for_tower(tower)
        kind = str(cfg.get("image_processor_type", ""))
        center = cfg.get("do_center_crop", "Siglip" not in kind and default.crop is not None)
        size = _size(cfg.get("size"), center) if cfg.get("do_resize", True) else None
        crop = _pair(cfg.get("crop_size", default.crop)) if center else None
        normalize = cfg.get("do_normalize", True)
        mean = _triple(cfg.get("image_mean", default.mean)) if normalize else None
        std = _triple(cfg.get("image_std", default.std)) if normalize else None
        rescale = float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) \
            else None
        return cls(size=size or None, resample=int(cfg.get("resample", _BICUBIC)), crop=crop,
                   rescale=rescale, mean=mean, std=std, pad_to_square=bool(cfg.get("do_pad")))

    @classmethod
    def from_dir(cls, path: str, tower: VisionTowerConfig) -> ImageProcessor:
        """The processor of the model directory ``path``: its ``preprocessor_config.json``, or
        the ``image_processor`` of its ``processor_config.json``, or the tower's defaults."""
        for name, key in (("preprocessor_config.json", None),
                          ("processor_config.json", "image_processor")):
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    cfg = json.load(f)
                cfg = cfg.get(key) if key else cfg
                if isinstance(cfg, dict):
                    return cls.from_dict(cfg, tower)
        return cls.for_tower(tower)

    def __call__(self, image: DecodedImage) -> np.ndarray:
        """The image as float32 ``[3, height, width]`` for the tower."""
        pil = Image.fromarray(image.pixels, "RGB")
        if self.pad_to_square:
            pil = self._square(pil)
        if self.size is not None:
            pil = pil.resize(self._target(pil.width, pil.height), resample=self.resample)
        pixels = np.asarray(pil).transpose(2, 0, 1)
        if self.crop is not None:
            pixels = center_crop(pixels, *self.crop)
        out = pixels.astype(np.float64) * self.rescale if self.rescale is not None \
            else pixels.astype(np.float64)
        values = out.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.array(self.mean, dtype=np.float32)[:, None, None]
            std = np.array(self.std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return np.ascontiguousarray(values, dtype=np.float32)

    def _square(self, pil: Image.Image) -> Image.Image:
        """``pil`` centred on a square of the mean colour (``do_pad``)."""
        if pil.width == pil.height:
            return pil
        side = max(pil.width, pil.height)
        colour = tuple(int(m * 255) for m in self.mean) if self.mean else (0, 0, 0)
        square = Image.new("RGB", (side, side), colour)
        square.paste(pil, ((side - pil.width) // 2, (side - pil.height) // 2))
        return square

    def _target(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) to resize a ``width`` x ``height`` image to."""
        assert self.size is not None
        kind, value = self.size
        if kind == "exact":
            return value[1], value[0]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = value, int(value * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre ``height`` x ``width`` of ``[channels, h, w]`` pixels; a smaller image is
    first centred on zeros."""
    _, rows, cols = pixels.shape
    top, left = (rows - height) // 2, (cols - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + height, left:left + width]
    new_rows, new_cols = max(height, rows), max(width, cols)
    padded = np.zeros((pixels.shape[0], new_rows, new_cols), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_rows - rows) / 2), math.ceil((new_cols - cols) / 2)
    padded[:, top_pad:top_pad + rows, left_pad:left_pad + cols] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[:, max(0, top):min(new_rows, top + height),
                  max(0, left):min(new_cols, left + width)]


def _size(value: Any, shortest_edge_for_int: bool) -> tuple[str, Any] | None:
    """``size`` of a processor config: a dict, or a bare int (older configs)."""
    if value is None:
        return None
    if isinstance(value, int):
        return ("shortest_edge", value) if shortest_edge_for_int else ("exact", (value, value))
    if "height" in value and "width" in value:
        return ("exact", (int(value["height"]), int(value["width"])))
    if "shortest_edge" in value and "longest_edge" not in value:
        return ("shortest_edge", int(value["shortest_edge"]))
    raise ValueError(f"unsupported image processor size {value!r}")


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value["height"]), int(value["width"])


def _triple(value: Any) -> tuple[float, ...]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"image mean and std need 3 channels, got {value!r}")
    return tuple(values)
