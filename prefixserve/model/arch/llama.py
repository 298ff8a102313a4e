"""Decoder-only transformer covering Llama, Qwen2 and Qwen3 through ``ModelConfig`` flags.

The model works on a flattened batch: ``input_ids`` and ``positions`` are ``[num_tokens]``
(all sequences of a step concatenated), and attention goes through the paged KV cache
described by :class:`~prefixserve.model.attention.paged.AttentionMetadata`.

Parameter names (what :func:`~prefixserve.model.weights.loader.load_model` fills):
``embed_tokens.weight``, ``layers.{i}.input_norm.weight``,
``layers.{i}.attn.qkv_proj.{weight,bias}`` (Q, K, V rows concatenated),
``layers.{i}.attn.o_proj.{weight,bias}``, ``layers.{i}.attn.{q,k}_norm.weight`` (Qwen3),
``layers.{i}.post_attn_norm.weight``, ``layers.{i}.mlp.gate_up_proj.weight`` (gate rows, then
up rows), ``layers.{i}.mlp.down_proj.weight``, ``norm.weight`` and, unless embeddings are
tied, ``lm_head.weight``. The rotary inverse frequencies are a buffer (``rope_inv_freq``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.arch.layers import GatedMLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from prefixserve.model.attention.paged import AttentionMetadata, paged_attention, write_kv
from prefixserve.model.kv_layout import kv_layout
from prefixserve.model.weights.quant import QuantEmbedding


class Attention(nn.Module):
    """Grouped-query self-attention with fused QKV, optional QKV bias and Q/K norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.attention_out_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        block_size: int,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split_sizes
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(n, -1, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # Rotate queries and keys together: they are adjacent heads of one view.
            qk = apply_rope(qkv[:, : q_size + kv_size].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        write_kv(layer_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, layer_cache, meta, block_size)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        block_size: int,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, layer_cache, meta, block_size)
        return x + self.mlp(self.post_attn_norm(x))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama/Qwen2/Qwen3 model."""

    rope_inv_freq: torch.Tensor  # a non-persistent buffer, registered in __init__

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on its own weight, initialised here as nn.Embedding would (the same random
        # draws) except on the meta device, where the loader builds models: there the init
        # would import torch._dynamo (over a second) for a weight the file's replaces.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.kv_layout = kv_layout(config)

    def set_rope_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the rotary frequencies by per-frequency ``factors`` (GGUF ``rope_freqs``)."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, factors)
        self.rope_inv_freq = inv_freq.to(self.rope_inv_freq.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | list[AttentionMetadata],
        block_size: int,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` before the final norm.

        ``kv_cache`` is ``[group_size, 2, num_slots, kv_heads, head_dim]`` and ``meta`` one
        metadata per KV cache group (:mod:`prefixserve.model.kv_layout`; a model with one
        attention kind has one group of all layers, and may be given its metadata alone);
        this call writes the step's K/V into the cache. ``inputs_embeds`` (``[num_tokens,
        hidden]``), when given, is the first layer's input instead of ``embed(input_ids)``
        (image rows in it: :mod:`prefixserve.model.vision`).
        """
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        metas = meta if isinstance(meta, list) else [meta]
        group, slot = self.kv_layout.group, self.kv_layout.slot
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[slot[i]], metas[group[i]], block_size)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[num_tokens, hidden]``: the tokens' embeddings."""
        x: torch.Tensor = self.embed_tokens(input_ids)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of pre-norm hidden states ``[rows, hidden]``."""
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(normed).float()
        if isinstance(self.embed_tokens, QuantEmbedding):
            return self.embed_tokens.logits(normed).float()
        return F.linear(normed, self.embed_tokens.weight).float()
