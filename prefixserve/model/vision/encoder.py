"""The image encoder of a LLaVA-style model: a ViT vision tower (CLIP or SigLIP) and the
projector into the decoder's hidden size.

The tower cuts the image into ``patch_size`` squares, embeds each with one convolution, adds
learned position embeddings (after CLIP's class token, which leads the sequence), applies a
layer norm (CLIP only), then pre-norm transformer layers with bidirectional attention and a
two-matrix MLP. The features are the hidden states of ``LlavaConfig.feature_layers`` (index 0:
the input of the first layer; ``i``: the output of layer ``i``), concatenated along the hidden
dimension, their first row dropped under the ``default`` strategy; layers after the deepest
selected one do not run. The projector is ``linear_2(act(linear_1(features)))``.

Parameter names follow transformers' (``vision_tower.embeddings.patch_embedding.weight``,
``vision_tower.encoder.layers.{i}.self_attn.q_proj.weight``,
``multi_modal_projector.linear_1.weight``, ...), so that the loader maps a checkpoint's
tensors by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.arch.vision_config import LlavaConfig, VisionTowerConfig


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "quick_gelu": _quick_gelu, "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_new, "relu": F.relu, "silu": F.silu,
}


class VisionAttention(nn.Module):
    """Multi-head self-attention over all rows of an image (no mask), with biases."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, rows, size = x.shape
        shape = (batch, rows, self.num_heads, size // self.num_heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, rows, size))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))``."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    """Patch embeddings plus positions, after the class token for CLIP."""

    def __init__(self, config: VisionTowerConfig) -> None:
        super().__init__()
        self.config = config
        size = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, size, config.patch_size,
                                         stride=config.patch_size,
                                         bias=config.kind == "siglip")
        self.position_embedding = nn.Embedding(config.num_positions, size)
        self.class_embedding: nn.Parameter | None = None
        if config.kind == "clip":
            self.class_embedding = nn.Parameter(torch.zeros(size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        side = self.config.image_size
        if pixels.shape[-2:] != (side, side):
            raise ValueError(f"the vision tower takes {side}x{side} images, got "
                             f"{pixels.shape[-2]}x{pixels.shape[-1]}")
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            first = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat((first, patches), dim=1)
        return patches + self.position_embedding.weight


class VisionEncoderLayers(nn.Module):
    """The tower's first ``num_layers`` transformer layers (``encoder.layers.{i}``)."""

    def __init__(self, config: VisionTowerConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(num_layers))


class VisionTower(nn.Module):
    """A CLIP or SigLIP ViT of its first ``num_layers`` layers (those the features need),
    returning the hidden states it is asked for."""

    def __init__(self, config: VisionTowerConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm: nn.LayerNorm | None = None
        if config.kind == "clip":
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = VisionEncoderLayers(config, num_layers)

    def forward(self, pixels: torch.Tensor, indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states ``indices`` (0: the first layer's input, at most ``num_layers``) of
        ``[n, 3, side, side]`` pixels, each ``[n, rows, hidden]``."""
        x = self.embeddings(pixels)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in indices]


class Projector(nn.Module):
    """``linear_2(act(linear_1(x)))`` into the decoder's hidden size."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        hidden = config.text_hidden_size
        self.linear_1 = nn.Linear(config.projector_input_size, hidden, bias=config.projector_bias)
        self.act = ACTIVATIONS[config.projector_act]
        self.linear_2 = nn.Linear(hidden, hidden, bias=config.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEncoder(nn.Module):
    """Pixels to decoder embeddings: ``[n, 3, side, side]`` to
    ``[n, tokens_per_image, text_hidden_size]``."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config.vision, config.layers_to_run)
        self.multi_modal_projector = Projector(config)

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        states = self.vision_tower(pixels.to(dtype), self.config.hidden_state_indices)
        features = torch.cat(states, dim=-1) if len(states) > 1 else states[0]
        if self.config.feature_strategy == "default":
            features = features[:, 1:]
        out: torch.Tensor = self.multi_modal_projector(features)
        return out
