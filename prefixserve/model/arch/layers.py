"""Building blocks of the decoder: RMSNorm, rotary embedding and the SiLU-gated MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32, scaled by ``weight``.

    Numerics follow the HF Llama convention: normalise in float32, cast back to the input
    dtype, then multiply by the weight.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (self.dim,), self.weight, self.eps)  # one op: the same math
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse frequencies (float32, ``[head_dim // 2]``) of the rotary embedding.

    ``scaling`` is a ``ModelConfig.rope_scaling`` dict (None, "linear" or "llama3");
    ``freq_factors`` are per-frequency divisors as GGUF files store them (``rope_freqs``).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float().cpu()
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelen) - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    in_between = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    return torch.where(in_between, interpolated, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables ``(cos, signed_sin)``, each ``[num_tokens, 1, head_dim]`` in ``dtype``.

    ``cos`` is ``[cos f, cos f]`` and ``signed_sin`` is ``[-sin f, sin f]`` over the
    ``head_dim // 2`` frequencies f; see :func:`apply_rope`. Computed once per forward pass
    and shared by all layers.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = freqs.cos()
    sin = freqs.sin()
    return (
        torch.cat((cos, cos), dim=-1)[:, None, :].to(dtype),
        torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype),
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[num_tokens, heads, head_dim]``) in HF's "rotate half" layout.

    HF computes ``x * cos + cat(-x2, x1) * sin``; ``roll`` gives ``cat(x2, x1)`` and the sign
    lives in ``signed_sin``, which is bit-for-bit the same result with fewer kernels.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
