"""The hybrid KV cache manager: one block pool shared by several KV cache groups.

A model that mixes attention kinds (Gemma 3: five sliding-window layers of 512 tokens, then one
full layer) keeps one **KV cache group** per set of layers of one kind; each group has its own
block table per request, and every block of the one pool can serve any group. Groups are given
by their windows (``None``: full attention), full ones usually first.

Rules (docs/sliding-window.md):

1. **One chain per request.** The block hashes are computed once per request (as for a single
   group, with the same salts and extra keys). A group ``g > 0`` registers and looks up its
   blocks under ``((hash value, g), block hash)``, so equal tokens in two groups are two
   different cache entries, and a hit in one group never hands out another group's block.
2. **Equal tables.** Every group's table has one entry per block of the request, so all tables
   have the same length; a window group holds the null block where its window no longer
   reaches. ``allocate_slots`` therefore returns (and takes as ``new_computed_blocks``) the
   groups' blocks concatenated: ``blocks[g * n:(g + 1) * n]`` are group g's.
3. **Hit.** The prefix hit of a request is the longest prefix that every group serves: a full
   group needs all its blocks from block 0 on (first miss ends it), a window group only the
   ``ceil((window - 1) / block_size)`` blocks before the hit's end. The lookup alternates
   between the groups, shortening the candidate length until all agree. With ``use_eagle`` the
   last hit block is dropped afterwards, so window groups must cover one block more.
4. **Sliding out.** Before each allocation, and after each step (``remove_skipped_blocks``,
   called by the engine), a window group frees the blocks that lie entirely before the window
   of the request's next token and puts the null block in their place.
5. **Free.** ``free`` releases the blocks of all groups, position by position from the tail, so
   at equal recency every group's tails are evicted before any group's heads.
6. Stats (one lookup per request, counted in blocks of the chain), salts, preemption (the chain
   survives ``free``), reset and prompt-logprob requests behave as for ``KVCacheManager``.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from prefixserve.core.block_pool import Clock, KVCacheBlock
from prefixserve.core.hashing import hash_value_of
from prefixserve.core.kv_cache_manager import KVCacheManager, window_cache_hit
from prefixserve.core.request import CacheRequest


def group_key(block_hash: Hashable, group: int) -> Hashable:
    """The key group ``group > 0`` caches the block of ``block_hash`` under (group 0 uses the
    block hash itself): its map key is ``(hash value, group)``, so groups never share blocks."""
    return ((hash_value_of(block_hash), group), block_hash)


class HybridKVCacheManager(KVCacheManager):
    """Prefix-cached allocation for KV cache groups of windows ``group_windows`` (None: full
    attention) sharing one pool of ``num_blocks`` blocks (see the module docstring).

    ``sliding_window`` is the smallest window of the groups (the pool then reserves the null
    block); ``req_to_blocks`` holds group 0's tables, ``group_blocks`` all of them.
    """

    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence[int | None],
                 enable_caching: bool = True, hash_algo: str = "builtin", *,
                 use_eagle: bool = False, log_stats: bool = True, clock: Clock | None = None,
                 max_pinned_fraction: float = 0.5, reserved_blocks: int = 0,
                 hash_root: Any = None) -> None:
        if not group_windows:
            raise ValueError("a hybrid KV cache needs at least one group")
        for window in group_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding windows must be positive, got {window}")
        self.group_windows = tuple(group_windows)
        windows = [w for w in self.group_windows if w is not None]
        self.sliding_window = min(windows) if windows else None
        super().__init__(num_blocks, block_size, enable_caching, hash_algo,
                         use_eagle=use_eagle, log_stats=log_stats, clock=clock,
                         max_pinned_fraction=max_pinned_fraction,
                         reserved_blocks=reserved_blocks, hash_root=hash_root)
        self.null_block = self.block_pool.null_block
        self.num_groups = len(self.group_windows)
        self.group_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        self._group_keys: dict[str, list[list[Hashable]]] = {}
        # blocks a window group's hit needs before its end (with eagle one more)
        self._needed = [None if w is None else -(-(w - 1) // block_size) + use_eagle
                        for w in self.group_windows]

    # ----------------------------------------------------------------- keys per group
    def _keys(self, request: CacheRequest, group: int, hashes: Sequence[Hashable]
              ) -> Sequence[Hashable]:
        """Group ``group``'s cache keys of the chain ``hashes`` (rule 1), extended lazily."""
        if group == 0:
            return hashes
        per_group = self._group_keys.setdefault(request.request_id,
                                                [[] for _ in range(self.num_groups)])
        keys = per_group[group]
        for block_hash in hashes[len(keys):]:
            keys.append(group_key(block_hash, group))
        return keys

    # ----------------------------------------------------------------- lookup
    def get_computed_blocks(self, request: CacheRequest, *, record_stats: bool = True
                            ) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group serves (rule 3), as the groups' hit blocks
        concatenated (rule 2), and the tokens it holds. Changes no reference count.
        ``record_stats`` as in ``KVCacheManager.get_computed_blocks``."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        hashes = self.block_hashes(request)
        length = min((request.num_tokens - 1) // self.block_size, len(hashes))
        keys = [self._keys(request, g, hashes) for g in range(self.num_groups)]
        hits: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        changed = True
        while changed and length > 0:
            changed = False
            for g in range(self.num_groups):
                hit = self._group_hit(g, keys[g], length)
                hits[g] = hit
                if len(hit) < length:
                    length, changed = len(hit), True
        if self.use_eagle and length > 0:
            length -= 1
        computed = [block for hit in hits for block in hit[:length]] if length else []
        if record_stats and self.log_stats:
            self._record(request, len(hashes), length)
        return computed, length * self.block_size

    def record_lookup(self, request: CacheRequest, hit: list[KVCacheBlock] | int) -> None:
        """As ``KVCacheManager.record_lookup``; a list ``hit`` holds every group's blocks."""
        if not isinstance(hit, int):
            hit = len(hit) // self.num_groups
        super().record_lookup(request, hit)

    def _group_hit(self, group: int, keys: Sequence[Hashable], max_blocks: int
                   ) -> list[KVCacheBlock]:
        """Group ``group``'s longest hit of at most ``max_blocks`` blocks."""
        needed = self._needed[group]
        if needed is None:
            return self._find_longest_cache_hit(keys, max_blocks)
        assert self.null_block is not None
        return window_cache_hit(self.block_pool, self.null_block, keys, max_blocks, needed)

    def _prefix_blocks(self, block_hashes: Sequence[Hashable]) -> list[KVCacheBlock]:
        """What a pin holds (``KVCacheManager.pin``): every group's blocks that a hit on the
        whole chain reads, group after group (a window group's: those of the last window)."""
        blocks: list[KVCacheBlock] = []
        for g in range(self.num_groups):
            keys = block_hashes if g == 0 else [group_key(h, g) for h in block_hashes]
            hit = self._group_hit(g, keys, len(block_hashes))
            if len(hit) < len(block_hashes):
                raise KeyError(f"block {len(hit)} of the prefix is not cached")
            blocks += [block for block in hit if not block.is_null]
        return blocks

    # ----------------------------------------------------------------- allocation
    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()
                       ) -> list[KVCacheBlock] | None:
        """As ``KVCacheManager.allocate_slots``, for every group at once: returns the groups'
        new blocks concatenated (rule 2), or None (changing nothing) when the pool is short."""
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        rid = request.request_id
        tables = self.group_blocks.get(rid)
        num_existing = len(tables[0]) if tables is not None else 0
        num_hits = len(new_computed_blocks) // self.num_groups
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_hits * bs
        total = num_computed + num_new_tokens
        per_group = -(-total // bs) - num_existing - num_hits
        skipped = [self._num_skipped(g, num_computed) for g in range(self.num_groups)]
        reclaimable = 0
        if tables is not None:
            for g, table in enumerate(tables):
                reclaimable += sum(1 for b in table[: skipped[g]]
                                   if not b.is_null and b.ref_cnt == 1)
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        needed = max(per_group, 0) * self.num_groups
        if needed > self.block_pool.get_num_free_blocks() + reclaimable - evictable_hits:
            return None
        if tables is None:
            tables = self.group_blocks[rid] = [[] for _ in range(self.num_groups)]
            self.req_to_blocks[rid] = tables[0]
        for g, table in enumerate(tables):
            self._slide_out(table, skipped[g])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            for g, table in enumerate(tables):
                table.extend(new_computed_blocks[g * num_hits : (g + 1) * num_hits])
        new_blocks = self.block_pool.get_new_blocks(needed) if needed > 0 else []
        for g, table in enumerate(tables):
            table.extend(new_blocks[g * per_group : (g + 1) * per_group])
        if self.enable_caching:
            self._cache_and_retain(request, tables, num_existing, num_hits, total)
        return new_blocks

    def _cache_and_retain(self, request: CacheRequest, tables: list[list[KVCacheBlock]],
                          num_existing: int, num_hits: int, total_tokens: int) -> None:
        """``KVCacheManager._cache_full`` in every group: registers the blocks full once
        ``total_tokens`` are in, then applies the request's retention to its hits and to what
        it just registered. Hit blocks are registered already; the request's own last block
        may be partly filled and is registered once full (``num_existing`` counts as
        registered only behind a hit)."""
        rid = request.request_id
        prev_cached = self.num_cached_block.get(rid, 0)
        num_known = num_existing + num_hits if num_hits else 0
        self._cache_full_groups(request, tables, num_known, total_tokens)
        if request.retention is not None or (self.retention_seen and num_hits):
            end_hit = num_existing + num_hits
            first_new = max(prev_cached, end_hit) if num_hits else prev_cached
            for table in tables:
                self._apply_retention(request, table, num_existing, end_hit, first_new,
                                      self.num_cached_block[rid])

    def _num_skipped(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks entirely before the window of the token at ``num_computed_tokens``."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def remove_skipped_blocks(self, request: CacheRequest) -> bool:
        """Rule 4 between allocations: each window group frees the blocks wholly before the
        window of the token at ``request.num_computed_tokens`` (see
        ``KVCacheManager.remove_skipped_blocks``); True when a table changed."""
        tables = self.group_blocks.get(request.request_id)
        if tables is None:
            return False
        changed = False
        for g, table in enumerate(tables):
            skipped = min(self._num_skipped(g, request.num_computed_tokens), len(table))
            if skipped and not table[skipped - 1].is_null:
                self._slide_out(table, skipped)
                changed = True
        return changed

    def _slide_out(self, table: list[KVCacheBlock], skipped: int) -> None:
        """Frees the table's first ``skipped`` blocks (rule 4), newest first, stopping at the
        null block already there."""
        assert skipped == 0 or self.null_block is not None
        out = []
        for i in range(min(skipped, len(table)) - 1, -1, -1):
            block = table[i]
            if block.is_null:
                break
            out.append(block)
            assert self.null_block is not None
            table[i] = self.null_block
        if out:
            self.block_pool.free_blocks(out)

    def _cache_full_groups(self, request: CacheRequest, tables: list[list[KVCacheBlock]],
                    num_known: int, total_tokens: int) -> None:
        """Registers in every group the blocks full once ``total_tokens`` are in."""
        rid = request.request_id
        num_cached = max(self.num_cached_block.get(rid, 0), num_known)
        num_full = min(total_tokens, request.num_tokens) // self.block_size
        if num_full > num_cached:
            hashes = self.block_hashes(request, num_full)
            num_full = min(num_full, len(hashes))
            for g, table in enumerate(tables):
                if num_full > num_cached:
                    keys = self._keys(request, g, hashes)
                    self.block_pool.cache_full_blocks(table, keys, num_cached, num_full)
            num_cached = max(num_cached, num_full)
        self.num_cached_block[rid] = num_cached

    # ----------------------------------------------------------------- release
    def free(self, request: CacheRequest) -> None:
        """Drops the request's references in every group (rule 5)."""
        tables = self.group_blocks.pop(request.request_id, None)
        self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if tables:
            self.block_pool.free_blocks(self._release_order(tables))

    def _release_order(self, tables: list[list[KVCacheBlock]]) -> Iterator[KVCacheBlock]:
        if not self.enable_caching:
            for table in tables:
                yield from table
            return
        for i in range(len(tables[0]) - 1, -1, -1):
            for table in tables:
                yield table[i]

    def free_block_hashes(self, request: CacheRequest) -> None:
        super().free_block_hashes(request)
        self._group_keys.pop(request.request_id, None)

    def get_group_block_ids(self, request: CacheRequest) -> list[list[int]]:
        """The block ids of every group's table, group 0 first."""
        tables = self.group_blocks.get(request.request_id)
        if tables is None:
            return [[] for _ in range(self.num_groups)]
        return [[block.block_id for block in table] for table in tables]
