"""The engine's KV cache manager for a model: plain, or hybrid for models with windows.

A model whose layers all use full attention gets the plain ``KVCacheManager``. One with
sliding-window layers (Gemma 3, Mistral, Qwen2 with ``use_sliding_window``) gets a
``HybridKVCacheManager`` with one group per KV cache group of
:func:`prefixserve.model.kv_layout.kv_layout` (the model runner lays its KV tensor out by the
same groups, so group g of the manager is group g of the runner).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from prefixserve.core import KVCacheManager
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.model.arch.config import ModelConfig
from prefixserve.model.kv_layout import blocks_for_request, kv_layout, max_tokens_for_blocks

if TYPE_CHECKING:
    from prefixserve.engine.config import EngineConfig

logger = logging.getLogger("prefixserve.engine")

REPORT_TOKENS = 8000
"""The request length of the startup report of a hybrid layout."""


def make_engine_kv_cache(model: ModelConfig, num_blocks: int, config: EngineConfig,
                         hash_root: Any = None) -> tuple[KVCacheManager, int]:
    """The manager over ``num_blocks`` blocks and the longest request (tokens) it can hold
    alone (a window group holds at most the window plus one step's chunk). ``hash_root``: a
    process-stable chain root (the cache tiers need one), else the algorithm's own."""
    layout = kv_layout(model)
    bs = config.block_size
    hybrid = any(w is not None for w in layout.windows)
    capacity = (max_tokens_for_blocks(layout, num_blocks - 1, bs, config.max_num_batched_tokens)
                if hybrid else num_blocks * bs)
    max_model_len = min(config.max_model_len or model.max_position_embeddings,
                        model.max_position_embeddings, capacity)
    reserved = -(-max_model_len // bs)  # the pin budget leaves room for one longest request
    if not hybrid:
        return KVCacheManager(num_blocks, bs, config.prefix_caching,
                              config.hash_algo,
                              max_pinned_fraction=config.max_pinned_fraction,
                              reserved_blocks=reserved, hash_root=hash_root), capacity
    return HybridKVCacheManager(num_blocks, bs, layout.windows, config.prefix_caching,
                                config.hash_algo,
                                max_pinned_fraction=config.max_pinned_fraction,
                                reserved_blocks=reserved, hash_root=hash_root), capacity


def capacity_report(model: ModelConfig, num_blocks: int, block_size: int, num_tokens: int,
                    chunk_tokens: int) -> dict[str, int]:
    """Blocks one request of ``num_tokens`` needs with this model's layout and with every layer
    full (same block size in bytes), and the longest request each layout fits in ``num_blocks``."""
    layout = kv_layout(model)
    full = kv_layout(replace(model, sliding_window=None, layer_types=None))
    # an all-full block holds every layer: count it in blocks of one group's layers
    scale = full.group_size // layout.group_size
    usable = num_blocks - (model.sliding_window is not None)
    return {
        "blocks_hybrid": blocks_for_request(layout, num_tokens, block_size, chunk_tokens),
        "blocks_all_full": blocks_for_request(full, num_tokens, block_size) * scale,
        "max_tokens_hybrid": max_tokens_for_blocks(layout, usable, block_size, chunk_tokens),
        "max_tokens_all_full": max_tokens_for_blocks(full, num_blocks // scale, block_size),
    }


def log_kv_capacity(model: ModelConfig, num_blocks: int, config: EngineConfig) -> None:
    """Logs, for a model with sliding windows, how many tokens one request can hold with the
    hybrid layout against every layer full, and the blocks a ``REPORT_TOKENS`` request needs."""
    if model.sliding_window is None:
        return
    report = capacity_report(model, num_blocks, config.block_size, REPORT_TOKENS,
                             config.max_num_batched_tokens)
    logger.info(
        "KV cache: %d blocks of %d tokens (%d KV cache groups); one request of up to %d tokens "
        "fits (%d if every layer attended fully); a %d-token request needs %d blocks (%d with "
        "every layer full)", num_blocks, config.block_size, len(kv_layout(model).groups),
        report["max_tokens_hybrid"], report["max_tokens_all_full"], REPORT_TOKENS,
        report["blocks_hybrid"], report["blocks_all_full"])
