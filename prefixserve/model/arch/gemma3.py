"""Gemma 3 text decoder over the paged KV cache (config:
:mod:`prefixserve.model.arch.gemma3_config`).

Differences from :class:`~prefixserve.model.arch.llama.CausalLM`, per the reference implementation:
the token embedding is multiplied by ``sqrt(hidden_size)``; every RMSNorm scales by
``1 + w`` (computed in float32; the loader stores ``1 + w`` as the norm weight, which is what
GGUF files hold already); queries and keys get a per-head RMSNorm before rope; each layer has
four norms: ``x + post_attn_norm(attn(input_norm(x)))``, then
``h + post_mlp_norm(mlp(pre_mlp_norm(h)))``; the MLP gate is GELU (tanh approximation); local
(sliding) layers rotate with base ``rope_local_theta``, global ones with ``rope_theta``; the
attention scale is ``query_pre_attn_scalar ** -0.5``; the output head is tied to the
embedding.

Parameter names: as :mod:`prefixserve.model.arch.llama`, plus ``layers.{i}.post_attn_out_norm`` and
``layers.{i}.post_mlp_norm`` (``layers.{i}.post_attn_norm`` is the norm before the MLP).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from prefixserve.model.arch.llama import Attention, CausalLM
from prefixserve.model.attention.paged import AttentionMetadata, paged_attention, write_kv


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalise and scale in float32, then cast back. ``weight`` holds
    ``1 + w`` of the reference implementation (so it multiplies directly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class GeGLU(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """Grouped-query attention with Gemma's Q/K norms; the query is pre-scaled so that SDPA's
    default ``head_dim ** -0.5`` gives ``query_pre_attn_scalar ** -0.5`` (one factor for the
    plain and the two-pass paths)."""

    q_norm: OffsetRMSNorm
    k_norm: OffsetRMSNorm

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        scalar = config.query_pre_attn_scalar or float(self.head_dim)
        self.query_factor = math.sqrt(self.head_dim / scalar)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata, block_size: int
                ) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size, _ = self.split_sizes
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :q_size].view(n, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(n, -1, self.head_dim))
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.query_factor != 1.0:
            q = q * self.query_factor
        write_kv(layer_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, layer_cache, meta, block_size)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP (see the module docstring)."""

    def __init__(self, config: ModelConfig, sliding: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = sliding
        self.input_norm = OffsetRMSNorm(config.hidden_size, eps)
        self.attn = Gemma3Attention(config)
        self.post_attn_out_norm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_attn_norm = OffsetRMSNorm(config.hidden_size, eps)
        self.mlp = GeGLU(config.hidden_size, config.intermediate_size, config.mlp_bias)
        self.post_mlp_norm = OffsetRMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                layer_cache: torch.Tensor, meta: AttentionMetadata, block_size: int
                ) -> torch.Tensor:
        attn = self.attn(self.input_norm(x), cos, sin, layer_cache, meta, block_size)
        x = x + self.post_attn_out_norm(attn)
        return x + self.post_mlp_norm(self.mlp(self.post_attn_norm(x)))


class Gemma3CausalLM(CausalLM):
    """Gemma 3 text model: embedding (scaled), decoder layers, final norm, tied head."""

    rope_local_inv_freq: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        windows = config.layer_windows
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, windows[i] is not None)
                                    for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        local = rope_inv_freq(config.head_dim, config.rope_local_theta or config.rope_theta, None)
        self.register_buffer("rope_local_inv_freq", local, persistent=False)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.sliding = [w is not None for w in windows]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata | list[AttentionMetadata], block_size: int,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`CausalLM.forward`."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        tables = {False: rope_cos_sin(self.rope_inv_freq, positions, x.dtype),
                  True: rope_cos_sin(self.rope_local_inv_freq, positions, x.dtype)}
        metas = meta if isinstance(meta, list) else [meta]
        group, slot = self.kv_layout.group, self.kv_layout.slot
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.sliding[i]]
            x = layer(x, cos, sin, kv_cache[slot[i]], metas[group[i]], block_size)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings times ``sqrt(hidden_size)`` (in the activations' dtype)."""
        x = super().embed(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The module class that runs ``config``'s architecture."""
    return Gemma3CausalLM if config.architecture == "gemma3" else CausalLM
