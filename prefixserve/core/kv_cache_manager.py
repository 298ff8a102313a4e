"""The KV cache manager: the scheduler's interface to the block pool and the prefix cache.

``KVCacheManager(num_blocks, block_size)`` serves full attention,
``SlidingWindowKVCacheManager(num_blocks, block_size, sliding_window=N)`` sliding-window attention;
``make_kv_cache_manager(..., sliding_window=None)`` picks one of the two for callers that take the
window as a setting.

The scheduler calls, in this order:

1. ``get_computed_blocks(request)``: a pure query (no reference count changes), so the scheduler
   may still decide not to run the request.
2. ``allocate_slots(request, num_new_tokens, new_computed_blocks)``: takes the hits, allocates the
   rest and caches the blocks that became full; returns None and changes nothing when the pool is
   short.
3. ``free(request)`` when the request finishes or is preempted, and ``free_block_hashes(request)``
   when it finishes (a preempted request keeps its chain, so resuming hits its own blocks).

``KVCacheManager`` serves full attention; ``SlidingWindowKVCacheManager`` serves sliding-window
attention, where blocks outside the window are neither needed on a hit nor kept while running.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from prefixserve.core.block_pool import BlockPool, KVCacheBlock
from prefixserve.core.hashing import get_hash_function, hash_block_chain, hash_value_of
from prefixserve.core.request import CacheRequest, block_extra_keys
from prefixserve.core.stats import PrefixCacheStats

ALLOWED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
"""Block sizes the engine offers. The manager itself takes any positive size (the worked examples
of the design use 4)."""


class KVCacheManager:
    """Prefix-cached block allocation for full attention.

    Per request it keeps the block table (append-only: blocks are only ever added at the end),
    the block-hash chain (computed once, extended only when a block becomes full, kept across
    preemption, dropped by ``free_block_hashes``) and how many of its blocks are already cached.

    ``use_eagle`` drops the last hit block of every lookup, for engines whose speculative-decoding
    heads need the hidden states of the last prompt block. ``hash_root``, when given, replaces
    the algorithm's root (the parent of block 0), e.g. by one that is stable across processes.
    """

    sliding_window: int | None = None
    """None: full attention. Set (before ``__init__`` runs) by ``SlidingWindowKVCacheManager``,
    whose pool then reserves the null block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        *,
        use_eagle: bool = False,
        log_stats: bool = True,
        hash_root: Any = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not isinstance(enable_caching, bool):
            raise TypeError(f"enable_caching must be a bool, got {enable_caching!r} (an unset "
                            f"setting is resolved by the caller, e.g. EngineConfig.prefix_caching)")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self._hash_function, self._hash_root = get_hash_function(hash_algo)
        if hash_root is not None:  # a process-stable root (the cache tiers need one)
            self._hash_root = hash_root
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    reserve_null_block=self.sliding_window is not None)
        self.num_blocks = num_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[Hashable]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ----------------------------------------------------------------- hashing
    def block_hashes(self, request: CacheRequest, num_full_blocks: int | None = None
                     ) -> Sequence[Hashable]:
        """The request's chain, extended (never recomputed) to cover ``num_full_blocks`` full
        blocks (default: every full block of ``request.token_ids``). Precomputed hashes are used
        as they are and never extended."""
        if request.block_hashes is not None:
            return request.block_hashes
        rid = request.request_id
        chain = self.req_to_block_hashes.get(rid)
        if chain is None:
            chain = self.req_to_block_hashes[rid] = []
        if num_full_blocks is None:
            num_full_blocks = len(request.token_ids) // self.block_size
        have = len(chain)
        if num_full_blocks > have:
            parent = hash_value_of(chain[-1]) if chain else self._hash_root
            extras = block_extra_keys(request, self.block_size, have, num_full_blocks)
            chain += hash_block_chain(self._hash_function, parent, request.token_ids,
                                      self.block_size, have, num_full_blocks, extras)
        return chain

    # ----------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks at the start of the request, and the tokens they
        hold. Changes no reference count.

        Returns nothing when caching is off or the request wants prompt logprobs (those need the
        whole prompt computed; such requests are not counted in the stats either). When the
        request length is an exact multiple of the block size, the last block is not looked up,
        so that at least one token is computed and there are logits to sample from."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        hashes = self.block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed = self._find_longest_cache_hit(hashes, min(max_hit_blocks, len(hashes)))
        if self.use_eagle and computed:
            computed.pop()
        num_computed_tokens = len(computed) * self.block_size
        if self.log_stats:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += len(hashes)
            stats.hits += len(computed)
            stats.query_tokens += request.num_tokens
            stats.hit_tokens += num_computed_tokens
        return computed, num_computed_tokens

    def _find_longest_cache_hit(self, hashes: Sequence[Hashable], max_blocks: int
                                ) -> list[KVCacheBlock]:
        """Walks the chain from block 0 and stops at the first miss: a block cannot be reused
        when an earlier one was not, since its KV depends on the whole history."""
        computed: list[KVCacheBlock] = []
        append = computed.append
        cache = self.block_pool.cached_block_hash_to_block
        get_cached_block = self.block_pool.get_cached_block
        for i in range(max_blocks):
            block_hash = hashes[i]
            # hash_value_of(block_hash), written out (hot loop)
            entry = cache.get(block_hash[0] if type(block_hash) is tuple else block_hash)
            if entry is None:
                break
            if type(entry) is not KVCacheBlock or entry.block_hash != block_hash:
                entry = get_cached_block(block_hash)
                if entry is None:
                    break
            append(entry)
        return computed

    # ----------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens after the request's computed ones.

        ``new_computed_blocks`` are the hits from ``get_computed_blocks`` (only on the request's
        first allocation after it was queued or resumed); they are referenced and appended to the
        block table. Blocks that become full with this step's tokens are cached.

        Returns the newly allocated blocks, or None when the pool cannot satisfy the request, in
        which case nothing at all has changed."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_existing = len(req_blocks) if req_blocks is not None else 0
        bs = self.block_size
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * bs
        total_tokens = num_computed_tokens + num_new_tokens
        num_new_blocks = -(-total_tokens // bs) - num_existing - len(new_computed_blocks)

        num_reclaimable = self._num_reclaimable_blocks(request, num_computed_tokens)
        num_evictable_hits = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable_hits += 1
        if num_new_blocks > (self.block_pool.get_num_free_blocks() + num_reclaimable
                             - num_evictable_hits):
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if num_reclaimable:
            self._remove_skipped_blocks(req_blocks, num_computed_tokens)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_cached = self.num_cached_block.get(rid, 0)
            if new_computed_blocks:
                num_cached = max(num_cached, num_existing + len(new_computed_blocks))
            num_full = min(total_tokens, request.num_tokens) // bs
            if num_full > num_cached:
                hashes = self.block_hashes(request, num_full)
                num_full = min(num_full, len(hashes))
                if num_full > num_cached:
                    self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
                    num_cached = num_full
            self.num_cached_block[rid] = num_cached
        return new_blocks

    def _num_reclaimable_blocks(self, request: CacheRequest, num_computed_tokens: int) -> int:
        """Blocks the request holds that are no longer needed (sliding window only)."""
        return 0

    def _remove_skipped_blocks(self, req_blocks: list[KVCacheBlock],
                               num_computed_tokens: int) -> None:
        """Frees blocks that are no longer needed (sliding window only)."""

    # ----------------------------------------------------------------- release
    def free(self, request: CacheRequest) -> None:
        """Drops the request's references. With caching on, its blocks join the free list tail
        first, so that at equal recency its most specific blocks are evicted before the shared
        head blocks that other requests may still reuse."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if not blocks:
            return
        self.block_pool.free_blocks(reversed(blocks) if self.enable_caching else blocks)

    def free_block_hashes(self, request: CacheRequest) -> None:
        """Forgets the request's hash chain. Call when it finishes, not when it is preempted."""
        self.req_to_block_hashes.pop(request.request_id, None)

    def get_block_ids(self, request: CacheRequest) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache, also under traffic; returns True (kept for callers).

        Running requests keep their blocks, chains and ``num_cached_block`` counts: their blocks
        cached before the reset are never registered again (they lie below the count), and the
        blocks they fill afterwards are cached under their still valid chain hashes. The stats
        are flagged ``reset`` (which clears the rolling hit-rate window, not the counters)."""
        self.block_pool.reset_prefix_cache()
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Returns the stats gathered since the last call and starts a new period."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()


class SlidingWindowKVCacheManager(KVCacheManager):
    """Prefix-cached allocation for sliding-window attention of ``sliding_window`` tokens.

    A token at position p attends to positions ``p - sliding_window + 1 .. p``. A cache hit
    therefore only needs the blocks inside the window before the hit's end: the lookup returns the
    null block as a placeholder for earlier blocks. While a request runs, blocks that fell out of
    the window are freed and replaced by the null block in its table.
    """

    sliding_window: int
    null_block: KVCacheBlock

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "builtin", *, sliding_window: int, use_eagle: bool = False,
                 log_stats: bool = True) -> None:
        if sliding_window is None:
            raise ValueError("SlidingWindowKVCacheManager needs a sliding_window")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        super().__init__(num_blocks, block_size, enable_caching, hash_algo, use_eagle=use_eagle,
                         log_stats=log_stats)
        assert self.block_pool.null_block is not None
        self.null_block = self.block_pool.null_block

    def _find_longest_cache_hit(self, hashes: Sequence[Hashable], max_blocks: int
                                ) -> list[KVCacheBlock]:
        """Searches from the end for the longest prefix whose last ``ceil((window - 1) / bs)``
        blocks are all cached; earlier blocks are returned as null blocks."""
        needed = -(-(self.sliding_window - 1) // self.block_size)
        pool = self.block_pool
        computed: list[KVCacheBlock] = [self.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(hashes[i])
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= needed:
                return computed[: i + run]
        return computed[:run]

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def _num_reclaimable_blocks(self, request: CacheRequest, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request.request_id, ())
        skipped = self._num_skipped_blocks(num_computed_tokens)
        return sum(1 for b in blocks[:skipped] if not b.is_null and b.ref_cnt == 1)

    def _remove_skipped_blocks(self, req_blocks: list[KVCacheBlock],
                               num_computed_tokens: int) -> None:
        skipped = min(self._num_skipped_blocks(num_computed_tokens), len(req_blocks))
        out_of_window = []
        for i in range(skipped - 1, -1, -1):
            block = req_blocks[i]
            if block.is_null:
                break
            out_of_window.append(block)
            req_blocks[i] = self.null_block
        self.block_pool.free_blocks(out_of_window)


def make_kv_cache_manager(
    num_blocks: int,
    block_size: int,
    enable_caching: bool = True,
    hash_algo: str = "builtin",
    *,
    sliding_window: int | None = None,
    use_eagle: bool = False,
    log_stats: bool = True,
) -> KVCacheManager:
    """The manager for an attention kind: ``SlidingWindowKVCacheManager`` when
    ``sliding_window`` is set, else the full-attention ``KVCacheManager``."""
    if sliding_window is None:
        return KVCacheManager(num_blocks, block_size, enable_caching, hash_algo,
                              use_eagle=use_eagle, log_stats=log_stats)
    return SlidingWindowKVCacheManager(num_blocks, block_size, enable_caching, hash_algo,
                                       sliding_window=sliding_window, use_eagle=use_eagle,
                                       log_stats=log_stats)
