"""How a model's layers share the paged KV cache: KV cache groups (imports no torch).

Layers of one attention kind (full, or a sliding window of W tokens) form groups of equal size
``group_size``; each group keeps its own block tables, and one block of the pool holds the K/V
of ``block_size`` tokens for the ``group_size`` layers of whichever group holds it. So the pool
is one tensor ``[group_size, 2, num_blocks * block_size, kv_heads, head_dim]``, and layer i
reads and writes row ``slot`` of it through the tables of its group. ``group_size`` is the
greatest common divisor of the number of layers of each kind (Gemma 3 270M: 15 sliding and 3
full layers, so groups of 3: five sliding groups and one full group). A model with one kind has
a single group of all its layers (the layout of a plain full-attention model).

Full-attention groups come first, so group 0 is a full one whenever the model has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixserve.model.arch.config import ModelConfig, _HasItemSize


@dataclass(frozen=True)
class KVGroup:
    """Layers ``layers`` (in order) share block tables; ``window`` None is full attention."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model and where each layer lives: layer i is row ``slot[i]`` of the
    pool tensor, addressed through the tables of group ``group[i]``."""

    groups: tuple[KVGroup, ...]
    group_size: int
    group: tuple[int, ...]
    slot: tuple[int, ...]

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self.groups]

    @property
    def is_hybrid(self) -> bool:
        """More than one group (so more than one table per request)."""
        return len(self.groups) > 1


def kv_layout(config: ModelConfig) -> KVLayout:
    """The KV cache groups of ``config`` (see the module docstring)."""
    windows = config.layer_windows
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        kinds.setdefault(window, []).append(i)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVGroup(w, tuple(kinds[w][j : j + size]))
                   for w in order for j in range(0, len(kinds[w]), size))
    group = [0] * len(windows)
    slot = [0] * len(windows)
    for g, kv_group in enumerate(groups):
        for j, layer in enumerate(kv_group.layers):
            group[layer], slot[layer] = g, j
    return KVLayout(groups, size, tuple(group), tuple(slot))


def kv_block_bytes(config: ModelConfig, dtype: _HasItemSize, block_size: int) -> int:
    """Bytes of one pool block: K and V of ``block_size`` tokens for one group's layers."""
    layout = kv_layout(config)
    per_layer = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return per_layer * layout.group_size * block_size


def blocks_for_request(layout: KVLayout, num_tokens: int, block_size: int,
                       chunk_tokens: int = 0) -> int:
    """Pool blocks one request of ``num_tokens`` holds at most: every block in a full group, and
    in a window group the blocks a query's window reaches (``window - 1`` earlier tokens) plus
    those of a prefill chunk of ``chunk_tokens`` tokens (plus one a window may straddle)."""
    full = -(-num_tokens // block_size)
    total = 0
    for group in layout.groups:
        if group.window is None:
            total += full
        else:
            reach = -(-(group.window - 1 + max(chunk_tokens, 1)) // block_size) + 1
            total += min(full, reach)
    return total


def max_tokens_for_blocks(layout: KVLayout, num_blocks: int, block_size: int,
                          chunk_tokens: int = 0) -> int:
    """The longest request (tokens) whose blocks fit ``num_blocks`` (binary search)."""
    lo, hi = 0, num_blocks * block_size * len(layout.groups)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for_request(layout, mid, block_size, chunk_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
