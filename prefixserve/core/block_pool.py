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
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import final

from prefixserve.core.hashing import hash_value_of
from prefixserve.core.kv_events import KVEventPublisher


@final
class KVCacheBlock:
    """One physical KV block: its id, reference count, cached block hash (or None) with its
    hash value (the pool's map key, kept so that eviction need not derive it again; stale while
    ``block_hash`` is None) and the two links of the intrusive free list (a block never linked,
    such as a sentinel's outer side or the null block, points at itself).

    Final: the pool's map tells a single block from a dict of blocks by ``type(entry) is
    KVCacheBlock``."""

    __slots__ = ("block_hash", "block_id", "hash_value", "is_null", "next_free", "prev_free",
                 "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
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

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head.next_free
        while block is not self.tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """All KV blocks, the free list and the prefix-cache map.

    The map is keyed by hash value (``hash_value_of``); its value is the block holding that hash or,
    once several blocks hold it, a ``{block id: block}`` dict (no per-block allocation in the
    common case). A lookup compares the whole block hash (value, tokens and extra keys) with the
    block's, so a collision of the hash function alone never gives a false hit.

    There is no de-duplication: several physical blocks may hold the same content (two requests
    that computed it at the same time), so a running request's block table never has to be
    rewritten. A lookup returns any one of them.
    """

    __slots__ = ("blocks", "cached_block_hash_to_block", "enable_caching", "event_sink",
                 "free_queue", "null_block", "num_blocks")

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks must be at least {1 + reserve_null_block}, "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.cached_block_hash_to_block: dict[
            Hashable, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.null_block: KVCacheBlock | None = None
        self.event_sink: KVEventPublisher | None = None
        """Told of every hash value entering or leaving the map (``kv_events``); None: off."""
        if reserve_null_block:
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.free_queue = FreeBlockQueue(self.blocks[1:])
        else:
            self.free_queue = FreeBlockQueue(self.blocks)

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
        """Takes ``n`` blocks from the head of the free list (least recently freed first), evicts
        their cached hashes and gives each one reference."""
        queue = self.free_queue
        if n > queue.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {queue.num_free_blocks} free")
        cache = self.cached_block_hash_to_block
        out: list[KVCacheBlock] = []
        append = out.append
        head = queue.head
        block = head.next_free
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
                if sink is not None and key not in cache:
                    sink.removed(key)
                block.block_hash = None
            block.ref_cnt = 1
            append(block)
            block = block.next_free
        head.next_free = block
        block.prev_free = head
        queue.num_free_blocks -= n
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a cache hit), taking free ones out of the free list."""
        remove = self.free_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

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
        """Drops one reference from each block; blocks reaching 0 join the free list **in the
        given order**, so the first one given is the first one evicted."""
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
            last.next_free = block
            block.prev_free = last
            last = block
            count += 1
        last.next_free = queue.tail
        queue.tail.prev_free = last
        queue.num_free_blocks += count

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash, also while requests hold blocks; always returns True.

        The map is emptied and every block, free or held, loses its hash at once. A held block
        stays in its request's table (its KV is still valid for that request) but can no longer
        be found, and when freed it joins the free list uncached, so its eviction touches no map
        entry. Blocks that become full later are cached again by ``cache_full_blocks``."""
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.event_sink is not None:
            self.event_sink.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks that are held by requests, in [0, 1]."""
        usable = self.num_blocks - (self.null_block is not None)
        return 1.0 - self.free_queue.num_free_blocks / usable
