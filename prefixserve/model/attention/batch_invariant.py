"""The deterministic (batch-invariant) mode: kernels whose result for a row never depends on
the other rows of the step.

With ``EngineConfig(deterministic=True)`` (``--deterministic``) a request's tokens depend only
on its own tokens, sampling parameters and seed: not on what else is in the batch, how its
prompt was chunked, or how much of it came from the prefix cache. Three things make that so:

* **Matmuls in fixed row tiles** (:func:`tiled_linear`): torch's GEMM picks its kernel by
  shape (on this project's reference CPU a float32 row's result differs between 1, 2-3 and 4+
  rows), so every dense product runs as products of exactly :data:`ROW_TILE` rows, the last
  one padded with zeros. Every call then has one shape, and a test shows a row's result does
  not depend on its place in the tile or on the other rows. Packed (quantized) weights keep one
  kernel of ``kernels/quant.c`` at every row count, instead of switching with it (to
  expand-and-GEMM above ``SMALL_M`` rows): a bfloat16 model's rows the bfloat16 batch kernel
  where the CPU has AVX512-BF16, other rows the 16-bit integer kernel. Both compute each
  output element with the same operations in the same order whatever the number of rows.
* **Attention with a fixed split over keys** (:func:`invariant_attention`,
  ``kernels/invariant_attention.c``): every query attends to its sequence's keys read from the
  paged cache, KV block by KV block from the first, each block's partial result merged into
  the running one by log-sum-exp. The split is the cache's blocks, which neither a cache hit
  nor a chunk boundary moves; prefill (with or without a cached prefix), chunked prefill and
  decode run the same arithmetic for a row. The two-pass shared-prefix decode is not used in
  this mode.
* Norms, rotary embedding, elementwise ops, the embedding lookup and the sampler already work
  row by row; ``tests/model/test_batch_invariant.py`` checks that bitwise.

:func:`make_batch_invariant` switches a loaded model's linear layers to these kernels; the
attention switch is the ``deterministic`` flag of
:func:`~prefixserve.model.attention.paged.build_metadata` (the model runner sets both).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.weights import quant_kernels
from prefixserve.model.weights.quant import QuantLinear

#: Rows of every dense product in the deterministic mode. Any fixed size makes every GEMM call
#: the same shape; 8 keeps the padding of a one-sequence decode step small while larger
#: products still run as GEMMs (``benchmarks/bench_deterministic.py`` measures the cost).
ROW_TILE = 8

_SOURCE = Path(__file__).parent.parent / "kernels" / "invariant_attention.c"

#: Cache dtypes the attention kernel reads.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as products of exactly :data:`ROW_TILE` rows
    (the last tile padded with zeros), so that a row's result does not depend on how many rows
    ``x`` has."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    out = flat.new_empty((rows, weight.shape[0]))
    full = rows - rows % ROW_TILE
    for start in range(0, full, ROW_TILE):
        out[start : start + ROW_TILE] = F.linear(flat[start : start + ROW_TILE], weight, bias)
    if full < rows:
        tail = flat.new_zeros((ROW_TILE, flat.shape[1]))
        tail[: rows - full] = flat[full:]
        out[full:] = F.linear(tail, weight, bias)[: rows - full]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RowTiledLinear(nn.Linear):
    """An ``nn.Linear`` whose product is :func:`tiled_linear` (same parameters, same state
    dict). :func:`make_batch_invariant` turns a model's ``nn.Linear`` layers into these."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_linear(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> None:
    """Switch ``model``'s products to the row-invariant kernels, in place: every plain
    ``nn.Linear`` computes by :func:`tiled_linear`, every :class:`QuantLinear` keeps one kernel
    at all row counts (``row_invariant``; the output head, packed, the integer kernel: it sees
    one row per sequence, where that kernel is the faster), and a tied output head (a model
    with ``lm_head`` None and a dense ``embed_tokens``) gets a :class:`RowTiledLinear` head
    sharing the embedding's weight."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowTiledLinear
        elif isinstance(module, QuantLinear):
            module.row_invariant = True
    embed = getattr(model, "embed_tokens", None)
    lm_head = getattr(model, "lm_head", None)
    for head in (lm_head, getattr(embed, "head", None)):
        if isinstance(head, QuantLinear):
            head.invariant_batch_kernel = False
    tied = hasattr(model, "lm_head") and model.lm_head is None
    if tied and isinstance(embed, nn.Embedding):
        head = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        head.weight = embed.weight
        head.__class__ = RowTiledLinear
        model.lm_head = head


@dataclass
class KeyTables:
    """Where each query row of a step finds its keys: ``tables`` (long ``[rows, width]``) holds
    block tables, row ``n`` of the step uses ``tables[table_of_row[n]]`` and attends to the
    positions ``0 .. pos_of_row[n]`` (its own included), or with a sliding ``window`` (0: none)
    to the last ``window`` of them."""

    tables: torch.Tensor
    table_of_row: torch.Tensor
    pos_of_row: torch.Tensor
    window: int = 0


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.invariant_attention.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int, i64, i64, p, i64,
                                        p, p, i64, ctypes.c_float, p]
    lib.invariant_attention.restype = None


_library = quant_kernels.KernelLibrary(_SOURCE, _declare)


def attention_kernel_error() -> str | None:
    """None when the attention kernel builds and loads here, else why not."""
    _library.get()
    return _library.error


def invariant_attention(q: torch.Tensor, layer_cache: torch.Tensor, keys: KeyTables,
                        block_size: int) -> torch.Tensor:
    """Causal attention of ``q`` (``[rows, heads, head_dim]``) over the K/V in
    ``layer_cache`` (``[2, slots, kv_heads, head_dim]``, float32 or bfloat16, the step's own
    K/V already written) at the positions ``keys`` gives (over its sliding window, if any),
    with the fixed per-block split of the module docstring. Returns ``[rows, heads, head_dim]``
    in ``q``'s dtype."""
    if layer_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"deterministic attention reads float32 or bfloat16, "
                         f"not {layer_cache.dtype}")
    rows, heads, head_dim = q.shape
    query = q.float().contiguous()
    out = torch.empty_like(query)
    k_cache, v_cache = layer_cache[0].contiguous(), layer_cache[1].contiguous()
    tables = keys.tables.contiguous()
    lib = _library.get()
    if lib is None:
        raise RuntimeError(f"the deterministic attention kernel cannot be built: "
                           f"{_library.error}")
    lib.invariant_attention(
        query.data_ptr(), rows, heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        int(layer_cache.dtype == torch.bfloat16), layer_cache.shape[2], block_size,
        tables.data_ptr(), tables.shape[1], keys.table_of_row.data_ptr(),
        keys.pos_of_row.data_ptr(), keys.window, 1.0 / math.sqrt(head_dim), out.data_ptr())
    return out.to(q.dtype)
