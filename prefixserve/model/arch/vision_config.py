"""The image side of a LLaVA-style model's ``config.json``: the vision tower, the projector and
the image placeholder token.

A LLaVA model (transformers' ``LlavaForConditionalGeneration``, ``model_type: llava``) is a
vision tower (CLIP or SigLIP), a two-layer projector into the decoder's hidden size, and a
decoder that :class:`~prefixserve.model.arch.config.ModelConfig` describes (``text_config``).
The prompt holds one placeholder token per image row: each row's embedding is replaced by the
projected feature of one image patch before the decoder runs.

This module imports no torch: the server reads it to know whether a model takes images.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""The most pixels (width times height) an image may have unless configured otherwise."""

DEFAULT_LIMIT_IMAGES_PER_PROMPT = 4
"""The most images one prompt may hold unless configured otherwise."""

VISION_ACTIVATIONS = ("gelu", "quick_gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "silu")
"""The activations the vision tower's MLP and the projector may use (transformers' names)."""

FEATURE_STRATEGIES = ("default", "full")
"""``default`` drops the first row of the selected hidden states (CLIP's class token); ``full``
keeps every row."""

# transformers' defaults for keys a config.json may leave out (CLIPVisionConfig,
# SiglipVisionConfig): (kind, defaults)
_TOWER_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "clip_vision_model": ("clip", {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "num_channels": 3,
        "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"}),
    "siglip_vision_model": ("siglip", {
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
        "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}),
}

# LlavaConfig's vision tower when config.json names none (llava-1.5's CLIP ViT-L/14 at 336).
_LLAVA_DEFAULT_TOWER = {
    "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
    "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
}

# LlamaConfig's defaults, for the text_config of older LLaVA checkpoints that spell out only
# what differs from them.
LLAMA_TEXT_DEFAULTS = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class VisionTowerConfig:
    """A ViT image encoder: ``clip`` (a class token, a bias-free patch convolution, a layer
    norm before the layers) or ``siglip`` (no class token, a patch convolution with bias)."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    def __post_init__(self) -> None:
        if self.kind not in ("clip", "siglip"):
            raise ValueError(f"unsupported vision tower {self.kind!r}; supported: clip, siglip")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision tower: hidden size {self.hidden_size} is not a multiple "
                             f"of {self.num_attention_heads} heads")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"vision tower: unsupported activation {self.hidden_act!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision tower: image size {self.image_size} is not a multiple "
                             f"of the patch size {self.patch_size}")

    @property
    def num_patches(self) -> int:
        """Patches of one image: rows of the tower's output, the class token aside."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """Rows of the tower's hidden states: the patches, and CLIP's class token first."""
        return self.num_patches + (1 if self.kind == "clip" else 0)


@dataclass(frozen=True)
class LlavaConfig:
    """What turns an image into decoder embeddings, and where they go in the prompt.

    ``feature_layers`` index the tower's hidden states (0: the embeddings, ``i``: the output
    of layer ``i``, negative from the end, as transformers' ``hidden_states``); several are
    concatenated along the hidden dimension. ``text_hidden_size`` is the decoder's.
    """

    vision: VisionTowerConfig
    text_hidden_size: int
    image_token_id: int
    projector_act: str = "gelu"
    projector_bias: bool = True
    feature_layers: tuple[int, ...] = (-2,)
    feature_strategy: str = "default"

    def __post_init__(self) -> None:
        if self.feature_strategy not in FEATURE_STRATEGIES:
            raise ValueError(f"unsupported vision_feature_select_strategy "
                             f"{self.feature_strategy!r}; supported: default, full")
        if self.projector_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported projector activation {self.projector_act!r}")
        depth = self.vision.num_hidden_layers
        bad = [i for i in self.feature_layers if not -depth - 1 <= i <= depth]
        if not self.feature_layers or bad:
            raise ValueError(f"vision_feature_layer {list(self.feature_layers)} is outside the "
                             f"tower's hidden states 0..{depth}")

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """``feature_layers`` as non-negative indices of the tower's hidden states."""
        count = self.vision.num_hidden_layers + 1
        return tuple(i % count for i in self.feature_layers)

    @property
    def layers_to_run(self) -> int:
        """Tower layers the features need: those after the deepest selected one never run."""
        return max(self.hidden_state_indices)

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens (and projected feature rows) of one image."""
        drop = 1 if self.feature_strategy == "default" else 0
        return self.vision.num_positions - drop

    @property
    def projector_input_size(self) -> int:
        return self.vision.hidden_size * len(self.feature_layers)


def is_llava_config(cfg: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict describes a LLaVA-style model."""
    return cfg.get("model_type") == "llava"


def llava_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config of a LLaVA ``config.json`` (``text_config``, transformers' Llama
    defaults under what it leaves out; ``tie_word_embeddings`` from either level)."""
    text = dict(cfg.get("text_config") or {})
    if text.get("model_type", "llama") == "llama":
        text = {**LLAMA_TEXT_DEFAULTS, **text}
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings")
                                       or text.get("tie_word_embeddings"))
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def tower_config(cfg: dict[str, Any]) -> VisionTowerConfig:
    """The vision tower of a ``vision_config`` dict (transformers' defaults under what it
    leaves out)."""
    model_type = cfg.get("model_type", "clip_vision_model")
    if model_type not in _TOWER_DEFAULTS:
        supported = ", ".join(_TOWER_DEFAULTS)
        raise ValueError(f"unsupported vision tower {model_type!r}; supported: {supported}")
    kind, defaults = _TOWER_DEFAULTS[model_type]
    merged = {**defaults, **{k: v for k, v in cfg.items() if k in defaults}}
    return VisionTowerConfig(kind=kind, **merged)


def llava_config(cfg: dict[str, Any]) -> LlavaConfig | None:
    """The image side of a ``config.json`` dict; None for a model that takes no images."""
    if not is_llava_config(cfg):
        return None
    vision = tower_config(cfg.get("vision_config") or _LLAVA_DEFAULT_TOWER)
    layers = cfg.get("vision_feature_layer", -2)
    return LlavaConfig(
        vision=vision,
        text_hidden_size=llava_text_config(cfg)["hidden_size"],
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        projector_act=cfg.get("projector_hidden_act", "gelu"),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
        feature_strategy=cfg.get("vision_feature_select_strategy", "default"),
    )


def read_llava_config(path: str) -> LlavaConfig | None:
    """The image side of the model at ``path`` (a resolved model path: an HF directory or a
    ``.gguf`` file); None for a model that takes no images."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config_file):
        return None
    with open(config_file, encoding="utf-8") as f:
        return llava_config(json.load(f))
