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

from prefixserve.core.block_pool import BlockPool, Clock, KVCacheBlock
from prefixserve.core.hashing import get_hash_function, hash_block_chain, hash_value_of
from prefixserve.core.request import CacheRequest, block_extra_keys
from prefixserve.core.retention import (
    DEFAULT_PRIORITY,
    NO_EXPIRY,
    PIN_PRIORITY,
    PinBudgetError,
)
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
    heads need the hidden states of the last prompt block.

    Retention (docs/explicit-caching.md): a request's ``retention`` is applied to its hit blocks
    and to the blocks it caches, at allocation; ``pin`` / ``unpin`` hold a cached prefix by
    reference until unpinned, within ``max_pinned_fraction`` of the pool less
    ``reserved_blocks`` (the engine reserves room for one request of its whole context, so that
    pins never make a request unschedulable). ``clock`` drives expiry (tests simulate it).
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
        clock: Clock | None = None,
        max_pinned_fraction: float = 0.5,
        reserved_blocks: int = 0,
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
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.block_pool = BlockPool(num_blocks, reserve_null_block=self.sliding_window is not None,
                                    clock=clock)
        self.num_blocks = num_blocks
        usable = num_blocks - (self.sliding_window is not None)
        self.max_pinned_blocks = max(0, min(int(max_pinned_fraction * usable),
                                            usable - reserved_blocks))
        self.pins: dict[str, list[KVCacheBlock]] = {}
        self._pin_refs: dict[int, int] = {}
        self.retention_seen = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[Hashable]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # ----------------------------------------------------------------- hashing
    def block_hashes(self, request: CacheRequest, num_full_blocks: int | None = None
                     ) -> Sequence[Hashable]:
        """The request's chain, extended (never recomputed) to cover ``num_full_blocks`` full
        blocks (default, and at most: every full block of ``request.token_ids``; a partial
        block is never hashed). Precomputed hashes are used as they are and never extended."""
        if request.block_hashes is not None:
            return request.block_hashes
        rid = request.request_id
        chain = self.req_to_block_hashes.get(rid)
        if chain is None:
            chain = self.req_to_block_hashes[rid] = []
        full = len(request.token_ids) // self.block_size
        num_full_blocks = full if num_full_blocks is None else min(num_full_blocks, full)
        have = len(chain)
        if num_full_blocks > have:
            parent = hash_value_of(chain[-1]) if chain else self._hash_root
            extras = block_extra_keys(request, self.block_size, have, num_full_blocks)
            chain += hash_block_chain(self._hash_function, parent, request.token_ids,
                                      self.block_size, have, num_full_blocks, extras)
        return chain

    # ----------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: CacheRequest, *, record_stats: bool = True
                            ) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks at the start of the request, and the tokens they
        hold. Changes no reference count.

        Returns nothing when caching is off or the request wants prompt logprobs (those need the
        whole prompt computed; such requests are not counted in the stats either). When the
        request length is an exact multiple of the block size, the last block is not looked up,
        so that at least one token is computed and there are logits to sample from.

        ``record_stats=False`` leaves the stats alone: a caller that may look the same request
        up again (a scheduler whose allocation failed) counts it once, with ``record_lookup``,
        when the allocation succeeds."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        hashes = self.block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed = self._find_longest_cache_hit(hashes, min(max_hit_blocks, len(hashes)))
        if self.use_eagle and computed:
            computed.pop()
        if record_stats and self.log_stats:
            self._record(request, len(hashes), computed)
        return computed, len(computed) * self.block_size

    def record_lookup(self, request: CacheRequest, hit: list[KVCacheBlock] | int) -> None:
        """Counts one lookup of ``request`` that found ``hit`` (the blocks, or their number)
        after a ``get_computed_blocks(request, record_stats=False)``, under the same rules."""
        if self.log_stats and self.enable_caching and not request.wants_prompt_logprobs:
            self._record(request, len(self.block_hashes(request)), hit)

    def _record(self, request: CacheRequest, num_queries: int,
                hit: list[KVCacheBlock] | int) -> None:
        """Adds one lookup to the stats; ``hit`` is the hit blocks (their retention levels are
        counted too) or just their number."""
        num_hits = hit if isinstance(hit, int) else len(hit)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_queries
        stats.hits += num_hits
        stats.query_tokens += request.num_tokens
        stats.hit_tokens += num_hits * self.block_size
        if self.retention_seen and not isinstance(hit, int) and hit:
            self._count_retained_hits(hit, stats.retained_hits)

    def _count_retained_hits(self, computed: list[KVCacheBlock], counts: dict[int, int]) -> None:
        self.block_pool.expire()  # count each hit at the level it really has now
        for block in computed:
            if block.priority != DEFAULT_PRIORITY:
                counts[block.priority] = counts.get(block.priority, 0) + 1

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
        if self.sliding_window is not None:
            # also when nothing comes back to the pool: shared blocks leave the table too
            self._remove_skipped_blocks(req_blocks, num_computed_tokens)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            self._cache_full(request, req_blocks, num_existing, len(new_computed_blocks),
                             total_tokens)
        return new_blocks

    def _cache_full(self, request: CacheRequest, req_blocks: list[KVCacheBlock],
                    num_existing: int, num_hits: int, total_tokens: int) -> None:
        """Caches the blocks that became full with this step's tokens, then applies the
        request's retention to its new hits and newly cached blocks."""
        rid = request.request_id
        num_cached = prev_cached = self.num_cached_block.get(rid, 0)
        if num_hits:
            num_cached = max(num_cached, num_existing + num_hits)
        num_full = min(total_tokens, request.num_tokens) // self.block_size
        if num_full > num_cached:
            hashes = self.block_hashes(request, num_full)
            num_full = min(num_full, len(hashes))
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
                num_cached = num_full
        self.num_cached_block[rid] = num_cached
        if request.retention is not None or (self.retention_seen and num_hits):
            end_hit = num_existing + num_hits
            # newly registered: from the first block not registered before (a block the last
            # chunk left partly filled included), past the hits, which were registered already
            first_new = max(prev_cached, end_hit) if num_hits else prev_cached
            self._apply_retention(request, req_blocks, num_existing, end_hit, first_new,
                                  num_cached)

    def _apply_retention(self, request: CacheRequest, req_blocks: list[KVCacheBlock],
                         first_hit: int, end_hit: int, first_new: int, end_new: int) -> None:
        """Applies the request's retention to its hit blocks ``[first_hit, end_hit)`` (a block
        keeps a higher retention than the request's) and to the blocks it has just cached,
        ``[first_new, end_new)`` (set as asked). A request without retention counts as
        ``DEFAULT_PRIORITY``: its hits lift a block kept at a lower priority back to it."""
        retain = self.block_pool.retain
        retention = request.retention
        if retention is None:
            for block in req_blocks[first_hit:end_hit]:
                if block.priority < DEFAULT_PRIORITY:
                    retain(block, DEFAULT_PRIORITY, 0.0)
            return
        self.retention_seen = True
        for lo, hi, fresh in ((first_hit, end_hit, False), (first_new, end_new, True)):
            if lo >= hi:
                continue
            values = retention.block_retentions(request.num_prompt_tokens, self.block_size,
                                                lo, hi)
            for block, (priority, duration) in zip(req_blocks[lo:hi], values, strict=True):
                if not block.is_null:
                    retain(block, priority, duration, fresh=fresh)

    def _num_reclaimable_blocks(self, request: CacheRequest, num_computed_tokens: int) -> int:
        """Blocks the request holds that are no longer needed (sliding window only)."""
        return 0

    def remove_skipped_blocks(self, request: CacheRequest) -> bool:
        """Frees the request's blocks that lie wholly before the window of its next token
        (the one at ``request.num_computed_tokens``), puts the null block in their places, and
        says whether its table changed. The engine calls it after every step, so that what a
        prefill pushed out of a window is free for the next step's allocations of every
        request, not only at this request's own next ``allocate_slots``. The blocks keep their
        hashes (they stay hits until evicted). Full attention frees nothing: False."""
        return False

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

    # ----------------------------------------------------------------- pins
    def pin(self, pin_id: str, block_hashes: Sequence[Hashable]) -> list[KVCacheBlock]:
        """Pins the cached blocks of ``block_hashes`` (a prefix's chain, every block of which
        must be cached): each gets one reference held by the pin, so it is never free and never
        evicted until ``unpin``. Raises ``KeyError`` when a block is not cached, ``ValueError``
        for a pin id in use and ``PinBudgetError`` when the distinct pinned blocks would exceed
        ``max_pinned_blocks``; nothing changes then."""
        if pin_id in self.pins:
            raise ValueError(f"pin id {pin_id!r} is already in use")
        blocks = self._prefix_blocks(block_hashes)
        new = {b.block_id for b in blocks if b.block_id not in self._pin_refs}
        if len(self._pin_refs) + len(new) > self.max_pinned_blocks:
            raise PinBudgetError(
                f"pinning {len(new)} more blocks would pin {len(self._pin_refs) + len(new)} of "
                f"{self.num_blocks} blocks; the pin budget is {self.max_pinned_blocks} "
                f"(--max-pinned-fraction)")
        self.block_pool.touch(blocks)
        for block in blocks:
            self._pin_refs[block.block_id] = self._pin_refs.get(block.block_id, 0) + 1
            block.priority = PIN_PRIORITY
            block.duration = NO_EXPIRY
        self.retention_seen = True
        self.pins[pin_id] = blocks
        return blocks

    def _prefix_blocks(self, block_hashes: Sequence[Hashable]) -> list[KVCacheBlock]:
        """The cached blocks a hit on the whole chain ``block_hashes`` reads (what a pin must
        hold; a window's placeholders are not blocks); ``KeyError`` naming the first block that
        is not cached."""
        blocks = self._find_longest_cache_hit(block_hashes, len(block_hashes))
        if len(blocks) < len(block_hashes):
            raise KeyError(f"block {len(blocks)} of the prefix is not cached")
        return [block for block in blocks if not block.is_null]

    def unpin(self, pin_id: str) -> bool:
        """Releases a pin (tail first); a block no other pin holds falls back to the default
        priority. Returns whether the pin existed."""
        blocks = self.pins.pop(pin_id, None)
        if blocks is None:
            return False
        for block in blocks:
            left = self._pin_refs[block.block_id] - 1
            if left:
                self._pin_refs[block.block_id] = left
                continue
            del self._pin_refs[block.block_id]
            block.priority = DEFAULT_PRIORITY
            block.duration = 0.0
        self.block_pool.free_blocks(reversed(blocks))
        return True

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len(self._pin_refs)

    def reset_prefix_cache(self, keep_pins: bool = False) -> bool:
        """Empties the prefix cache, also under traffic; returns True (kept for callers).

        Running requests keep their blocks, chains and ``num_cached_block`` counts: their blocks
        cached before the reset are never registered again (they lie below the count), and the
        blocks they fill afterwards are cached under their still valid chain hashes. The stats
        are flagged ``reset`` (which clears the rolling hit-rate window, not the counters).
        Pins are released first unless ``keep_pins``, which keeps them and their hashes."""
        if not keep_pins:
            for pin_id in list(self.pins):
                self.unpin(pin_id)
        kept = [block for blocks in self.pins.values() for block in blocks]
        self.block_pool.reset_prefix_cache(keep=kept)
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
                 log_stats: bool = True, clock: Clock | None = None,
                 max_pinned_fraction: float = 0.5, reserved_blocks: int = 0) -> None:
        if sliding_window is None:
            raise ValueError("SlidingWindowKVCacheManager needs a sliding_window")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window
        super().__init__(num_blocks, block_size, enable_caching, hash_algo, use_eagle=use_eagle,
                         log_stats=log_stats, clock=clock,
                         max_pinned_fraction=max_pinned_fraction,
                         reserved_blocks=reserved_blocks)
        assert self.block_pool.null_block is not None
        self.null_block = self.block_pool.null_block

    def _find_longest_cache_hit(self, hashes: Sequence[Hashable], max_blocks: int
                                ) -> list[KVCacheBlock]:
        """Searches from the end for the longest prefix whose last ``ceil((window - 1) / bs)``
        blocks are all cached; earlier blocks are returned as null blocks. With ``use_eagle``
        one more cached block is required, since the caller drops the last one: the hit that
        remains must still have its whole window cached."""
        needed = -(-(self.sliding_window - 1) // self.block_size) + self.use_eagle
        return window_cache_hit(self.block_pool, self.null_block, hashes, max_blocks, needed)

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def _num_reclaimable_blocks(self, request: CacheRequest, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request.request_id, ())
        skipped = self._num_skipped_blocks(num_computed_tokens)
        return sum(1 for b in blocks[:skipped] if not b.is_null and b.ref_cnt == 1)

    def remove_skipped_blocks(self, request: CacheRequest) -> bool:
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return False
        skipped = min(self._num_skipped_blocks(request.num_computed_tokens), len(blocks))
        if skipped == 0 or blocks[skipped - 1].is_null:
            return False
        self._remove_skipped_blocks(blocks, request.num_computed_tokens)
        return True

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


def window_cache_hit(pool: BlockPool, null_block: KVCacheBlock, hashes: Sequence[Hashable],
                     max_blocks: int, needed: int) -> list[KVCacheBlock]:
    """The longest prefix of at most ``max_blocks`` blocks whose last ``needed`` blocks are all
    cached (searched from the end), its earlier blocks as ``null_block``; a shorter run of cached
    blocks from block 0 when no such window exists. The one window lookup of the sliding-window
    and hybrid managers."""
    computed: list[KVCacheBlock] = [null_block] * max_blocks
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
