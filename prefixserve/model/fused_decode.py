"""The fused decode step: all decoder layers of a decode batch in one C call (``kernels/decode.c``).

A decode step of the eager model runs about 40 torch operations per layer, and its attention
first gathers each sequence's context out of the paged cache; on CPU both cost more than the
products with packed weights (``benchmarks/RESULTS.md``). :class:`FusedDecode` hands
the whole layer stack to one C function that reads the cache in place. The embedding lookup,
the final norm and the logits stay in torch.

It applies (:func:`unsupported` says why not) to a Llama-family :class:`CausalLM` (Q/K norms
included: Qwen3) or a Gemma 3 model on CPU with float32 or bfloat16 activations (the layers
compute in float32 either way) and a float32, bfloat16 or float16 cache, every projection
packed (:class:`QuantLinear`, so not wrapped by LoRA), with any KV cache groups (full
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
from pathlib import Path
from typing import cast

import torch
from torch import nn

from prefixserve.model import quant_kernels
from prefixserve.model.gemma3 import GeGLU, Gemma3CausalLM
from prefixserve.model.llama import CausalLM, DecoderLayer
from prefixserve.model.quant import QuantLinear

_SOURCE = Path(__file__).with_name("kernels") / "decode.c"
#: Activation dtypes of the fused step. With bfloat16 the layers compute in float32 (norm
#: weights and biases are copied to float32 once).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
#: Cache dtypes the kernel reads and writes (``kv_type`` of ``decode.c``), any of them beside
#: either activation dtype (``--kv-cache-dtype``); K/V are rounded to the 16-bit types as they
#: are written (to nearest even, as torch rounds) and attention reads them back.
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")] + \
               [(name, ctypes.c_int64) for name in
                ("qkv_fmt", "o_fmt", "gate_up_fmt", "down_fmt")] + \
               [(name, ctypes.c_void_p) for name in
                ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "kv", "q_norm", "k_norm",
                 "attn_out_norm", "mlp_out_norm")] + \
               [("group", ctypes.c_int64), ("local_rope", ctypes.c_int64)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("kv_type", ctypes.c_int64), ("bf16_products", ctypes.c_int64),
                ("bf16_queries", ctypes.c_int64), ("eps", ctypes.c_double),
                ("inv_freq", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)),
                ("gelu", ctypes.c_int64), ("query_factor", ctypes.c_double),
                ("inv_freq_local", ctypes.c_void_p), ("num_groups", ctypes.c_int64),
                ("windows", ctypes.c_void_p)]


class _Batch(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("pos", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("table_stride", ctypes.c_int64)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.decode_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Batch),
                                   ctypes.c_void_p]
    lib.decode_forward.restype = ctypes.c_int
    # attention alone (prefixserve.model.prompt_attention)
    model, batch = ctypes.POINTER(_Model), ctypes.POINTER(_Batch)
    lib.attention_plan_bytes.argtypes = [model, batch]
    lib.attention_plan_bytes.restype = ctypes.c_int64
    lib.attention_plan.argtypes = [model, batch, ctypes.c_int64, ctypes.c_void_p]
    lib.attention_plan.restype = None
    lib.attention_run.argtypes = [model, batch, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.attention_run.restype = None
    lib.attention_has_fast_form.argtypes = [ctypes.c_int64]
    lib.attention_has_fast_form.restype = ctypes.c_int
    lib.attention_has_bf16_form.argtypes = []
    lib.attention_has_bf16_form.restype = ctypes.c_int


_library = quant_kernels.KernelLibrary(_SOURCE, _declare)


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
    if any(type(p) is not QuantLinear for layer in _layers(model) for p in _projections(layer)):
        return "a projection not packed (dense weights or a LoRA wrapper)"
    return None


def unsupported_attention(model: nn.Module, kv_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot attend for ``model``'s eager steps over ``kv_cache`` (whatever its
    projections are: :class:`~prefixserve.model.prompt_attention.PromptAttention`); None when
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
    if _library.get() is None:
        return f"the decode kernel cannot be built: {_library.error}"
    return None


class FusedDecode:
    """The layer stack of ``model`` as one C call over ``kv_cache`` (``[layers, 2, slots,
    kv_heads, head_dim]``, the runner's). Check :func:`unsupported` first. It keeps pointers
    into the model's weights and the cache: build it again if either is replaced."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int) -> None:
        lib = _library.get()
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
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(_layers(model)):
            layers[i] = self._layer(layer, kv_cache[layout.slot[i]])
            layers[i].group = layout.group[i]
            layers[i].local_rope = int(local is not None and sliding[i])
        self._layers = layers
        self.num_groups = len(layout.groups)
        # a bfloat16 model's batch products may take bfloat16 activations, and it attends in
        # bfloat16 over a bfloat16 cache (queries and softmax weights rounded, as its eager
        # SDPA rounds them); both on AVX512-BF16 builds
        bf16 = int(_layers(model)[0].input_norm.weight.dtype == torch.bfloat16)
        first = _layers(model)[0]
        query_factor = getattr(first.attn, "query_factor", 1.0)
        self.model = _Model(
            len(model.layers), config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, block_size,
            kv_cache.shape[2], KV_TYPES[kv_cache.dtype], bf16, bf16, config.rms_norm_eps,
            self._keep[1].data_ptr(), layers, int(isinstance(first.mlp, GeGLU)), query_factor,
            None if local is None else self._keep[3].data_ptr(), self.num_groups,
            windows.data_ptr())

    def _layer(self, layer: DecoderLayer, cache: torch.Tensor) -> _Layer:
        def as_float(tensor: torch.Tensor) -> int:
            kept = tensor.detach().float().contiguous()  # a copy unless already float32
            self._keep.append(kept)
            return kept.data_ptr()

        def bias(p: QuantLinear) -> int | None:
            return None if p.bias is None else as_float(p.bias)

        def norm(owner: nn.Module, name: str) -> int | None:
            module = getattr(owner, name, None)  # absent, or None: not this model's
            return None if module is None else as_float(module.weight)

        projections = [cast(QuantLinear, p) for p in _projections(layer)]
        assert cache.is_contiguous()
        norms = [as_float(layer.input_norm.weight), as_float(layer.post_attn_norm.weight)]
        # Q/K norms (Qwen3, Gemma 3); Gemma 3's norms of each block's output
        extra = [norm(layer.attn, "q_norm"), norm(layer.attn, "k_norm"),
                 norm(layer, "post_attn_out_norm"), norm(layer, "post_mlp_norm")]
        return _Layer(*norms, *(p.qweight.data_ptr() for p in projections),
                      *(p.fmt for p in projections), *(bias(p) for p in projections),
                      cache.data_ptr(), *extra)

    def run(self, hidden: torch.Tensor, positions: list[int], tables: torch.Tensor,
            rows: list[int], extra: Sequence[tuple[torch.Tensor, list[int]]] = ()
            ) -> torch.Tensor:
        """The decoder layers over ``hidden`` (the embeddings ``[B, hidden]``). Row b is at
        position ``positions[b]``, its block table row ``rows[b]`` of ``tables`` (long,
        ``[num_rows, width]``), covering that position. A model of several KV cache groups
        takes the tables and rows of groups 1, 2, ... in ``extra``. Writes each row's K/V into
        the cache; returns the last layer's output, in the model's dtype."""
        if len(extra) != self.num_groups - 1:
            raise ValueError(f"{self.num_groups} KV cache groups: give {self.num_groups - 1} "
                             f"more tables, got {len(extra)}")
        given = hidden.dtype
        hidden = hidden.float().contiguous()
        pos_t = torch.tensor(positions, dtype=torch.int64)
        groups = [(tables, torch.tensor(rows, dtype=torch.int64))]
        groups += [(t, torch.tensor(r, dtype=torch.int64)) for t, r in extra]
        batches = (_Batch * len(groups))(*(
            _Batch(len(positions), pos_t.data_ptr(), t.data_ptr(), r.data_ptr(), t.stride(0))
            for t, r in groups))
        if self._lib.decode_forward(ctypes.byref(self.model), batches,
                                    hidden.data_ptr()) != 0:
            raise MemoryError("the fused decode step could not allocate its scratch memory")
        return hidden.to(given)
