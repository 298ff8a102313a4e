"""The estimator's replay through the hybrid KV cache, for models with sliding windows.

``prefixserve estimate --kv-model gemma-3-270m`` sizes pools in blocks of the model's KV cache
groups (:mod:`prefixserve.model.kv_layout`: a block holds one group's layers) and replays
through ``HybridKVCacheManager`` with the model's group windows, as the engine runs it. The
prompt is allocated in chunks of ``CHUNK_TOKENS`` (the engine's default step budget), so window
groups release the blocks that slide out between chunks; the output is then allocated at once
(window groups keep the output's blocks until the request leaves: a slight overestimate of
what a long output holds). A request that cannot be allocated in an otherwise empty pool counts
as too large.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from prefixserve.core import CacheRequest, PrefixCacheStats
from prefixserve.core.block_pool import Clock
from prefixserve.core.hybrid_kv_cache_manager import HybridKVCacheManager
from prefixserve.tools.estimate.results import ReplaySettings
from prefixserve.tools.trace_formats import TraceRequest, Workload

if TYPE_CHECKING:
    from prefixserve.model.arch.config import ModelConfig

CHUNK_TOKENS = 2048


@functools.cache
def model_config(model: str | None) -> ModelConfig:
    """The config of ``model`` (a GGUF file, an HF directory, a short name or None for the
    default model), read once per process; no weights are loaded."""
    from prefixserve.model.arch.config import ModelConfig, resolve_model_path
    from prefixserve.model.weights.gguf_file import GGUFFile

    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        gguf = GGUFFile(path)
        return ModelConfig.from_gguf_metadata(gguf.metadata, set(gguf.tensors))
    return ModelConfig.from_hf_dir(path)


def model_kv_groups(model: str | None) -> tuple[int, int, tuple[int | None, ...] | None]:
    """``(layers, layers per pool block, group windows)`` of ``model``; the windows are None
    (and a block holds every layer) when every layer is full attention."""
    from prefixserve.model.kv_layout import kv_layout

    config = model_config(model)
    layout = kv_layout(config)
    windows = tuple(layout.windows)
    if all(w is None for w in windows):
        return config.num_hidden_layers, config.num_hidden_layers, None
    return config.num_hidden_layers, layout.group_size, windows


def hybrid_arrive(replay: Any, index: int, trace_request: TraceRequest,
                  settings: ReplaySettings) -> int:
    """``_PoolReplay._arrive`` for a hybrid pool (see the module docstring)."""
    workload: Workload = replay.workload
    bs = workload.block_size
    keys = workload.block_keys(trace_request)
    prompt = trace_request.num_prompt_tokens
    total = prompt + trace_request.num_decoded_tokens
    num_prompt_blocks = min(len(keys), prompt // bs)
    while len(replay.resident) >= replay.concurrency:
        replay._leave()
    prompt_keys = keys if num_prompt_blocks == len(keys) else keys[:num_prompt_blocks]
    request = CacheRequest(str(index), range(prompt), block_hashes=prompt_keys)
    manager: HybridKVCacheManager = replay.manager
    hits, num_cached = manager.get_computed_blocks(request)
    stats = manager.make_prefix_cache_stats()
    request.num_computed_tokens = 0
    pending: Any = hits
    done = num_cached
    while done < total:
        n = min(CHUNK_TOKENS, prompt - done) if done < prompt else total - done
        if manager.allocate_slots(request, n, pending) is None:
            if replay.resident:
                replay._leave()
                continue
            manager.free(request)
            manager.free_block_hashes(request)
            replay.result.requests_too_large += index >= replay.tally.warmup
            replay.tally.observe(index, PrefixCacheStats(
                requests=1, queries=num_prompt_blocks, query_tokens=prompt))
            return 0
        pending = ()
        done += n
        request.num_computed_tokens = done
    request.num_computed_tokens = num_cached  # as the plain replay leaves it
    replay.tally.observe(index, stats)
    replay.resident.append((request, trace_request, keys))
    return num_cached


def hybrid_manager(capacity: int, block_size: int, settings: ReplaySettings,
                   clock: Clock | None = None) -> HybridKVCacheManager:
    assert settings.group_windows is not None
    return HybridKVCacheManager(capacity, block_size, settings.group_windows, clock=clock,
                                max_pinned_fraction=settings.max_pinned_fraction)
