"""The block pool's retention levels and expiry, on ``BlockPool`` alone with a simulated clock:
exact free counts per level, exact expiry times and boundaries, the order expired blocks rejoin
the default list, and the bound on the expiry heap. ``check`` verifies the pool's documented
invariants (``prefixserve/core/block_pool.py``) after every step; each test names the bug it
catches."""

from __future__ import annotations

import pytest

from prefixserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from prefixserve.core.retention import DEFAULT_PRIORITY, NO_EXPIRY

pytestmark = pytest.mark.fast


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def check(pool: BlockPool) -> None:
    """Every free block is in the list of its own priority, and only there; the free counts
    (total and retained) are the lengths of those lists; a block at the default priority keeps
    no duration and, free or held, no expiry, as does every held block."""
    seen: list[KVCacheBlock] = []
    for priority, queue in pool._levels:
        members = list(queue)
        assert len(members) == len(queue)
        for block in members:
            assert block.ref_cnt == 0 and block.priority == priority
        seen += members
    free = [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
    assert sorted(b.block_id for b in seen) == sorted(b.block_id for b in free)
    assert pool.get_num_free_blocks() == len(free)
    assert pool.num_free_retained == sum(
        len(q) for p, q in pool._levels if p != DEFAULT_PRIORITY)
    assert [p for p, _ in pool._levels] == sorted(p for p, _ in pool._levels)
    for block in pool.blocks:
        if block.priority == DEFAULT_PRIORITY:
            assert block.duration == 0.0, f"block {block.block_id} keeps a duration"
        if block.priority == DEFAULT_PRIORITY or block.ref_cnt:
            assert block.expiry == NO_EXPIRY, f"block {block.block_id} keeps an expiry"


def cached(pool: BlockPool, n: int, first_hash: int = 0) -> list[KVCacheBlock]:
    """``n`` new blocks, held, cached under hashes ``first_hash``, ``first_hash + 1``, ..."""
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(blocks, list(range(first_hash, first_hash + n)), 0, n)
    return blocks


def release(pool: BlockPool, blocks: list[KVCacheBlock], priority: int,
            duration: float) -> None:
    for block in blocks:
        pool.retain(block, priority, duration, fresh=True)
    pool.free_blocks(blocks)
    check(pool)


def test_an_empty_free_list_says_so() -> None:
    with pytest.raises(ValueError, match=r"^no free block to pop$"):
        FreeBlockQueue(()).popleft()


def test_retained_counts_follow_release_hit_and_eviction() -> None:
    """Bug: ``num_free_retained`` set or stepped wrongly on release, on a hit or on eviction
    (the free count, and so admission, goes wrong)."""
    clock = Clock()
    pool = BlockPool(10, clock=clock)
    blocks = cached(pool, 6)
    release(pool, blocks[:4], 80, 60.0)
    assert pool.num_free_retained == 4 and pool.get_num_free_blocks() == 8
    pool.touch(blocks[:2])  # two hits on retained free blocks
    check(pool)
    assert pool.num_free_retained == 2 and pool.get_num_free_blocks() == 6
    assert [b.priority for b in blocks[:2]] == [80, 80]  # not expired: kept
    assert pool.expired_retentions == 0
    taken = pool.get_new_blocks(6)  # the 4 default ones, then the 2 retained ones
    check(pool)
    assert [b.block_id for b in taken[4:]] == [b.block_id for b in blocks[2:4]]
    assert pool.num_free_retained == 0 and pool.get_num_free_blocks() == 0


def test_a_hit_at_exactly_the_expiry_falls_back_and_is_counted() -> None:
    """Bug: the expiry compared with ``<`` (a block hit at its expiry stays retained), or the
    expired-retention counter set instead of added to."""
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    a, b, c = cached(pool, 3)
    release(pool, [a, b], 80, 60.0)
    assert (a.expiry, b.expiry) == (1060.0, 1060.0)
    clock.now = 1059.0
    pool.touch([a])
    check(pool)
    assert a.priority == 80 and a.duration == 60.0 and pool.expired_retentions == 0
    clock.now = 1060.0
    pool.touch([b])  # exactly at its expiry
    check(pool)
    assert (b.priority, b.duration, pool.expired_retentions) == (DEFAULT_PRIORITY, 0.0, 1)
    release(pool, [c], 80, 5.0)
    clock.now = 1065.0
    pool.touch([c])
    check(pool)
    assert pool.expired_retentions == 2


def test_expire_demotes_at_exactly_the_expiry_and_counts_across_calls() -> None:
    """Bug: ``expire`` with ``<`` (a block stays retained at its expiry), a wrong count from an
    empty heap, or the counter overwritten by each call."""
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    assert pool.expire() == 0
    a, b = cached(pool, 2)
    release(pool, [a], 80, 10.0)
    clock.now = 1002.0
    release(pool, [b], 80, 10.0)
    clock.now = 1010.0
    assert pool.expire() == 1
    check(pool)
    assert (a.priority, a.duration, a.expiry) == (DEFAULT_PRIORITY, 0.0, NO_EXPIRY)
    assert b.priority == 80 and pool.num_free_retained == 1
    clock.now = 1012.0
    assert pool.expire() == 1
    check(pool)
    assert pool.expired_retentions == 2 and pool.num_free_retained == 0
    assert pool.expire() == 0  # heap empty again


def test_a_stale_heap_entry_does_not_stop_later_expiries() -> None:
    """Bug: ``expire`` stops at the first stale entry (a block hit since it was pushed), so the
    expired blocks behind it stay retained."""
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    a, b = cached(pool, 2)
    release(pool, [a], 80, 10.0)
    clock.now = 1001.0
    release(pool, [b], 80, 10.0)
    pool.touch([a])  # a's entry is stale now; a stays held
    clock.now = 1020.0
    assert pool.expire() == 1
    check(pool)
    assert b.priority == DEFAULT_PRIORITY and a.priority == 80 and a.ref_cnt == 1


def test_blocks_expiring_together_rejoin_the_default_list_in_release_order() -> None:
    """Bug: the heap's tie-breaking sequence counted down, so blocks with the same expiry
    rejoin the default list newest first (the LRU order inverted)."""
    clock = Clock()
    pool = BlockPool(5, clock=clock)
    blocks = cached(pool, 5)
    release(pool, blocks[:3], 80, 10.0)  # one release, same expiry, in this order
    release(pool, blocks[3:], 80, 10.0)
    clock.now = 1010.0
    assert pool.expire() == 5
    check(pool)
    assert [b.block_id for b in pool.free_blocks_in_eviction_order()] == [0, 1, 2, 3, 4]


def test_retain_keeps_the_highest_priority_unless_fresh() -> None:
    """Bug: ``retain`` treats every block as fresh (a shared block loses a higher priority
    another request asked for), or keeps a duration at the default priority."""
    pool = BlockPool(4, clock=Clock())
    (block,) = cached(pool, 1)
    pool.retain(block, 80, 60.0)
    pool.retain(block, 20, 10.0)
    assert (block.priority, block.duration) == (80, 60.0)
    pool.retain(block, 20, 10.0, fresh=True)
    assert (block.priority, block.duration) == (20, 10.0)
    pool.retain(block, DEFAULT_PRIORITY, 30.0, fresh=True)
    assert (block.priority, block.duration) == (DEFAULT_PRIORITY, 0.0)
    pool.free_blocks([block])
    check(pool)


def test_an_uncached_retained_block_is_freed_as_plain_space() -> None:
    """Bug: a block with a retention but no hash (nothing to keep) is not put back in the
    default list at the default priority."""
    pool = BlockPool(4, clock=Clock())
    (plain,) = pool.get_new_blocks(1)
    pool.retain(plain, 80, 60.0, fresh=True)
    pool.free_blocks([plain])
    check(pool)
    assert (plain.priority, plain.duration) == (DEFAULT_PRIORITY, 0.0)
    assert pool.num_free_retained == 0 and pool.get_num_free_blocks() == 4
    assert list(pool.free_blocks_in_eviction_order())[-1] is plain


def test_the_expiry_heap_is_compacted_just_past_its_bound() -> None:
    """Hits and releases of one retained block leave a stale heap entry each; the heap is
    compacted as soon as it holds more than ``2 * num_blocks + 64`` entries, and not before.
    Bug: a wrong bound (memory grows without limit, or a compaction on every release)."""
    clock = Clock()
    pool = BlockPool(4, clock=clock)
    (block,) = cached(pool, 1)
    bound = 2 * pool.num_blocks + 64
    for pushes in range(1, bound + 2):
        pool.retain(block, 80, 60.0)
        pool.free_blocks([block])
        assert len(pool._expiry_heap) == (pushes if pushes <= bound else 1)
        pool.touch([block])
    pool.free_blocks([block])
    check(pool)


def test_reset_empties_retained_levels_to_the_default_head_and_drops_held_retention() -> None:
    """Bug: a reset leaves a retention (duration, expiry) on blocks it moves to the default
    level, or breaks the links of the default list while putting them at its head."""
    pool = BlockPool(8, clock=Clock())
    blocks = cached(pool, 5)
    release(pool, blocks[:3], 80, 60.0)  # three retained free blocks
    pool.retain(blocks[3], 90, NO_EXPIRY, fresh=True)  # a held retained block
    assert pool.reset_prefix_cache(keep=[blocks[4]]) is True
    check(pool)
    order = [b.block_id for b in pool.free_blocks_in_eviction_order()]
    assert order[:3] == [b.block_id for b in blocks[:3]]  # empty now: reused first
    assert (blocks[3].priority, blocks[3].duration) == (DEFAULT_PRIORITY, 0.0)
    assert [pool.get_cached_block(h) for h in range(5)] == [None] * 4 + [blocks[4]]
    pool.touch([blocks[1]])  # unlinked from the middle of the prepended run
    check(pool)
    pool.free_blocks([blocks[1], blocks[3]])
    check(pool)
    assert pool.num_free_retained == 0 and pool.get_num_free_blocks() == 7


def test_eviction_spans_levels_lowest_first_and_resets_what_it_takes() -> None:
    """Bug: the count still wanted from a level computed wrongly (more blocks than asked),
    or a block taken from a retained level keeping its priority."""
    clock = Clock()
    pool = BlockPool(6, clock=clock)
    blocks = cached(pool, 6)
    release(pool, blocks[:2], 20, 60.0)  # below the default: evicted first
    release(pool, blocks[2:4], 80, 60.0)
    pool.free_blocks(blocks[4:])  # default level
    check(pool)
    taken = pool.get_new_blocks(5)
    assert [b.block_id for b in taken] == [0, 1, 4, 5, 2]
    assert all((b.priority, b.duration, b.expiry) == (DEFAULT_PRIORITY, 0.0, NO_EXPIRY)
               for b in taken)
    check(pool)
    assert pool.get_num_free_blocks() == 1 and pool.num_free_retained == 1
    assert pool.evictions_by_priority == {20: 2, DEFAULT_PRIORITY: 2, 80: 1}


def test_evictions_are_logged_with_their_hash_when_asked() -> None:
    """The cache tiers' write-back reads ``evicted``. Bug: the log not kept, or its entries
    not ``(block id, block hash)``."""
    pool = BlockPool(4)
    blocks = cached(pool, 3, first_hash=100)
    pool.free_blocks(blocks)
    pool.evicted = []
    pool.get_new_blocks(3)  # the free uncached block first, then two cached ones
    assert pool.evicted == [(blocks[0].block_id, 100), (blocks[1].block_id, 101)]


def test_misuse_is_refused_with_a_message_naming_it() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match=r"^asked for 5 free blocks, only 4 free$"):
        pool.get_new_blocks(5)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError):  # a hash missing for a block: zip(strict=True)
        pool.cache_full_blocks(blocks, [1], 0, 2)
    pool.free_blocks(blocks[:1])
    with pytest.raises(RuntimeError, match=rf"^block {blocks[0].block_id} freed more often"):
        pool.free_blocks(blocks[:1])
