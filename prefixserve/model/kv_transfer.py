"""KV blocks out of and into the runner's cache tensor, as bytes for the cache tiers.

The cache is ``[num_layers, 2, num_blocks * block_size, kv_heads, head_dim]``
(``ModelRunner.kv_cache``). One block's payload is its slice ``[num_layers, 2, block_size,
kv_heads, head_dim]``, contiguous, as raw bytes of the cache's dtype (``block_payload_size``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch


def _blocks_view(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    layers, two, slots, heads, dim = kv_cache.shape
    return kv_cache.view(layers, two, slots // block_size, block_size, heads, dim)


def block_payload_size(kv_cache: torch.Tensor, block_size: int) -> int:
    """Bytes of one block's payload."""
    layers, two, _, heads, dim = kv_cache.shape
    return layers * two * block_size * heads * dim * kv_cache.element_size()


def gather_blocks(kv_cache: torch.Tensor, block_size: int, block_ids: Sequence[int]
                  ) -> torch.Tensor:
    """A copy of the blocks' KV, ``[len(block_ids), num_layers, 2, block_size, heads, dim]``
    (so that the blocks may be overwritten once this returns)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    picked = _blocks_view(kv_cache, block_size).index_select(2, index)
    return picked.permute(2, 0, 1, 3, 4, 5).contiguous().cpu()


def payload_of(blocks: torch.Tensor, row: int) -> bytes:
    """The raw bytes of row ``row`` of a ``gather_blocks`` result."""
    return blocks[row].reshape(-1).view(torch.uint8).numpy().tobytes()


def scatter_blocks(kv_cache: torch.Tensor, block_size: int, block_ids: Sequence[int],
                   payloads: Sequence[bytes | memoryview]) -> None:
    """Writes each payload (from ``payload_of``, same dtype and shape) into its block."""
    view = _blocks_view(kv_cache, block_size)
    shape = view.shape[:2] + view.shape[3:]
    with warnings.catch_warnings():  # read-only buffers: the data is only copied from
        warnings.simplefilter("ignore", UserWarning)
        for block_id, payload in zip(block_ids, payloads, strict=True):
            raw = torch.frombuffer(payload, dtype=torch.uint8)
            view[:, :, block_id] = raw.view(kv_cache.dtype).view(shape).to(kv_cache.device)
