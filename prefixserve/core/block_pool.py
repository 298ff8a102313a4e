"""The pool of KV blocks, its free list (which is also the LRU order) and the prefix-cache map.

Invariants (checked by the stateful tests):

* Every block object is created once, in ``BlockPool.__init__``; nothing per block is allocated
  afterwards.
* A block is in the free list if and only if its reference count is 0 (the null block, used by
  sliding-window attention as a placeholder, is never in it and never counted).
* ``free + used == num_blocks`` (the null block, when reserved, counts as used).
* Every entry of the hash map points at a block that carries that hash.
* Eviction is lazy: a freed block keeps its hash and can still be hit until it is taken for reuse.
* The free list is popped at its head and appended at its tail: **the first block freed is the
  first evicted**. Callers choose the order they free in (the manager frees a request's blocks
  tail first, so a shared head outlives the tails that hang from it).
* **Retention levels** (docs/explicit-caching.md): every block carries a ``priority`` (0-100,
  ``DEFAULT_PRIORITY`` unless a request asked for more or less), a ``duration`` and, while free,
  an ``expiry``. The free list is one intrusive list per priority in use: ``free_queue`` is the
  default level's, the others live in ``retained_queues``. A free block is in the list of its own
  priority; eviction takes the lowest priority first and, within a priority, the head (LRU).
* A retained free block's expiry is its release time plus its duration; once the clock passes
  it, the block falls back to the default priority **lazily** (no timer: ``expire`` runs, from
  a heap of expiries, before every eviction, before every release and when hits are counted; a
  hit on an expired block resets it at once). It joins the tail of the default list **as if
  released at its expiry**: since nothing joins the default list without ``expire`` running
  first, the default list stays ordered by the time each block joined it, whenever ``expire``
  ran. The expiry restarts whenever the block is released again (a hit refreshes it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import final

from prefixserve.core.hashing import hash_value_of
from prefixserve.core.kv_events import KVEventPublisher
from prefixserve.core.retention import DEFAULT_PRIORITY, NO_EXPIRY

Clock = Callable[[], float]



@final
class KVCacheBlock:
    """One physical KV block: its id, reference count, cached block hash (or None) with its
    hash value (the pool's map key, kept so that eviction need not derive it again; stale while
    ``block_hash`` is None) and the two links of the intrusive free list (a block never linked,
    such as a sentinel's outer side or the null block, points at itself).

    Final: the pool's map tells a single block from a dict of blocks by ``type(entry) is
    KVCacheBlock``."""

    __slots__ = ("block_hash", "block_id", "duration", "expiry", "expiry_seq", "hash_value",
                 "is_null", "next_free", "prev_free", "priority", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.priority = DEFAULT_PRIORITY
        self.duration = 0.0  # seconds kept at ``priority`` after release; NO_EXPIRY for ever
        self.expiry = NO_EXPIRY  # while free at a retained priority: when it falls back
        self.expiry_seq = 0  # the pool's heap entry for ``expiry`` (older entries are stale)
        self.block_hash: Hashable | None = None
        self.hash_value: Hashable | None = None
        self.prev_free: KVCacheBlock = self
        self.next_free: KVCacheBlock = self
        self.is_null = False

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"cached={self.block_hash is not None})"
        )


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, between two sentinel blocks.

    Only the links of blocks in the list are meaningful: a block taken out by ``get_new_blocks``
    keeps stale links (not clearing them saves two stores per block on the hot path); its
    reference count, not its links, says whether it is free.

    ``popleft`` takes the least recently freed block, ``remove`` unlinks a block from anywhere in
    O(1) (a cache hit on a free block), ``append`` adds a freed block at the tail."""

    __slots__ = ("head", "num_free_blocks", "tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self.tail
        self.tail.prev_free = prev
        self.num_free_blocks = len(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free block to pop")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlinks ``block``, which must be in the list (reference count 0)."""
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def prepend(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Puts ``blocks`` at the head, in the given order (the first one is popped first)."""
        nxt = self.head.next_free
        prev = self.head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All KV blocks, the free lists (one per priority level) and the prefix-cache map.

    The map is keyed by hash value (``hash_value_of``); its value is the block holding that hash or,
    once several blocks hold it, a ``{block id: block}`` dict (no per-block allocation in the
    common case). A lookup compares the whole block hash (value, tokens and extra keys) with the
    block's, so a collision of the hash function alone never gives a false hit.

    There is no de-duplication: several physical blocks may hold the same content (two requests
    that computed it at the same time), so a running request's block table never has to be
    rewritten. A lookup returns any one of them.

    Whether anything is cached is the manager's decision (``KVCacheManager.enable_caching``): with
    caching off it never fills the map nor looks anything up in it, so the pool needs no flag.

    Without retention every block stays at ``DEFAULT_PRIORITY`` and only ``free_queue`` is used:
    the hot paths check one attribute per block more than a single-list pool. ``clock`` (default
    ``time.monotonic``) is injectable, so tests drive expiry with a simulated clock.
    """

    __slots__ = ("_expiry_heap", "_heap_seq", "_levels", "blocks", "cached_block_hash_to_block",
                 "clock", "event_sink", "evicted", "evictions_by_priority",
                 "expired_retentions", "free_queue", "null_block", "num_blocks",
                 "num_free_retained", "retained_queues")

    def __init__(self, num_blocks: int, reserve_null_block: bool = False,
                 clock: Clock | None = None) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be at least {1 + reserve_null_block}, "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.clock: Clock = clock or time.monotonic
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.cached_block_hash_to_block: dict[
            Hashable, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.null_block: KVCacheBlock | None = None
        self.evicted: list[tuple[int, Hashable]] | None = None
        """When a list (the cache tiers' write-back sets one), ``get_new_blocks`` appends
        ``(block id, block hash)`` of each cached block it evicts; its owner empties it."""
        self.event_sink: KVEventPublisher | None = None
        """Told of every hash value entering or leaving the map (``kv_events``); None: off."""
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.free_queue = FreeBlockQueue(self.blocks[1:])
        else:
            self.free_queue = FreeBlockQueue(self.blocks)
        self.retained_queues: dict[int, FreeBlockQueue] = {}
        self._levels: list[tuple[int, FreeBlockQueue]] = [(DEFAULT_PRIORITY, self.free_queue)]
        self.num_free_retained = 0
        self._expiry_heap: list[tuple[float, int, KVCacheBlock]] = []
        self._heap_seq = 0
        self.evictions_by_priority: dict[int, int] = {}
        self.expired_retentions = 0

    def get_cached_block(self, block_hash: Hashable) -> KVCacheBlock | None:
        """Any block holding ``block_hash``, or None. Changes nothing."""
        entry = self.cached_block_hash_to_block.get(hash_value_of(block_hash))
        if entry is None:
            return None
        if type(entry) is KVCacheBlock:
            return entry if entry.block_hash == block_hash else None
        for block in entry.values():
            if block.block_hash == block_hash:
                return block
        return None

    def cached_blocks(self, block_hash: Hashable) -> list[KVCacheBlock]:
        """Every block holding ``block_hash`` (for inspection and tests)."""
        entry = self.cached_block_hash_to_block.get(hash_value_of(block_hash))
        if entry is None:
            return []
        blocks = [entry] if type(entry) is KVCacheBlock else list(entry.values())
        return [b for b in blocks if b.block_hash == block_hash]

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Takes ``n`` free blocks, lowest priority first and least recently freed first within
        a priority, evicts their cached hashes and gives each one reference. Expired retentions
        fall back to the default priority first."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"asked for {n} free blocks, only {self.get_num_free_blocks()} free")
        if self._expiry_heap:
            self.expire()
        out: list[KVCacheBlock] = []
        if not self.num_free_retained:
            self._take(self.free_queue, n, out)
            return out
        for priority, queue in self._levels:
            k = min(n - len(out), queue.num_free_blocks)
            if k:
                first = len(out)
                self._take(queue, k, out)
                if priority != DEFAULT_PRIORITY:
                    self.num_free_retained -= k
                    for block in out[first:]:
                        block.expiry_seq = 0
                        block.priority = DEFAULT_PRIORITY
                        block.duration = 0.0
                        block.expiry = NO_EXPIRY
            if len(out) == n:
                break
        return out

    def _take(self, queue: FreeBlockQueue, n: int, out: list[KVCacheBlock]) -> None:
        """Pops ``n`` blocks from the head of ``queue`` into ``out``, evicting their hashes."""
        cache = self.cached_block_hash_to_block
        append = out.append
        head = queue.head
        block = head.next_free
        priority = block.priority
        evicted = 0
        evicted_log = self.evicted
        sink = self.event_sink
        for _ in range(n):
            if block.block_hash is not None:
                key = block.hash_value
                entry = cache.pop(key)
                if entry is not block:
                    # a single block under this key would be this one: a dict, holding it too
                    assert type(entry) is dict
                    del entry[block.block_id]
                    if entry:
                        cache[key] = entry
                if evicted_log is not None:
                    evicted_log.append((block.block_id, block.block_hash))
                if sink is not None and key not in cache:
                    sink.removed(key)
                block.block_hash = None
                evicted += 1
            block.ref_cnt = 1
            append(block)
            block = block.next_free
        head.next_free = block
        block.prev_free = head
        queue.num_free_blocks -= n
        if evicted:
            counts = self.evictions_by_priority
            counts[priority] = counts.get(priority, 0) + evicted

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a cache hit), taking free ones out of their free
        list. A retained block whose expiry has passed falls back to the default priority."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                if block.priority == DEFAULT_PRIORITY:
                    remove(block)
                else:
                    self._take_retained(block)
            block.ref_cnt += 1

    def _take_retained(self, block: KVCacheBlock) -> None:
        """Unlinks a free block of a retained level (a hit on it); an expired one falls back."""
        self.retained_queues[block.priority].remove(block)
        self.num_free_retained -= 1
        block.expiry_seq = 0
        if block.expiry <= self.clock():
            self.expired_retentions += 1
            block.priority = DEFAULT_PRIORITY
            block.duration = 0.0
        block.expiry = NO_EXPIRY

    def retain(self, block: KVCacheBlock, priority: int, duration: float, *,
               fresh: bool = False) -> None:
        """Raises a **held** block's retention to ``priority`` for ``duration`` seconds after
        release (``NO_EXPIRY``: no expiry). A block shared by several requests keeps the
        highest priority and the longest duration asked for; ``fresh`` (a block this request
        just computed, nobody else's) sets them as given, so a low priority can apply."""
        if not fresh:
            priority = max(priority, block.priority)
            duration = max(duration, block.duration)
        block.priority = priority
        block.duration = 0.0 if priority == DEFAULT_PRIORITY else duration

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[Hashable],
                          start: int, end: int) -> None:
        """Registers ``blocks[start:end]`` under ``block_hashes[start:end]`` (they are full)."""
        cache = self.cached_block_hash_to_block
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            block.block_hash = block_hash
            # hash_value_of(block_hash), written out (hot loop); kept for eviction
            key = block_hash[0] if type(block_hash) is tuple else block_hash
            block.hash_value = key
            entry = cache.setdefault(key, block)
            if entry is not block:
                if type(entry) is KVCacheBlock:
                    cache[key] = {entry.block_id: entry, block.block_id: block}
                else:
                    entry[block.block_id] = block
        if self.event_sink is not None:
            self.event_sink.stored(block_hashes, start, end)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the tail of their
        priority's free list **in the given order**, so within a level the first one given is
        the first one evicted. A retained block's expiry starts now."""
        if self._expiry_heap:
            self.expire()  # what expired before this release joins the default list first
        queue = self.free_queue
        last = queue.tail.prev_free
        count = 0
        for block in ordered_blocks:
            ref_cnt = block.ref_cnt - 1
            if ref_cnt:
                if ref_cnt > 0:
                    block.ref_cnt = ref_cnt
                elif not block.is_null:
                    raise RuntimeError(f"block {block.block_id} freed more often than taken")
                continue
            block.ref_cnt = 0
            if block.priority != DEFAULT_PRIORITY:
                if block.block_hash is not None:
                    self._free_retained(block)
                    continue
                # nothing to keep: an uncached block is plain free space, linked here in order
                # (appending it to the default list now would be undone by the links below)
                block.priority = DEFAULT_PRIORITY
                block.duration = 0.0
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = queue.tail
        queue.tail.prev_free = last
        queue.num_free_blocks += count

    def _free_retained(self, block: KVCacheBlock) -> None:
        """Puts a released cached block at the tail of its retained level; its expiry starts."""
        queue = self.retained_queues.get(block.priority)
        if queue is None:
            queue = self._add_level(block.priority)
        queue.append(block)
        self.num_free_retained += 1
        block.expiry_seq = 0  # any older heap entry is stale from now on
        if block.duration != NO_EXPIRY:
            block.expiry = self.clock() + block.duration
            self._heap_seq += 1
            block.expiry_seq = self._heap_seq
            heapq.heappush(self._expiry_heap, (block.expiry, self._heap_seq, block))
            if len(self._expiry_heap) > 2 * self.num_blocks + 64:
                self._compact_heap()

    def _add_level(self, priority: int) -> FreeBlockQueue:
        """Creates the free list of a priority not used before (at most 101 ever exist)."""
        queue = self.retained_queues[priority] = FreeBlockQueue(())
        self._levels.append((priority, queue))
        self._levels.sort(key=lambda level: level[0])
        return queue

    def _compact_heap(self) -> None:
        """Drops stale heap entries (blocks touched or evicted since they were pushed)."""
        self._expiry_heap = [e for e in self._expiry_heap
                             if e[2].ref_cnt == 0 and e[2].expiry_seq == e[1]
                             and e[2].priority != DEFAULT_PRIORITY]
        heapq.heapify(self._expiry_heap)

    def expire(self) -> int:
        """Moves every free block whose retention has expired to the tail of the default list,
        earliest expiry first (as if each had been released at its expiry); returns how many
        moved."""
        heap = self._expiry_heap
        if not heap:
            return 0
        now = self.clock()
        demoted = 0
        while heap and heap[0][0] <= now:
            _, seq, block = heapq.heappop(heap)
            if block.ref_cnt or block.expiry_seq != seq or block.priority == DEFAULT_PRIORITY:
                continue  # stale: touched, evicted or already demoted since it was pushed
            self.retained_queues[block.priority].remove(block)
            self.num_free_retained -= 1
            block.priority = DEFAULT_PRIORITY
            block.duration = 0.0
            block.expiry = NO_EXPIRY
            self.free_queue.append(block)
            demoted += 1
        self.expired_retentions += demoted
        return demoted

    def free_blocks_in_eviction_order(self) -> Iterator[KVCacheBlock]:
        """Every free block, in the order ``get_new_blocks`` would take them now (expired
        retentions are counted at their current level until ``expire`` runs)."""
        for _, queue in self._levels:
            yield from queue

    def num_free_by_priority(self) -> dict[int, int]:
        """Free blocks per priority level (levels with none left out)."""
        return {p: len(q) for p, q in self._levels if len(q)}

    def reset_prefix_cache(self, keep: Iterable[KVCacheBlock] = ()) -> bool:
        """Forgets every cached hash but those of ``keep`` (pinned blocks), also while requests
        hold blocks; always returns True.

        The map is emptied and every other block, free or held, loses its hash and its retention
        at once. A held block stays in its request's table (its KV is still valid for that
        request) but can no longer be found, and when freed it joins the free list uncached, so
        its eviction touches no map entry. Retained free blocks move to the head of the default
        list (they are empty now). Blocks that become full later are cached again by
        ``cache_full_blocks``."""
        kept = list(keep)
        kept_ids = {block.block_id for block in kept}
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            if block.block_id not in kept_ids:
                block.block_hash = None
                if block.ref_cnt:
                    block.priority = DEFAULT_PRIORITY
                    block.duration = 0.0
        if self.event_sink is not None:
            self.event_sink.cleared()  # the kept blocks are reported stored again below
        retained = [b for p, q in self._levels if p != DEFAULT_PRIORITY for b in q]
        for block in retained:
            self.retained_queues[block.priority].remove(block)
            block.priority = DEFAULT_PRIORITY
            block.duration = 0.0
            block.expiry = NO_EXPIRY
        self.num_free_retained = 0
        self._expiry_heap.clear()
        self.free_queue.prepend(retained)
        for block in kept:
            if block.block_hash is not None:
                self.cache_full_blocks([block], [block.block_hash], 0, 1)
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks + self.num_free_retained

    def get_usage(self) -> float:
        """Share of usable blocks that are held by requests, in [0, 1]."""
        usable = self.num_blocks - (self.null_block is not None)
        return 1.0 - self.get_num_free_blocks() / usable
