"""The fused decode step: all decoder layers of a decode batch in one C call (``kernels/decode.c``).

A decode step of the eager model runs about 40 torch operations per layer, and its attention
first gathers each sequence's context out of the paged cache; on CPU both cost more than the
products with packed weights (``benchmarks/RESULTS.md``). :class:`FusedDecode` hands
the whole layer stack to one C function that reads the cache in place. The embedding lookup,
the final norm and the logits stay in torch.

It applies (:func:`unsupported` says why not) to a Llama-family :class:`CausalLM` (Q/K norms
included: Qwen3) or a Gemma 3 model on CPU with float32 or bfloat16 activations (the layers
compute in float32 either way) and a float32, bfloat16 or float16 cache, every projection
packed (:class:`QuantLinear`, or for QKV and gate/up a :class:`SplitQuantLinear` of up to three
parts in different formats; with or without LoRA adapters around it: each row adds the delta
of its own adapter slot after each product), with any KV cache groups (full
attention or sliding windows: each layer attends through its group's tables); and per step
(the runner checks) when every sequence adds one token and none asks for prompt logits.
``--enforce-eager`` turns it off. The deterministic mode never uses it (its attention has its
own reduction order).

The result equals the eager path's up to float rounding (a different summation order in the
norms and attention, and the exponential of ``decode.c``):
``tests/model/test_fused_decode.py`` bounds the difference and checks that greedy tokens agree.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from prefixserve.model.arch.gemma3 import GeGLU, Gemma3CausalLM
from prefixserve.model.arch.llama import CausalLM, DecoderLayer
from prefixserve.model.arch.lora import LoRALinear
from prefixserve.model.attention import decode_kernel
from prefixserve.model.attention.decode_kernel import KV_TYPES, SUPPORTED_DTYPES
from prefixserve.model.weights.quant import K_FORMATS, QuantLinear, SplitQuantLinear


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return [cast(DecoderLayer, layer) for layer in model.layers]


def _projections(layer: DecoderLayer) -> tuple[nn.Module, ...]:
    """The four products of a layer, in the order of ``DecodeLayer``'s fields."""
    return (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)


def unsupported(model: nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why :class:`FusedDecode` cannot run ``model`` over ``kv_cache``; None when it can."""
    reason = unsupported_attention(model, kv_cache)
    if reason is not None:
        return reason
    assert isinstance(model, CausalLM)
    for layer in _layers(model):
        kinds = [type(_packed(p)) for p in _projections(layer)]
        fused_ones = (kinds[0], kinds[2])  # QKV and gate/up may be split in parts
        if any(kind is not QuantLinear for kind in (kinds[1], kinds[3])) or any(
                kind not in (QuantLinear, SplitQuantLinear) for kind in fused_ones):
            return "a projection not packed (dense weights)"
        if any(len(_parts(p)) > 3 for p in _projections(layer)):
            return "a projection of more than three parts"
    return None


def _packed(projection: nn.Module) -> nn.Module:
    """The product under a projection's LoRA adapters (the projection itself without)."""
    return projection.base if isinstance(projection, LoRALinear) else projection


def _parts(projection: nn.Module) -> list[QuantLinear]:
    """A packed projection's parts: itself, or a :class:`SplitQuantLinear`'s parts."""
    projection = _packed(projection)
    if isinstance(projection, SplitQuantLinear):
        return projection.part_layers()
    return [cast(QuantLinear, projection)]


def unsupported_attention(model: nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot attend for ``model``'s eager steps over ``kv_cache`` (whatever its
    projections are: :class:`~prefixserve.model.attention.prompt.PromptAttention`); None when
    it can."""
    if type(model) not in (CausalLM, Gemma3CausalLM):
        return "not a Llama-family or Gemma 3 model"
    assert isinstance(model, CausalLM)
    config = model.config
    reasons = [
        (kv_cache.device.type != "cpu", "not on CPU"),
        (model.norm.weight.dtype not in SUPPORTED_DTYPES, "activations not float32 or bfloat16"),
        (kv_cache.dtype not in KV_TYPES, "a KV cache not float32, bfloat16 or float16"),
        (config.num_attention_heads % config.num_key_value_heads != 0, "uneven GQA groups"),
        (config.head_dim % 2 != 0, "odd head_dim"),
    ]
    for failed, reason in reasons:
        if failed:
            return reason
    if decode_kernel.library.get() is None:
        return f"the decode kernel cannot be built: {decode_kernel.library.error}"
    return None


class FusedDecode:
    """The layer stack of ``model`` as one C call over ``kv_cache`` (``[layers, 2, slots,
    kv_heads, head_dim]``, the runner's). Check :func:`unsupported` first. It keeps pointers
    into the model's weights and the cache: build it again if either is replaced."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        lib = decode_kernel.library.get()
        assert lib is not None, "check unsupported() first"
        self._lib = lib
        config = model.config
        layout = model.kv_layout
        windows = torch.tensor([group.window or 0 for group in layout.groups], dtype=torch.int64)
        self._keep = [kv_cache, model.rope_inv_freq.float().contiguous(), windows]
        # Gemma 3: its sliding layers rotate with another base
        local = getattr(model, "rope_local_inv_freq", None)
        sliding = getattr(model, "sliding", [False] * len(model.layers))
        if local is not None:
            self._keep.append(local.float().contiguous())
        layers = (decode_kernel.LayerStruct * len(model.layers))()
        lora_rows = 0
        self.max_loras = 0
        for i, layer in enumerate(_layers(model)):
            layers[i] = self._layer(layer, kv_cache[layout.slot[i]])
            layers[i].group = layout.group[i]
            layers[i].local_rope = int(local is not None and sliding[i])
            lora_rows = max(lora_rows, *layers[i].lora_rows)
        self._layers = layers
        self.has_lora = lora_rows > 0
        """Whether the model's projections carry LoRA adapter slots (``run`` takes each row's)."""
        self.num_groups = len(layout.groups)
        # a bfloat16 model's batch products may take bfloat16 activations, and it attends in
        # bfloat16 over a bfloat16 cache (queries and softmax weights rounded, as its eager
        # SDPA rounds them); both on AVX512-BF16 builds
        bf16 = int(_layers(model)[0].input_norm.weight.dtype == torch.bfloat16)
        # K-quant weights take the 16-bit kernels only (kernels/kquant.c)
        products = bf16 and not any(part.fmt in K_FORMATS for layer in _layers(model)
                                    for p in _projections(layer) for part in _parts(p))
        # the products' row count for the tiles, one for the step (quant.share_amx_rows)
        amx_from = max(part.amx_from for layer in _layers(model)
                       for p in _projections(layer) for part in _parts(p))
        first = _layers(model)[0]
        query_factor = getattr(first.attn, "query_factor", 1.0)
        self.model = decode_kernel.ModelStruct(
            len(model.layers), config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, block_size,
            kv_cache.shape[2], KV_TYPES[kv_cache.dtype], int(products), bf16,
            config.rms_norm_eps,
            self._keep[1].data_ptr(), layers, int(isinstance(first.mlp, GeGLU)), query_factor,
            None if local is None else self._keep[3].data_ptr(), self.num_groups,
            windows.data_ptr(), lora_rows, amx_from)

    def _layer(self, layer: DecoderLayer, cache: torch.Tensor) -> decode_kernel.LayerStruct:
        def as_float(tensor: torch.Tensor) -> int:
            kept = tensor.detach().float().contiguous()  # a copy unless already float32
            self._keep.append(kept)
            return kept.data_ptr()

        def bias(p: nn.Module) -> int | None:
            value = getattr(p, "bias", None)
            return None if value is None else as_float(value)

        def norm(owner: nn.Module, name: str) -> int | None:
            module = getattr(owner, name, None)  # absent, or None: not this model's
            return None if module is None else as_float(module.weight)

        projections = _projections(layer)
        firsts = [_parts(p)[0] for p in projections]
        assert cache.is_contiguous()
        norms = [as_float(layer.input_norm.weight), as_float(layer.post_attn_norm.weight)]
        # Q/K norms (Qwen3, Gemma 3); Gemma 3's norms of each block's output
        extra = [norm(layer.attn, "q_norm"), norm(layer.attn, "k_norm"),
                 norm(layer, "post_attn_out_norm"), norm(layer, "post_mlp_norm")]
        struct = decode_kernel.LayerStruct(*norms, *(p.qweight.data_ptr() for p in firsts),
                                           *(p.fmt for p in firsts),
                                           *(bias(_packed(p)) for p in projections),
                                           cache.data_ptr(), *extra)
        for name, projection in (("qkv", projections[0]), ("gate_up", projections[2])):
            parts = _parts(projection)
            if len(parts) > 1:  # the C side reads parts 1 and 2 where rows[1] > 0
                rows = getattr(struct, name + "_rows")
                more = getattr(struct, name + "_more")
                more_fmt = getattr(struct, name + "_more_fmt")
                for j, part in enumerate(parts):
                    rows[j] = part.out_features
                    if j:
                        more[j - 1] = part.qweight.data_ptr()
                        more_fmt[j - 1] = part.fmt
        for j, projection in enumerate(projections):
            if isinstance(projection, LoRALinear):
                self.max_loras = projection.used_counts.shape[0]
                a, bt = projection.float_buffers()
                self._keep += [a, bt, projection.used_counts]
                struct.lora_a[j], struct.lora_bt[j] = a.data_ptr(), bt.data_ptr()
                struct.lora_used[j] = projection.used_counts.data_ptr()
                struct.lora_rows[j] = a.shape[1]
        return struct

    def run(self, hidden: torch.Tensor, positions: list[int], tables: torch.Tensor,
            rows: list[int], extra: Sequence[tuple[torch.Tensor, list[int]]] = (),
            lora_slots: list[int] | None = None) -> torch.Tensor:
        """The decoder layers over ``hidden`` (the embeddings ``[B, hidden]``). Row b is at
        position ``positions[b]``, its block table row ``rows[b]`` of ``tables`` (long,
        ``[num_rows, width]``), covering that position. A model of several KV cache groups
        takes the tables and rows of groups 1, 2, ... in ``extra``. ``lora_slots[b]``: the
        adapter slot row b runs under (-1: none; None: no row has one). Writes each row's K/V
        into the cache; returns the last layer's output, in the model's dtype."""
        if len(extra) != self.num_groups - 1:
            raise ValueError(f"{self.num_groups} KV cache groups: give {self.num_groups - 1} "
                             f"more tables, got {len(extra)}")
        given = hidden.dtype
        hidden = hidden.float().contiguous()
        pos_t = torch.tensor(positions, dtype=torch.int64)
        groups = [(tables, torch.tensor(rows, dtype=torch.int64))]
        groups += [(t, torch.tensor(r, dtype=torch.int64)) for t, r in extra]
        slots = None
        if lora_slots is not None and self.has_lora:
            if len(lora_slots) != len(positions) or \
                    not all(-1 <= slot < self.max_loras for slot in lora_slots):
                raise ValueError(f"give one adapter slot in [-1, {self.max_loras}) per row")
            slots = torch.tensor(lora_slots, dtype=torch.int64)
        batch = decode_kernel.BatchStruct
        batches = (batch * len(groups))(*(
            batch(len(positions), pos_t.data_ptr(), t.data_ptr(), r.data_ptr(), t.stride(0),
                  None if slots is None else slots.data_ptr())
            for t, r in groups))
        if self._lib.decode_forward(ctypes.byref(self.model), batches,
                                    hidden.data_ptr()) != 0:
            raise MemoryError("the fused decode step could not allocate its scratch memory")
        return hidden.to(given)
