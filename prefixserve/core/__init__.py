"""The prefix cache: block hash chains, the block pool and the KV cache manager.

Pure Python with no dependency on the rest of prefixserve (nor on torch or numpy), so other
engines can embed it and the offline estimator replays workloads through this very code.
"""

from prefixserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from prefixserve.core.hashing import (
    HASH_ALGOS,
    NONE_HASH,
    BlockHash,
    get_hash_function,
    hash_block_chain,
    hash_block_tokens,
)
from prefixserve.core.kv_cache_manager import (
    ALLOWED_BLOCK_SIZES,
    KVCacheManager,
    SlidingWindowKVCacheManager,
    make_kv_cache_manager,
)
from prefixserve.core.request import (
    EXTRA_KEY_SOURCES,
    CacheRequest,
    ExtraKeySource,
    MultiModalInput,
    block_extra_keys,
)
from prefixserve.core.retention import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PIN_PRIORITY,
    PinBudgetError,
    Retention,
    RetentionRange,
)
from prefixserve.core.stats import PrefixCacheStats, PrefixCachingMetrics

__all__ = [
    "ALLOWED_BLOCK_SIZES",
    "DEFAULT_PRIORITY",
    "EXTRA_KEY_SOURCES",
    "HASH_ALGOS",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "NONE_HASH",
    "PIN_PRIORITY",
    "BlockHash",
    "BlockPool",
    "CacheRequest",
    "ExtraKeySource",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "MultiModalInput",
    "PinBudgetError",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "Retention",
    "RetentionRange",
    "SlidingWindowKVCacheManager",
    "block_extra_keys",
    "get_hash_function",
    "hash_block_chain",
    "hash_block_tokens",
    "make_kv_cache_manager",
]
